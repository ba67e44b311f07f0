"""The routed-expert stage: one step's MXFP4 expert GEMVs, all selected experts in one pass.

Contract
- Inputs: x [R, d] bf16 (the FFN input of each row), picks ids [R, k] (expert ids; -1 marks a
  pad row's picks, which are skipped) and routing weights [R, k] fp32. Output y [R, d] fp32:
  sum over the row's k picks, in top-k order, of w2((weight * h).to(bf16)) with
  h = silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) in fp32 (the per-op path's MoE).
- Weights: `ExpertWeights`, the checkpoint's MXFP4 stacked per matrix: codes [E, N, K / 2] uint8
  (element 2i in the low nibble) and E8M0 scales [E, N, K / 32] uint8. `prepare` builds it once
  at load; `unprepare` is its inverse (tests round-trip it). With `fragments`, the codes of each
  block of 16 rows and 128 columns are permuted into the fragment order (`to_fragment_order`):
  the order in which the lanes of a warp load them and the tensor cores take the decoded
  weights from registers, so loads are whole lines and the decode's pairs need no shuffling
  (K steps then a multiple of 128, tiles a multiple of 16 rows), with the bits of each 16-bit
  half placed so that a shift and a mask decode a code (after one byte swap for some). The mono
  runner stacks the experts in that order wherever their sizes allow (`weights.stack_experts`:
  every DeepSeek-V4 size).
- Grouping: the step's R * k picks are sorted by expert; a task serves one expert and up to
  `ROWS` (16) of the rows that picked it, so rows sharing an expert read its weights once.
  Tasks are laid on a fixed grid (one per pick, times the N blocks) and the ones that do not
  start a group exit at once: the launch needs no host sync and can be graph-captured.
- Stages: `up_task` (a w1 or a w3 tile) writes gate/up [R * k, 2, I] fp32; `swiglu_task`
  (clamp, SwiGLU, routing weight, bf16 rounding) writes h [R * k, I]; `down_task` (w2 tiles)
  writes per-pick outputs [R * k, d] fp32; the sum over a row's picks runs in top-k order, so
  the result does not depend on task order. The tasks are device functions; `up_stage` and
  `down_stage` are the task loops K2 runs (program p of a persistent grid takes tasks p,
  p + grid, ...). Standalone (`routed_experts`: the benchmark, and the DSpark draft's MoE while
  the mono kernels are in use): one program a task (`_up`, `_swiglu`, `_down`), or with
  `LaunchConfig.programs` that many persistent programs running K2's loops (`_up_persistent`,
  `_down_persistent`), the stage as it runs inside K2. Standalone options: `LaunchConfig.paired`
  (`paired_up_task`: the gate and up rows of a block in one tile, the SwiGLU in its epilogue, so
  no gate/up buffer and no SwiGLU pass; the default), `LaunchConfig.down_split` (down in S
  slices of the intermediate, per-pick partial sums [S, R * k, d] added in slice order: more,
  shorter down tasks for the few experts of a 1-row step) and `LaunchConfig.up_split` (the
  paired gate/up in U slices of the hidden: each stores its partial sums in gate/up [R * k, U,
  2, I] and arrives at its block's counter (`sync.arrive`), and the last to arrive adds them in
  slice order and goes on to the SwiGLU); both 2 is the 1-row default.
- Programmatic dependent launches (`LaunchConfig.pdl`, the default of the fast decode in the
  fragment order): SwiGLU (paired: down) launches while gate/up runs, down while SwiGLU runs,
  and down loads its first weight tile before waiting for h (`launch_stages`). With
  `LaunchConfig.overlap` (paired; the default) a down task waits for its own group's gate/up
  tasks, not for the whole gate/up kernel: a release counter a group (`sync.signal`), a bounded
  acquire wait (`sync.wait_at_least`), both grids in group order, so down fills the slots that
  gate/up's last wave leaves idle. With `LaunchConfig.diagonal` (the fragment order, K steps of
  256; the default) the tasks of one or two rows take the diagonal loop (below), bigger groups
  the ordinary one, in the same kernels (K2's loops too: `up_stage`, `down_stage`).
- The K loop (`_matvec`): load a tile of codes and scales; in the checkpoint's order (pointers,
  or with `LaunchConfig.tma` a tensor descriptor: the copy engine fills shared memory) decode it
  into its even and odd K columns and interleave them for one dot, pipelined by Triton; in the
  fragment order load it straight into the registers the dot takes it from (`_load_fragments`),
  one K step ahead (`_fragment_matvec`), and decode it into the natural column order
  (`_decode_fragments`). The same products both ways.

Decode (constexpr FAST):
- FAST (NVIDIA): a PTX block places each e2m1 code's bits in a bf16: sign to bit 15, exponent
  and mantissa to bits 8..6, which is the e2m1 value times 2^-126 (the e2m1 subnormal 0.5 lands
  on a bf16 subnormal, exact). In the checkpoint's order 4 packed bytes (8 codes) go to 8 bf16
  with `prmt`, shifts and masks (`_decode_fast`: 18 sm_90 instructions); in the fragment order a
  register of two 16-bit halves (8 codes) goes to 4 bf16 pairs with a byte swap, 3 shifts and 5
  masks (`_decode_halves_fast`, generated from the layout's table `formats.fragment_code_masks`: 9).
  Each decode is elementwise (a result depends on its own byte or half only), so it is right
  however Triton groups the elements into registers. The factor 2^126 is folded into the block
  scale, applied as one bf16 multiply: 2^(e - 127) * 2^126 = 2^(e - 1) must be a bf16 and the
  scaled values normal, so scale codes are limited to [2, 128]
  (`ExpertWeights.supports_fast_decode`; real weights, |w| < 12, are far inside; the launcher
  refuses others on the fast path). The products then go through the tensor cores with the
  weights as the M operand (swap AB: M = weight rows, N = the rows of the step padded to 16),
  accumulating in fp32.
- Diagonal (`LaunchConfig.diagonal`, either decode): the block scales go on fp32 partial sums
  instead of on the weights. x [R, 256] of a K step is laid out block-diagonally, [R * 8, 256]
  with row r * 8 + b holding x[r] on block b's 32 columns and zeros elsewhere (`_diagonal_x`), so
  one dot gives each 32-column block's partial sum in a column of its own; each is multiplied by
  its fp32 scale (`_diagonal_scales`: lane t of a row's four loads only the scales of blocks 2t
  and 2t + 1, the columns it holds of the dot's result) and added up, the blocks summed once at
  the end of the task. With two rows that is a dot of N = 16, the tensor cores' smallest wgmma
  that Triton issues from registers, so it is for groups of up to `DIAG_ROWS` (2) rows, which at
  v4-flash's 256 experts are nearly all of them up to 48 rows. FAST: x times 2^100 (exact in
  bf16 for |x| < 2^28) keeps the products of the decode's 2^-126-scaled weights normal in fp32,
  and the scale is 2^(e - 127 + 26). It takes the bf16 multiply of every weight (64 HMUL2 and 40
  PRMT a K step of a 128 x 256 tile) out of the loop for 8 FFMA and 16 selects: 292 sm_90
  instructions a step against 357 (`tests/expert_sass.py --diagonal`).
- Portable (interpreter, AMD): the codes found as the fast decode finds them (nibbles; the same
  byte swap, shifts and masks in the fragment order), decoded arithmetically to fp32, the scale applied in
  fp32, an fp32 dot in IEEE precision, h rounded to bf16 by integer arithmetic (the interpreter's
  own bf16 cast truncates). (Triton's CPU interpreter computes bf16 dots wrongly and
  flushes bf16 subnormals: research in DESIGN.md section 7.)
Both are exact up to fp32 accumulation order against a float64 reference of the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import formats
from ..formats import FRAGMENT_GROUP, FRAGMENT_ROWS, fragment_code_masks, from_fragment_order, to_fragment_order
from .rounding import bf16
from .sync import DEFAULT_MAX_POLLS, arrive, signal, wait_at_least

ROWS = 16  # rows of one expert a task serves: the N dimension of the swapped-AB dot
_MAX_POLLS = tl.constexpr(DEFAULT_MAX_POLLS)  # a down task's wait for its group's flag (`LaunchConfig.overlap`)
FAST_SCALE_CODES = (2, 128)
DIAG_ROWS = tl.constexpr(2)  # rows of a task that takes the diagonal loop (`LaunchConfig.diagonal`)


@dataclass
class ExpertWeights:
    """Routed experts of one layer, stacked: codes [E, N, K / 2] uint8, scales [E, N, K / 32]."""

    w1: tuple[torch.Tensor, torch.Tensor]
    w2: tuple[torch.Tensor, torch.Tensor]
    w3: tuple[torch.Tensor, torch.Tensor]
    fragments: bool = False  # codes in the fragment order (`to_fragment_order`), not the checkpoint's
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
        """Whether every scale code is in [2, 128], as the fast decode's folded scale needs.
        Checked once (a device sync), so call it at build, before any graph capture."""
        if self._fast_decode is None:
            low, high = FAST_SCALE_CODES
            self._fast_decode = all(bool(((s >= low) & (s <= high)).all()) for _, s in (self.w1, self.w2, self.w3))
        return self._fast_decode


def prepare(experts: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]], fragments: bool = False) -> ExpertWeights:
    """Stack a layer's per-expert checkpoint tensors [(w1, w2, w3) each (packed, scale)], the codes
    in the checkpoint's order or (fragments) in the fragment order."""
    def stack(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.stack([e[m][0].view(torch.uint8) for e in experts]).contiguous()
        scales = torch.stack([e[m][1].view(torch.uint8) for e in experts]).contiguous()
        return (to_fragment_order(codes) if fragments else codes), scales

    return ExpertWeights(stack(0), stack(1), stack(2), fragments)


def unprepare(weights: ExpertWeights) -> list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
    """The inverse of `prepare`: per expert (w1, w2, w3), each (packed uint8, e8m0 scale)."""
    def one(m: tuple[torch.Tensor, torch.Tensor], e: int):
        codes = from_fragment_order(m[0][e]) if weights.fragments else m[0][e]
        return codes, m[1][e].view(torch.float8_e8m0fnu)

    return [(one(weights.w1, e), one(weights.w2, e), one(weights.w3, e)) for e in range(weights.num_experts)]


def fragment_tiles_refusal(block_n: int, block_k: int, hidden: int, inter: int) -> str | None:
    """What expert tiles of `block_n` outputs over K steps of `block_k` lack to read experts in the
    fragment order (whole 128-column groups a K step, whole 16-row blocks of the dot's operand a
    tile: `_load_fragments`), or None."""
    steps = sorted({min(block_k, hidden), min(block_k, inter)})
    if any(k % FRAGMENT_GROUP for k in steps):
        return f"expert K steps of a multiple of {FRAGMENT_GROUP} (here {steps})"
    rows = sorted({min(block_n, hidden), min(block_n, inter)})
    if any(n % FRAGMENT_ROWS for n in rows):
        return f"expert tiles of a multiple of {FRAGMENT_ROWS} rows (here {rows})"
    return None


def in_fragment_order(weights: ExpertWeights) -> ExpertWeights:
    """A copy of checkpoint-order experts with the codes in the fragment order (scales shared)."""
    if weights.fragments:
        raise ValueError("these experts are in the fragment order already")
    return ExpertWeights(*((to_fragment_order(c), s) for c, s in (weights.w1, weights.w2, weights.w3)),
                         fragments=True, _fast_decode=weights._fast_decode)


# --- decode ---------------------------------------------------------------------------------------
@triton.jit
def _decode_fast(codes):
    """codes uint8 [..., n] -> (low-nibble values, high-nibble values) bf16 [..., n], each the
    e2m1 value times 2^-126."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 s0, s1, a, b;
        prmt.b32 s0, $4, 0, 0x4140;
        prmt.b32 s1, $4, 0, 0x4342;
        shl.b32 a, s0, 12; and.b32 a, a, 0x80008000;
        shl.b32 b, s0, 6;  and.b32 b, b, 0x01C001C0; or.b32 $0, a, b;
        shl.b32 a, s1, 12; and.b32 a, a, 0x80008000;
        shl.b32 b, s1, 6;  and.b32 b, b, 0x01C001C0; or.b32 $1, a, b;
        shl.b32 a, s0, 8;  and.b32 a, a, 0x80008000;
        shl.b32 b, s0, 2;  and.b32 b, b, 0x01C001C0; or.b32 $2, a, b;
        shl.b32 a, s1, 8;  and.b32 a, a, 0x80008000;
        shl.b32 b, s1, 2;  and.b32 b, b, 0x01C001C0; or.b32 $3, a, b;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[codes],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e2m1_value(nibble):
    """A 4-bit e2m1 code (int32) -> its value (fp32), arithmetically."""
    exponent = (nibble >> 1) & 3
    mantissa = (nibble & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                         (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


def _halves_decode_asm() -> str:
    """PTX of `_decode_halves_fast`, from the layout's ways and masks (`formats.fragment_code_masks`):
    $4 holds two 16-bit halves; output $c holds code c of each as a bf16 (times 2^-126). The byte
    swap stays within each half and the masks keep each result's bits to those of its own half, so
    the op is elementwise however Triton pairs the halves into registers."""
    lines = ["{", ".reg .b32 w, s, t, u;", "mov.b32 w, $4;",  # outputs may share the input's register
             "prmt.b32 s, w, 0, 0x2301;"]  # each half's two bytes swapped
    for code in range(4):
        for i, ((swap, shift), mask) in enumerate(sorted(fragment_code_masks(code).items())):
            source = "s" if swap else "w"
            if shift:
                lines.append(f"{'shl' if shift > 0 else 'shr'}.b32 t, {source}, {abs(shift)};")
                source = "t"
            both = mask | mask << 16  # the same bits of both halves
            if i == 0:
                lines.append(f"and.b32 ${code}, {source}, {both:#010x};")
            else:
                lines.append(f"and.b32 u, {source}, {both:#010x};")
                lines.append(f"or.b32 ${code}, ${code}, u;")
    return "\n".join(lines + ["}"])


HALVES_DECODE_ASM = tl.constexpr(_halves_decode_asm())
_CODES = [sorted(fragment_code_masks(code).items()) for code in range(4)]
assert [len(c) for c in _CODES] == [1, 1, 1, 2], "the portable decode takes one way for codes 0-2, two for 3"


def _way_constants(code: int, term: int) -> tuple[tl.constexpr, ...]:
    """(swap, shift, mask) of a code's term, as the portable decode's constants."""
    (swap, shift), mask = _CODES[code][term]
    return tl.constexpr(swap), tl.constexpr(shift), tl.constexpr(mask)


_SWAP0, _SHIFT0, _MASK0 = _way_constants(0, 0)
_SWAP1, _SHIFT1, _MASK1 = _way_constants(1, 0)
_SWAP2, _SHIFT2, _MASK2 = _way_constants(2, 0)
_SWAP3, _SHIFT3, _MASK3 = _way_constants(3, 0)
_SWAP3B, _SHIFT3B, _MASK3B = _way_constants(3, 1)


@triton.jit
def _decode_halves_fast(halves):
    """Fragment halves int16 [..] -> codes 0..3 of each, bf16 [..] times 2^-126: a byte swap, then
    a shift and a mask a code (code 3: two masks), two halves at a time (`formats.to_fragment_order`)."""
    return tl.inline_asm_elementwise(
        asm=HALVES_DECODE_ASM,
        constraints="=r,=r,=r,=r,r",
        args=[halves],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _way(h, swapped, SWAP: tl.constexpr, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """The bits MASK of a half (uint32, the low 16; `swapped`: its two bytes swapped) after the
    swap (SWAP) and a left shift by SHIFT (negative: right)."""
    x = swapped if SWAP else h
    if SHIFT > 0:
        x = x << SHIFT
    elif SHIFT < 0:
        x = x >> -SHIFT
    return x & MASK


@triton.jit
def _code_of(placed):
    """The e2m1 value (fp32) of a code from its placed bf16 bits (uint32, the low 16)."""
    return _e2m1_value((((placed >> 6) & 7) | ((placed >> 12) & 8)).to(tl.int32))


@triton.jit
def _decode_halves_portable(halves):
    """`_decode_halves_fast` in plain Triton (the same byte swap, shifts and masks), values in fp32."""
    h = halves.to(tl.uint16, bitcast=True).to(tl.uint32)
    s = ((h & 255) << 8) | (h >> 8)
    c0 = _code_of(_way(h, s, _SWAP0, _SHIFT0, _MASK0))
    c1 = _code_of(_way(h, s, _SWAP1, _SHIFT1, _MASK1))
    c2 = _code_of(_way(h, s, _SWAP2, _SHIFT2, _MASK2))
    c3 = _code_of(_way(h, s, _SWAP3, _SHIFT3, _MASK3) | _way(h, s, _SWAP3B, _SHIFT3B, _MASK3B))
    return c0, c1, c2, c3


@triton.jit
def _load_tile(codes, scales_ptr, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
               FRAG: tl.constexpr):
    """Rows row0 .. row0 + BN of a stacked matrix ([E * N, K / 2] codes: expert e's row n is row
    e * N + n), columns k0 .. k0 + BK: (codes [BN, BK / 2] uint8 as stored, or with FRAG the
    fragment halves [BN, BK / 4] int16, each row's in the order a row of the fragment order's
    blocks holds them; scale codes [BN, BK / 32] int32). `codes`: a pointer (the checkpoint's
    order), or (TMA) a tensor descriptor (`codes_operand`: tiles of that shape, or with FRAG the
    [BN / 16, BK / 128, 2, 256] blocks of the fragment order that hold them), whose loads the
    copy engine makes into shared memory, asynchronously and without registers. (`_matvec`
    reads fragment-order codes through pointers with `_load_fragments`.)"""
    rows = row0 + tl.arange(0, BN)
    if TMA:
        if FRAG:  # blocks (w, g) of rows 16 w + 8 a + i: to rows
            blocks = codes.load([(row0 // 16).to(tl.int32), k0 // 128, 0, 0])
            tile = tl.reshape(tl.permute(tl.reshape(blocks, (BN // 16, BK // 128, 2, 8, 32)), (0, 2, 3, 1, 4)),
                              (BN, BK // 4))
        else:
            tile = codes.load([row0.to(tl.int32), k0 // 2])
    else:
        tl.static_assert(not FRAG, "fragment-order codes are read through pointers by _load_fragments")
        # Rows are K / 2 bytes apart, a multiple of 16 (K % 32 == 0): say so, for 16-byte loads.
        rk = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BK // 2), 16), BK // 2)
        tile = tl.load(codes + tl.multiple_of(rows * (K // 2), 16)[:, None] + rk[None, :])
    rg = k0 // 32 + tl.arange(0, BK // 32)
    return tile, tl.load(scales_ptr + rows[:, None] * (K // 32) + rg[None, :]).to(tl.int32)


@triton.jit
def _load_fragments(codes, scales_ptr, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                    PAIR: tl.constexpr = False, up_codes=None, up_scales=None, OWN: tl.constexpr = False):
    """Like `_load_tile` for codes in the fragment order, but loaded straight into the registers
    the tensor cores take them from: (halves [BN, BK / 4] int16, scale codes [BN, 4, BK / 32]
    uint8, each row's scales once for each of the 4 lanes that share the row). The dot's operand
    gives warp w rows 16 w .. 16 w + 15 (and 16 (w + warps) ..., and so on), lane l rows l / 4
    and l / 4 + 8 of those and, of each 128-column group, the 16 bytes l % 4. The loads are shaped
    so that Triton's coalesced layout for them is exactly that: the last dimension runs over (w,
    row l / 4, 16-byte chunk l % 4, 8 halves), so lanes and then warps take it in that order
    and the row offset 8 and the groups are left to registers; the result needs no shared memory
    on its way to the dot (Triton picks the order of the other dimensions differently from one
    version to the next, so they must not need lanes or warps). The fragment order's blocks
    (`formats.to_fragment_order`) store a warp's rows in that order too, so each load
    instruction of a warp reads 512 contiguous bytes. PAIR (a paired tile, `paired_up_task`): the
    tile's first BN / 2 rows are rows row0 .. of `codes` (w1) and the others the same rows of
    `up_codes` (w3), each warp's band from one matrix."""
    tl.static_assert(BN % 16 == 0, "fragment tiles need a multiple of 16 rows")
    G: tl.constexpr = BK // 128  # column groups
    W: tl.constexpr = BN // 16
    g = tl.arange(0, G)[:, None, None]
    a = tl.arange(0, 2)[None, :, None]  # the row offset 8
    f = tl.arange(0, W * 256)[None, None, :]  # (w, row i, 32 halves c): row 16 w + 8 a + i, half 32 g + c
    band, codes = _band(f // 256, codes, up_codes, W, PAIR)
    block = (row0 // 16 + band) * (K // 128) + k0 // 128 + g  # 512 halves: (a, i, c)
    halves = tl.load(codes + tl.multiple_of(block * 512 + 256 * a, [1, 1, 8]) + f % 256)
    tile = tl.reshape(tl.permute(tl.reshape(halves, (G, 2, W, 8, 32)), (2, 1, 3, 0, 4)), (BN, BK // 4))
    S: tl.constexpr = 2 if OWN else BK // 32  # scales a lane
    f = tl.arange(0, W * 32 * S)[None, :]  # (w, row i, lane t, scale s)
    band, scales_ptr = _band(f // (32 * S), scales_ptr, up_scales, W, PAIR)
    rows = row0 + 16 * band + 8 * tl.arange(0, 2)[:, None] + f // (4 * S) % 8
    own = f % (4 * S) if OWN else f % S  # OWN: lane t's are blocks 2t, 2t + 1
    scale_codes = tl.load(scales_ptr + tl.multiple_of(rows * (K // 32) + k0 // 32, [1, S]) + own)
    return tile, tl.reshape(tl.permute(tl.reshape(scale_codes, (2, W, 8, 4, S)), (1, 0, 2, 3, 4)), (BN, 4, S))


@triton.jit
def _band(warp, gate_ptr, up_ptr, W: tl.constexpr, PAIR: tl.constexpr):
    """(16-row band within its matrix, base pointer) of a tile's warp band `warp`: all of one matrix,
    or (PAIR) the first W / 2 bands of gate's, the others of up's."""
    if PAIR:
        tl.static_assert(W % 2 == 0, "a paired tile needs an even number of 16-row bands")
        band, ptr = warp % (W // 2), tl.where(warp < W // 2, gate_ptr, up_ptr)
    else:
        band, ptr = warp, gate_ptr
    return band, ptr


@triton.jit
def _scales(scale_codes, FAST: tl.constexpr):
    """Block scales from their E8M0 codes: bf16 (FAST: times the 2^126 the bit placement left
    out) or fp32."""
    if FAST:
        # 2^(e - 127) times 2^126, as a bf16: exponent field e + 126
        scale = ((scale_codes + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        # 2^(e - 127) built from its bits: exact, code 0 being the fp32 subnormal 2^-127
        scale = tl.where(scale_codes == 0, 0x00400000, scale_codes << 23).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _decode_tile(codes, scale_codes, BK: tl.constexpr, FAST: tl.constexpr):
    """A tile from `_load_tile` (the checkpoint's order) decoded with its scales: [BN, BK] bf16
    (FAST, the nibbles times 2^-126 by `_decode_fast`) or fp32 in K order. The nibbles give the
    even and the odd columns apart; joining them back is a shuffle of every weight (the fragment
    order's reason to be)."""
    BN: tl.constexpr = codes.shape[0]
    if FAST:
        low, high = _decode_fast(codes)
    else:
        c = codes.to(tl.int32)
        low, high = _e2m1_value(c & 15), _e2m1_value(c >> 4)
    scale = _scales(scale_codes, FAST)[:, :, None]  # a scale per 32 columns: per 16 of each half
    even = tl.reshape(tl.reshape(low, (BN, BK // 32, 16)) * scale, (BN, BK // 2))
    odd = tl.reshape(tl.reshape(high, (BN, BK // 32, 16)) * scale, (BN, BK // 2))
    return tl.reshape(tl.join(even, odd), (BN, BK))


@triton.jit
def _decode_fragments(halves, scale_codes, BK: tl.constexpr, FAST: tl.constexpr, SCALED: tl.constexpr = True):
    """Fragment halves from `_load_fragments` (or `_load_tile`) decoded, with their scales if
    SCALED (codes [BN, 4, BK / 32]: a row's once for each lane t, as `_load_fragments` has them): [BN, BK] in
    the natural K order. Half (g, t, m, r) of the tile holds codes 2s + q, columns
    g*128 + m*32 + s*16 + q*8 + 2t + r (`formats.to_fragment_order`): a code of halves r = 0 and
    1 is the pair of columns a thread of the tensor cores' operand takes from one register, which
    is how the fast decode packs them, and each thread's halves of a group are contiguous."""
    BN: tl.constexpr = halves.shape[0]
    G: tl.constexpr = BK // 128
    if FAST:
        c0, c1, c2, c3 = _decode_halves_fast(halves)
    else:
        c0, c1, c2, c3 = _decode_halves_portable(halves)
    w = tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (BN, G, 4, 4, 2, 2, 2))  # (n, g, t, m, r, q, s)
    if SCALED:
        scale = tl.permute(tl.reshape(_scales(scale_codes.to(tl.int32), FAST), (BN, 4, G, 4)), (0, 2, 1, 3))
        w = w * tl.reshape(scale, (BN, G, 4, 4, 1, 1, 1))  # a scale per (g, m): 32 columns
    return tl.reshape(tl.permute(w, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))  # (n, g, m, s, q, t, r): column order


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
def _matvec(codes, scales_ptr, row0, x_ptr, x_rows, x_mask, K, BN: tl.constexpr, BK: tl.constexpr,
            FAST: tl.constexpr, NS: tl.constexpr, TMA: tl.constexpr, FRAG: tl.constexpr,
            PDL: tl.constexpr = False, SPLIT: tl.constexpr = 1, part=0, READY: tl.constexpr = False, ready=None,
            target=0, error=None, DIAG: tl.constexpr = False):
    """acc [BN, ROWS] fp32 = W[row0 .. row0 + BN, :] @ x[x_rows, :]^T over all K (rows of the
    stacked matrix: `_load_tile`). FRAG: the codes are in the fragment order
    (`ExpertWeights.fragments`), which without TMA takes `_fragment_matvec`'s loop. NS: the
    other loops' software-pipelining depth (`tl.range` num_stages; None: the launch's). PDL,
    SPLIT, part and DIAG: `_fragment_matvec`'s (the other loops do not take them; the launcher
    refuses them there)."""
    if FRAG and not TMA:
        acc = _fragment_matvec(codes, scales_ptr, row0, x_ptr, x_rows, x_mask, K, BN, BK, FAST, PDL=PDL, SPLIT=SPLIT,
                               part=part, READY=READY, ready=ready, target=target, error=error, DIAG=DIAG)
    else:
        acc = tl.zeros((BN, x_rows.shape[0]), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=NS):
            tile, scale_codes = _load_tile(codes, scales_ptr, row0, k0, K, BN, BK, TMA, FRAG)
            if FRAG:  # the scales as `_load_fragments` gives them
                w = _decode_fragments(tile, tl.broadcast_to(scale_codes[:, None, :], (BN, 4, BK // 32)), BK, FAST)
            else:
                w = _decode_tile(tile, scale_codes, BK, FAST)
            acc = _dot(w, _x_tile(x_ptr, x_rows, x_mask, k0, K, BK, FAST), acc, FAST)
    return acc


@triton.jit
def _fragment_matvec(codes, scales_ptr, row0, x_ptr, x_rows, x_mask, K, BN: tl.constexpr, BK: tl.constexpr,
                     FAST: tl.constexpr, PDL: tl.constexpr = False, PAIR: tl.constexpr = False, up_codes=None,
                     up_scales=None, SPLIT: tl.constexpr = 1, part=0, READY: tl.constexpr = False, ready=None,
                     target=0, error=None, DIAG: tl.constexpr = False):
    """`_matvec` of fragment-order codes, prefetched by hand: while K step k is decoded and
    multiplied, the codes, scales and x of step k + 1 are already on their way into registers
    (`_load_fragments`; the last step loads itself again, in bounds, rather than branch).
    Triton's own pipelining staged the codes through shared memory instead, one buffer a tile,
    and waited for each step's copy before decoding it; this loop moves 10-13 % more bytes a
    second on the H200 (docs/PERFORMANCE.md). It holds one more tile in registers, which is
    why the launcher caps them (`LaunchConfig.max_registers`). PDL (NVIDIA; the kernel launched
    as a programmatic dependent of the one that writes x, `LaunchConfig.pdl`): the first tile's
    loads go out before waiting for that kernel (`griddepcontrol.wait`), x's after. PAIR: a paired
    tile of `codes` (w1) and `up_codes` (w3) (`_load_fragments`). SPLIT: only slice `part` of
    SPLIT equal slices of K. READY: instead of PDL's wait, wait (bounded) for *ready >= target,
    the publication of x by the tasks that write it (`LaunchConfig.overlap`); NaN if it gave up.
    DIAG: the block scales on fp32 partial sums, x block-diagonal (module docstring, "Diagonal")."""
    k_lo = part * (K // SPLIT)
    k_hi = k_lo + K // SPLIT
    tile, scale_codes = _load_fragments(codes, scales_ptr, row0, k_lo, K, BN, BK, PAIR, up_codes, up_scales, DIAG)
    if READY:  # this group's gate/up tasks have published h (`LaunchConfig.overlap`)
        published = wait_at_least(ready, target, error, 0, _MAX_POLLS)
    elif PDL:
        gdc_wait()
    x = _x_tile(x_ptr, x_rows, x_mask, k_lo, K, BK, FAST)
    R: tl.constexpr = x_rows.shape[0]
    sums = tl.zeros((BN, R * (BK // 32) if DIAG else R), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=1):
        ahead = tl.minimum(k0 + BK, k_hi - BK)
        next_tile, next_scales = _load_fragments(codes, scales_ptr, row0, ahead, K, BN, BK, PAIR, up_codes,
                                                 up_scales, DIAG)
        next_x = _x_tile(x_ptr, x_rows, x_mask, ahead, K, BK, FAST)
        sums = _k_step(tile, scale_codes, x, sums, BK, FAST, DIAG)
        tile, scale_codes, x = next_tile, next_scales, next_x
    if DIAG:
        acc = tl.sum(tl.reshape(sums, (BN, R, BK // 32)), axis=2)
    else:
        acc = sums
    if READY:  # a wait that gave up (a bug: every gate/up task runs) leaves NaN, not stale sums
        acc = tl.where(published, acc, float("nan"))
    return acc


@triton.jit
def _k_step(tile, scale_codes, x, sums, BK: tl.constexpr, FAST: tl.constexpr, DIAG: tl.constexpr):
    """sums plus one K step's products: [BN, R], or (DIAG) the scaled block sums [BN, R * BK / 32]."""
    if DIAG:
        block_sums = _dot(_decode_fragments(tile, scale_codes, BK, FAST, SCALED=False), _diagonal_x(x, FAST),
                          tl.zeros(sums.shape, dtype=tl.float32), FAST)
        sums += block_sums * _diagonal_scales(scale_codes, x.shape[0], FAST)
    else:
        sums = _dot(_decode_fragments(tile, scale_codes, BK, FAST), x, sums, FAST)
    return sums


@triton.jit
def _diagonal_x(x, FAST: tl.constexpr):
    """x [R, BK] -> [R * BK / 32, BK]: row r * (BK / 32) + b holds x[r] on the columns of block b
    and zeros elsewhere, so one dot gives each 32-column block's partial sum in a column of its
    own; FAST: times 2^100 (the decoded weights are 2^-126 of their values, products stay normal)."""
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
    """Scale codes [BN, 4, 2] (`_load_fragments` with OWN: lane t's, of blocks 2t and 2t + 1) ->
    fp32 [BN, R * G]: column r * G + b the scale of block b, 2^(e - 127) (FAST: times 2^26,
    undoing the weights' 2^-126 and x's 2^100)."""
    BN: tl.constexpr = scale_codes.shape[0]
    G: tl.constexpr = 4 * scale_codes.shape[2]
    tl.static_assert(G == 8, "a lane holds blocks 2t, 2t + 1 of the dot's columns: K steps of 256")
    e = tl.reshape(scale_codes.to(tl.int32), (BN, G))
    if FAST:
        scale = ((e + 26) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 + 26)
    else:
        scale = _scales(e, False)
    return tl.reshape(tl.broadcast_to(tl.reshape(scale, (BN, 1, G)), (BN, R, G)), (BN, R * G))


@triton.jit
def _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_: tl.constexpr):
    """The task of sorted pick j: (active, expert, pick ids [ROWS], mask [ROWS])."""
    count = tl.load(counts_ptr + j)
    expert = tl.load(experts_ptr + j).to(tl.int64)
    m = tl.arange(0, ROWS_)
    mask = m < count
    picks = tl.load(order_ptr + j + m, mask=mask, other=0)
    return count > 0, expert, picks, mask


@triton.jit
def up_task(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr,
            w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK,
            BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
            NS: tl.constexpr = None, TMA: tl.constexpr = False,
            FRAG: tl.constexpr = False, DIAG: tl.constexpr = False):
    """Gate (which = 0, w1) or up (which = 1, w3) task for sorted pick j and intermediate block
    nb: gu[pick, which, block] in fp32 for the up to ROWS_ picks of one expert that start at j;
    nothing unless j starts a group. Gate and up are separate tasks: one accumulator a task
    halves the registers (measured: twice the occupancy, 1.30 -> 1.70 TB/s). DIAG: a group of up
    to DIAG_ROWS rows takes the diagonal loop. K2 calls this."""
    if DIAG and tl.load(counts_ptr + j) <= DIAG_ROWS:  # one or two rows: the diagonal loop
        _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
                  w3_scales, K, I, TOPK, BN, BK, DIAG_ROWS, FAST, NS, TMA, FRAG, True)
    else:
        _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
                  w3_scales, K, I, TOPK, BN, BK, ROWS_, FAST, NS, TMA, FRAG, False)


@triton.jit
def _up_group(j, nb, which, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
              w3_scales, K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
              NS: tl.constexpr, TMA: tl.constexpr, FRAG: tl.constexpr, DIAG: tl.constexpr):
    active, expert, picks, mask = _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_)
    if active:
        row0 = expert * I + nb * BN
        if which == 0:
            acc = _matvec(w1_codes, w1_scales, row0, x_ptr, picks // TOPK, mask, K, BN, BK, FAST, NS, TMA, FRAG,
                          DIAG=DIAG)
        else:
            acc = _matvec(w3_codes, w3_scales, row0, x_ptr, picks // TOPK, mask, K, BN, BK, FAST, NS, TMA, FRAG,
                          DIAG=DIAG)
        _store_gate_up(acc, nb, which, picks, mask, gu_ptr, I, BN)


@triton.jit
def _store_gate_up(acc, nb, which, picks, mask, gu_ptr, I, BN: tl.constexpr):
    n = nb * BN + tl.arange(0, BN)
    tl.store(gu_ptr + picks[None, :] * (2 * I) + which * I + n[:, None], acc, mask=mask[None, :])


@triton.jit
def swiglu_value(gate, up, weight, limit, FAST: tl.constexpr):
    """(silu(min(gate, limit)) * clamp(up, -limit, limit) * weight) in fp32, rounded to bf16 (the
    routed experts' h; the shared expert's with weight 1, `router.shared_swiglu_task`)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up * weight
    if not FAST:
        h = bf16(h)
    return h.to(tl.bfloat16)


@triton.jit
def paired_up_task(j, nb, x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
                   w3_scales, K, I, TOPK, limit, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr,
                   FAST: tl.constexpr, READY: tl.constexpr = False, ready=None, DIAG: tl.constexpr = False,
                   SPLIT: tl.constexpr = 1, part=0, slices_ptr=None, arrivals_ptr=None):
    """Gate and up of intermediate block nb (BN / 2 columns) for the group that starts at sorted
    pick j, as one tile of fragment-order codes (BN / 2 rows of w1 over the same rows of w3,
    `_load_fragments`), and their SwiGLU with the routing weight in the epilogue: h[pick, block]
    (`swiglu_value`), with no gate/up round trip through memory and no SwiGLU pass. READY: then
    publish the block to the group's counter ready[j] (`LaunchConfig.overlap`). DIAG: a group of
    up to DIAG_ROWS rows takes the diagonal loop. SPLIT: only slice `part` of K (`_split_sums`)."""
    if DIAG and tl.load(counts_ptr + j) <= DIAG_ROWS:  # one or two rows: the diagonal loop
        _paired_up_group(j, nb, x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales,
                         w3_codes, w3_scales, K, I, TOPK, limit, BN, BK, DIAG_ROWS, FAST, True, READY, ready,
                         SPLIT, part, slices_ptr, arrivals_ptr)
    else:
        _paired_up_group(j, nb, x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales,
                         w3_codes, w3_scales, K, I, TOPK, limit, BN, BK, ROWS_, FAST, False, READY, ready,
                         SPLIT, part, slices_ptr, arrivals_ptr)


@triton.jit
def _paired_up_group(j, nb, x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales,
                     w3_codes, w3_scales, K, I, TOPK, limit, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr,
                     FAST: tl.constexpr, DIAG: tl.constexpr, READY: tl.constexpr, ready, SPLIT: tl.constexpr, part,
                     slices_ptr, arrivals_ptr):
    active, expert, picks, mask = _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_)
    if active:
        HB: tl.constexpr = BN // 2
        acc = _fragment_matvec(w1_codes, w1_scales, expert * I + nb * HB, x_ptr, picks // TOPK, mask, K, BN, BK,
                               FAST, PAIR=True, up_codes=w3_codes, up_scales=w3_scales, SPLIT=SPLIT, part=part,
                               DIAG=DIAG)
        last = True
        if SPLIT > 1:
            acc, last = _split_sums(acc, nb, picks, mask, slices_ptr, arrivals_ptr + j * (2 * I // BN) + nb, I,
                                    SPLIT, part)
        if last:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HB, ROWS_)), (1, 2, 0)))
            weight = tl.load(rw_ptr + picks, mask=mask, other=0.0)
            n = nb * HB + tl.arange(0, HB)
            tl.store(h_ptr + picks[None, :] * I + n[:, None], swiglu_value(gate, up, weight[None, :], limit, FAST),
                     mask=mask[None, :])
            if READY:
                signal(ready + j)


@triton.jit
def _split_sums(acc, nb, picks, mask, slices_ptr, arrivals, I, SPLIT: tl.constexpr, part):
    """A paired tile's slice `part` of SPLIT slices of K: store its partial sums (gate/up [P, SPLIT,
    2, I] fp32, the tile's rows at their gate or up columns) and arrive at the block's counter.
    Returns (the sum of all slices, in slice order, whatever order they finished in; whether this
    task arrived last, so that it alone goes on to the SwiGLU). The last one puts the counter back
    to 0 for the next launch (it is allocated zeroed)."""
    BN: tl.constexpr = acc.shape[0]
    HB: tl.constexpr = BN // 2
    r = tl.arange(0, BN)
    column = (r // HB) * I + nb * HB + r % HB  # gate rows first, then up
    at = slices_ptr + picks[None, :] * (SPLIT * 2 * I) + column[:, None]
    tl.store(at + part * (2 * I), acc, mask=mask[None, :])
    last = arrive(arrivals) == SPLIT - 1
    if last:
        acc = tl.load(at, mask=mask[None, :], other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(at + s * (2 * I), mask=mask[None, :], other=0.0, cache_modifier=".cg")
        tl.store(arrivals, 0)
    return acc, last


@triton.jit
def swiglu_task(p, ib, gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """h[p, block] from pick p's gate and up (`swiglu_value`)."""
    i = ib * BLOCK + tl.arange(0, BLOCK)
    gate, up = tl.load(gu_ptr + p * (2 * I) + i), tl.load(gu_ptr + p * (2 * I) + I + i)
    tl.store(h_ptr + p * I + i, swiglu_value(gate, up, tl.load(rw_ptr + p), limit, FAST))


@triton.jit
def down_task(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
              BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
              NS: tl.constexpr = None, TMA: tl.constexpr = False,
              FRAG: tl.constexpr = False, PDL: tl.constexpr = False, SPLIT: tl.constexpr = 1, part=0,
              READY: tl.constexpr = False, ready=None, target=0, error=None, DIAG: tl.constexpr = False):
    """Down task (sorted pick j, hidden block nb): per-pick outputs out[pick, block] in fp32. PDL:
    h comes from a kernel this one is a programmatic dependent of (`_fragment_matvec`). SPLIT:
    slice `part` of the intermediate only (its partial sum; out points at that slice's outputs).
    READY: wait for ready[j] >= target first instead (`LaunchConfig.overlap`; error: the error word).
    DIAG: a group of up to DIAG_ROWS rows takes the diagonal loop."""
    if READY:  # this group's flag
        ready = ready + j
    if DIAG and tl.load(counts_ptr + j) <= DIAG_ROWS:  # one or two rows: the diagonal loop
        _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, BN, BK,
                    DIAG_ROWS, FAST, NS, TMA, FRAG, PDL, SPLIT, part, READY, ready, target, error, True)
    else:
        _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, BN, BK,
                    ROWS_, FAST, NS, TMA, FRAG, PDL, SPLIT, part, READY, ready, target, error, False)


@triton.jit
def _down_group(j, nb, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
                BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr, NS: tl.constexpr,
                TMA: tl.constexpr, FRAG: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, part,
                READY: tl.constexpr, ready, target, error, DIAG: tl.constexpr):
    active, expert, picks, mask = _group(j, counts_ptr, order_ptr, experts_ptr, ROWS_)
    if active:
        y = _matvec(w2_codes, w2_scales, expert * D + nb * BN, h_ptr, picks, mask, I, BN, BK, FAST, NS, TMA, FRAG,
                    PDL, SPLIT, part, READY, ready, target, error, DIAG)
        _store_down(y, nb, picks, mask, out_ptr, D, BN)


@triton.jit
def _store_down(y, nb, picks, mask, out_ptr, D, BN: tl.constexpr):
    n = nb * BN + tl.arange(0, BN)
    tl.store(out_ptr + picks[None, :] * D + n[:, None], y, mask=mask[None, :])


@triton.jit
def up_stage(pid, grid, P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
             w3_scales, K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
             NS: tl.constexpr = None, TMA: tl.constexpr = False, FRAG: tl.constexpr = False,
             DIAG: tl.constexpr = False):
    """The gate/up tasks of P picks taken by program `pid` of `grid` (persistent: K2, or the
    `programs` launch): tasks pid, pid + grid, ...; task t is sorted pick t // (2 * blocks),
    block (t // 2) % blocks, gate or up t % 2."""
    blocks = I // BN
    for t in range(pid, P * blocks * 2, grid):
        up_task(t // (2 * blocks), (t // 2) % blocks, t % 2, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr,
                w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK, BN, BK, ROWS_, FAST, NS, TMA, FRAG, DIAG)


@triton.jit
def down_stage(pid, grid, P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
               BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr, NS: tl.constexpr = None,
               TMA: tl.constexpr = False, FRAG: tl.constexpr = False, DIAG: tl.constexpr = False):
    """The down tasks of P picks taken by program `pid` of `grid`: task t is sorted pick
    t // blocks, hidden block t % blocks."""
    blocks = D // BN
    for t in range(pid, P * blocks, grid):
        down_task(t // blocks, t % blocks, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes,
                  w2_scales, D, I, BN, BK, ROWS_, FAST, NS, TMA, FRAG, DIAG=DIAG)


@triton.jit
def _up_persistent(P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales,
                   K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
                   TMA: tl.constexpr, FRAG: tl.constexpr, DIAG: tl.constexpr):
    up_stage(tl.program_id(0), tl.num_programs(0), P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr,
             w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK, BN, BK, ROWS_, FAST, None, TMA, FRAG, DIAG)


@triton.jit
def _down_persistent(P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I,
                     BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
                     TMA: tl.constexpr, FRAG: tl.constexpr, DIAG: tl.constexpr):
    down_stage(tl.program_id(0), tl.num_programs(0), P, h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr,
               w2_codes, w2_scales, D, I, BN, BK, ROWS_, FAST, None, TMA, FRAG, DIAG)


@triton.jit
def _up(x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales,
        K, I, TOPK, BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr,
        TMA: tl.constexpr, FRAG: tl.constexpr, PDL: tl.constexpr, DIAG: tl.constexpr):
    if PDL:  # the SwiGLU's programs may launch once every gate/up program has started
        gdc_launch_dependents()
    up_task(tl.program_id(0), tl.program_id(1), tl.program_id(2), x_ptr, gu_ptr, counts_ptr, order_ptr,
            experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales, K, I, TOPK, BN, BK, ROWS_, FAST, None, TMA, FRAG,
            DIAG)


@triton.jit
def _paired_up(x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes, w3_scales,
               K, I, TOPK, limit, ready, slices_ptr, arrivals_ptr, BN: tl.constexpr, BK: tl.constexpr,
               ROWS_: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr, READY: tl.constexpr, DIAG: tl.constexpr,
               SPLIT: tl.constexpr):
    if PDL:  # down's programs may launch once every program here has started
        gdc_launch_dependents()
    if READY:  # group-major: a group's blocks run together, and it signals when each is done
        j, block = tl.program_id(1), tl.program_id(0)
    else:
        j, block = tl.program_id(0), tl.program_id(1)
    paired_up_task(j, block // SPLIT, x_ptr, h_ptr, rw_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales,
                   w3_codes, w3_scales, K, I, TOPK, limit, BN, BK, ROWS_, FAST, READY, ready, DIAG, SPLIT,
                   block % SPLIT, slices_ptr, arrivals_ptr)


@triton.jit
def _swiglu(gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched during gate/up's last wave: let down launch (it starts when gate/up ends), then wait
        gdc_launch_dependents()
        gdc_wait()
    swiglu_task(tl.program_id(0), tl.program_id(1), gu_ptr, rw_ptr, h_ptr, I, limit, BLOCK, FAST)


@triton.jit
def _down(h_ptr, out_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D, I, ready, target, error,
          BN: tl.constexpr, BK: tl.constexpr, ROWS_: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr,
          FRAG: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, GROUPED: tl.constexpr, READY: tl.constexpr,
          DIAG: tl.constexpr):
    part = tl.program_id(2)
    if GROUPED:  # group-major grid (`LaunchConfig.overlap`); READY: wait for the group's gate/up tasks
        j, nb, picks = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    else:
        j, nb, picks = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    down_task(j, nb, h_ptr, out_ptr + part * picks * D, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, D,
              I, BN, BK, ROWS_, FAST, None, TMA, FRAG, PDL, SPLIT, part, READY, ready, target, error, DIAG)


# --- launcher -------------------------------------------------------------------------------------
def group_picks(ids: torch.Tensor, rows: int = ROWS):
    """Sort a step's picks by expert: (order, experts, counts) over the R * k sorted picks.
    counts[j] > 0 only where a task starts: at the first pick of an expert and every `rows`
    picks after it; pad picks (id < 0) get no task."""
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


@dataclass(frozen=True)
class LaunchConfig:
    fast: bool
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 1  # Triton's pipelining of the checkpoint order's K loop (and tma's); not the fragment order's
    programs: int = 0  # 0: a program a task; n: n persistent programs looping over the tasks, as in K2
    tma: bool = False  # the codes tiles loaded by the copy engine through tensor descriptors (`_load_tile`)
    max_registers: int = 0  # registers a thread the compiler may use (Triton's maxnreg); 0: its own choice
    pdl: bool = False  # SwiGLU (or paired: down) and down launched as programmatic dependents (`launch_stages`)
    paired: bool = False  # gate and up of a block in one tile, the SwiGLU in its epilogue (`paired_up_task`)
    down_split: int = 1  # down in that many slices of the intermediate: partial outputs, summed in slice order
    overlap: bool = False  # paired: a down task waits for its own group's gate/up tasks (flags), not the whole kernel
    diagonal: bool = False  # tasks of 1-2 rows scale fp32 partial sums: x block-diagonal, a dot column a block
    up_split: int = 1  # paired: gate/up in that many slices of the hidden, the last to finish sums them


def default_config(weights: ExpertWeights, rows: int, fast: bool) -> LaunchConfig:
    """The fastest launch measured on the H200 for a step of `rows` rows (docs/PERFORMANCE.md,
    `experts_bench`): in the fragment order, tiles of 128 x 256 with 8 warps capped at 128
    registers a thread (two programs a SM), gate and up paired with the SwiGLU in their epilogue,
    down launched as a programmatic dependent (`LaunchConfig.pdl`) whose tasks wait for their own
    group's gate/up tasks only (`LaunchConfig.overlap`), and tasks of one or two rows scaling
    their fp32 partial sums (`LaunchConfig.diagonal`, where the K steps are 256); at 1 row also
    gate/up and down in two slices each (`up_split`, `down_split`), where the sizes allow: more,
    shorter tasks for the 264 program slots that 6 experts' 192 tiles leave a quarter empty.
    Measured (docs/PERFORMANCE.md): 2.32-2.37 TB/s at 1 row with diagonal alone, 2.39-2.47 with
    the slices; 2.88-2.99 / 3.22-3.27 / 3.34-3.38 / 3.30-3.32 at 2 / 6 / 16 / 48 rows against
    2.69-2.74 / 2.95-2.96 / 3.06 / 3.08-3.09 without diagonal in the same runs. Where the sizes
    refuse it, paired tiles without. In the checkpoint's order 64 x 256, 1 stage."""
    if not (fast and weights.fragments):
        return LaunchConfig(fast)
    config = LaunchConfig(fast, block_n=128, block_k=256, num_warps=8, max_registers=128, pdl=True)
    paired = replace(config, paired=True, overlap=True)
    diagonal = replace(paired, diagonal=True)
    candidates = ([replace(diagonal, up_split=2, down_split=2)] if rows == 1 else []) + [diagonal, paired]
    fits = [c for c in candidates if launch_refusal(c, weights) is None]
    return (fits + [config])[0]


def routed_experts(x: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, weights: ExpertWeights,
                   limit: float, config: LaunchConfig | None = None, *, poison: bool = False,
                   pick_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [R, d] fp32 of one step's routed experts (the contract in the module docstring).
    `poison` fills the intermediates with NaN first, so that tests see any element no task wrote.
    `pick_dtype`: each pick's output rounded to it before the sum, as the per-op MoE's w2
    projection rounds to the activation dtype."""
    if config is None:
        config = default_config(weights, x.shape[0],
                                fast=x.is_cuda and torch.version.cuda is not None and weights.supports_fast_decode())
    buffers = StageBuffers(ids.numel(), weights, x.device, poison, config.down_split, config.up_split)
    launch_stages(x.contiguous(), group_picks(ids), route_weights.to(torch.float32).flatten().contiguous(),
                  weights, limit, config, buffers)
    r, k = ids.shape
    per_pick = buffers.per_pick[0].view(r, k, -1)
    for part in buffers.per_pick[1:]:  # the down slices' partial sums, in slice order
        per_pick = per_pick + part.view(r, k, -1)
    if pick_dtype is not None:
        per_pick = per_pick.to(pick_dtype).float()
    per_pick = torch.where((ids >= 0).unsqueeze(-1), per_pick, 0.0)  # pads: no task
    y = per_pick[:, 0].clone()
    for slot in range(1, k):  # top-k order, whatever the task order was
        y += per_pick[:, slot]
    return y


class StageBuffers:
    """Intermediates of one step's expert stage: gate/up [P, U, 2, I] fp32 (U =
    `LaunchConfig.up_split`: the paired tiles' slices' partial sums, or with U = 1 the unpaired
    tasks' outputs), h [P, I] bf16, per-pick outputs [S, P, d] fp32 (the partial sums of S =
    `LaunchConfig.down_split` slices) for P = R * k picks, `LaunchConfig.overlap`'s words [P + 1]
    int32 (a counter a group, indexed by its first sorted pick, and the error word of the waits),
    and `up_split`'s arrival counters, one a group and paired block (zeroed here; the last
    arrival of each launch puts its counter back to 0). The intermediates are left uninitialised
    (the kernels write every element anything reads; pad picks' outputs are masked by
    `routed_experts`), or filled with NaN with `poison`, for tests to catch an element no task
    wrote."""

    def __init__(self, picks: int, weights: ExpertWeights, device, poison: bool = False, splits: int = 1,
                 up_splits: int = 1):
        def intermediate(shape, dtype):
            if poison:
                return torch.full(shape, float("nan"), dtype=dtype, device=device)
            return torch.empty(shape, dtype=dtype, device=device)

        inter, d = weights.intermediate, weights.hidden
        self.gate_up = intermediate((picks, up_splits, 2, inter), torch.float32)
        self.h = intermediate((picks, inter), torch.bfloat16)
        self.per_pick = intermediate((splits, picks, d), torch.float32)
        # `LaunchConfig.overlap`'s counters: zeroed by `launch_stages` before each gate/up launch that sets them
        self.ready = torch.empty(picks + 1, dtype=torch.int32, device=device)
        blocks = 2 * inter // (2 * FRAGMENT_ROWS)  # of the smallest paired tile
        self.arrivals = torch.zeros(picks * blocks, dtype=torch.int32, device=device) if up_splits > 1 else None


def launch_refusal(config: LaunchConfig, weights: ExpertWeights) -> str | None:
    """Why `config` cannot run the stage of `weights` (what it lacks, as a message), or None."""
    pointers_per_task = weights.fragments and not config.tma and not config.programs
    d, inter = weights.hidden, weights.intermediate
    if config.fast and not weights.supports_fast_decode():
        return ("these experts have E8M0 scale codes outside [2, 128], which the fast decode cannot fold into a "
                "bf16 scale: use LaunchConfig(fast=False)")
    if config.pdl and not (config.fast and pointers_per_task):
        return ("LaunchConfig.pdl (programmatic dependent launches, NVIDIA) waits inside the K loop of fragment-order "
                "codes read through pointers, a program a task: it needs the fast decode, the fragment order, no tma "
                "and programs = 0")
    if config.paired and not pointers_per_task:
        return ("LaunchConfig.paired (gate and up in one tile of fragment-order codes read through pointers, a "
                "program a task) needs the fragment order, no tma and programs = 0")
    if config.overlap and not config.paired:
        return "LaunchConfig.overlap (down waiting for its group's gate/up tasks) needs paired tiles"
    if config.down_split < 1:
        return f"LaunchConfig.down_split is a number of slices, at least 1 (here {config.down_split})"
    if config.down_split > 1 and not (pointers_per_task and inter % (config.down_split * min(config.block_k, inter))
                                      == 0):
        return ("LaunchConfig.down_split (slices of down's K loop) needs the fragment order, no tma, programs = 0 "
                f"and slices of whole K steps (here {inter} / {config.down_split} in steps of "
                f"{min(config.block_k, inter)})")
    if config.up_split < 1:
        return f"LaunchConfig.up_split is a number of slices, at least 1 (here {config.up_split})"
    if config.up_split > 1 and not (config.paired and d % (config.up_split * min(config.block_k, d)) == 0):
        return ("LaunchConfig.up_split (slices of the paired gate/up K loop) needs paired tiles and slices of whole "
                f"K steps (here {d} / {config.up_split} in steps of {min(config.block_k, d)})")
    if config.diagonal and not (weights.fragments and not config.tma
                                and min(config.block_k, d) == min(config.block_k, inter) == 256):
        return ("LaunchConfig.diagonal (block scales on the partial sums, a lane holding two 32-column blocks of "
                f"each K step) needs the fragment order read through pointers (no tma) and K steps of 256 (here "
                f"{min(config.block_k, d)} and {min(config.block_k, inter)})")
    refusal = weights.fragments and fragment_tiles_refusal(config.block_n, config.block_k, d, inter)
    block_up = min(config.block_n, (1 + config.paired) * inter)
    if not refusal and config.paired and block_up % (2 * FRAGMENT_ROWS):
        refusal = f"paired tiles of a multiple of {2 * FRAGMENT_ROWS} rows (here {block_up})"
    return f"experts in the fragment order need {refusal}" if refusal else None


def launch_stages(x: torch.Tensor, groups, route_weights: torch.Tensor, weights: ExpertWeights, limit: float,
                  config: LaunchConfig, buffers: StageBuffers, kernels=("up", "swiglu", "down")) -> dict:
    """The stage's kernels alone (gate/up, SwiGLU, down; `kernels` picks some, for benchmarks of
    one): x [R, d] bf16, `groups` from `group_picks`, flat routing weights [R * k]; fills
    `buffers`. Returns the compiled gate/up and down kernels launched ({"up": ..., "down": ...};
    None under the interpreter), for their resources.

    With `LaunchConfig.pdl` the SwiGLU and down kernels are programmatic dependent launches
    (NVIDIA, Hopper on). gate/up lets SwiGLU launch once all its programs have started, and
    SwiGLU waits (`griddepcontrol.wait`) for gate/up to finish before reading gate/up; SwiGLU
    lets down launch at once, and down reads its group (written before gate/up was launched, by
    an ordinary launch) and loads its first weight tile, then waits for SwiGLU before reading h.
    A dependent of a dependent does not start before the first kernel has finished
    (`tests/pdl_probe.py` on the H200), so down overlaps SwiGLU, not gate/up. gate/up itself is
    an ordinary launch: the stage starts after whatever came before it, as without.

    With `LaunchConfig.paired` one kernel (`_paired_up`) computes gate, up and the SwiGLU, and
    down (with pdl, its direct dependent) follows it: two launches. With `LaunchConfig.down_split`
    S, down's grid has S slices of the intermediate, each writing its partial sums to
    `buffers.per_pick[s]`; `routed_experts` adds them in slice order. With `LaunchConfig.up_split`
    U the paired kernel's grid has U slices of each block (adjacent in launch order), which store
    their partial sums in `buffers.gate_up` and count themselves in `buffers.arrivals`; the last
    of a block sums them and goes on (`_split_sums`). `LaunchConfig.diagonal` changes no launch:
    each task of one or two rows takes the diagonal loop (module docstring).

    With `LaunchConfig.overlap` (paired) both grids run group by group (a group's blocks adjacent
    in launch order) and down's tasks wait for their own group instead of for the whole gate/up
    kernel: each gate/up task publishes its h block with a release increment of its group's
    counter in `buffers.ready` (zeroed here first), and a down task polls that counter (bounded,
    acquire: `sync.wait_at_least`) until all the group's gate/up tasks are in, so down's tasks of
    early groups run in the slots gate/up's last wave leaves idle. No deadlock: down launches
    only once every gate/up program has started (pdl), or after gate/up ends (no pdl). A wait that
    gives up (a bug) records itself in `buffers.ready[-1]` and leaves NaN in the task's outputs.
    Down launched without gate/up (`kernels`, for a benchmark of down alone) does not wait."""
    refusal = launch_refusal(config, weights)
    if refusal:
        raise ValueError(refusal)
    d, inter = weights.hidden, weights.intermediate
    block_up, block_down = min(config.block_n, (1 + config.paired) * inter), min(config.block_n, d)
    order, experts, counts = groups
    picks = order.numel()
    meta = dict(ROWS_=ROWS, FAST=config.fast, num_warps=config.num_warps,
                num_stages=config.num_stages)
    if config.max_registers:
        meta["maxnreg"] = config.max_registers
    up_meta = dict(BN=block_up, BK=min(config.block_k, d), **meta)
    down_meta = dict(BN=block_down, BK=min(config.block_k, inter), **meta)
    # not the paired kernel's (fragments, pointers only)
    layout = dict(TMA=config.tma, FRAG=weights.fragments, DIAG=config.diagonal)
    w1, w2, w3 = (codes_operand(m, weights.fragments, config.tma, meta["BN"], meta["BK"]) for m, meta in
                  ((weights.w1, up_meta), (weights.w2, down_meta), (weights.w3, up_meta)))
    up_args = (x, buffers.gate_up, counts, order, experts, *w1, *w3, d, inter, picks // x.shape[0])
    down_args = (buffers.h, buffers.per_pick, counts, order, experts, *w2, d, inter)
    compiled = {}
    dependent = {"launch_pdl": True} if config.pdl else {}  # a Triton launch option: NVIDIA only
    if "up" in kernels:
        if config.paired:
            if config.overlap:
                buffers.ready.zero_()
            blocks = config.up_split * 2 * inter // block_up  # slices of a block adjacent
            grid = (blocks, picks) if config.overlap else (picks, blocks)
            compiled["up"] = _paired_up[grid](
                x, buffers.h, route_weights, counts, order, experts, *w1, *w3, d, inter, picks // x.shape[0],
                float(limit), buffers.ready, buffers.gate_up, buffers.arrivals, PDL=config.pdl, READY=config.overlap,
                DIAG=config.diagonal, SPLIT=config.up_split, **up_meta)
        elif config.programs:
            compiled["up"] = _up_persistent[(config.programs,)](picks, *up_args, **layout, **up_meta)
        else:
            compiled["up"] = _up[(picks, inter // block_up, 2)](*up_args, PDL=config.pdl, **layout, **up_meta)
    if "swiglu" in kernels and not config.paired:
        swiglu_block = min(1024, inter)
        _swiglu[(picks, inter // swiglu_block)](buffers.gate_up, route_weights, buffers.h, inter, float(limit),
                                                BLOCK=swiglu_block, FAST=config.fast, PDL=config.pdl, **dependent)
    if "down" in kernels:
        if config.programs:
            compiled["down"] = _down_persistent[(config.programs,)](picks, *down_args, **layout, **down_meta)
        else:
            grid = (d // block_down, picks) if config.overlap else (picks, d // block_down)
            compiled["down"] = _down[grid + (config.down_split,)](
                *down_args, buffers.ready, 2 * inter // block_up, buffers.ready[picks:], PDL=config.pdl,
                SPLIT=config.down_split, GROUPED=config.overlap, READY=config.overlap and "up" in kernels, **layout,
                **down_meta, **dependent)
    return compiled


def codes_operand(matrix: tuple[torch.Tensor, torch.Tensor], fragments: bool, tma: bool, block_n: int,
                  block_k: int):
    """(codes, scales) as the kernels take them: the stacked codes [E, N, K / 2], or in the
    fragment order (`fragments`) their 16-bit halves [E, N, K / 4] int16 (a view), or (tma) a
    tensor descriptor: of the codes viewed as [E * N, K / 2] in tiles of block_n rows and block_k
    columns of weights, or of the halves viewed as the fragment order's blocks [E * N / 16, K / 128,
    2, 256] in [block_n / 16, block_k / 128, 2, 256] (the same tile)."""
    codes, scales = matrix
    codes = codes.view(torch.int16) if fragments else codes
    if not tma:
        return codes, scales
    from triton.tools.tensor_descriptor import TensorDescriptor

    experts, n, width = codes.shape
    if fragments:  # [row bands, 128-column groups, a, (i, 32 halves)]: a tile is whole blocks
        blocks = codes.view(experts * n // 16, width // 32, 2, 256)
        return TensorDescriptor.from_tensor(blocks, [block_n // 16, block_k // 128, 2, 256]), scales
    return TensorDescriptor.from_tensor(codes.view(experts * n, width), [block_n, block_k // 2]), scales


def reference(x: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, weights: ExpertWeights,
              limit: float) -> torch.Tensor:
    """float64 reference of `routed_experts`, from the same MXFP4 weights (dequantized exactly),
    with the same bf16 rounding of the weighted SwiGLU output."""
    experts = unprepare(weights)
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for row in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[row, slot])
            if e < 0:
                continue
            w1, w2, w3 = (formats.dequantize_mxfp4(*experts[e][m], dtype=torch.float64) for m in range(3))
            xr = x[row].double()
            gate, up = (w1 @ xr).clamp(max=limit), (w3 @ xr).clamp(-limit, limit)
            h = (torch.nn.functional.silu(gate) * up * float(route_weights[row, slot])).to(torch.bfloat16)
            y[row] += w2 @ h.double()
    return y
