"""DeepSeek-V4.1's compressed KV and its selection, made on a few source layers and read by others.

Compressor (on the KV-source layers only): one entry per `ratio` positions, entry w summarising
positions [w * ratio, (w + 1) * ratio). At ratio 2 the projections `wkv` and `wgate` run in fp32 and
each channel takes a softmax over the group's two positions of the gate to weight the values (no
position bias, no overlapping windows); at ratio 1 the entry is `wkv(x)` of its own position.
Either way the pooled vector is rounded to the activation dtype and RMS-normed: the pre-RoPE
latent. The cached entry is the latent rotated at the group's first position w * ratio; the index
key of the entry is `k_norm(wk(latent))`, rotated the same way. Entry w is visible to the query at
position t when w < (t + 1) // ratio (at ratio 1 that includes t itself, beside the window's raw
row of t: neither is masked, as in the official code).

Indexer (on the index-source layers only): queries `wq_b(qr)` rotated at the query's position,
head weights `weights_proj(x) / sqrt(heads)`, scores sum_h w_h relu(q_h . k) / sqrt(d) against the
KV source's index keys (`compressor.index_scores`), then the top `index_topk` visible entries.
The candidate layer also publishes, from its scores, the candidate blocks of a query: blocks of
`candidate_block_size` entries scored by their best entry, the block of the query's newest visible
entry always kept, the best `candidate_topk_blocks` kept, unreachable blocks never; the index
sources above it drop every entry outside their query's candidate blocks before their top-k.

Which source a layer reads, and the rules above, follow DeepSeek-V4.1's `inference/model.py`
(Compressor, Indexer, select_candidate_blocks), as vLLM's `models/deepseek_v41` also implements
them; where the official code republishes the shared index keys only on the steps a source
emits an entry (so a ratio-2 source between emissions scores another source's keys), this follows
vLLM and reads the layer's own KV source, the evident intent. Like the V4 path (compressor.py),
the official code's simulated quantisation (FP8 window KV, NVFP4 entries, MXFP4 index queries and
keys) is not reproduced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .compressor import index_scores, top_mask
from .norm import rms_norm
from .rope import apply_rope


class LatentCompressor:
    """A KV-source layer's compressor and the index keys made from its latents."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, ratio: int, config, freqs: torch.Tensor):
        self.wkv, self.norm = w[f"{prefix}compressor.wkv"], w[f"{prefix}compressor.norm"]
        self.wgate = w.get(f"{prefix}compressor.wgate")  # ratio 2 only: ratio 1 pools one position
        self.wk, self.k_norm = w[f"{prefix}indexer.wk"], w[f"{prefix}indexer.k_norm"]
        self.ratio, self.freqs, self.eps = ratio, freqs, config.rms_norm_eps

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-position source rows: at ratio 2 the fp32 values and gate scores, at ratio 1 the
        latent itself."""
        if self.ratio == 1:
            return {"latent": rms_norm(F.linear(x, self.wkv), self.norm, self.eps)}
        xf = x.float()
        return {"kv": F.linear(xf, self.wkv.float()), "gate": F.linear(xf, self.wgate.float())}

    def latents(self, kv: torch.Tensor, gate: torch.Tensor, present: torch.Tensor, dtype) -> torch.Tensor:
        """Latents [k, d] of groups whose source rows are kv, gate [k, ratio, d] (fp32; `present`
        [k, ratio] marks the rows that exist)."""
        gate = gate.masked_fill(~present.unsqueeze(-1), float("-inf"))
        pooled = (gate.softmax(dim=1) * kv.masked_fill(~present.unsqueeze(-1), 0)).sum(dim=1)
        return rms_norm(pooled.to(dtype), self.norm, self.eps)

    def entries_and_keys(self, latent: torch.Tensor, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached entries and index keys of latents [k, d] of groups `windows` [k]."""
        first = windows * self.ratio
        keys = rms_norm(F.linear(latent, self.wk), self.k_norm, self.eps)
        return apply_rope(latent, first, self.freqs), apply_rope(keys, first, self.freqs)


class SourceIndexer:
    """An index-source layer's indexer: its queries and the entries they select."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, ratio: int, config, freqs: torch.Tensor):
        self.wq_b, self.weights_proj = w[f"{prefix}indexer.wq_b"], w[f"{prefix}indexer.weights_proj"]
        self.heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.ratio, self.freqs = ratio, freqs

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor):
        """(queries [N, heads, d] rotated at `positions`, head weights [N, heads] fp32)."""
        q = F.linear(qr, self.wq_b).unflatten(-1, (self.heads, self.head_dim))
        weights = F.linear(x, self.weights_proj).float() * self.heads**-0.5
        return apply_rope(q, positions, self.freqs), weights

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores [n, E] against the KV source's keys [E, d]; -inf where an entry is not
        visible, or outside the query's `candidates` mask [n, E] when given."""
        scores = index_scores(q, weights, keys, positions, self.ratio)
        return scores if candidates is None else scores.masked_fill(~candidates, float("-inf"))

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Mask [n, E] of each query's top-k visible entries."""
        return top_mask(scores, self.topk)


def candidate_mask(scores: torch.Tensor, positions: torch.Tensor, ratio: int, blocks: int,
                   block_size: int) -> torch.Tensor:
    """The candidate layer's mask [n, E] of the entries inside each query's candidate blocks, from
    its index scores [n, E] (-inf: not visible)."""
    n, count = scores.shape
    if count == 0:
        return torch.zeros(n, 0, dtype=torch.bool, device=scores.device)
    num_blocks = math.ceil(count / block_size)
    padded = F.pad(scores, (0, num_blocks * block_size - count), value=float("-inf"))
    block_scores = padded.view(n, num_blocks, block_size).amax(dim=-1)
    visible = (positions + 1) // ratio
    newest = ((visible - 1) // block_size).clamp(min=0)
    pinned = torch.where(visible > 0, float("inf"), block_scores.gather(1, newest[:, None]).squeeze(1))
    block_scores = block_scores.scatter(1, newest[:, None], pinned[:, None])
    chosen = block_scores.topk(min(blocks, num_blocks), dim=-1).indices
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, chosen, True)
    keep &= block_scores > float("-inf")
    return keep.repeat_interleave(block_size, dim=1)[:, :count]
