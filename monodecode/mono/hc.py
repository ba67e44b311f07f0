"""The mHC seam of a sub-block: fold the owed output into the residual streams, then the site's
mixes (Sinkhorn), the collapse and the RMSNorm. Two stages, as tasks for K1 / K2.

Contract (hc = HC streams, a power of two; MIX = (2 + hc) * hc mixes; rows r < R):
- `fold_task`, tasks (row block, column chunk): `fold_tasks(R, d, CHUNK, RB)` =
  ceil(R / RB) * ceil(d / CHUNK); task t serves rows (t // n_chunks) * RB .. + RB (masked at R)
  and columns (t % n_chunks) * CHUNK .. + CHUNK (masked at d), n_chunks = ceil(d / CHUNK).
  - HAS_OWED: the previous sub-block's output is folded in as `model.hc.hc_post` does:
    streams[r, k, c] = bf16(bf16(bf16(post[r, k]) * out[r, c])
                            + bf16(sum_j bf16(comb[r, j, k]) * residual[r, j, c]))   (sum in fp32)
    reading residual [R, hc, d] bf16, out [R, d] bf16 (row stride `out_stride`), post [R, hc] and
    comb [R, hc, hc] fp32 (as `hc_pre` returns them), writing streams [R, hc, d] bf16, a buffer
    other than the residual. Without HAS_OWED the residual is the streams, and nothing is written.
  - Either way, the partial sums of the site's mixes over the task's hc x CHUNK stream values
    (as fp32): part[r, chunk, m] = sum_{k, c} fn[m, k * d + c] * streams[r, k, c] for m < MIX, and
    part[r, chunk, MIX] = sum_{k, c} streams[r, k, c]^2; part is [R, n_chunks, MIX + 1] fp32.
    The dot is one fp32 `tl.dot` in IEEE precision over K = hc x CHUNK (the reference's F.linear
    is fp32; TF32 would cost ~1e-3 of the mixes), with RB rows of the step as its M side, so a
    task reads its fn columns once for RB rows: RB = 16 reads fn ceil(R / 16) times a step. A
    one-row step's tasks cover its one row (RB = 1) and sum the products in registers instead:
    a dot's M side is 16 rows, 15 of them padding, and its operands go through shared memory.
    A task issues all its loads (fn, residual, out, post, comb) before its first store: it
    waits on memory once (a store between them would make each later load wait for it).
- `settle_task`, two tasks per row: `settle_tasks(R)` = 2 R. Both reduce the row's partials:
  mixes = dot * rsqrt(sumsq / (hc * d) + norm_eps), i.e. F.linear(rms_norm(flat streams), fn);
  then, all in fp32 as `hc_pre`. Task t < R (row t) collapses: pre = sigmoid(mix * scale[0] +
  base) + hc_eps, and writes x_norm [R, d] bf16 = bf16(norm_w * (x * rsqrt(mean(x^2) + norm_eps)))
  of the collapsed row x = bf16(sum_k pre[k] * streams[r, k]) (fp32 product-sum), norm_w fp32 [d].
  Task R + r mixes row r: post = 2 sigmoid(mix * scale[1] + base), comb = softmax over k of
  (mix * scale[2] + base)[j, k] + hc_eps, a column normalisation, then (sinkhorn_iters - 1) row /
  column rounds (+ hc_eps in each denominator); writes post [R, hc] and comb [R, hc, hc] fp32
  (owed to the next fold). Why two: the Sinkhorn rounds are a serial chain as long as the
  collapse's, and nothing this stage's successors read depends on them, so a one-row step's
  settle takes two programs the time of the longer of the two instead of their sum.
  The collapsing task loads the row's first BD columns (streams and norm weight) with the
  partials. A row of d <= BD is then collapsed and normalised in registers. A longer row goes in
  BD-column pieces and two passes: pass 1 writes the collapsed bf16 row into x_norm itself (its
  scratch) and sums its squares; a CTA barrier (`tl.debug_barrier`: the pass-2 tile may sit on
  other threads than the pass-1 tile); pass 2 re-reads it and overwrites it with the normalised
  row. Pad rows are computed like any row.
- Stages: settle reads the streams fold wrote (or the residual, without HAS_OWED) and all of a row's
  partials, so a grid barrier separates them.
- Rounding points: the reference's (bf16 after each bf16 op of hc_post, after the collapse and after
  the norm), each by `rounding.bf16` (not a cast: why, there). Exact to the
  reference up to fp32 summation order.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .plan import task_grid
from .rounding import bf16


CHUNK = 64  # columns a fold task covers in the standalone launch (a power of two >= 16: the K side of its dot)
MIN_CHUNK = 16  # the smallest CHUNK: partials buffers sized for it serve every chunk
MAX_CHUNK = 64  # the largest the kernels take: a task holds hc x CHUNK x MIXP of fn (32 KB at 64) at once
RB = 16  # rows a fold task's dot covers (a power of two >= 16: its M side), the fewest but a one-row step's 1
MAX_FOLD_ROWS = 64  # the most (a step's 48 rows padded)
BD = 1024  # columns of a settle tile in the standalone launch
CB = 16  # chunks of partials the standalone settle reduces at a time


def seam_blocks(warps: int, d: int, rows: int, programs: int, fold_rows: int = RB,
                settle_columns: int = 0) -> tuple[int, int, int, int]:
    """(RB, CHUNK, CB, BD) of the kernels' fold and settle for `programs` programs of `warps` warps
    and a step of `rows` rows. A fold task covers the step's rows padded to a power of two, at
    least 16 (its dot's M side) and at most `fold_rows` (`LaunchShape.fold_rows`): RB; the fewer
    row blocks, the fewer times the tasks read fn. A one-row step's tasks take RB = 1 (no dot). A fold task waits on memory once, so its tasks
    are as large as leave none to a second round: CHUNK is the smallest power of two from
    MIN_CHUNK to MAX_CHUNK with at most one task a program. The settle sums all of a row's
    partials at once (CB, up to 256 chunks) and collapses the row in tiles of 512 x warps columns
    (BD: 16 values a thread and a stream; `settle_columns` if not 0), in registers when one tile
    holds the row."""
    rb = 1 if rows == 1 else max(RB, min(fold_rows, triton.next_power_of_2(rows)))
    chunk = MIN_CHUNK
    while chunk < MAX_CHUNK and fold_tasks(rows, d, chunk, rb) > programs:
        chunk *= 2
    cb = min(256, triton.next_power_of_2(triton.cdiv(d, chunk)))
    return rb, chunk, cb, min(settle_columns or 512 * warps, triton.next_power_of_2(d))


def settle_columns_refusal(settle_columns: int) -> str | None:
    """Why a settle task cannot take tiles of `settle_columns` columns (None if it can): 0 (the
    default rule) or a power of two from 16."""
    if settle_columns and (settle_columns < 16 or settle_columns & (settle_columns - 1)):
        return f"settle columns 0 or a power of two from 16 (here {settle_columns})"
    return None


def fold_rows_refusal(fold_rows: int) -> str | None:
    """Why a fold task cannot cover `fold_rows` rows (None if it can): a power of two from RB
    (the dot's M side) to MAX_FOLD_ROWS."""
    if fold_rows < RB or fold_rows > MAX_FOLD_ROWS or fold_rows & (fold_rows - 1):
        return f"fold rows a power of two from {RB} to {MAX_FOLD_ROWS} (here {fold_rows})"
    return None


def fold_tasks(R: int, d: int, CHUNK: int = CHUNK, RB: int = RB) -> int:
    return triton.cdiv(R, RB) * triton.cdiv(d, CHUNK)


def settle_tasks(R: int) -> int:
    return 2 * R


def mix_pad(hc: int) -> int:
    """MIXP, the fold's mix tile: (2 + hc) * hc padded to a power of two, at least 16 (the dot's N)."""
    return max(16, triton.next_power_of_2((2 + hc) * hc))


@triton.jit
def _owed_streams(rows, rmask, cols, tile_mask, d, res_ptr, out_ptr, out_stride, post_ptr, comb_ptr,
                  HC: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr):
    """hc_post on the task's tile: every stream k at once, [RB, HC, CHUNK] bf16 values as fp32.
    Every operand is loaded in the tile's three dimensions (size 1 where it is broadcast), so
    that no operand changes layout on the way."""
    r3 = rows[:, None, None]
    k3 = tl.arange(0, HC)[None, :, None]
    c3 = cols[None, None, :]
    m3 = rmask[:, None, None]
    cm3 = tile_mask[:, None, :]
    out = tl.load(out_ptr + r3 * out_stride + c3, mask=cm3, other=0.0).to(tl.float32)  # [RB, 1, CHUNK]
    post = bf16(tl.load(post_ptr + r3 * HC + k3, mask=m3, other=0.0))  # [RB, HC, 1]
    mixed = tl.zeros((RB, HC, CHUNK), dtype=tl.float32)
    for j in tl.static_range(HC):  # stream k receives sum over j of comb[r, j, k] * residual[r, j]
        res_j = tl.load(res_ptr + r3 * (HC * d) + j * d + c3, mask=cm3, other=0.0).to(tl.float32)
        comb_j = bf16(tl.load(comb_ptr + r3 * (HC * HC) + j * HC + k3, mask=m3, other=0.0))
        mixed += comb_j * res_j
    spread = bf16(post * out)
    return bf16(spread + bf16(mixed))


@triton.jit
def fold_task(t, R, d, res_ptr, out_ptr, out_stride, post_ptr, comb_ptr, streams_ptr, fn_ptr, part_ptr,
              HC: tl.constexpr, MIXP: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr,
              HAS_OWED: tl.constexpr):
    """Fold task t (row block, column chunk): the new streams (HAS_OWED) and the mix partials.
    Every load comes before the task's first store, so the task waits on memory once."""
    MIX: tl.constexpr = (2 + HC) * HC
    n_chunks = tl.cdiv(d, CHUNK)
    chunk = t % n_chunks
    rows = (t // n_chunks) * RB + tl.arange(0, RB)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    rmask, cmask = rows < R, cols < d
    tile_mask = rmask[:, None] & cmask[None, :]
    k = tl.arange(0, HC)
    m = tl.arange(0, MIXP)
    fn = tl.load(fn_ptr + m[None, None, :] * (HC * d) + k[:, None, None] * d + cols[None, :, None],
                 mask=(m[None, None, :] < MIX) & cmask[None, :, None], other=0.0)  # [HC, CHUNK, MIXP]
    at = rows[:, None, None] * (HC * d) + k[None, :, None] * d + cols[None, None, :]
    if HAS_OWED:
        s = _owed_streams(rows, rmask, cols, tile_mask, d, res_ptr, out_ptr, out_stride, post_ptr, comb_ptr, HC, RB,
                          CHUNK)
    else:
        s = tl.load(res_ptr + at, mask=tile_mask[:, None, :], other=0.0).to(tl.float32)
    # the mixes' partial dots over the task's hc x CHUNK stream values: one dot, K = hc * CHUNK
    if RB == 1:  # one row: its products summed in registers (a dot would pad it to 16 rows)
        flat = tl.reshape(s, (HC * CHUNK, 1))
        dots = tl.sum(flat * tl.reshape(fn, (HC * CHUNK, MIXP)), axis=0)[None, :]
    else:
        dots = tl.dot(tl.reshape(s, (RB, HC * CHUNK)), tl.reshape(fn, (HC * CHUNK, MIXP)), input_precision="ieee")
    sumsq = tl.sum(tl.sum(s * s, axis=2), axis=1)
    part = part_ptr + (rows * n_chunks + chunk) * (MIX + 1)
    tl.store(part[:, None] + m[None, :], dots, mask=rmask[:, None] & (m[None, :] < MIX))
    tl.store(part + MIX, sumsq, mask=rmask)
    if HAS_OWED:
        tl.store(streams_ptr + at, s.to(tl.bfloat16), mask=tile_mask[:, None, :])


@triton.jit
def _mix_sums(part_ptr, n_chunks, HC: tl.constexpr, CB: tl.constexpr):
    """A row's partials [n_chunks, MIX + 1] summed: (pre [HC], post [HC], comb [HC, HC], sumsq).
    One tile of all of a row's partials and one sum over the chunks: a single CTA-wide reduction,
    the parts then picked from the summed row."""
    MIX: tl.constexpr = (2 + HC) * HC
    MP: tl.constexpr = triton.next_power_of_2(MIX + 1)
    m = tl.arange(0, MP)
    total = tl.zeros((MP,), dtype=tl.float32)
    for c0 in range(0, n_chunks, CB):
        c = c0 + tl.arange(0, CB)
        mask = (c < n_chunks)[:, None] & (m < MIX + 1)[None, :]
        tile = tl.load(part_ptr + c[:, None] * (MIX + 1) + m[None, :], mask=mask, other=0.0)
        total += tl.sum(tile, axis=0)
    i = tl.arange(0, HC)
    pre = tl.gather(total, i, 0)
    post = tl.gather(total, HC + i, 0)
    comb = tl.reshape(tl.gather(total, 2 * HC + tl.arange(0, HC * HC), 0), (HC, HC))
    return pre, post, comb, tl.sum(tl.where(m == MIX, total, 0.0), axis=0)


@triton.jit
def _sinkhorn(z, hc_eps, sinkhorn_iters):
    """comb [HC(j), HC(k)] from its logits, as hc_pre: softmax over k, + eps, column
    normalisation, then (iters - 1) rounds of row and column normalisation."""
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    return comb


@triton.jit
def settle_task(t, R, d, streams_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, post_ptr, comb_ptr, xn_ptr,
                hc_eps, norm_eps, sinkhorn_iters,
                HC: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr):
    """Settle task t: row t's normalised collapsed row x_norm (t < R), or row t - R's post and
    comb."""
    if t < R:
        _collapse_row(t, d, streams_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, xn_ptr, hc_eps, norm_eps, HC,
                      CHUNK, CB, BD)
    else:
        _mix_row(t - R, d, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, norm_eps, sinkhorn_iters, HC,
                 CHUNK, CB)


@triton.jit
def _row_mixes(t, d, part_ptr, norm_eps, HC: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr):
    """Row t's mixes (pre [HC], post [HC], comb [HC, HC]) before their scales and bases."""
    MIX: tl.constexpr = (2 + HC) * HC
    n_chunks = tl.cdiv(d, CHUNK)
    pre_w, post_w, comb_w, sumsq = _mix_sums(part_ptr + t * n_chunks * (MIX + 1), n_chunks, HC, CB)
    inv = tl.rsqrt(sumsq / (HC * d) + norm_eps)  # rms_norm of the flat streams, applied to the dots
    return pre_w * inv, post_w * inv, comb_w * inv


@triton.jit
def _mix_row(t, d, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, norm_eps, sinkhorn_iters,
             HC: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr):
    """Row t's post and comb (Sinkhorn), for the next fold."""
    i = tl.arange(0, HC)
    _, post_w, comb_w = _row_mixes(t, d, part_ptr, norm_eps, HC, CHUNK, CB)
    post = 2 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i))
    z = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + i[:, None] * HC + i[None, :])
    comb = _sinkhorn(z, hc_eps, sinkhorn_iters)
    tl.store(post_ptr + t * HC + i, post)
    tl.store(comb_ptr + t * (HC * HC) + i[:, None] * HC + i[None, :], comb)


@triton.jit
def _collapse_row(t, d, streams_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, xn_ptr, hc_eps, norm_eps,
                  HC: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr):
    """Row t's normalised collapsed row x_norm. The row's first BD columns of streams and norm
    weight are loaded with the partials, before anything waits on memory; a row that fits in them
    (d <= BD) is then normalised in registers, in one pass."""
    i = tl.arange(0, HC)
    c = tl.arange(0, BD)
    first = tl.load(streams_ptr + t * (HC * d) + i[:, None] * d + c[None, :], mask=c[None, :] < d, other=0.0)
    first_w = tl.load(norm_w_ptr + c, mask=c < d, other=0.0)
    pre_w, _, _ = _row_mixes(t, d, part_ptr, norm_eps, HC, CHUNK, CB)
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps

    # the collapsed row, rounded to bf16, and its sum of squares
    row = xn_ptr + t * d
    x = bf16(tl.sum(pre[:, None] * first.to(tl.float32), axis=0))
    if d <= BD:  # the whole row is in registers: normalise it there
        inv_x = tl.rsqrt(tl.sum(x * x, axis=0) / d + norm_eps)
        tl.store(row + c, bf16(first_w * (x * inv_x)).to(tl.bfloat16), mask=c < d)
    else:  # pass 1 parks the collapsed row in x_norm itself; pass 2 normalises it in place
        tl.store(row + c, x.to(tl.bfloat16))
        sq = x * x
        for c0 in range(BD, d, BD):
            cc = c0 + c
            cm = cc < d
            s = tl.load(streams_ptr + t * (HC * d) + i[:, None] * d + cc[None, :], mask=cm[None, :], other=0.0)
            x = bf16(tl.sum(pre[:, None] * s.to(tl.float32), axis=0))
            tl.store(row + cc, x.to(tl.bfloat16), mask=cm)
            sq += x * x
        inv_x = tl.rsqrt(tl.sum(sq, axis=0) / d + norm_eps)
        tl.debug_barrier()  # pass 2 reads what other threads of this program stored
        for c0 in range(0, d, BD):
            cc = c0 + c
            cm = cc < d
            x = tl.load(row + cc, mask=cm, other=0.0).to(tl.float32)
            y = bf16(tl.load(norm_w_ptr + cc, mask=cm, other=0.0) * (x * inv_x))
            tl.store(row + cc, y.to(tl.bfloat16), mask=cm)


# --- standalone launches --------------------------------------------------------------------------
@triton.jit
def _fold(n_tasks, R, d, res_ptr, out_ptr, out_stride, post_ptr, comb_ptr, streams_ptr, fn_ptr, part_ptr,
          HC: tl.constexpr, MIXP: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr,
          HAS_OWED: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        fold_task(t, R, d, res_ptr, out_ptr, out_stride, post_ptr, comb_ptr, streams_ptr, fn_ptr, part_ptr,
                  HC, MIXP, RB, CHUNK, HAS_OWED)


@triton.jit
def _settle(n_tasks, R, d, streams_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, post_ptr, comb_ptr, xn_ptr,
            hc_eps, norm_eps, sinkhorn_iters,
            HC: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        settle_task(t, R, d, streams_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, post_ptr, comb_ptr, xn_ptr,
                    hc_eps, norm_eps, sinkhorn_iters, HC, CHUNK, CB, BD)


# The launches use num_stages=1: a program of the standalone grid has one task, so there is nothing
# to prefetch, and Triton's pipeliner would still double-buffer the task loop's fn / post / comb loads
# in shared memory (sm_90 compile of the fold at RB = 16: 72 KB a program, 12 KB without).


def _empty(shape, dtype, like: torch.Tensor, poison: bool) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=like.device) if poison else \
        torch.empty(shape, dtype=dtype, device=like.device)


def fold(residual: torch.Tensor, fn: torch.Tensor, owed=None, *, chunk: int = CHUNK, rows: int = RB,
         poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual [R, hc, d] bf16, fn [MIX, hc * d] fp32, owed (out [R, d] bf16, post [R, hc],
    comb [R, hc, hc] fp32) or None -> (streams [R, hc, d] bf16, partials [R, n_chunks, MIX + 1] fp32).
    Without owed the streams are the residual itself. `poison` fills the outputs with NaN first."""
    R, hc, d = residual.shape
    assert residual.dtype == torch.bfloat16 and residual.is_contiguous()
    assert hc & (hc - 1) == 0 and fn.shape == ((2 + hc) * hc, hc * d) and fn.dtype == torch.float32
    n_chunks = triton.cdiv(d, chunk)
    partials = _empty((R, n_chunks, (2 + hc) * hc + 1), torch.float32, residual, poison)
    if owed is None:
        streams, out, post, comb = residual, residual, residual, residual  # unread placeholders
    else:
        out, post, comb = owed
        assert out.shape == (R, d) and out.dtype == torch.bfloat16 and out.stride(1) == 1
        assert post.shape == (R, hc) and comb.shape == (R, hc, hc)
        post, comb = post.float().contiguous(), comb.float().contiguous()
        streams = _empty(residual.shape, torch.bfloat16, residual, poison)
    n_tasks = fold_tasks(R, d, chunk, rows)
    _fold[task_grid(n_tasks)](n_tasks, R, d, residual, out, out.stride(0), post, comb, streams, fn.contiguous(),
                              partials, HC=hc, MIXP=mix_pad(hc), RB=rows, CHUNK=chunk, HAS_OWED=owed is not None,
                              num_stages=1)
    return streams, partials


def settle(streams: torch.Tensor, partials: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           norm_weight: torch.Tensor, *, hc_eps: float, norm_eps: float, sinkhorn_iters: int,
           chunk: int = CHUNK, block: int = BD, poison: bool = False):
    """streams [R, hc, d] bf16 and their partials from `fold` (same `chunk`), the site's base [MIX]
    and scale [3], the norm weight [d] (all fp32) -> (x_norm [R, d] bf16, post [R, hc],
    comb [R, hc, hc] fp32)."""
    R, hc, d = streams.shape
    assert streams.dtype == torch.bfloat16 and streams.is_contiguous()
    assert partials.shape == (R, triton.cdiv(d, chunk), (2 + hc) * hc + 1) and partials.is_contiguous()
    x_norm = _empty((R, d), torch.bfloat16, streams, poison)
    post = _empty((R, hc), torch.float32, streams, poison)
    comb = _empty((R, hc, hc), torch.float32, streams, poison)
    n_tasks = settle_tasks(R)
    _settle[task_grid(n_tasks)](n_tasks, R, d, streams, partials, base.float().contiguous(), scale.float().contiguous(),
                                norm_weight.float().contiguous(), post, comb, x_norm, float(hc_eps), float(norm_eps),
                                int(sinkhorn_iters), HC=hc, CHUNK=chunk, CB=CB,
                                BD=min(block, triton.next_power_of_2(d)), num_stages=1)
    return x_norm, post, comb
