"""The routed-expert tasks that K3 runs: one step's MXFP4 expert GEMVs, all selected experts.

Contract
- Inputs: x [R, d] bf16 (the FFN input of each row), the step's picks grouped by expert
  (`group_picks`, or on the device `router.group_task`) and routing weights [R * k] fp32. Each
  pick's gate/up [R * k, 2, I] fp32 (`up_task`), its h [R * k, I] bf16 (`swiglu_task`: h =
  silu(min(gate, limit)) * clamp(up, -limit, limit) * weight, rounded to bf16) and its output
  [R * k, d] fp32 (`down_task`: w2 h). The sum over a row's picks in top-k order is the
  caller's (`router.combine_task` in K3), so results do not depend on task order.
- Weights: `ExpertWeights`, the checkpoint's MXFP4 stacked per matrix, the codes in the fragment
  order (`fragments.py`): codes [E, N, K / 2] uint8, E8M0 scale codes [E, N, K / 32] uint8. Sizes:
  N a multiple of 16 and K of 128 (every DeepSeek-V4 size); tiles as `tiles_refusal` says.
- Grouping: a task serves one expert and up to `ROWS` (16) of the rows that picked it, so rows
  sharing an expert read its weights once. Tasks lie on a fixed grid (one per sorted pick, times
  the N blocks); the ones that do not start a group return at once, so nothing needs a host sync.
- Task loops: `up_stage` and `down_stage` give program p of a persistent grid the tasks p,
  p + grid, ...; K3 runs them between grid barriers, `expert_stage.py` alone.

The K loop (`fragment_matvec`): the codes of a [BN, BK] tile are loaded straight into the
registers the tensor cores take them from (`load_fragments`), one K step ahead of the step being
decoded (`expert_decode.decode_fragments`) and multiplied (weights as the M operand, swap AB: N =
the group's rows padded to 16), accumulating in fp32. With K steps of 256, tasks of one or two rows
(`DIAG_ROWS`) take the diagonal loop: x laid out block-diagonally, [R * 8, 256] with row r * 8 + b
holding x[r] on block b's 32 columns (`_diagonal_x`), so one dot gives each 32-column block's
partial sum in a column of its own; the fp32 block scale multiplies that sum (`_diagonal_scales`)
instead of every weight. FAST there: x times 2^100 (exact in bf16 for |x| < 2^28) keeps the
products of the decode's 2^-126-scaled weights normal in fp32, and the scale is 2^(e - 127 + 26).

Decode and dots: FAST (NVIDIA) decodes to bf16 and multiplies on bf16 tensor cores; the portable
path (interpreter, AMD) decodes to fp32, takes an fp32 dot in IEEE precision and rounds h to
bf16 by integer arithmetic (the interpreter's own bf16 cast truncates, and its bf16 dot is wrong).
Rounding points: fp32 accumulation; h rounded to bf16 (the per-op path's `w2` input); the
per-pick output kept in fp32 for the caller to round. Both paths equal a float64 reference of the
same weights (`expert_reference.py`) up to fp32 accumulation order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .expert_decode import block_scales, decode_fragments
from .fragments import FRAGMENT_GROUP, FRAGMENT_ROWS, fragment_order_refusal, from_fragment_order, to_fragment_order
from .rounding import bf16

ROWS = 16  # rows of one expert a task serves: the N dimension of the swapped-AB dot
_ROWS = tl.constexpr(ROWS)
FAST_SCALE_CODES = (2, 128)  # E8M0 codes whose scale times 2^126 is a normal bf16 (expert_decode.py)
DIAG_ROWS = tl.constexpr(2)  # rows of a task that takes the diagonal loop
DIAG_K_STEP = 256  # the diagonal loop's K step: a lane holds two 32-column blocks of it


@dataclass
class ExpertWeights:
    """Routed experts of one layer, stacked, codes in the fragment order: codes [E, N, K / 2] uint8,
    scale codes [E, N, K / 32] uint8, for each of w1, w2, w3."""

    w1: tuple[torch.Tensor, torch.Tensor]
    w2: tuple[torch.Tensor, torch.Tensor]
    w3: tuple[torch.Tensor, torch.Tensor]
    _fast_decode: bool | None = field(default=None, repr=False)

    @property
    def num_experts(self) -> int:
        return self.w1[0].shape[0]

    @property
    def intermediate(self) -> int:
        return self.w1[0].shape[1]

    @property
    def hidden(self) -> int:
        return self.w2[0].shape[1]

    def supports_fast_decode(self) -> bool:
        """Whether every scale code is in FAST_SCALE_CODES, as the fast decode's folded scale needs.
        Checked once (a device sync), so call it at build, before any graph capture."""
        if self._fast_decode is None:
            low, high = FAST_SCALE_CODES
            self._fast_decode = all(bool(((s >= low) & (s <= high)).all()) for _, s in (self.w1, self.w2, self.w3))
        return self._fast_decode

    def checkpoint_tensors(self, e: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Expert e's (w1, w2, w3), each (packed codes uint8 in the checkpoint's order, e8m0 scales)."""
        return tuple((from_fragment_order(codes[e]), scales[e].view(torch.float8_e8m0fnu))
                     for codes, scales in (self.w1, self.w2, self.w3))


def layout_refusal(hidden: int, inter: int) -> str | None:
    """Why experts of these sizes cannot be stacked in the fragment order, or None."""
    for name, shape in (("w1", (inter, hidden // 2)), ("w2", (hidden, inter // 2))):
        refusal = fragment_order_refusal(shape)
        if refusal:
            return f"the expert kernels' fragment order needs {name} with {refusal}"
    return None


def stack(experts: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]) -> ExpertWeights:
    """A layer's per-expert checkpoint tensors [(w1, w2, w3) each (packed, scale)] stacked, the
    codes in the fragment order."""
    def matrix(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.stack([e[m][0].view(torch.uint8) for e in experts]).contiguous()
        scales = torch.stack([e[m][1].view(torch.uint8) for e in experts]).contiguous()
        return to_fragment_order(codes), scales

    return ExpertWeights(matrix(0), matrix(1), matrix(2))


def tiles_refusal(block_n: int, block_k: int, hidden: int, inter: int) -> str | None:
    """What expert tiles of `block_n` outputs over K steps of `block_k` lack (whole 128-column
    groups a K step, whole 16-row blocks of the dot's operand a tile: `load_fragments`), or None."""
    steps = sorted({min(block_k, hidden), min(block_k, inter)})
    if any(k % FRAGMENT_GROUP for k in steps):
        return f"expert K steps of a multiple of {FRAGMENT_GROUP} (here {steps})"
    rows = sorted({min(block_n, hidden), min(block_n, inter)})
    if any(n % FRAGMENT_ROWS for n in rows):
        return f"expert tiles of a multiple of {FRAGMENT_ROWS} rows (here {rows})"
    return None


def takes_diagonal(block_k: int, hidden: int, inter: int) -> bool:
    """Whether tasks of one or two rows take the diagonal loop: both K steps are DIAG_K_STEP."""
    return min(block_k, hidden) == min(block_k, inter) == DIAG_K_STEP


# --- the K loop -----------------------------------------------------------------------------------
@triton.jit
def load_fragments(codes, scales_ptr, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr, OWN: tl.constexpr = False):
    """Rows row0 .. row0 + BN of a stacked matrix (expert e's row n is row e * N + n), K columns
    k0 .. k0 + BK, loaded straight into the registers the tensor cores take them from: (halves
    [BN, BK / 4] int16, scale codes [BN, 4, BK / 32] uint8, each row's scales once for each of the
    4 lanes that share the row; OWN: [BN, 4, 2], lane t's blocks 2t and 2t + 1 only). The dot's
    operand gives warp w rows 16 w .. 16 w + 15 (and 16 (w + warps) ..., and so on), lane l rows
    l / 4 and l / 4 + 8 of those and, of each 128-column group, the 16 bytes l % 4. The loads are
    shaped so that Triton's coalesced layout for them is exactly that: the last dimension runs
    over (w, row l / 4, 16-byte chunk l % 4, 8 halves), so lanes and then warps take it in that
    order and the row offset 8 and the groups are left to registers; the result needs no shared
    memory on its way to the dot (the other dimensions must not need lanes or warps, since Triton
    orders them differently from one version to the next). The fragment order's blocks store a
    warp's rows in that order, so each load instruction of a warp reads 512 contiguous bytes."""
    tl.static_assert(BN % 16 == 0, "fragment tiles need a multiple of 16 rows")
    G: tl.constexpr = BK // 128  # column groups
    W: tl.constexpr = BN // 16
    g = tl.arange(0, G)[:, None, None]
    a = tl.arange(0, 2)[None, :, None]  # the row offset 8
    f = tl.arange(0, W * 256)[None, None, :]  # (w, row i, 32 halves c): row 16 w + 8 a + i, half 32 g + c
    block = (row0 // 16 + f // 256) * (K // 128) + k0 // 128 + g  # 512 halves: (a, i, c)
    halves = tl.load(codes + tl.multiple_of(block * 512 + 256 * a, [1, 1, 8]) + f % 256)
    tile = tl.reshape(tl.permute(tl.reshape(halves, (G, 2, W, 8, 32)), (2, 1, 3, 0, 4)), (BN, BK // 4))
    S: tl.constexpr = 2 if OWN else BK // 32  # scales a lane
    f = tl.arange(0, W * 32 * S)[None, :]  # (w, row i, lane t, scale s)
    rows = row0 + 16 * (f // (32 * S)) + 8 * tl.arange(0, 2)[:, None] + f // (4 * S) % 8
    own = f % (4 * S) if OWN else f % S  # OWN: lane t's are blocks 2t, 2t + 1
    scale_codes = tl.load(scales_ptr + tl.multiple_of(rows * (K // 32) + k0 // 32, [1, S]) + own)
    return tile, tl.reshape(tl.permute(tl.reshape(scale_codes, (2, W, 8, 4, S)), (1, 0, 2, 3, 4)), (BN, 4, S))


@triton.jit
def _x_tile(x_ptr, x_rows, x_mask, k0, K, BK: tl.constexpr, FAST: tl.constexpr):
    """x[x_rows, k0 .. k0 + BK] (masked rows 0) as the dot takes it."""
    rk = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + x_rows[:, None] * K + rk[None, :], mask=x_mask[:, None], other=0.0)
    return x.to(tl.bfloat16) if FAST else x.to(tl.float32)


@triton.jit
def _dot(w, x, acc, FAST: tl.constexpr):
    """acc + w @ x^T: bf16 tensor cores (FAST), or fp32 in IEEE precision (the interpreter's bf16
    dot is wrong)."""
    if FAST:
        return tl.dot(w, tl.trans(x), acc)
    return tl.dot(w, tl.trans(x), acc, input_precision="ieee")


@triton.jit
def fragment_matvec(codes, scales_ptr, row0, x_ptr, x_rows, x_mask, K, BN: tl.constexpr, BK: tl.constexpr,
                    FAST: tl.constexpr, DIAG: tl.constexpr):
    """acc [BN, len(x_rows)] fp32 = W[row0 .. row0 + BN, :] @ x[x_rows, :]^T over all K, prefetched
    by hand: while K step k is decoded and multiplied, the codes, scales and x of step k + 1 are
    already on their way into registers (the last step loads itself again, in bounds, rather than
    branch). Triton's own pipelining would stage the codes through shared memory and wait for each
    step's copy before decoding it. DIAG: the block scales on fp32 partial sums (module docstring)."""
    tile, scale_codes = load_fragments(codes, scales_ptr, row0, 0, K, BN, BK, DIAG)
    x = _x_tile(x_ptr, x_rows, x_mask, 0, K, BK, FAST)
    R: tl.constexpr = x_rows.shape[0]
    sums = tl.zeros((BN, R * (BK // 32) if DIAG else R), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        ahead = tl.minimum(k0 + BK, K - BK)
        next_tile, next_scales = load_fragments(codes, scales_ptr, row0, ahead, K, BN, BK, DIAG)
        next_x = _x_tile(x_ptr, x_rows, x_mask, ahead, K, BK, FAST)
        sums = _k_step(tile, scale_codes, x, sums, BK, FAST, DIAG)
        tile, scale_codes, x = next_tile, next_scales, next_x
    if DIAG:
        acc = tl.sum(tl.reshape(sums, (BN, R, BK // 32)), axis=2)
    else:
        acc = sums
    return acc


@triton.jit
def _k_step(tile, scale_codes, x, sums, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """sums plus one K step's products: [BN, R], or (DIAG) the scaled block sums [BN, R * BK / 32]."""
    if DIAG:
        block_sums = _dot(decode_fragments(tile, scale_codes, BK, FAST, SCALED=False), _diagonal_x(x, FAST),
                          tl.zeros(sums.shape, dtype=tl.float32), FAST)
        sums += block_sums * _diagonal_scales(scale_codes, x.shape[0], FAST)
    else:
        sums = _dot(decode_fragments(tile, scale_codes, BK, FAST), x, sums, FAST)
    return sums


@triton.jit
def _diagonal_x(x, FAST: tl.constexpr):
    """x [R, BK] -> [R * BK / 32, BK]: row r * (BK / 32) + b holds x[r] on the columns of block b
    and zeros elsewhere; FAST: times 2^100 (the decoded weights are 2^-126 of their values)."""
    R: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    G: tl.constexpr = BK // 32
    if FAST:
        x = x * 1.2676506002282294e30  # 2^100: exact in bf16 for |x| < 2^28
    own = (tl.arange(0, G)[None, :, None] == (tl.arange(0, BK) // 32)[None, None, :])
    xb = tl.where(own, tl.reshape(x, (R, 1, BK)), tl.zeros((R, G, BK), x.dtype))
    return tl.reshape(xb, (R * G, BK))


@triton.jit
def _diagonal_scales(scale_codes, R: tl.constexpr, FAST: tl.constexpr):
    """Scale codes [BN, 4, 2] (`load_fragments` with OWN: lane t's, of blocks 2t and 2t + 1) ->
    fp32 [BN, R * G]: column r * G + b the scale of block b, 2^(e - 127) (FAST: times 2^26,
    undoing the weights' 2^-126 and x's 2^100)."""
    BN: tl.constexpr = scale_codes.shape[0]
    G: tl.constexpr = 4 * scale_codes.shape[2]
    tl.static_assert(G == 8, "a lane holds blocks 2t, 2t + 1 of the dot's columns: K steps of 256")
    e = tl.reshape(scale_codes.to(tl.int32), (BN, G))
    if FAST:
        scale = ((e + 26) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 + 26)
    else:
        scale = block_scales(e, False)
    return tl.reshape(tl.broadcast_to(tl.reshape(scale, (BN, 1, G)), (BN, R, G)), (BN, R * G))


# --- the tasks ------------------------------------------------------------------------------------
@triton.jit
def _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_: tl.constexpr):
    """The task of sorted pick j: (active, expert, pick ids [ROWS_], mask [ROWS_])."""
    count = tl.load(counts_ptr + j)
    expert = tl.load(experts_ptr + j).to(tl.int64)
    m = tl.arange(0, ROWS_)
    mask = m < count
    picks = tl.load(order_ptr + j + m, mask=mask, other=0)
    return count > 0, expert, picks, mask


@triton.jit
def up_task(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
            w3_scales, K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """Gate (which = 0, w1) or up (which = 1, w3) task for sorted pick j and intermediate block
    nb: gu[pick, which, block] in fp32 for the up to ROWS picks of one expert that start at j;
    nothing unless j starts a group. Gate and up are separate tasks: one accumulator a task
    halves the registers. DIAG: a group of up to DIAG_ROWS rows takes the diagonal loop."""
    if DIAG and tl.load(counts_ptr + j) <= DIAG_ROWS:
        _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
                  w3_scales, K, I, TOPK, BN, BK, DIAG_ROWS, FAST, True)
    else:
        _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
                  w3_scales, K, I, TOPK, BN, BK, _ROWS, FAST, False)


@triton.jit
def _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
              w3_scales, K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
              DIAG: tl.constexpr):
    active, expert, picks, mask = _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_)
    if active:
        row0 = expert * I + nb * BN
        if which == 0:
            acc = fragment_matvec(w1_codes, w1_scales, row0, x_ptr, picks // TOPK, mask, K, BN, BK, FAST, DIAG)
        else:
            acc = fragment_matvec(w3_codes, w3_scales, row0, x_ptr, picks // TOPK, mask, K, BN, BK, FAST, DIAG)
        n = nb * BN + tl.arange(0, BN)
        tl.store(gu_ptr + picks[None, :] * (2 * I) + which * I + n[:, None], acc, mask=mask[None, :])


@triton.jit
def swiglu_value(gate, up, weight, limit, FAST: tl.constexpr):
    """(silu(min(gate, limit)) * clamp(up, -limit, limit) * weight) in fp32, rounded to bf16 (the
    routed experts' h; the shared expert's with weight 1, as its w2 loads it: `gemv.gemv_stage`)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up * weight
    if not FAST:
        h = bf16(h)
    return h.to(tl.bfloat16)


@triton.jit
def swiglu_task(p, ib, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """h[p, block] from pick p's gate and up (`swiglu_value`)."""
    i = ib * BLOCK + tl.arange(0, BLOCK)
    gate, up = tl.load(gu_ptr + p * (2 * I) + i), tl.load(gu_ptr + p * (2 * I) + I + i)
    tl.store(h_ptr + p * I + i, swiglu_value(gate, up, tl.load(rw_ptr + p), limit, FAST))


@triton.jit
def down_task(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
              BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """Down task (sorted pick j, hidden block nb): per-pick outputs out[pick, block] in fp32.
    DIAG: a group of up to DIAG_ROWS rows takes the diagonal loop."""
    if DIAG and tl.load(counts_ptr + j) <= DIAG_ROWS:
        _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, BN, BK,
                    DIAG_ROWS, FAST, True)
    else:
        _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, BN, BK,
                    _ROWS, FAST, False)


@triton.jit
def _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
                BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    active, expert, picks, mask = _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_)
    if active:
        y = fragment_matvec(w2_codes, w2_scales, expert * D + nb * BN, h_ptr, picks, mask, I, BN, BK, FAST, DIAG)
        n = nb * BN + tl.arange(0, BN)
        tl.store(out_ptr + picks[None, :] * D + n[:, None], y, mask=mask[None, :])


@triton.jit
def up_stage(pid, grid, P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
             w3_scales, K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """The gate/up tasks of P picks taken by program `pid` of `grid`: task t is sorted pick
    t // (2 * blocks), block (t // 2) % blocks, gate or up t % 2."""
    blocks = I // BN
    for t in range(pid, P * blocks * 2, grid):
        up_task(t // (2 * blocks), (t // 2) % blocks, t % 2, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr,
                w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK, BN, BK, FAST, DIAG)


@triton.jit
def swiglu_stage(pid, grid, P, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The SwiGLU tasks of P picks taken by program `pid` of `grid`: pick t // blocks, block t % blocks."""
    blocks = tl.cdiv(I, BLOCK)
    for t in range(pid, P * blocks, grid):
        swiglu_task(t // blocks, t % blocks, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK, FAST)


@triton.jit
def down_stage(pid, grid, P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
               BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """The down tasks of P picks taken by program `pid` of `grid`: task t is sorted pick
    t // blocks, hidden block t % blocks."""
    blocks = D // BN
    for t in range(pid, P * blocks, grid):
        down_task(t // blocks, t % blocks, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes,
                  w2_scales, D, I, BN, BK, FAST, DIAG)


def group_picks(ids: torch.Tensor, rows: int = ROWS):
    """Sort a step's picks by expert on the host side of a launch: (order, experts, counts) over
    the R * k sorted picks, as `router.group_task` computes them on the device. counts[j] > 0 only
    where a task starts: at the first pick of an expert and every `rows` picks after it; pad
    picks (id < 0) get no task."""
    flat = ids.flatten()
    key = torch.where(flat < 0, torch.iinfo(torch.int32).max, flat.to(torch.int32))
    sorted_ids, order = torch.sort(key, stable=True)
    index = torch.arange(flat.numel(), device=flat.device)
    run_start = torch.searchsorted(sorted_ids, sorted_ids, right=False)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    starts_task = ((index - run_start) % rows == 0) & (sorted_ids != torch.iinfo(torch.int32).max)
    counts = torch.where(starts_task, torch.clamp(run_end - index, max=rows), 0)
    experts = torch.where(counts > 0, sorted_ids, 0)
    return order.to(torch.int32), experts.to(torch.int32), counts.to(torch.int32)
