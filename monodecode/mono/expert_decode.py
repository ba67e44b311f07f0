"""The MXFP4 decode of the expert kernels: fragment-order codes to weights, in registers.

A register of two 16-bit halves of the fragment order (`fragments.py`) holds 8 e2m1 codes, 4 of
each half. Two decodes, chosen by the constexpr FAST:
- FAST (NVIDIA): a PTX block (`_decode_halves_fast`, generated from the layout's table
  `fragments.fragment_code_masks`) places each code's bits in a bf16 with one byte swap, 3 shifts
  and 5 masks: sign to bit 15, exponent and mantissa to bits 8..6, which is the e2m1 value times
  2^-126 (the e2m1 subnormal 0.5 lands on a bf16 subnormal, exact). The decode is elementwise (a
  result depends on its own half only), so it is right however Triton pairs the halves into
  registers. The 2^126 is folded into the block scale (`block_scales`): 2^(e - 127) * 2^126 must be
  a normal bf16, so scale codes are limited to [2, 128] (`experts.FAST_SCALE_CODES`; real weights
  are far inside, and the kernels' builder checks it).
- Portable (Triton's interpreter, AMD): the same byte swap, shifts and masks in plain Triton, the
  code then decoded arithmetically to fp32 and the scale applied in fp32 (the interpreter flushes
  bf16 subnormals, which the bit placement needs).
Both give the same weights up to the factor 2^-126.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fragments import fragment_code_masks

@triton.jit
def _e2m1_value(nibble):
    """A 4-bit e2m1 code (int32) -> its value (fp32), arithmetically."""
    exponent = (nibble >> 1) & 3
    mantissa = (nibble & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                         (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


def _halves_decode_asm() -> str:
    """PTX of `_decode_halves_fast`, from the layout's ways and masks (`fragments.fragment_code_masks`):
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
    a shift and a mask a code (code 3: two masks), two halves at a time (`fragments.py`)."""
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
def block_scales(scale_codes, FAST: tl.constexpr):
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
def decode_fragments(halves, scale_codes, BK: tl.constexpr, FAST: tl.constexpr, SCALED: tl.constexpr = True):
    """Fragment halves from `experts.load_fragments` decoded, with their scales if SCALED (codes
    [BN, 4, BK / 32]: a row's once for each lane t, as `load_fragments` has them): [BN, BK] in the
    natural K order. Half (g, t, m, r) of the tile holds codes 2s + q, columns
    g*128 + m*32 + s*16 + q*8 + 2t + r (`fragments.py`): a code of halves r = 0 and
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
        scale = tl.permute(tl.reshape(block_scales(scale_codes.to(tl.int32), FAST), (BN, 4, G, 4)), (0, 2, 1, 3))
        w = w * tl.reshape(scale, (BN, G, 4, 4, 1, 1, 1))  # a scale per (g, m): 32 columns
    return tl.reshape(tl.permute(w, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))  # (n, g, m, s, q, t, r): column order

