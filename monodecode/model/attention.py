"""Attention of a DeepSeek-V4 layer: window-only, CSA or HCA.

Queries: `wq_a` -> `q_norm` (qr, shared with the indexer) -> `wq_b` -> per-head unweighted
RMSNorm (V4 only: `config.q_head_norm`) -> RoPE on the trailing rope dims. One K=V head: `wkv` ->
`kv_norm` -> RoPE. A query at position t attends, with one softmax that also holds a per-head
sink logit (probability mass with no value): the raw KV of positions t - window + 1 .. t, plus on
CSA layers the indexer's top-k visible compressed entries and on HCA layers every visible
compressed entry. The output's rope dims are de-rotated at the query position, then the grouped
`wo_a` and `wo_b` project. DeepSeek-V4.1's layers (shared_attention.py) keep this core and take
their compressed entries and selection from source layers.
Under tensor parallelism (parallel.py) a rank holds a range of the heads and the o groups they
feed, and `wo_b`'s output is summed over the ranks.

A step's rows are grouped by request (consecutive positions of one slot); each group reads the
positions before it from the cache and its own rows directly, so one code path serves prefill
(one group of T rows) and decode (many small groups), and then writes its rows to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .cache import LayerCache
from .compressor import Compressor, Indexer
from .norm import rms_norm
from .parallel import SINGLE, TensorParallel
from .rope import apply_rope, layer_frequencies


@dataclass
class RequestRows:
    slot: int
    index: torch.Tensor  # rows of the step, in position order
    positions: torch.Tensor  # consecutive


def rotated_keys(x: torch.Tensor, wkv: torch.Tensor, kv_norm: torch.Tensor, positions: torch.Tensor,
                 freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """K=V heads of x [N, d]: `wkv` -> `kv_norm` -> RoPE at positions [N]. One head, wkv [D, d]
    and kv_norm [D], gives [N, D]; the heads of several attentions stacked, wkv [S * D, d] and
    kv_norm [S, D], give [N, S, D] in one GEMM, one norm and one rotation for them all (the
    draft's stages, whose attentions share their frequencies: `Draft.commit`)."""
    kv = F.linear(x, wkv).unflatten(-1, kv_norm.shape)
    return apply_rope(rms_norm(kv, kv_norm, eps), positions, freqs)


class Attention:
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str, ratio: int,
                 tp: TensorParallel = SINGLE):
        self.c, self.tp = config, tp
        self.w = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        # under tensor parallelism this rank's heads and the o groups they feed (parallel.py)
        self.heads, self.o_groups = config.num_attention_heads // tp.size, config.o_groups // tp.size
        self.ratio = ratio
        # on the weights' device: a CPU table would be copied in every step (and cannot be inside a CUDA graph)
        self.freqs = layer_frequencies(config, compressed=ratio > 0).to(next(iter(self.w.values())).device)
        self.compressor = self.indexer = None
        self.build_compression()

    def build_compression(self) -> None:
        """V4: a compressed layer's own compressor, and on CSA layers its indexer."""
        if self.ratio:
            self.compressor = Compressor(self.w, "compressor.", self.ratio, self.c.head_dim, self.freqs,
                                         self.c.rms_norm_eps)
        if self.ratio == 4:
            self.indexer = Indexer(self.w, "indexer.", self.c, self.freqs)

    def share_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Read the named weights (names after the layer's `attn.` prefix) from `weights` from now
        on: the same values held elsewhere (views of a stack another reader takes), so that they
        are held once. The compressor and indexer are rebuilt on them."""
        self.w.update(weights)
        self.build_compression()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, groups: list[RequestRows],
                 cache: LayerCache) -> torch.Tensor:
        qr, q, kv = self.project(x, positions)
        side = {}
        if self.compressor:
            side["source"] = self.compressor.project(x)
        if self.indexer:
            side["index_source"] = self.indexer.compressor.project(x)
            side["index_q"], side["index_w"] = self.indexer.queries(x, qr, positions)
        out = torch.zeros_like(q)
        for g in groups:
            rows = {k: (v[g.index] if torch.is_tensor(v) else {kk: vv[g.index] for kk, vv in v.items()})
                    for k, v in side.items()}
            keys, mask = self._window_keys(g, kv[g.index], cache)
            if self.compressor:
                entries, entry_mask = self._compressed_keys(g, rows, cache)
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, entry_mask], dim=1)
            cache.window.write(g.slot, g.positions, {"kv": kv[g.index]})
            out[g.index] = self.attend(q[g.index], keys, mask)
        return self.output(out, positions)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """(qr [N, q_lora], q [N, H, D], kv [N, D]), q and kv rotated at `positions`."""
        c, w = self.c, self.w
        qr = rms_norm(F.linear(x, w["wq_a"]), w["q_norm"], c.rms_norm_eps)
        q = F.linear(qr, w["wq_b"]).unflatten(-1, (self.heads, c.head_dim))
        if c.q_head_norm:
            q = rms_norm(q, None, c.rms_norm_eps)
        q = apply_rope(q, positions, self.freqs)
        return qr, q, self.keys(x, positions)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The shared K=V head of `x`, rotated at `positions`."""
        return rotated_keys(x, self.w["wkv"], self.w["kv_norm"], positions, self.freqs, self.c.rms_norm_eps)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention of q [n, H, D] over keys [K, D] (or [n, K, D], per query; = values)
        where mask [n, K], with the per-head sink logit in the softmax; fp32 inside, q's dtype out."""
        k = "kd" if keys.dim() == 2 else "nkd"
        logits = torch.einsum(f"nhd,{k}->nhk", q.float(), keys.float()) * self.c.head_dim**-0.5
        logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
        sink = self.w["attn_sink"].float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum(f"nhk,{k}->nhd", probs, keys.float()).to(q.dtype)

    def output(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """De-rotate the heads' rope dims at the query positions, then grouped wo_a and wo_b
        (summed over the tensor-parallel ranks' groups)."""
        out = apply_rope(out, positions, self.freqs, inverse=True)
        groups = out.reshape(out.shape[0], self.o_groups, -1)  # group g = heads g*H/G .. (g+1)*H/G - 1
        wo_a = self.w["wo_a"].view(self.o_groups, self.c.o_lora_rank, -1)
        z = torch.einsum("ngi,gri->ngr", groups, wo_a).flatten(1)
        return self.tp.reduce(F.linear(z, self.w["wo_b"]))

    def _window_keys(self, g: RequestRows, kv: torch.Tensor, cache: LayerCache):
        window, p0 = self.c.sliding_window, int(g.positions[0])
        before = torch.arange(p0 - window + 1, p0, device=kv.device)
        old, old_valid = cache.window.read(g.slot, before)
        keys = torch.cat([old["kv"], kv])
        key_pos = torch.cat([before, g.positions])
        valid = torch.cat([old_valid, torch.ones_like(g.positions, dtype=torch.bool)])
        distance = g.positions[:, None] - key_pos[None, :]
        return keys, valid[None, :] & (distance >= 0) & (distance < window)

    def _compressed_keys(self, g: RequestRows, side, cache: LayerCache):
        m = self.ratio
        self._emit(self.compressor, cache.source, cache.entries, g, side["source"])
        if self.indexer:
            self._emit(self.indexer.compressor, cache.index_source, cache.index_entries, g, side["index_source"])
        count = (int(g.positions[-1]) + 1) // m
        entries = cache.entries[g.slot, :count]
        if count == 0:
            return entries, torch.zeros(len(g.positions), 0, dtype=torch.bool, device=entries.device)
        if self.indexer:
            keys = cache.index_entries[g.slot, :count]
            return entries, self.indexer.select(side["index_q"], side["index_w"], keys, g.positions)
        visible = torch.arange(count, device=entries.device)[None] < ((g.positions + 1) // m)[:, None]
        return entries, visible

    @staticmethod
    def _emit(compressor: Compressor, ring, entries: torch.Tensor, g: RequestRows, new: dict) -> None:
        """Compress the windows that the group's rows complete, then remember the rows."""
        m = compressor.ratio
        p0, p_last = int(g.positions[0]), int(g.positions[-1])
        first, last = (p0 + 1 + m - 1) // m - 1, (p_last + 1) // m - 1
        if last >= first:
            start = compressor.first_source(first)
            before = torch.arange(start, p0, device=g.positions.device)
            old, old_valid = ring.read(g.slot, before)
            kv = torch.cat([old["kv"], new["kv"]])
            gate = torch.cat([old["gate"], new["gate"]])
            valid = torch.cat([old_valid, torch.ones_like(g.positions, dtype=torch.bool)])
            windows = torch.arange(first, last + 1, device=kv.device)
            entries[g.slot, first:last + 1] = compressor.entries(kv, gate, valid, start, windows).to(entries.dtype)
        ring.write(g.slot, g.positions, new)
