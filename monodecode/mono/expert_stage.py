"""The routed-expert stage on its own: K3's expert task loops as three persistent launches.

`routed_experts` runs one step's experts exactly as K3 runs them (`experts.up_stage`,
`swiglu_stage`, `down_stage`, the same tiles, grid and register cap from the same
`LaunchShape`), but with a launch boundary where K3 has a grid barrier, and the sum over each row's picks in top-k order on the
host side. It is what the expert tests check against the float64 reference
(`expert_reference.py`) and what the expert benchmark times.

Grid: `expert_programs_per_sm` programs a SM (grid (1,) under Triton's interpreter), program p taking
tasks p, p + grid, ...; nothing waits inside a launch, so no launch needs to be co-resident.
Scratch: `StageBuffers` (gate/up fp32, h bf16, per-pick outputs fp32), uninitialised unless
poisoned with NaN (the tasks write every element anything reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import experts as X
from .plan import fast_dots, interpreted
from .shape import LaunchShape

SWIGLU_BLOCK = 1024  # intermediate columns of a SwiGLU task (as K3's)


class StageBuffers:
    """Intermediates of one step's expert stage for P picks: gate/up [P, 2, I] fp32, h [P, I]
    bf16, per-pick outputs [P, d] fp32; NaN-filled with `poison`, for tests to catch an element
    no task wrote."""

    def __init__(self, picks: int, weights: X.ExpertWeights, device, poison: bool = False):
        def intermediate(shape, dtype):
            if poison:
                return torch.full(shape, float("nan"), dtype=dtype, device=device)
            return torch.empty(shape, dtype=dtype, device=device)

        inter, d = weights.intermediate, weights.hidden
        self.gate_up = intermediate((picks, 2, inter), torch.float32)
        self.h = intermediate((picks, inter), torch.bfloat16)
        self.per_pick = intermediate((picks, d), torch.float32)


@triton.jit
def _up(P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK,
        BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    X.up_stage(tl.program_id(0), tl.num_programs(0), P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr,
               w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK, BN, BK, FAST, DIAG)


@triton.jit
def _swiglu(P, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK: tl.constexpr, FAST: tl.constexpr):
    X.swiglu_stage(tl.program_id(0), tl.num_programs(0), P, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK, FAST)


@triton.jit
def _down(P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
          BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    X.down_stage(tl.program_id(0), tl.num_programs(0), P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr,
                 w2_codes, w2_scales, D, I, BN, BK, FAST, DIAG)


def shape_refusal(shape: LaunchShape, weights: X.ExpertWeights) -> str | None:
    """Why `shape`'s expert tiles cannot serve these experts, or None."""
    return X.tiles_refusal(shape.expert_block_n, shape.expert_block_k, weights.hidden, weights.intermediate)


def launch_stages(x: torch.Tensor, groups, route_weights: torch.Tensor, weights: X.ExpertWeights, limit: float,
                  buffers: StageBuffers, *, shape: LaunchShape = LaunchShape(), fast: bool,
                  kernels=("up", "swiglu", "down")) -> None:
    """The stage's three launches (`kernels` picks some, for a benchmark of one): x [R, d] bf16,
    `groups` from `experts.group_picks`, flat routing weights [R * k] fp32; fills `buffers`."""
    refusal = shape_refusal(shape, weights)
    if refusal:
        raise ValueError(f"launch shape {shape.spec()}: {refusal}")
    if fast and not weights.supports_fast_decode():
        raise ValueError("these experts have E8M0 scale codes outside "
                         f"{list(X.FAST_SCALE_CODES)}, which the fast decode cannot fold into a bf16 scale")
    d, inter = weights.hidden, weights.intermediate
    bn_up, bn_down = min(shape.expert_block_n, inter), min(shape.expert_block_n, d)
    bk_up, bk_down = min(shape.expert_block_k, d), min(shape.expert_block_k, inter)
    diagonal = X.takes_diagonal(shape.expert_block_k, d, inter)
    order, experts, counts = groups
    picks = order.numel()
    grid = (1,) if interpreted() else (torch.cuda.get_device_properties(x.device).multi_processor_count
                                       * shape.expert_programs_per_sm,)
    launch = {"num_warps": shape.expert_warps, "maxnreg": shape.expert_registers()}
    (w1, s1), (w2, s2), (w3, s3) = ((codes.view(torch.int16), scales) for codes, scales in
                                    (weights.w1, weights.w2, weights.w3))
    if "up" in kernels:
        _up[grid](picks, x, buffers.gate_up, counts, order, experts, w1, s1, w3, s3, d, inter, picks // x.shape[0],
                  BN=bn_up, BK=bk_up, FAST=fast, DIAG=diagonal, **launch)
    if "swiglu" in kernels:
        _swiglu[grid](picks, buffers.gate_up, route_weights, buffers.h, inter, float(limit),
                      BLOCK=min(SWIGLU_BLOCK, inter), FAST=fast, **launch)
    if "down" in kernels:
        _down[grid](picks, buffers.h, buffers.per_pick, counts, order, experts, w2, s2, d, inter,
                    BN=bn_down, BK=bk_down, FAST=fast, DIAG=diagonal, **launch)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, weights: X.ExpertWeights,
                   limit: float, *, shape: LaunchShape = LaunchShape(), fast: bool | None = None,
                   poison: bool = False) -> torch.Tensor:
    """y [R, d] fp32 of one step's routed experts: x [R, d] bf16, ids [R, k] (-1: a pad row's
    pick, skipped), routing weights [R, k]; each row's per-pick outputs summed in top-k order.
    `fast`: the NVIDIA decode (default: on a CUDA GPU); `poison`: NaN-filled intermediates."""
    if fast is None:
        fast = fast_dots(x)
    buffers = StageBuffers(ids.numel(), weights, x.device, poison)
    launch_stages(x.contiguous(), X.group_picks(ids), route_weights.to(torch.float32).flatten().contiguous(),
                  weights, limit, buffers, shape=shape, fast=fast)
    r, k = ids.shape
    per_pick = torch.where((ids >= 0).unsqueeze(-1), buffers.per_pick.view(r, k, -1), 0.0)  # pads: no task
    y = per_pick[:, 0].clone()
    for slot in range(1, k):  # top-k order, whatever the task order was
        y += per_pick[:, slot]
    return y
