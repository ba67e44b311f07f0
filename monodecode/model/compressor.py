"""KV compression for CSA and HCA layers, and CSA's lightning indexer.

A compressor turns each window of `ratio` source tokens into one entry: per channel, a softmax
over the window's slots of the gate scores `wgate(x) + ape[slot]` weights the values `wkv(x)`;
then RMSNorm and RoPE at the window's first position. CSA (ratio 4) overlaps windows: its
projections have two halves, and entry w mixes the first half of window w - 1's tokens with the
second half of window w's (8 slots; window 0's missing half has weight 0). HCA does not overlap.
Entry w is visible to the query at position t only when w < (t + 1) // ratio.

The lightning indexer (CSA only) scores a query against the indexer compressor's entries with
sum over heads of w_h * relu(q_h . k) and keeps the top `index_topk` visible entries.
The official reference also simulates FP8 (kv) and FP4 + Hadamard (indexer) quantization here;
like transformers, this reference does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_norm
from .rope import apply_rope


class Compressor:
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, ratio: int, width: int,
                 freqs: torch.Tensor, norm_eps: float):
        self.wkv, self.wgate = w[f"{prefix}wkv"], w[f"{prefix}wgate"]
        self.ape, self.norm = w[f"{prefix}ape"], w[f"{prefix}norm"]
        self.ratio, self.width, self.overlap = ratio, width, ratio == 4
        self.freqs, self.norm_eps = freqs, norm_eps

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"kv": F.linear(x, self.wkv), "gate": F.linear(x, self.wgate)}

    def first_source(self, first_window: int) -> int:
        """The first source position the entries from `first_window` on need."""
        return max(first_window - int(self.overlap), 0) * self.ratio

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor, start: int,
                windows: torch.Tensor) -> torch.Tensor:
        """Entries of `windows` [k] from source rows kv/gate [L, c * width] of positions
        start .. start + L - 1 (`valid` [L] marks rows that exist)."""
        def lookup(pos):
            rows = (pos - start).clamp(min=0)
            return kv[rows], gate[rows], (pos >= start) & valid[rows]

        return self.compress(lookup, windows)

    def compress(self, lookup, windows: torch.Tensor) -> torch.Tensor:
        """Entries of `windows` [k]; `lookup(positions [k, m])` gives the source rows of those
        positions: (kv, gate [k, m, c * width], present [k, m])."""
        m, d = self.ratio, self.width
        b_pos = windows[:, None] * m + torch.arange(m, device=windows.device)  # [k, m]
        slots_kv, slots_gate, slots_valid = [], [], []
        halves = [(b_pos - m, slice(0, d)), (b_pos, slice(d, 2 * d))] if self.overlap else [(b_pos, slice(0, d))]
        for pos, half in halves:
            kv, gate, present = lookup(pos)
            slots_kv.append(kv[..., half])
            slots_gate.append(gate[..., half] + self.ape[:, half])
            slots_valid.append(present)
        values, scores = torch.cat(slots_kv, dim=1), torch.cat(slots_gate, dim=1)
        present = torch.cat(slots_valid, dim=1).unsqueeze(-1)
        scores = scores.float().masked_fill(~present, float("-inf"))
        values = values.masked_fill(~present, 0)
        pooled = (values * scores.softmax(dim=1).to(values.dtype)).sum(dim=1)
        return apply_rope(rms_norm(pooled, self.norm, self.norm_eps), windows * m, self.freqs)


class Indexer:
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, config, freqs: torch.Tensor):
        self.wq_b, self.weights_proj = w[f"{prefix}wq_b"], w[f"{prefix}weights_proj"]
        self.heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.compressor = Compressor(w, f"{prefix}compressor.", 4, self.head_dim, freqs, config.rms_norm_eps)
        self.freqs = freqs

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor):
        q = F.linear(qr, self.wq_b).unflatten(-1, (self.heads, self.head_dim))
        weights = F.linear(x, self.weights_proj).float() * self.heads**-0.5
        return apply_rope(q, positions, self.freqs), weights

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """`index_scores` of this ratio-4 indexer."""
        return index_scores(q, weights, keys, positions, ratio=4)

    def top(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [n, k], valid [n, k]) of each query's top-k entries, k = min(topk, E); an
        index is valid where its entry is visible (fewer than k may be)."""
        return top_entries(self.scores(q, weights, keys, positions), self.topk)

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Mask [n, E] of the entries each query attends: its top-k visible ones."""
        return top_mask(self.scores(q, weights, keys, positions), self.topk)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 ratio: int) -> torch.Tensor:
    """Index scores [n, E] fp32 of queries q [n, heads, d] with their head weights [n, heads]
    against entries keys [E, d] (or [n, E, d], per query): sum over heads of w_h * relu(q_h . k)
    / sqrt(d); -inf where an entry is not visible (entry w < (t + 1) // ratio)."""
    equation = "nhd,ed->nhe" if keys.dim() == 2 else "nhd,ned->nhe"
    scores = torch.einsum(equation, q.float(), keys.float()).relu() * q.shape[-1]**-0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, E]
    visible = torch.arange(keys.shape[-2], device=keys.device)[None] < ((positions + 1) // ratio)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def top_entries(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [n, k], valid [n, k]) of each row's k = min(topk, E) highest scores; valid where
    the score is finite (a visible entry)."""
    top = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return top.indices, top.values > float("-inf")


def top_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Mask [n, E] of each row's top-k visible entries (`top_entries`)."""
    indices, valid = top_entries(scores, topk)
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, indices, valid)
