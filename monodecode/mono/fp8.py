"""FP8 in the dense GEMVs' K steps (`gemv.py`): the portable decode of e4m3 and E8M0 codes from
their bits, and x split into two e4m3 parts for FP8 tensor-core dots.

- `e4m3_value`: e4m3fn codes -> fp32, exact for all 256 codes (subnormals; 0x7F / 0xFF NaN),
  for the interpreter and AMD, which have no fp8 type to bitcast to.
- `e8m0_value`: an E8M0 scale code -> 2^(code - 127), exact (`formats.e8m0_to_float`).
- `e4m3_pair`: a bf16 tile [BR, BK] as (hi, lo, down) with x = (hi + lo) * down a row; rounding
  and exactness in its docstring. NVIDIA only (FAST).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_value(code):
    """e4m3fn codes (int32, 0..255) -> their values (fp32), from the bits: exact for all codes."""
    exponent = (code >> 3) & 15
    mantissa = code & 7
    # Normal: the fp32 with the same mantissa (its 3 top bits) and exponent e - 7 + 127.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # m/8 * 2^-6
    value = tl.where((code & 0x80) != 0, -magnitude, magnitude)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e8m0_value(code):
    """An E8M0 scale code (int32) -> 2^(code - 127) (fp32) from its bits; code 0 is the fp32
    subnormal 2^-127, 255 NaN (as `formats.e8m0_to_float`)."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_pair(x):
    """x [BR, BK] (bf16) as two e4m3 tiles and a power of two a row: x = (hi + lo) * down. Each
    row is scaled so that its largest magnitude lies in [128, 256) (e4m3 reaches 448); hi is that
    rounded to e4m3 (4 significant bits), lo the remainder rounded to e4m3. A bf16 has 8
    significant bits, so the remainder has at most 4 and lo is exact down to e4m3's subnormal
    step: every element within 2^-10 of its row's largest magnitude is split exactly, smaller ones
    within 2^-17 of it. A row holding an infinity gets down = NaN, one holding a NaN keeps it in hi:
    all its outputs are NaN."""
    xs = x.to(tl.float32)
    e = tl.max(tl.abs(xs), axis=1).to(tl.int32, bitcast=True) >> 23  # the biased exponent of each row's largest
    e_scaled = tl.maximum(e, 8)  # an all-zero row (the padding) keeps both scales normal numbers
    up = ((261 - e_scaled) << 23).to(tl.float32, bitcast=True)  # 2^(134 - e): the largest into [2^7, 2^8)
    down = tl.where(e == 255, float("nan"), ((e_scaled - 7) << 23).to(tl.float32, bitcast=True))  # 1 / up
    xs = xs * up[:, None]
    hi = xs.to(tl.float8e4nv)  # rounded to nearest even
    lo = (xs - hi.to(tl.float32)).to(tl.float8e4nv)  # (the difference is exact in fp32)
    return hi, lo, down
