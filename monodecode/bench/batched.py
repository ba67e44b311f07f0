"""The per-op baseline of `bench layer` for a window-only layer: the model's own math with no host
syncs, so that it can be captured in a CUDA graph (DESIGN.md section 6: a fair per-op baseline
batches the experts and prepares their weights once).

`BatchedWindowLayer(block)` runs `model.layer.Block` of a window-only layer on a step whose rows
are all live (no pad rows; every row's (slot, position) distinct): the same projections, norms,
mHC seams and rounding points, with two changes of form, not of math:
- attention: the step's KV rows are written to the ring first, then each row's window is read
  from the ring by position (the per-op path reads older rows from the ring and the step's own
  rows directly: the same keys);
- MoE: the routed experts are dequantized once at construction (bf16, stacked) and the step's
  picks, sorted by expert, go through `torch._grouped_mm` (one grouped GEMM for gate|up, one for
  down); experts no row picked are not read. The per-op MoE loops over the picked experts in
  Python and dequantizes each on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.hc import hc_post
from ..model.layer import Block
from ..model.norm import rms_norm


class BatchedWindowLayer:
    def __init__(self, block: Block):
        if block.attention.ratio:
            raise ValueError("BatchedWindowLayer takes window-only layers (compress ratio 0)")
        self.block, self.c = block, block.c
        device = block.w[f"{block.p}attn_norm"].device
        block.attention.freqs = block.attention.freqs.to(device)  # no host-to-device copy in a capture
        bank = block.moe.experts
        experts = [bank.expert(e) for e in range(len(bank.w1))]  # (w1, w2, w3) each in the compute dtype
        # x @ w13[e] -> gate | up, [E, d, 2I]; h @ w2[e] -> [E, I, d]
        self.w13 = torch.stack([torch.cat([w1, w3]).t() for w1, _, w3 in experts]).contiguous()
        self.w2 = torch.stack([w2.t() for _, w2, _ in experts]).contiguous()

    def __call__(self, streams, tokens, positions, slots, ring) -> torch.Tensor:
        b, eps = self.block, self.c.rms_norm_eps
        x, post, comb = b._hc_pre(streams, "attn")
        streams = hc_post(self.attention(rms_norm(x, b.w[f"{b.p}attn_norm"], eps), positions, slots, ring),
                          streams, post, comb)
        x, post, comb = b._hc_pre(streams, "ffn")
        return hc_post(self.moe(rms_norm(x, b.w[f"{b.p}ffn_norm"], eps), tokens), streams, post, comb)

    def attention(self, x, positions, slots, ring) -> torch.Tensor:
        att, window = self.block.attention, self.c.sliding_window
        _, q, kv = att.project(x, positions)
        index = positions % ring.size
        ring.data["kv"][slots, index] = kv.to(ring.data["kv"].dtype)
        ring.pos[slots, index] = positions
        key_pos = positions[:, None] - window + 1 + torch.arange(window, device=x.device)  # [R, W]
        key_index = key_pos % ring.size
        keys = ring.data["kv"][slots[:, None], key_index]  # [R, W, D]
        valid = (key_pos >= 0) & (ring.pos[slots[:, None], key_index] == key_pos)
        logits = torch.einsum("rhd,rkd->rhk", q.float(), keys.float()) * self.c.head_dim ** -0.5
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink = att.w["attn_sink"].float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("rhk,rkd->rhd", probs, keys.float()).to(q.dtype)
        return att.output(out, positions)

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
