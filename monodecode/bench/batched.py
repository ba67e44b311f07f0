"""The per-op baseline of `bench layer`: a decoder layer's own math with no host syncs, so that it
can be captured in a CUDA graph (DESIGN.md section 6: a fair per-op baseline batches the experts
and prepares their weights once).

`BatchedLayer(block)` runs `model.layer.Block` of any kind (window-only, CSA, HCA) on a decode
step whose rows are all live (no pad rows; every row's (slot, position) distinct; a request's rows
consecutive positions, at most the cache's `max_step_rows`): the same projections, norms, mHC
seams and rounding points, with changes of form, not of math:
- the step's rows are written to the position rings first (window KV, compressor sources), then
  read back by position, where the per-op path reads older rows from a ring and the step's own
  rows directly: the same rows;
- every row computes the compressed entry of its last window (the `Compressor.compress` of the
  per-op path, on source rows read from the ring), and the rows that complete a window (position
  + 1 a multiple of the ratio) write it; the others write back the unchanged entry of a window
  that no row of the step completes, so the writes never collide;
- each row attends over its window and every entry slot of its request (fixed shapes), masked to
  the visible entries (HCA) or the indexer's top-k of them (CSA): the per-op path slices the
  visible ones. The masked keys add exact zeros to the softmax, so the result is the per-op
  path's up to fp32 summation order;
- MoE: the routed experts are dequantized once at construction (bf16, stacked) and the step's
  picks, sorted by expert, go through `torch._grouped_mm` (one grouped GEMM for gate|up, one for
  down); experts no row picked are not read. The per-op MoE loops over the picked experts in
  Python and dequantizes each on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.cache import LayerCache, PositionRing
from ..model.hc import hc_post
from ..model.layer import Block
from ..model.norm import rms_norm


class BatchedLayer:
    def __init__(self, block: Block):
        self.block, self.c = block, block.c
        att = block.attention
        device = block.w[f"{block.p}attn_norm"].device
        for owner in (att, att.compressor, att.indexer, att.indexer and att.indexer.compressor):
            if owner is not None:  # no host-to-device copy in a capture
                owner.freqs = owner.freqs.to(device)
        bank = block.moe.experts
        experts = [bank.expert(e) for e in range(len(bank.w1))]  # (w1, w2, w3) each in the compute dtype
        # x @ w13[e] -> gate | up, [E, d, 2I]; h @ w2[e] -> [E, I, d]
        self.w13 = torch.stack([torch.cat([w1, w3]).t() for w1, _, w3 in experts]).contiguous()
        self.w2 = torch.stack([w2.t() for _, w2, _ in experts]).contiguous()

    def __call__(self, streams, tokens, positions, slots, cache: LayerCache) -> torch.Tensor:
        b, eps = self.block, self.c.rms_norm_eps
        x, post, comb = b._hc_pre(streams, "attn")
        streams = hc_post(self.attention(rms_norm(x, b.w[f"{b.p}attn_norm"], eps), positions, slots, cache),
                          streams, post, comb)
        x, post, comb = b._hc_pre(streams, "ffn")
        return hc_post(self.moe(rms_norm(x, b.w[f"{b.p}ffn_norm"], eps), tokens), streams, post, comb)

    def attention(self, x, positions, slots, cache: LayerCache) -> torch.Tensor:
        att, window = self.block.attention, self.c.sliding_window
        qr, q, kv = att.project(x, positions)
        write(cache.window, slots, positions, {"kv": kv})
        key_pos = positions[:, None] - window + 1 + torch.arange(window, device=x.device)  # [R, W]
        keys, valid = read(cache.window, slots, key_pos)
        keys = keys["kv"]
        if att.ratio:
            entries, visible = self.compressed(att.compressor, cache.source, cache.entries, x, positions, slots)
            if att.indexer:
                index_keys, _ = self.compressed(att.indexer.compressor, cache.index_source, cache.index_entries,
                                                x, positions, slots)
                index_q, index_w = att.indexer.queries(x, qr, positions)
                visible = att.indexer.select(index_q, index_w, index_keys, positions)
            keys, valid = torch.cat([keys, entries], dim=1), torch.cat([valid, visible], dim=1)
        logits = torch.einsum("rhd,rkd->rhk", q.float(), keys.float()) * self.c.head_dim ** -0.5
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink = att.w["attn_sink"].float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("rhk,rkd->rhd", probs, keys.float()).to(q.dtype)
        return att.output(out, positions)

    @staticmethod
    def compressed(compressor, ring: PositionRing, entries: torch.Tensor, x, positions, slots):
        """Emit the entries the step's rows complete, then (every entry slot of each row's request
        [R, E, d], which of them the row sees [R, E])."""
        m, count = compressor.ratio, entries.shape[1]
        write(ring, slots, positions, compressor.project(x))
        visible = torch.arange(count, device=x.device)[None] < ((positions + 1) // m)[:, None]
        if count == 0:  # a context shorter than one window: nothing to emit or see
            return entries[slots], visible
        window = (positions + 1) // m - 1  # the last window a row's position closes or passed
        completes = ((positions + 1) % m == 0) & (window >= 0)

        def lookup(pos):  # pos [R, m] of row r's window
            rows, present = read(ring, slots, pos)
            return rows["kv"], rows["gate"], present

        new = compressor.compress(lookup, window.clamp(min=0)).to(entries.dtype)
        last = torch.full((entries.shape[0],), -1, dtype=positions.dtype, device=positions.device)
        last = last.scatter_reduce(0, slots, positions, "amax")[slots]  # the request's last row
        untouched = ((last + 1) // m).clamp(max=count - 1)  # a window no row of the step completes
        target = torch.where(completes, window, untouched)
        entries[slots, target] = torch.where(completes[:, None], new, entries[slots, target])
        return entries[slots], visible

    def moe(self, x, tokens) -> torch.Tensor:
        moe = self.block.moe
        ids, weights = moe.route(x, tokens)
        rows, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[order // k], self.w13, offs=ends).float().chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=moe.limit)) * up.clamp(-moe.limit, moe.limit) * weights.flatten()[order, None]
        y = torch._grouped_mm(h.to(x.dtype), self.w2, offs=ends)  # [P, d], each pick rounded as F.linear
        per_pick = torch.empty_like(y).index_copy_(0, order, y).view(rows, k, -1).float()
        out = per_pick.sum(dim=1)
        if moe.shared:
            out += moe._swiglu(x, *moe.shared, None).float()
        return out.to(x.dtype)


def write(ring: PositionRing, slots, positions, values: dict[str, torch.Tensor]) -> None:
    """The step's rows into a position ring (rows of one request never collide: at most
    `max_step_rows` of them, fewer than the ring's size)."""
    index = positions % ring.size
    for name, value in values.items():
        ring.data[name][slots, index] = value.to(ring.data[name].dtype)
    ring.pos[slots, index] = positions


def read(ring: PositionRing, slots, positions):
    """Rows of positions [R, n] of each row's slot: ({name: [R, n, width]}, present [R, n])."""
    index = positions % ring.size
    present = (positions >= 0) & (ring.pos[slots[:, None], index] == positions)
    return {name: data[slots[:, None], index] for name, data in ring.data.items()}, present
