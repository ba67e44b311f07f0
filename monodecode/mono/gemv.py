"""The dense GEMV stage: one task computes BN outputs of y = x @ W.T for all R rows of a step.

Used by K1 (wq_a, wkv, wq_b) and K2 (grouped wo_a, wo_b, the router gate, the shared expert's
w1 / w3 / w2). `gemv_task` is the device function the mono kernels call from their task loop;
`_gemv_stage` is the standalone launch (program p takes tasks p, p + grid, ...) that `gemv`
and the tests use.

Contract
- Task `nb` (0 <= nb < `gemv_tasks(N, BN)` = ceil(N / BN)) writes
  y[r, nb*BN + n] = sum_k x[r, xoff + k] * W[nb*BN + n, k] for r < R and nb*BN + n < N, and
  nothing else; it reads x [R, >= xoff + K] bf16 (row stride `x_stride`, unit column stride),
  W [N, K] row-major and, for FP8, its scales. Tasks of the stage are independent.
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
  `single_row_blocks` picks, so that enough bytes are in flight to cover the memory latency),
  multiplies it by x's BK values, each already scaled by its column's E8M0 scale (the same
  power of two as scaling the weight: exact while normal), and sums along K on the CUDA cores
  in fp32. BK may then be any power of two dividing K.
- Rounding: fp32 accumulation; y is stored as bf16 rounded to nearest even (OUT_BF16, what the
  reference's bf16 F.linear returns) or as fp32.

Python side: `gemv_tasks` (the stage's task count), `row_block` (BR), `default_blocks`
(BN, BK) of a dot task, `single_row_blocks` (BN, BK) of a one-row task, `kernel_blocks` (the
kernels' choice between them), `check_blocks` (the ValueErrors above: call it at build),
`scale_block` (SB from a scale tensor's shape) and `gemv`, the standalone launch (grid (1,)
under the interpreter).

Decode (constexpr FAST)
- FAST (NVIDIA): the codes bitcast to float8e4nv and converted to bf16 (exact), x bf16, and a
  bf16 `tl.dot` with the weight tile as the first operand (swap AB: [BN, BK] x [BK, BR]), since
  R is small; fp32 accumulation. One row: the codes converted to fp32 the same way, no dot.
- Portable (interpreter, AMD): e4m3 decoded from its bits to fp32 (all 256 codes, subnormals
  too; 0x7F / 0xFF are NaN), fp32 `tl.dot` in IEEE precision, and the bf16 output rounded by
  `bf16` (the interpreter's cast truncates). The interpreter computes bf16 dots
  wrongly and has no fp8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import interpreted
from .rounding import bf16


WFMT_FP8 = 0
WFMT_BF16 = 1


@triton.jit
def _e4m3_value(code):
    """e4m3fn codes (int32, 0..255) -> their values (fp32), from the bits: exact for all codes."""
    exponent = (code >> 3) & 15
    mantissa = code & 7
    # Normal: the fp32 with the same mantissa (its 3 top bits) and exponent e - 7 + 127.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # m/8 * 2^-6
    value = tl.where((code & 0x80) != 0, -magnitude, magnitude)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _e8m0_value(code):
    """An E8M0 scale code (int32) -> 2^(code - 127) (fp32) from its bits; code 0 is the fp32
    subnormal 2^-127, 255 NaN (as `formats.e8m0_to_float`)."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def gemv_task(nb, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows,
              WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr):
    """y[:R, nb*BN : nb*BN + BN] (masked at N) = x[:R, xoff : xoff + K] @ W[block].T (the
    contract in the module docstring). K1 / K2 call this."""
    # K rounded down to a multiple of BK (no change: BK divides K, `check_blocks`) tells the
    # compiler that W's rows are 16-byte aligned. Given a K computed in the kernel (wo_a's
    # heads * D / groups) it cannot know that, and loads the tile a byte at a time, unpipelined.
    K = K // BK * BK
    if BR == 1:
        _single_row_task(nb, x_ptr, w_ptr, s_ptr, y_ptr, N, K, group_rows, WFMT, SB, BN, BK, OUT_BF16, FAST)
    else:
        _dot_task(nb, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows,
                  WFMT, SB, BN, BK, BR, OUT_BF16, FAST)


@triton.jit
def _single_row_task(nb, x_ptr, w_ptr, s_ptr, y_ptr, N, K, group_rows, WFMT: tl.constexpr, SB: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr):
    """gemv_task for one row (BR == 1): fp32 products summed on the CUDA cores."""
    n = nb * BN + tl.arange(0, BN)
    n_mask = n < N
    rk = tl.arange(0, BK)
    xoff = 0
    if group_rows > 0:
        xoff = (nb * BN) // group_rows * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + rk[None, :]
    scale_row = s_ptr + (nb * BN // SB) * tl.cdiv(K, SB)  # BN divides SB: one block row
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        w = tl.load(w_rows + k0, mask=n_mask[:, None], other=0)
        x = tl.load(x_ptr + xoff + k0 + rk).to(tl.float32)
        if WFMT == 0:
            x = x * _e8m0_value(tl.load(scale_row + (k0 + rk) // SB).to(tl.int32))
            if FAST:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = _e4m3_value(w.to(tl.int32))
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if OUT_BF16:
        if not FAST:
            acc = bf16(acc)
        tl.store(y_ptr + n, acc.to(tl.bfloat16), mask=n_mask)
    else:
        tl.store(y_ptr + n, acc, mask=n_mask)


@triton.jit
def _dot_task(nb, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows,
              WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr):
    """gemv_task for BR >= 16 rows: tensor-core dots of the weight tile and x's tile."""
    n = nb * BN + tl.arange(0, BN)
    n_mask = n < N
    r = tl.arange(0, BR)
    r_mask = r < R
    rk = tl.arange(0, BK)
    xoff = 0
    if group_rows > 0:
        xoff = (nb * BN) // group_rows * K
    x_rows = x_ptr + r[:, None] * x_stride + xoff + rk[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + rk[None, :]  # N * K may pass 2^31
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        x = tl.load(x_rows + k0, mask=r_mask[:, None], other=0.0)
        w = tl.load(w_rows + k0, mask=n_mask[:, None], other=0)
        if WFMT == 0 and BK > SB:
            # Several scale blocks along K: each weight scaled in registers before the dot (a
            # power of two: exact while the product is a normal number, as the per-op path's
            # bf16 dequantized weights are). BN divides SB, so a tile spans one block row.
            codes = tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + (k0 + rk) // SB)
            scale_k = _e8m0_value(codes.to(tl.int32))[None, :]
            if FAST:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale_k.to(tl.bfloat16)
                acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(_e4m3_value(w.to(tl.int32)) * scale_k, tl.trans(x.to(tl.float32)), acc,
                             input_precision="ieee")
        elif WFMT == 0:
            if FAST:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
                part = tl.dot(w, tl.trans(x.to(tl.bfloat16)))
            else:
                part = tl.dot(_e4m3_value(w.to(tl.int32)), tl.trans(x.to(tl.float32)), input_precision="ieee")
            # One scale for the whole tile: BN and BK divide SB.
            scale = _e8m0_value(tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + k0 // SB).to(tl.int32))
            acc += part * scale
        else:
            if FAST:
                acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    y_tile = y_ptr + r[None, :] * y_stride + n[:, None]
    y_mask = n_mask[:, None] & r_mask[None, :]
    if OUT_BF16:
        if not FAST:
            acc = bf16(acc)
        tl.store(y_tile, acc.to(tl.bfloat16), mask=y_mask)
    else:
        tl.store(y_tile, acc, mask=y_mask)


@triton.jit
def _gemv_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows, n_tasks,
                WFMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                BR: tl.constexpr, OUT_BF16: tl.constexpr, FAST: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        gemv_task(t, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, y_stride, N, K, group_rows,
                  WFMT, SB, BN, BK, BR, OUT_BF16, FAST)


# --- Python side ----------------------------------------------------------------------------------
def gemv_tasks(N: int, BN: int) -> int:
    """Tasks of a GEMV stage with N output columns in blocks of BN."""
    return triton.cdiv(N, BN)


def row_block(R: int) -> int:
    """BR for R rows: 1 for one row (the CUDA-core task), else R padded up to a power of two,
    at least 16 (the dot's minimum)."""
    return 1 if R == 1 else max(16, triton.next_power_of_2(R))


def default_blocks(N: int, K: int, SB: int | None = None, programs: int | None = None) -> tuple[int, int]:
    """(BN, BK) for an [N, K] weight (FP8 with SB x SB scale blocks, or bf16 with SB None):
    BN = min(64, SB, next_pow2(N)) but >= 16, halved (not below 16) while the stage has fewer
    tasks than half of `programs` (the persistent grid, if given); BK = the largest power of
    two <= min(128, SB) that divides K. Why: a task streams too few bytes at once to cover the
    memory latency, so a small stage wants most programs busy."""
    bn = max(16, min(64 if SB is None else min(64, SB), triton.next_power_of_2(N)))
    while programs and bn > 16 and 2 * gemv_tasks(N, bn) < programs:
        bn //= 2
    bk = min(128 if SB is None else min(128, SB), K & -K)
    return bn, bk


def single_row_blocks(N: int, K: int, SB: int | None = None, programs: int | None = None) -> tuple[int, int]:
    """(BN, BK) of a one-row task: BN = 32 (16 while the stage would have fewer tasks than half
    of `programs`; at most SB and next_pow2(N)), BK = 16384 weight elements / BN, capped at the
    largest power of two dividing K. Why: one row is a stream of weights with almost no
    arithmetic, so a step's load is as large as the registers allow without spilling."""
    bn = min(32, SB or 32, max(16, triton.next_power_of_2(N)))
    if programs and bn > 16 and 2 * gemv_tasks(N, bn) < programs:
        bn = 16
    return bn, min(16384 // bn, K & -K)


def kernel_blocks(block_n: int, block_k: int, N: int, K: int, SB: int | None, programs: int,
                  rows: int) -> tuple[int, int]:
    """(BN, BK) of a GEMV stage inside the persistent kernels for a step of `rows` rows: one row,
    `single_row_blocks`; more, the launch shape's (`LaunchShape.block_n / block_k`): BN =
    block_n capped at SB, or with block_n 0 `default_blocks`' choice for `programs`; BK =
    block_k capped at the largest power of two dividing K."""
    if rows == 1:
        return single_row_blocks(N, K, SB, programs)
    bn = default_blocks(N, K, SB, programs)[0] if block_n == 0 else min(block_n, SB or block_n)
    return bn, min(block_k, K & -K)


def check_blocks(N: int, K: int, SB: int | None, BN: int, BK: int, group_rows: int = 0) -> None:
    """Raise ValueError unless (BN, BK) is a valid tiling of an [N, K] weight (SB None: bf16)."""
    for name, b in (("BN", BN), ("BK", BK)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"gemv: {name}={b} must be a power of two >= 16")
    if K <= 0 or K % BK:
        raise ValueError(f"gemv: BK={BK} must divide K={K}")
    if SB is not None and SB % BN:  # (BK, a power of two as SB, divides SB or is a multiple of it)
        raise ValueError(f"gemv: BN={BN} must divide the scale block SB={SB}, so that a tile spans one block row")
    if group_rows and (group_rows < 0 or group_rows % BN or N % group_rows):
        raise ValueError(f"gemv: group_rows={group_rows} must be a multiple of BN={BN} dividing N={N}")


def scale_block(N: int, K: int, scale_shape) -> int:
    """The power-of-two SB with scale_shape == (ceil(N/SB), ceil(K/SB)). Where several fit, the
    grid is one block in both dims and all of them mean the same: take the smallest."""
    sb = 1
    while sb <= 2 * max(N, K):
        if tuple(scale_shape) == (triton.cdiv(N, sb), triton.cdiv(K, sb)):
            return sb
        sb *= 2
    raise ValueError(f"gemv: scale shape {tuple(scale_shape)} is no power-of-two block grid of a [{N}, {K}] weight")


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, block=None,
         out_dtype=torch.bfloat16, group_rows: int = 0, fast: bool | None = None,
         poison: bool = False) -> torch.Tensor:
    """y [R, N] = x [R, >= K] (bf16) @ W.T, W [N, K]: FP8 (float8_e4m3fn or its uint8 codes)
    with E8M0 block scales `scale` (float8_e8m0fnu or uint8), or bf16 when `scale` is None.
    With group_rows > 0, output rows g*group_rows .. read x columns g*K .. (grouped wo_a).
    `block` = (BN, BK), default `default_blocks` for this device's SM count; `poison` fills y
    with NaN first, so that tests see any element no task wrote."""
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
    check_blocks(N, K, sb, bn, bk, group_rows)
    width = (N // group_rows) * K if group_rows else K
    if R < 1 or x.shape[1] < width:
        raise ValueError(f"gemv: x {tuple(x.shape)} needs >= 1 row and >= {width} columns")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemv: out_dtype must be bf16 or fp32, found {out_dtype}")
    if fast is None:
        fast = x.is_cuda and torch.version.cuda is not None
    y = torch.full((R, N), float("nan") if poison else 0.0, dtype=out_dtype, device=x.device)
    n_tasks = gemv_tasks(N, bn)
    grid = (1,) if interpreted() else (n_tasks,)
    _gemv_stage[grid](x, x.stride(0), R, w.contiguous(), s, y, y.stride(0), N, K, group_rows, n_tasks,
                      WFMT=wfmt, SB=sb or 1, BN=bn, BK=bk, BR=row_block(R), OUT_BF16=out_dtype == torch.bfloat16,
                      FAST=fast)
    return y

