"""The dense GEMV stage: y = x @ W.T for all R rows of a step, in tasks of BN outputs.

Used by K1 (wq_a and wkv stacked, wq_b) and K2 (grouped wo_a, wo_b, the router gate, the shared expert's
w1 / w3 / w2). `gemv_stage` is the device function the mono kernels call for a program's share
of a stage; `_gemv_stage` is the standalone launch that `gemv` and the tests use.

Contract
- A stage of SPLIT slices has `gemv_tasks(N, BN, SPLIT)` = ceil(N / BN) * SPLIT tasks; task t is
  slice ks = t % SPLIT (K steps ks * K / SPLIT ..) of output block nb = t // SPLIT. The outputs
  y[r, nb*BN + n] = sum_k x[r, xoff + k] * W[nb*BN + n, k] for r < R and nb*BN + n < N, and
  nothing else, are written by the block's one task (SPLIT 1), or, split, by the block's slice
  that arrives last: each slice stores its fp32 tile in the slice sums (`sums_ptr`, a [BN, BR]
  tile a task at t * BN * BR) and, once the program's K loop is done, takes the block's ticket
  (`tickets_ptr[nb]`, `sync.arrive`: its stores published first); the one that draws ticket
  SPLIT - 1 sums the block's tiles in
  slice order 0, 1, .., SPLIT - 1, writes y and sets the ticket back to 0. So the result does
  not depend on which slice finished last (graph replays are bit-exact), no task waits for
  another (any grid is safe), and the tickets are 0 again when the stage is over: a later stage
  or launch may reuse them and the sums after a grid barrier or in stream order. The stage reads
  x [R, >= xoff + K] bf16 (row stride `x_stride`, unit column stride), W [N, K] row-major and,
  for FP8, its scales.
- SWIGLU (the shared expert's w2): x is not read as is but made as it is loaded from two bf16
  tensors of the same strides, the gate at x_ptr and the up at up_ptr:
  x = bf16(silu(min(gate, limit)) * clamp(up, -limit, limit)) (`experts.swiglu_value`, the per-op
  path's h), so no stage writes h. Every task computes it for the x it loads: once a row at one
  row, once an output block at more.
- Program p of a grid of G takes tasks (p - first) mod G, + G, ... (`first`: where the stage's
  tasks start, so that a stage of several GEMVs spreads them over all programs). Its dot tasks
  run as one loop over their K steps, task after task, pipelined STAGES K steps deep by
  Triton (cp.async copies to shared memory), so the weights keep streaming across task
  boundaries.
- Grouped projection (`wo_a`): with group_rows > 0, output rows g*group_rows .. belong to group
  g, which reads x columns g*K .. g*K + K - 1, so xoff = (nb*BN // group_rows) * K; BN must
  divide group_rows so that a task lies in one group. group_rows == 0: xoff = 0.
- WFMT 0, FP8: W is e4m3 codes as uint8 [N, K], s the E8M0 codes uint8 [ceil(N/SB), ceil(K/SB)]
  (2^(code - 127); `formats.quantize_fp8_block`). BN divides SB. When BK divides SB too, one
  scale covers a BN x BK tile and is applied to the tile's fp32 partial product; when BK is a
  multiple of SB (a longer K step: more bytes in flight a load), each weight is scaled in
  registers before the dot. The e4m3 values and the power-of-two scales are exact in bf16 /
  fp32 (the scaled weights while they are normal numbers, which the per-op path's bf16
  dequantized weights must be too), so the result equals x @ dequantize_fp8_block(W).T up to
  fp32 accumulation order.
- WFMT 1: bf16 W [N, K] (the router gate, whose output is fp32); s_ptr is not read.
- K % BK == 0; N is arbitrary (the tail block is masked). Rows: R runtime, BR = R padded up to a
  power of two >= 16 (the dot's minimum), rows >= R masked; a one-row step has BR = 1 (below).
- One row (BR == 1): no dot. Each step loads a BN x BK weight tile (16 KB at the tiles
  `single_row_blocks` picks), in the same kind of pipelined loop over the program's tasks,
  multiplies it by x's BK values, each already scaled by its column's E8M0 scale (the same
  power of two as scaling the weight: exact while normal), and sums along K on the CUDA cores
  in fp32. BK may then be any power of two dividing K.
  A one-row step is not split (SPLIT 1).
- Rounding: fp32 accumulation (within a task by the dot, then over the slices in order); y is
  stored as bf16 rounded to nearest even (OUT_BF16, what the reference's bf16 F.linear returns)
  or as fp32. The FP8 tensor-core dots (FAST, 2-32 rows) of tiles of 64+ outputs (warp-group
  MMAs) sum a K step's products with less than fp32's precision inside the tensor core (the
  hardware's FP8 accumulation; each step's partial is fp32 when added to acc): errors up to
  ~1e-4 of sum |x| |w| seen, well below the bf16 output's rounding.

Python side: `gemv`, the standalone launch (grid (1,) under the interpreter); the tiles (BN, BK,
SPLIT), the scratch a split GEMV needs and the ValueErrors above are `gemv_tiles.py`'s.

Decode (constexpr FAST)
- FAST (NVIDIA): a `tl.dot` with the weight tile as the first operand (swap AB: [BN, BK] x
  [BK, BR]), since R is small. FP8 at BR <= SPLIT_X_ROWS (2-32 rows): the codes bitcast to
  float8e4nv and used as they are, x split into two e4m3 tiles and a power of two a row
  (`fp8.e4m3_pair`: exact for the elements that matter), two FP8 tensor-core dots, their sum scaled
  in fp32. So no weight is converted in registers: at these widths that conversion, not the
  memory, set a K step's time. Wider row blocks (and BK > SB): the codes converted to bf16
  (exact) and a bf16 dot of x. One row: the codes converted to fp32, no dot.
- Portable (interpreter, AMD): e4m3 decoded from its bits to fp32 (all 256 codes, subnormals
  too; 0x7F / 0xFF are NaN), fp32 `tl.dot` in IEEE precision, and the bf16 output rounded by
  `bf16` (the interpreter's cast truncates). The interpreter computes bf16 dots
  wrongly and has no fp8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .experts import swiglu_value
from .fp8 import e4m3_pair, e4m3_value, e8m0_value
from .gemv_tiles import (check_blocks, default_blocks, gemv_tasks, row_block, scale_block, single_row_blocks,
                         split_scratch)
from .plan import fast_dots, interpreted
from .rounding import bf16
from .sync import arrive


WFMT_FP8 = 0
WFMT_BF16 = 1
DENSE_STAGES = 4  # the standalone stage's pipeline depth (the kernels': LaunchShape.dense_stages)
# The widest row block (BR) whose FP8 dots take x as two e4m3 parts (`fp8.e4m3_pair`): wider, the
# split costs more a K step than the bf16 weights it replaces.
SPLIT_X_ROWS: tl.constexpr = tl.constexpr(32)


@triton.jit
def gemv_stage(pid, grid, first, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows, sums_ptr,
               tickets_ptr, WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr, BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr,
               STAGES: tl.constexpr, up_ptr=None, limit=0.0, SWIGLU: tl.constexpr = False):
    """Program `pid`'s share of a GEMV stage (the contract in the module docstring): tasks
    t = start, start + grid, ... with start = (pid - first) mod grid, so that a stage of several
    GEMVs can start the next one's tasks on the programs after the last one's. K1 / K2 call this.
    SWIGLU: x is the SwiGLU of x_ptr (gate) and up_ptr (up, same strides) with `limit`."""
    # K rounded down to a multiple of BK (no change: BK divides K, `check_blocks`) tells the
    # compiler that W's rows are 16-byte aligned. Given a K computed in the kernel (wo_a's
    # heads * D / groups) it cannot know that, and loads the tile a byte at a time, unpipelined.
    K = K // BK * BK
    n_tasks = tl.cdiv(N, BN) * SPLIT
    start = (pid - first % grid + grid) % grid
    if BR == 1:
        _single_row_tasks(start, grid, n_tasks, x_ptr, up_ptr, limit, w_ptr, s_ptr, y_ptr, N, K, group_rows, WFMT,
                          SB, BN, BK, OUT_BF16, FAST, STAGES, SWIGLU)
    else:
        _dot_tasks(start, grid, n_tasks, x_ptr, up_ptr, limit, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K,
                   group_rows, sums_ptr, tickets_ptr, WFMT, SB, BN, BK, SPLIT, BR, OUT_BF16, FAST, STAGES, SWIGLU)


@triton.jit
def _single_row_tasks(start, grid, n_tasks, x_ptr, up_ptr, limit, w_ptr, s_ptr, y_ptr, N, K, group_rows,
                      WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      OUT_BF16: tl.constexpr, FAST: tl.constexpr, STAGES: tl.constexpr, SWIGLU: tl.constexpr):
    """The program's tasks of a one-row step (BR == 1): fp32 products summed on the CUDA cores, one
    loop over the tasks' K steps pipelined as `_dot_tasks`' (a task's outputs leave at its last)."""
    steps = K // BK
    mine = tl.cdiv(tl.maximum(n_tasks - start, 0), grid)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for i in tl.range(0, mine * steps, num_stages=STAGES):
        j = i // steps
        k0 = (i - j * steps) * BK
        nb = start + j * grid
        n = nb * BN + tl.arange(0, BN)
        xoff = 0
        if group_rows > 0:
            xoff = (nb * BN) // group_rows * K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
        x = _load_x(x_ptr, up_ptr, xoff + k0 + rk, None, limit, FAST, SWIGLU).to(tl.float32)
        if WFMT == 0:
            scale_row = s_ptr + (nb * BN // SB) * tl.cdiv(K, SB)  # BN divides SB: one block row
            x = x * e8m0_value(tl.load(scale_row + (k0 + rk) // SB).to(tl.int32))
            if FAST:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = e4m3_value(w.to(tl.int32))
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if k0 + BK == K:
            _store(y_ptr + n, acc, n < N, OUT_BF16, FAST)
            acc = tl.zeros((BN,), dtype=tl.float32)


@triton.jit
def _dot_tasks(start, grid, n_tasks, x_ptr, up_ptr, limit, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K,
               group_rows, sums_ptr, tickets_ptr, WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr,
               STAGES: tl.constexpr, SWIGLU: tl.constexpr):
    """The program's dot tasks (BR >= 16) as one loop over their K steps, task after task, so
    that Triton's software pipeline (STAGES deep) keeps loading across task boundaries;
    a task's tile leaves at its last K step: the outputs (SPLIT 1) or its slice sum. Split, the
    tickets are taken after the loop: a CTA barrier inside it would stop Triton pipelining it."""
    steps = K // BK // SPLIT  # K steps of a task
    mine = tl.cdiv(tl.maximum(n_tasks - start, 0), grid)
    tile = tl.arange(0, BN)[:, None] * BR + tl.arange(0, BR)[None, :]
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for i in tl.range(0, mine * steps, num_stages=STAGES):
        j = i // steps
        step = i - j * steps
        t = start + j * grid
        nb = t // SPLIT
        k0 = ((t - nb * SPLIT) * steps + step) * BK
        acc = _dot_step(acc, nb, k0, x_ptr, up_ptr, limit, x_stride, R, w_ptr, s_ptr, N, K, group_rows, WFMT, SB, BN,
                        BK, BR, FAST, SWIGLU)
        if step == steps - 1:
            if SPLIT == 1:
                _store_outputs(acc, nb, R, y_ptr, y_stride, N, BN, BR, OUT_BF16, FAST)
            else:
                tl.store(sums_ptr + t * (BN * BR) + tile, acc)
            acc = tl.zeros((BN, BR), dtype=tl.float32)
    if SPLIT > 1:
        for j in range(mine):
            nb = (start + j * grid) // SPLIT
            if arrive(tickets_ptr + nb) == SPLIT - 1:
                # Every slice of the block is in: sum them in slice order, whichever arrived last,
                # so the result is the same every run. L2 loads (.cg): an earlier stage's sums may
                # sit in this SM's L1 at these addresses. A loop, not unrolled: unrolled, the
                # compiler loads all the slices' tiles at once, and at 64 rows (a [128, 64] fp32
                # tile is 32 registers a thread) that spills.
                block = sums_ptr + nb * SPLIT * (BN * BR) + tile
                total = tl.load(block, cache_modifier=".cg")
                for k in tl.range(1, SPLIT, loop_unroll_factor=1):
                    total += tl.load(block + k * (BN * BR), cache_modifier=".cg")
                tl.atomic_xchg(tickets_ptr + nb, 0, sem="relaxed", scope="gpu")  # 0 again for the next stage
                _store_outputs(total, nb, R, y_ptr, y_stride, N, BN, BR, OUT_BF16, FAST)


@triton.jit
def _load_x(x_ptr, up_ptr, offsets, mask, limit, FAST: tl.constexpr, SWIGLU: tl.constexpr):
    """The stage's x (bf16) at `offsets`: loaded, or with SWIGLU the SwiGLU of the gate at x_ptr and
    the up at up_ptr (`experts.swiglu_value` with weight 1, rounded to bf16 as the per-op path's h)."""
    if mask is None:
        x = tl.load(x_ptr + offsets)
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if SWIGLU:
        if mask is None:
            up = tl.load(up_ptr + offsets)
        else:
            up = tl.load(up_ptr + offsets, mask=mask, other=0.0)
        x = swiglu_value(x.to(tl.float32), up.to(tl.float32), 1.0, limit, FAST)
    return x


@triton.jit
def _dot_step(acc, nb, k0, x_ptr, up_ptr, limit, x_stride, R, w_ptr, s_ptr, N, K, group_rows, WFMT: tl.constexpr,
              SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, FAST: tl.constexpr,
              SWIGLU: tl.constexpr):
    """acc + W[nb*BN : nb*BN + BN, k0 : k0 + BK] @ x[:R, xoff + k0 : xoff + k0 + BK].T (fp32)."""
    n = nb * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    rk = k0 + tl.arange(0, BK)
    xoff = 0
    if group_rows > 0:
        xoff = (nb * BN) // group_rows * K
    x = _load_x(x_ptr, up_ptr, r[:, None] * x_stride + xoff + rk[None, :], (r < R)[:, None], limit, FAST, SWIGLU)
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + rk[None, :], mask=(n < N)[:, None], other=0)  # N*K may pass 2^31
    if WFMT == 0 and BK > SB:
        # Several scale blocks along K: each weight scaled in registers before the dot (a power of
        # two: exact while the product is a normal number, as the per-op path's bf16 dequantized
        # weights are). BN divides SB, so a tile spans one block row.
        codes = tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + rk // SB)
        scale_k = e8m0_value(codes.to(tl.int32))[None, :]
        if FAST:
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale_k.to(tl.bfloat16)
            acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(e4m3_value(w.to(tl.int32)) * scale_k, tl.trans(x.to(tl.float32)), acc,
                         input_precision="ieee")
    elif WFMT == 0:
        # One scale for the whole tile: BN and BK divide SB.
        scale = e8m0_value(tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + k0 // SB).to(tl.int32))
        if FAST and BR <= SPLIT_X_ROWS and BK >= 32:  # (an FP8 dot's K is a multiple of 32)
            hi, lo, down = e4m3_pair(x)
            w = w.to(tl.float8e4nv, bitcast=True)
            acc += (tl.dot(w, tl.trans(hi)) + tl.dot(w, tl.trans(lo))) * (scale * down)[None, :]
        elif FAST:
            acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), tl.trans(x.to(tl.bfloat16))) * scale
        else:
            acc += tl.dot(e4m3_value(w.to(tl.int32)), tl.trans(x.to(tl.float32)), input_precision="ieee") * scale
    else:
        if FAST:
            acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _store_outputs(acc, nb, R, y_ptr, y_stride, N, BN: tl.constexpr, BR: tl.constexpr, OUT_BF16: tl.constexpr,
                   FAST: tl.constexpr):
    """y[r, nb*BN + n] = acc[n, r] for r < R, nb*BN + n < N."""
    n = nb * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    _store(y_ptr + r[None, :] * y_stride + n[:, None], acc, (n < N)[:, None] & (r < R)[None, :], OUT_BF16, FAST)


@triton.jit
def _store(ptrs, acc, mask, OUT_BF16: tl.constexpr, FAST: tl.constexpr):
    """fp32 acc stored at ptrs: as bf16 rounded to nearest even (OUT_BF16; `rounding.bf16` where the
    cast truncates) or as fp32."""
    if OUT_BF16:
        if not FAST:
            acc = bf16(acc)
        tl.store(ptrs, acc.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def split_sums_of(N, BN: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr):
    """The slice sums one GEMV of a stage takes (`split_scratch`), for the next one's offset."""
    sums = 0
    if SPLIT > 1:
        sums = tl.cdiv(N, BN) * SPLIT * BN * BR
    return sums


@triton.jit
def split_tickets_of(N, BN: tl.constexpr, SPLIT: tl.constexpr):
    """The tickets one GEMV of a stage takes (`split_scratch`), for the next one's offset."""
    tickets = 0
    if SPLIT > 1:
        tickets = tl.cdiv(N, BN)
    return tickets


@triton.jit
def _gemv_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows, sums_ptr, tickets_ptr,
                up_ptr, limit, WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr,
                STAGES: tl.constexpr, SWIGLU: tl.constexpr):
    gemv_stage(tl.program_id(0), tl.num_programs(0), 0, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K,
               group_rows, sums_ptr, tickets_ptr, WFMT, SB, BN, BK, SPLIT, BR, OUT_BF16, FAST, STAGES, up_ptr, limit,
               SWIGLU)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, block=None, split: int = 1,
         out_dtype=torch.bfloat16, group_rows: int = 0, up: torch.Tensor | None = None, limit: float = 0.0,
         fast: bool | None = None, poison: bool = False) -> torch.Tensor:
    """y [R, N] = x [R, >= K] (bf16) @ W.T, W [N, K]: FP8 (float8_e4m3fn or its uint8 codes)
    with E8M0 block scales `scale` (float8_e8m0fnu or uint8), or bf16 when `scale` is None.
    With group_rows > 0, output rows g*group_rows .. read x columns g*K .. (grouped wo_a).
    With `up` (bf16, x's shape and strides), x is a SwiGLU's gate and the GEMV reads
    silu(min(x, limit)) * clamp(up, -limit, limit) rounded to bf16 in its place (the shared
    expert's w2). `block` = (BN, BK), default `default_blocks` for this device's SM count; `split`
    slices of K a block (2+ rows); `poison` fills y with NaN first, so that tests see any element
    no task wrote."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"gemv: x must be a 2-D bf16 tensor with unit column stride, found {x.dtype} {tuple(x.shape)}")
    R, (N, K) = x.shape[0], w.shape
    if scale is None:
        if w.dtype != torch.bfloat16:
            raise ValueError(f"gemv: weights without scales must be bf16, found {w.dtype}")
        wfmt, sb, s = WFMT_BF16, None, w
    else:
        if w.dtype not in (torch.float8_e4m3fn, torch.uint8) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise ValueError(f"gemv: FP8 weights need e4m3 codes and e8m0 scales, found {w.dtype}, {scale.dtype}")
        wfmt, sb, s = WFMT_FP8, scale_block(N, K, scale.shape), scale.view(torch.uint8).contiguous()
        w = w.view(torch.uint8)
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else None
    bn, bk = block if block is not None else (single_row_blocks if R == 1 else default_blocks)(N, K, sb, programs)
    check_blocks(N, K, sb, bn, bk, group_rows, split, R)
    width = (N // group_rows) * K if group_rows else K
    if R < 1 or x.shape[1] < width:
        raise ValueError(f"gemv: x {tuple(x.shape)} needs >= 1 row and >= {width} columns")
    if up is not None and (up.dtype != torch.bfloat16 or up.shape != x.shape or up.stride() != x.stride()):
        raise ValueError(f"gemv: up must be bf16 with x's shape and strides, found {up.dtype} {tuple(up.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemv: out_dtype must be bf16 or fp32, found {out_dtype}")
    if fast is None:
        fast = fast_dots(x)
    y = torch.full((R, N), float("nan") if poison else 0.0, dtype=out_dtype, device=x.device)
    br = row_block(R)
    sums, tickets = split_scratch(N, bn, split, br)
    sums = torch.full((max(sums, 1),), float("nan"), dtype=torch.float32, device=x.device)
    tickets = torch.zeros(max(tickets, 1), dtype=torch.int32, device=x.device)
    grid = (1,) if interpreted() else (gemv_tasks(N, bn, split),)
    _gemv_stage[grid](x, x.stride(0), R, w.contiguous(), s, y, y.stride(0), N, K, group_rows, sums, tickets,
                      x if up is None else up, float(limit), WFMT=wfmt, SB=sb or 1, BN=bn, BK=bk, SPLIT=split, BR=br,
                      OUT_BF16=out_dtype == torch.bfloat16, FAST=fast, STAGES=DENSE_STAGES, SWIGLU=up is not None)
    return y
