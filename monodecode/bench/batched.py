"""The per-op baseline of `bench layer`: a decoder layer's own math with no host syncs, so that it
can be captured in a CUDA graph (a fair per-op baseline batches the experts and prepares their
weights once).

`BatchedLayer(block)` runs `model.layer.Block` of any kind on a decode step (the step's rules:
`model/batched.py`): the same projections, norms, mHC seams and rounding points, with changes of
form, not of math:
- attention: `model.batched.BatchedAttention` (fixed shapes, the rings written before they are
  read, compressed entries emitted by the rows that complete them);
- MoE: the routed experts are dequantized once at construction (bf16, stacked) and the step's
  picks, sorted by expert, go through `torch._grouped_mm` (one grouped GEMM for gate|up, one for
  down); experts no row picked are not read. The per-op MoE loops over the picked experts in
  Python and dequantizes each on every call.
Pad rows are not supported (their expert ids would index the bank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.batched import BatchedAttention, attention_site
from ..model.cache import LayerCache
from ..model.hc import hc_post
from ..model.layer import Block


class BatchedLayer:
    def __init__(self, block: Block):
        self.block, self.c = block, block.c
        self.attention = BatchedAttention(block.attention, block.w[f"{block.p}attn_norm"].device)
        bank, num_experts = block.moe.experts, block.moe.gate.shape[0]  # the router gate: a row an expert
        experts = [bank.expert(e) for e in range(num_experts)]  # (w1, w2, w3) each in the compute dtype
        # x @ w13[e] -> gate | up, [E, d, 2I]; h @ w2[e] -> [E, I, d]
        self.w13 = torch.stack([torch.cat([w1, w3]).t() for w1, _, w3 in experts]).contiguous()
        self.w2 = torch.stack([w2.t() for _, w2, _ in experts]).contiguous()

    def __call__(self, streams, tokens, positions, slots, cache: LayerCache) -> torch.Tensor:
        b = self.block
        streams = attention_site(self.attention, streams, *b.site_weights("attn"), positions, slots, cache, self.c)
        x, post, comb = b.site_input(streams, "ffn")
        return hc_post(self.moe(x, tokens), streams, post, comb)

    def moe(self, x, tokens) -> torch.Tensor:
        moe = self.block.moe
        ids, weights = moe.route(x, tokens)
        rows, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        gate, up = grouped_mm(x[order // k], self.w13, ends).float().chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=moe.limit)) * up.clamp(-moe.limit, moe.limit) * weights.flatten()[order, None]
        y = grouped_mm(h.to(x.dtype), self.w2, ends)  # [P, d], each pick rounded as F.linear
        per_pick = torch.empty_like(y).index_copy_(0, order, y).view(rows, k, -1).float()
        out = per_pick.sum(dim=1)
        if moe.shared:
            out += moe._swiglu(x, *moe.shared, None).float()
        return out.to(x.dtype)


@torch.compiler.disable
def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x (sorted by expert, expert e's ending at ends[e]) times their expert's w[e].
    Kept out of torch.compile: max-autotune benchmarks a grouped GEMM on random stand-ins for
    offsets computed inside the graph, which trips the kernel's offset assert (device-side
    assert on the H200, torch 2.11)."""
    return torch._grouped_mm(x, w, offs=ends)
