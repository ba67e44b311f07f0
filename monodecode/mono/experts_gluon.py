"""The expert stage's paired gate/up and down kernels in Gluon (NVIDIA): x staged in chunks.

Why: the Triton kernels (`experts._paired_up`, `experts._down`) put each K step's x tile into
shared memory for the tensor cores and so wait at a CTA barrier every step; Nsight Compute has
barrier stalls at a sixth of the warps' cycles there, more than the wait for HBM. Here x goes
through shared memory C steps at a time (`cp.async`, one chunk ahead, double-buffered), so a
barrier every C steps, and the 16 dots of a step are one wgmma group (Triton fences each).

Invariants
- The weights are read as `experts._fragment_matvec` reads them: fragment-order codes and their
  scale codes loaded straight into the registers the tensor cores take them from, one K step
  ahead (`_weight_pointers` computes `experts._load_fragments`'s addresses, `HALVES` / `SCALES`
  are Triton's layouts for them), decoded by `experts.HALVES_DECODE_ASM` with the same folded
  bf16 scales: the same products, in the same order, as the Triton kernels.
- x's chunk buffers: chunk c + 1's copies are issued after the barrier that opens chunk c (every
  warp is then done with chunk c - 1, the other buffer), and chunk c is read after its copies
  are done (`wait_group`), made visible to the tensor cores' proxy (`fence_async_shared`) and
  to every warp (the barrier). Masked rows are zero-filled, not read.
- A program a task, the grids and early exits of `experts._paired_up` and `experts._down`; PDL as
  there (down's first weight tile loads before `griddepcontrol.wait`, x after).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import experts
from .experts import HALVES_DECODE_ASM

ROWS = gl.constexpr(experts.ROWS)  # rows of one expert a task serves: the dot's N


def x_chunk(steps: int, cap: int = 4) -> int:
    """K steps of x a chunk for a K loop of `steps` steps (even): the most, up to `cap`, that make an
    even number of chunks (`_matvec` runs them in pairs, one buffer each)."""
    return max(c for c in (1, 2, 4, 8) if c <= cap and steps % (2 * c) == 0)


@gluon.constexpr_function
def _halves_layout(num_warps):
    """[G, 2, W * 256] halves of a K step: lane l of warp w takes 8 halves (16 bytes) of f = w, l."""
    return gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, 1, num_warps], [2, 0, 1])


@gluon.constexpr_function
def _scales_layout(num_warps, per_row):
    """[2, W * 32 * S] scale codes: lane l of warp w the S codes of its row (8 a + l / 4)."""
    return gl.BlockedLayout([1, per_row], [1, 32], [1, num_warps], [1, 0])


@gluon.constexpr_function
def _x_layout(num_warps):
    return gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(num_warps):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, ROWS, 16])


@gluon.jit
def _arange3(n: gl.constexpr, axis: gl.constexpr, layout: gl.constexpr):
    """arange(n) laid along `axis` of a rank-3 tensor of `layout` (the other two of size 1)."""
    if axis == 0:
        v = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(v, 1), 2)
    elif axis == 1:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(v, 0), 2)
    else:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
        return gl.expand_dims(gl.expand_dims(v, 0), 0)


@gluon.jit
def _load_weights(codes, scales, up_codes, up_scales, row0, k0, K, BN: gl.constexpr, BK: gl.constexpr,
                  PAIR: gl.constexpr):
    """K step k0's codes [G, 2, W * 256] int16 and scale codes [2, W * 32 * S] of rows row0 ..
    row0 + BN (PAIR: the first half of the bands from `codes`, the rest the same rows of
    `up_codes`), at `experts._load_fragments`'s addresses, in `HALVES` / `SCALES`."""
    NW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = BK // 128
    W: gl.constexpr = BN // 16
    S: gl.constexpr = BK // 32
    HL: gl.constexpr = _halves_layout(NW)
    g = _arange3(G, 0, HL)
    a = _arange3(2, 1, HL)
    f = _arange3(W * 256, 2, HL)
    warp = f // 256
    band = warp % (W // 2) if PAIR else warp
    offset = gl.multiple_of(((row0 // 16 + band) * (K // 128) + k0 // 128 + g) * 512 + 256 * a, [1, 1, 8]) + f % 256
    if PAIR:
        halves = gl.load(gl.where(warp < W // 2, codes + offset, up_codes + offset))
    else:
        halves = gl.load(codes + offset)

    SL: gl.constexpr = _scales_layout(NW, S)
    fs = gl.expand_dims(gl.arange(0, W * 32 * S, layout=gl.SliceLayout(0, SL)), 0)
    sa = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, SL)), 1)
    sband = fs // (32 * S)
    srow = row0 + 16 * (sband % (W // 2) if PAIR else sband) + 8 * sa + fs // (4 * S) % 8
    soff = gl.multiple_of(srow * (K // 32), [1, S]) + k0 // 32 + fs % S
    if PAIR:
        scale_codes = gl.load(gl.where(sband < W // 2, scales + soff, up_scales + soff))
    else:
        scale_codes = gl.load(scales + soff)
    return halves, scale_codes


@gluon.jit
def _decode(halves, scale_codes, BN: gl.constexpr, BK: gl.constexpr):
    """A step's codes and scale codes (`_load_weights`) -> its weights [BN, BK] bf16 in the dot's
    operand layout (`experts._load_fragments` and `experts._decode_fragments`, the FAST decode)."""
    NW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = BK // 128
    W: gl.constexpr = BN // 16
    S: gl.constexpr = BK // 32
    tile = gl.reshape(gl.permute(gl.reshape(halves, (G, 2, W, 8, 32)), (2, 1, 3, 0, 4)), (BN, BK // 4))
    sc = gl.reshape(gl.permute(gl.reshape(scale_codes, (2, W, 8, 4, S)), (1, 0, 2, 3, 4)), (BN, 4, S)).to(gl.int32)
    c0, c1, c2, c3 = gl.inline_asm_elementwise(
        asm=HALVES_DECODE_ASM, constraints="=r,=r,=r,=r,r", args=[tile],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
    w = gl.reshape(gl.join(gl.join(c0, c1), gl.join(c2, c3)), (BN, G, 4, 4, 2, 2, 2))  # (n, g, t, m, r, q, s)
    scale = ((sc + 126) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)  # 2^(e - 1): `experts._scales`
    scale = gl.permute(gl.reshape(scale, (BN, 4, G, 4)), (0, 2, 1, 3))
    for _ in gl.static_range(3):  # a scale per (g, m), 32 columns: repeated over (r, q, s) by joins (Gluon
        scale = gl.join(scale, scale)  # broadcasts only between equal layouts)
    w = w * gl.convert_layout(scale, w.type.layout)
    w = gl.reshape(gl.permute(w, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))
    return gl.convert_layout(w, gl.DotOperandLayout(0, _mma_layout(NW), 2))


@gluon.jit
def _copy_x_chunk(buffer, x_ptr, x_rows, x_mask, k0, K, BK: gl.constexpr, C: gl.constexpr):
    """cp.async of x[x_rows, k0 .. k0 + C * BK] into `buffer` [C * ROWS, BK] (step s in rows s * ROWS
    ..; masked rows zero-filled, not read), as one copy (the compiler puts a barrier between two
    copies into one buffer) and one group."""
    XL: gl.constexpr = _x_layout(gl.num_warps())
    slot = gl.arange(0, C * ROWS, layout=gl.SliceLayout(1, XL))
    x_rows = gl.convert_layout(x_rows, gl.SliceLayout(1, XL))  # picks as laid out for x: ROWS, repeated C times
    rows = gl.gather(x_rows, slot % ROWS, 0)
    mask = gl.gather(x_mask.to(gl.int8), slot % ROWS, 0) != 0
    offset = gl.expand_dims(rows * K + k0 + slot // ROWS * BK, 1) + gl.expand_dims(
        gl.arange(0, BK, layout=gl.SliceLayout(0, XL)), 0)
    async_copy.async_copy_global_to_shared(buffer, x_ptr + offset, mask=gl.expand_dims(mask, 1))
    async_copy.commit_group()


@gluon.jit
def _chunk(acc, buffer, other, halves, scale_codes, codes, scales, up_codes, up_scales, row0, x_ptr, x_rows, x_mask,
           K, k0, k_hi, more, BN: gl.constexpr, BK: gl.constexpr, C: gl.constexpr, PAIR: gl.constexpr):
    """The C steps from k0, x in `buffer` (its copies awaited here); the next chunk's x copied into
    `other` first if there is `more`. Returns (acc, the next step's codes and scale codes)."""
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    if more:
        _copy_x_chunk(other, x_ptr, x_rows, x_mask, k0 + C * BK, K, BK, C)
    for s in gl.static_range(C):
        ahead = gl.multiple_of(gl.minimum(k0 + (s + 1) * BK, k_hi - BK), BK)  # the last step loads itself again
        next_halves, next_scales = _load_weights(codes, scales, up_codes, up_scales, row0, ahead, K, BN, BK, PAIR)
        acc = warpgroup_mma(_decode(halves, scale_codes, BN, BK), buffer.slice(s * ROWS, ROWS).permute((1, 0)), acc)
        halves, scale_codes = next_halves, next_scales
    return acc, halves, scale_codes


@gluon.jit
def _matvec(codes, scales, row0, x_ptr, x_rows, x_mask, K, k_lo, k_hi, BN: gl.constexpr, BK: gl.constexpr,
            C: gl.constexpr, PDL: gl.constexpr, PAIR: gl.constexpr, up_codes, up_scales):
    """acc [BN, ROWS] fp32 = W[row0 .., k_lo .. k_hi] @ x[x_rows, k_lo .. k_hi]^T: the weights one
    step ahead in registers, x in chunks of C steps through two shared-memory buffers, an even
    number of chunks (`experts.launch_refusal`)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    even = gl.allocate_shared_memory(gl.bfloat16, [C * ROWS, BK], layout)
    odd = gl.allocate_shared_memory(gl.bfloat16, [C * ROWS, BK], layout)
    halves, scale_codes = _load_weights(codes, scales, up_codes, up_scales, row0, k_lo, K, BN, BK, PAIR)
    if PDL:
        gdc_wait()
    _copy_x_chunk(even, x_ptr, x_rows, x_mask, k_lo, K, BK, C)
    acc = gl.zeros((BN, ROWS), gl.float32, _mma_layout(gl.num_warps()))
    for k0 in range(k_lo, k_hi, 2 * C * BK):
        acc, halves, scale_codes = _chunk(acc, even, odd, halves, scale_codes, codes, scales, up_codes, up_scales, row0,
                                          x_ptr, x_rows, x_mask, K, k0, k_hi, True, BN, BK, C, PAIR)
        acc, halves, scale_codes = _chunk(acc, odd, even, halves, scale_codes, codes, scales, up_codes, up_scales, row0,
                                          x_ptr, x_rows, x_mask, K, k0 + C * BK, k_hi, k0 + 2 * C * BK < k_hi, BN, BK,
                                          C, PAIR)
    return acc


@gluon.jit
def _group(j, counts_ptr, order_ptr, experts_ptr, layout: gl.constexpr):
    """`experts._group` with the picks laid out as `layout` (1-D, ROWS)."""
    count = gl.load(counts_ptr + j)
    expert = gl.load(experts_ptr + j).to(gl.int64)
    m = gl.arange(0, ROWS, layout=layout)
    mask = m < count
    picks = gl.load(order_ptr + j + m, mask=mask, other=0)
    return count > 0, expert, picks, mask


@gluon.jit
def _paired_up(x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales,
               K, I, TOPK, limit, BN: gl.constexpr, BK: gl.constexpr, C: gl.constexpr, PDL: gl.constexpr):
    """`experts._paired_up` in Gluon."""
    if PDL:  # down's programs may launch once every program here has started
        gdc_launch_dependents()
    NW: gl.constexpr = gl.num_warps()
    active, expert, picks, mask = _group(gl.program_id(0), counts_ptr, order_ptr, experts_ptr,
                                         gl.SliceLayout(1, _x_layout(NW)))
    if active:
        HB: gl.constexpr = BN // 2
        nb = gl.program_id(1)
        acc = _matvec(w1_codes, w1_scales, expert * I + nb * HB, x_ptr, picks // TOPK, mask, K, 0, K, BN, BK, C,
                      False, True, w3_codes, w3_scales)
        pairs = gl.permute(gl.reshape(acc, (2, HB, ROWS)), (1, 2, 0))  # (n, row, gate or up): split takes a
        pairs = gl.convert_layout(pairs, gl.BlockedLayout([1, 1, 2], [2, 16, 1], [NW, 1, 1], [2, 1, 0]))  # pair a thread
        gate, up = gl.split(pairs)
        EL: gl.constexpr = gate.type.layout
        out_picks = gl.convert_layout(picks, gl.SliceLayout(0, EL))
        out_mask = gl.convert_layout(mask, gl.SliceLayout(0, EL))
        weight = gl.expand_dims(gl.load(rw_ptr + out_picks, mask=out_mask, other=0.0), 0)
        gate = gl.minimum(gate, limit)  # `experts.swiglu_value`
        up = gl.minimum(gl.maximum(up, -limit), limit)
        h = gate / (1.0 + gl.exp(-gate)) * up * weight
        n = nb * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, EL))
        gl.store(h_ptr + gl.expand_dims(out_picks, 0) * I + gl.expand_dims(n, 1), h.to(gl.bfloat16),
                 mask=gl.expand_dims(out_mask, 0))


@gluon.jit
def _down(h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, BN: gl.constexpr,
          BK: gl.constexpr, C: gl.constexpr, PDL: gl.constexpr, SPLIT: gl.constexpr):
    """`experts._down` in Gluon."""
    NW: gl.constexpr = gl.num_warps()
    part = gl.program_id(2)
    active, expert, picks, mask = _group(gl.program_id(0), counts_ptr, order_ptr, experts_ptr,
                                         gl.SliceLayout(1, _x_layout(NW)))
    if active:
        nb = gl.program_id(1)
        k_lo = gl.multiple_of(part * (I // SPLIT), BK)  # whole K steps (`experts.launch_refusal`)
        y = _matvec(w2_codes, w2_scales, expert * D + nb * BN, h_ptr, picks, mask, I, k_lo, k_lo + I // SPLIT, BN, BK,
                    C, PDL, False, w2_codes, w2_scales)
        EL: gl.constexpr = y.type.layout
        out_picks = gl.convert_layout(picks, gl.SliceLayout(0, EL))
        out_mask = gl.expand_dims(gl.convert_layout(mask, gl.SliceLayout(0, EL)), 0)
        n = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, EL))
        out = out_ptr + part * gl.num_programs(0) * D
        gl.store(out + gl.expand_dims(out_picks, 0) * D + gl.expand_dims(n, 1), y, mask=out_mask)
