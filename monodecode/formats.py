"""Quantized weight formats of DeepSeek-V4 checkpoints: reference encode/decode.

This module is the bit-level reference for the kernels; everything below is
exact (no tolerance) unless stated.

E8M0 scale (``torch.float8_e8m0fnu``)
    One unsigned byte ``c``, no sign, no mantissa. ``c`` in 0..254 encodes
    ``2**(c - 127)`` (so 2^-127 .. 2^127; code 0 is 2^-127, which is a float32
    subnormal, not zero). ``c == 255`` is NaN. There is no zero and no infinity.

FP8 E4M3 (``torch.float8_e4m3fn``)
    Sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0. Exponent 0
    encodes subnormals ``m/8 * 2^-6``; otherwise ``(1 + m/8) * 2^(e-7)``. No
    infinities; ``0x7F``/``0xFF`` are NaN, so the largest finite value is
    ``0x7E`` = 448. ``0x80`` is -0.

FP8 block format (``quantize_fp8_block``)
    A 2-D weight ``[R, C]`` is cut into blocks of ``b0`` rows x ``b1`` columns
    (default 128 x 128, DeepSeek-V4's; DeepSeek-V4.1's dense weights use
    32 x 32, and its Engram tables 1 x 32: one scale per 32 values of a row),
    starting at the top-left; the last block row/column may be partial. Tensors: ``q`` float8_e4m3fn ``[R, C]`` and ``scale``
    float8_e8m0fnu ``[ceil(R/b0), ceil(C/b1)]``. Value:
    ``w[i, j] = q[i, j] * scale[i // b0, j // b1]``.
    Encoding (the DeepSeek reference's UE8M0 rule):
    ``amax = max(max|w| over the block in fp32, 1e-4)``,
    ``scale = 2^ceil(log2(amax / 448))`` (rounded up, so ``|w| / scale <= 448``),
    ``q = RNE_e4m3(clamp(w / scale, -448, 448))``; the sign of zero is kept
    (a negative value that rounds to zero gives -0, ``0x80``).

E2M1 (FP4)
    4-bit code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
    Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are their
    negatives (code 8 is -0). Largest magnitude 6; no NaN, no infinity.

MXFP4 (``quantize_mxfp4``)
    A weight ``[..., K]`` with ``K % 32 == 0``. Tensors: ``packed`` uint8
    ``[..., K/2]`` (checkpoints store the same bytes as int8) and ``scale``
    float8_e8m0fnu ``[..., K/32]``. Byte ``i`` of a row holds element ``2i``
    in its LOW nibble and element ``2i+1`` in its HIGH nibble. Value:
    ``w[..., k] = E2M1_VALUES[code[..., k]] * scale[..., k // 32]``.
    Encoding: ``amax = max(max|w| over the 32-group in fp32, 6 * 2^-126)``,
    ``scale = 2^ceil(log2(amax / 6))``, code = the e2m1 value nearest to
    ``w / scale``, ties to the code with mantissa bit 0 (so 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating
    at 6; the sign bit is copied from ``w`` (a negative value that rounds to
    zero gives code 8, -0). The amax floor makes the smallest scale 2^-126,
    the smallest one that is a normal float32 (kernels that flush subnormals
    to zero still see a nonzero scale), and gives an all-zero group a finite
    scale.

Both scale rules divide amax by 448 or 6 in float32 before rounding up to a
power of two. That division is safe: for these divisors a float32 ``amax``
slightly above ``d * 2^k`` gives a quotient at least 0.57 ulp above ``2^k``,
which cannot round down onto ``2^k``, so the float32 quotient is above a
power of two exactly when the true quotient is.
"""

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0

_FP8_AMAX_FLOOR = 1e-4
_MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126
_MXFP4_GROUP = 32
_QUANT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Boundaries between adjacent e2m1 magnitudes, with whether a value exactly
# on the boundary goes UP. Ties go to the neighbour whose mantissa bit is 0:
# codes 0, 2, 4, 6 are "even", so a tie goes to the value 0, 1, 2 or 4.
_E2M1_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))


def e8m0_to_float(scale: Tensor) -> Tensor:
    """float32 value of E8M0 codes (float8_e8m0fnu, or uint8 raw codes)."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"e8m0 scale must be float8_e8m0fnu or uint8, found {scale.dtype}")
    code = scale.view(torch.uint8).to(torch.int32)
    # Codes 1..254 are float32 normals: the code is exactly the float32
    # exponent field. Code 0 (2^-127) is the float32 subnormal with only the
    # top mantissa bit set; 255 is NaN.
    bits = torch.where(code == 0, 0x00400000, code << 23)
    bits = torch.where(code == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def float_to_e8m0_ceil(x: Tensor) -> Tensor:
    """Smallest power of two >= x as float8_e8m0fnu, clamped to 2^-127..2^127.

    Defined for x >= 0 (zero clamps to 2^-127, +inf to 2^127).
    """
    if not x.is_floating_point():
        raise ValueError(f"float_to_e8m0_ceil needs a floating tensor, found {x.dtype}")
    if bool((torch.isnan(x) | (x < 0)).any()):
        raise ValueError("float_to_e8m0_ceil needs non-negative, non-NaN input")
    # frexp is exact: x = m * 2^e with 0.5 <= m < 1, so x is a power of two
    # exactly when m == 0.5 (then x = 2^(e-1)); otherwise the ceiling is 2^e.
    mantissa, exponent = torch.frexp(x)
    exponent = exponent - (mantissa == 0.5).to(torch.int32)
    code = (exponent + 127).clamp(0, 254)
    # frexp does not give usable exponents for 0 and inf.
    code = torch.where(x == 0, 0, code)
    code = torch.where(torch.isinf(x), 254, code)
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)


def _check_quant_input(w: Tensor) -> None:
    # Other dtypes are refused rather than converted: float64 -> float32 would
    # round once before the final rounding (double rounding).
    if w.dtype not in _QUANT_INPUT_DTYPES:
        raise ValueError(f"weight dtype must be float32, bfloat16 or float16, found {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight contains non-finite values (inf or NaN)")


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block must be two positive ints, found {block!r}")
    return block[0], block[1]


def _block_grid(shape, block) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _expand_blocks(s: Tensor, shape, block) -> Tensor:
    """Repeat each per-block value over its block, cropped to `shape`."""
    return s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def quantize_fp8_block(w: Tensor, block=(128, 128)) -> tuple[Tensor, Tensor]:
    """2-D float -> (q float8_e4m3fn [R, C], scale float8_e8m0fnu [ceil(R/b0), ceil(C/b1)])."""
    if w.dim() != 2:
        raise ValueError(f"fp8 block quantization needs a 2-D weight, found shape {tuple(w.shape)}")
    block = _check_block(block)
    _check_quant_input(w)
    rows, cols = w.shape
    nb0, nb1 = _block_grid(w.shape, block)
    wf = w.float()
    # Zero padding to whole blocks does not change max|w|.
    padded = torch.nn.functional.pad(wf.abs(), (0, nb1 * block[1] - cols, 0, nb0 * block[0] - rows))
    amax = padded.view(nb0, block[0], nb1, block[1]).amax(dim=(1, 3))
    scale = float_to_e8m0_ceil(amax.clamp_min(_FP8_AMAX_FLOOR) / FP8_E4M3_MAX)
    # Division by a power of two is exact, so the cast does the only rounding
    # (RNE). The clamp guarantees saturation whatever the cast does on overflow.
    scaled = wf / _expand_blocks(e8m0_to_float(scale), w.shape, block)
    q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_block(q: Tensor, scale: Tensor, block=(128, 128), dtype=torch.bfloat16) -> Tensor:
    """q.float() * the scale of its block, cast to dtype."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 q must be float8_e4m3fn, found {q.dtype}")
    if q.dim() != 2:
        raise ValueError(f"fp8 block dequantization needs a 2-D q, found shape {tuple(q.shape)}")
    block = _check_block(block)
    expected = _block_grid(q.shape, block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape mismatch: expected {expected} for q {tuple(q.shape)} "
                         f"and block {block}, found {tuple(scale.shape)}")
    return (q.float() * _expand_blocks(e8m0_to_float(scale), q.shape, block)).to(dtype)


def _encode_e2m1(y: Tensor) -> Tensor:
    """float32 (already divided by its scale) -> e2m1 codes as uint8."""
    magnitude = y.abs()
    # The code of a magnitude is the number of boundaries it lies above; a
    # magnitude above 5 gets code 7 (6.0), which is the saturation.
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for boundary, tie_goes_up in _E2M1_BOUNDARIES:
        code += (magnitude >= boundary) if tie_goes_up else (magnitude > boundary)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [..., K] -> (packed uint8 [..., K/2], scale float8_e8m0fnu [..., K/32])."""
    k = w.shape[-1] if w.dim() else None
    if k is None or k == 0 or k % _MXFP4_GROUP != 0:
        raise ValueError(f"mxfp4 needs the last dim K to be a positive multiple of {_MXFP4_GROUP}, found K={k}")
    _check_quant_input(w)
    groups = w.float().reshape(*w.shape[:-1], -1, _MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale = float_to_e8m0_ceil(amax.clamp_min(_MXFP4_AMAX_FLOOR) / E2M1_MAX)
    # Exact: division by a power of two (results that underflow are far below
    # the first rounding boundary 0.25 and keep their sign).
    code = _encode_e2m1(groups / e8m0_to_float(scale).unsqueeze(-1)).reshape(w.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, scale


def unpack_e2m1(packed: Tensor) -> Tensor:
    """uint8/int8 [..., N] -> e2m1 codes uint8 [..., 2N] (low nibble first)."""
    if packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"packed e2m1 must be uint8 or int8, found {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed e2m1 must have at least one dimension")
    p = packed.view(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype=torch.bfloat16) -> Tensor:
    """(packed [..., K/2], scale [..., K/32]) -> dtype [..., K]."""
    code = unpack_e2m1(packed)
    k = code.shape[-1]
    if k == 0 or k % _MXFP4_GROUP != 0:
        raise ValueError(f"mxfp4 needs K = 2 * packed.shape[-1] to be a positive multiple of {_MXFP4_GROUP}, "
                         f"found K={k}")
    expected = (*code.shape[:-1], k // _MXFP4_GROUP)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape mismatch: expected {expected} for packed {tuple(packed.shape)}, "
                         f"found {tuple(scale.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    values = lut[code.int()].view(*expected, _MXFP4_GROUP)
    return (values * e8m0_to_float(scale).unsqueeze(-1)).reshape(code.shape).to(dtype)
