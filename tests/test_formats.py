"""Exact tests of monodecode.formats against independent float64 references."""

import math

import numpy as np
import pytest
import torch

from monodecode import formats

E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn


# ---------------------------------------------------------------- references
# Written from the format definitions, without using the module under test.

def e4m3_grid() -> np.ndarray:
    """Non-negative finite e4m3 values, index = code (0..126)."""
    values = []
    for code in range(127):
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(values)


E4M3_GRID = e4m3_grid()
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # index = code 0..7


def ref_round_codes(x: np.ndarray, grid: np.ndarray, sign_bit: int) -> np.ndarray:
    """float64 -> codes: nearest grid magnitude, ties to the even code (mantissa
    bit 0), saturating at the grid maximum, sign bit copied from x."""
    a = np.minimum(np.abs(x).reshape(-1), grid[-1])
    dist = np.abs(a[:, None] - grid[None, :])
    candidates = dist == dist.min(axis=1, keepdims=True)
    even = candidates & (np.arange(len(grid)) % 2 == 0)[None, :]
    index = np.where(even.any(axis=1), even.argmax(axis=1), candidates.argmax(axis=1))
    codes = index + sign_bit * np.signbit(x.reshape(-1))
    return codes.reshape(x.shape)


def ref_pow2_exponent(amax: float, divisor: float) -> int:
    """Smallest k with divisor * 2^k >= amax (exact comparisons in float64)."""
    k = math.frexp(amax / divisor)[1]
    while math.ldexp(divisor, k - 1) >= amax:
        k -= 1
    while math.ldexp(divisor, k) < amax:
        k += 1
    return k


def ref_quantize_fp8_block(w: torch.Tensor, block):
    """-> (uint8 codes [R, C], e8m0 codes [nb0, nb1]) as numpy arrays."""
    x = w.double().numpy()
    rows, cols = x.shape
    nb0, nb1 = -(-rows // block[0]), -(-cols // block[1])
    codes = np.zeros(x.shape, dtype=np.int64)
    scale_codes = np.zeros((nb0, nb1), dtype=np.int64)
    for i in range(nb0):
        for j in range(nb1):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            amax = max(float(np.abs(x[sl]).max()), 1e-4)
            k = ref_pow2_exponent(amax, 448.0)
            scale_codes[i, j] = k + 127
            codes[sl] = ref_round_codes(x[sl] / 2.0 ** k, E4M3_GRID, 0x80)
    return codes, scale_codes


def ref_quantize_mxfp4(w: torch.Tensor):
    """-> (e2m1 codes [..., K], e8m0 codes [..., K/32]) as numpy arrays."""
    x = w.double().numpy()
    groups = x.reshape(-1, 32)
    codes = np.zeros(groups.shape, dtype=np.int64)
    scale_codes = np.zeros(len(groups), dtype=np.int64)
    for g in range(len(groups)):
        amax = max(float(np.abs(groups[g]).max()), 6.0 * 2.0 ** -126)
        k = ref_pow2_exponent(amax, 6.0)
        scale_codes[g] = k + 127
        codes[g] = ref_round_codes(groups[g] / 2.0 ** k, E2M1_GRID, 8)
    return codes.reshape(x.shape), scale_codes.reshape(*x.shape[:-1], -1)


def pack_low_first(codes: np.ndarray) -> np.ndarray:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().astype(np.int64)


def random_magnitude_rows(gen, rows, cols, lo_exp, hi_exp):
    """Normal data whose rows have magnitudes 10^U(lo_exp, hi_exp)."""
    mags = 10.0 ** (lo_exp + (hi_exp - lo_exp) * torch.rand(rows, 1, generator=gen, dtype=torch.float64))
    return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * mags).float()


# ---------------------------------------------------------------- constants

def test_constants():
    assert formats.FP8_E4M3_MAX == 448.0
    assert formats.E2M1_MAX == 6.0
    assert formats.E2M1_VALUES == (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)
    assert math.copysign(1.0, formats.E2M1_VALUES[8]) == -1.0


# ---------------------------------------------------------------- E8M0

def test_e8m0_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for raw in (codes, codes.view(E8M0)):
        out = formats.e8m0_to_float(raw)
        assert out.dtype == torch.float32
        for c in range(255):
            assert out[c].item() == 2.0 ** (c - 127), c
        assert math.isnan(out[255].item())


def test_e8m0_decode_matches_torch_cast():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E8M0)
    ours, theirs = formats.e8m0_to_float(codes), codes.float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    finite = ~torch.isnan(ours)
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))


def test_e8m0_decode_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float8_e8m0fnu or uint8"):
        formats.e8m0_to_float(torch.ones(3))


def _ceil_codes(x):
    return formats.float_to_e8m0_ceil(x).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype,k_range", [(torch.float32, range(-149, 128)),
                                           (torch.float64, range(-160, 160))])
def test_float_to_e8m0_ceil_around_powers_of_two(dtype, k_range):
    ks = list(k_range)
    x = torch.tensor([2.0 ** k for k in ks], dtype=dtype)
    up = torch.nextafter(x, torch.tensor(math.inf, dtype=dtype))
    down = torch.nextafter(x, torch.tensor(0.0, dtype=dtype))
    clamp = lambda c: min(max(c, 0), 254)  # noqa: E731
    assert _ceil_codes(x) == [clamp(k + 127) for k in ks]
    assert _ceil_codes(up) == [clamp(k + 128) for k in ks]
    # just below 2^k (and above 2^(k-1)) the ceiling is still 2^k
    assert _ceil_codes(down[1:]) == [clamp(k + 127) for k in ks[1:]]


def test_float_to_e8m0_ceil_bfloat16():
    ks = list(range(-126, 128))
    x = torch.tensor([2.0 ** k for k in ks], dtype=torch.bfloat16)
    assert _ceil_codes(x) == [k + 127 for k in ks]
    assert _ceil_codes(x * (1 + 2.0 ** -7)) == [min(k + 128, 254) for k in ks]
    assert _ceil_codes(x * (1 - 2.0 ** -8)) == [k + 127 for k in ks]


def test_float_to_e8m0_ceil_random_and_edges():
    gen = torch.Generator().manual_seed(11)
    x = torch.exp2(torch.rand(5000, generator=gen, dtype=torch.float64) * 275 - 148).float()
    expected = [min(max(ref_pow2_exponent(v, 1.0) + 127, 0), 254) for v in x.double().tolist()]
    assert _ceil_codes(x) == expected
    assert _ceil_codes(torch.tensor([0.0, math.inf, 3.0, 0.75])) == [0, 254, 129, 127]
    for bad in (torch.tensor([1.0, -2.0]), torch.tensor([math.nan])):
        with pytest.raises(ValueError, match="non-negative"):
            formats.float_to_e8m0_ceil(bad)


# ---------------------------------------------------------------- FP8 block

def _random_scale_codes(gen, shape, lo, hi):
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("block", [(5, 7), (16, 16), (3, 1)])
def test_fp8_dequantize_every_code(block):
    gen = torch.Generator().manual_seed(21)
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).reshape(16, 16)
    grid = (-(-16 // block[0]), -(-16 // block[1]))
    scale = _random_scale_codes(gen, grid, 100, 150)
    decoded = q.float()  # torch's own e4m3 -> float32
    expected = torch.empty(16, 16)
    for i in range(16):
        for j in range(16):
            s = 2.0 ** (int(scale[i // block[0], j // block[1]]) - 127)
            expected[i, j] = decoded[i, j].item() * s
    out = formats.dequantize_fp8_block(q, scale.view(E8M0), block, dtype=torch.float32)
    assert int(torch.isnan(out).sum()) == 2  # codes 0x7F and 0xFF
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    out_bf16 = formats.dequantize_fp8_block(q, scale.view(E8M0), block)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16, expected.bfloat16(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype,k_lo,k_hi", [(torch.float32, -20, 20), (torch.bfloat16, -20, 20),
                                             (torch.float16, -5, 5)])
@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((64, 48), (16, 32))])
def test_fp8_round_trip_is_bit_exact(dtype, k_lo, k_hi, shape, block):
    gen = torch.Generator().manual_seed(31)
    rows, cols = shape
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    codes = torch.where(codes & 0x7F == 0x7F, codes ^ 1, codes)  # NaN -> +-448
    nb0, nb1 = -(-rows // block[0]), -(-cols // block[1])
    exps = torch.randint(k_lo, k_hi + 1, (nb0, nb1), generator=gen)
    w = torch.empty(shape, dtype=torch.float64)
    for i in range(nb0):
        for j in range(nb1):
            r0, c0 = i * block[0], j * block[1]
            r1, c1 = min(r0 + block[0], rows), min(c0 + block[1], cols)
            # One magnitude in (224, 448] (codes 0x77..0x7E) fixes the scale to 2^k.
            r = int(torch.randint(r0, r1, (), generator=gen))
            c = int(torch.randint(c0, c1, (), generator=gen))
            codes[r, c] = int(torch.randint(0x77, 0x7F, (), generator=gen)) | (0x80 * (r % 2))
            q = codes[r0:r1, c0:c1].to(torch.uint8).view(E4M3).double()
            w[r0:r1, c0:c1] = q * 2.0 ** int(exps[i, j])
    w = w.to(dtype)
    q, scale = formats.quantize_fp8_block(w, block)
    assert q.dtype == E4M3 and q.shape == shape
    assert scale.dtype == E8M0 and scale.shape == (nb0, nb1)
    assert np.array_equal(bytes_of(q), codes.numpy())
    assert np.array_equal(bytes_of(scale), (exps + 127).numpy())
    back = formats.dequantize_fp8_block(q, scale, block, dtype=torch.float32)
    assert torch.equal(back, w.float())


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((50, 33), (7, 5)),
                                         ((129, 257), (128, 128))])
@pytest.mark.parametrize("lo_exp,hi_exp", [(-8, 8), (-7, -5), (0, 0), (20, 30)])
def test_fp8_quantize_matches_float64_reference(shape, block, lo_exp, hi_exp):
    gen = torch.Generator().manual_seed(41 + lo_exp)
    w = random_magnitude_rows(gen, *shape, lo_exp, hi_exp)
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        q, scale = formats.quantize_fp8_block(x, block)
        ref_codes, ref_scale = ref_quantize_fp8_block(x, block)
        assert np.array_equal(bytes_of(scale), ref_scale)
        assert np.array_equal(bytes_of(q), ref_codes)


def test_fp8_quantize_ties_round_to_even():
    gen = torch.Generator().manual_seed(51)
    k = int(torch.randint(-10, 11, (), generator=gen))
    midpoints = (E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2  # 126 ties, incl. subnormal ones
    values = np.concatenate([[448.0], midpoints, -midpoints, [-448.0, 0.0, -0.0]]).reshape(16, 16)
    signs = np.where(torch.rand(16, 16, generator=gen).numpy() < 0.5, -1.0, 1.0)
    signs[0, 0] = 1.0
    w = torch.from_numpy(values * signs * 2.0 ** k).float()
    q, scale = formats.quantize_fp8_block(w, (16, 16))
    assert bytes_of(scale).tolist() == [[k + 127]]
    ref_codes, _ = ref_quantize_fp8_block(w, (16, 16))
    assert np.array_equal(bytes_of(q), ref_codes)
    # Hand-checked ties (the even code has mantissa bit 0): 1.0625 -> 1.0 (0x38),
    # 1.1875 -> 1.25 (0x3A), 2^-10 -> 0, 3 * 2^-10 -> 2^-8 (0x02),
    # 432 -> 448 (0x7E; 416 is the odd 0x7D), and the signs are kept.
    probes = torch.tensor([[448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 432.0, -1.0625, -2.0 ** -10]])
    q, _ = formats.quantize_fp8_block(probes * 2.0 ** k, (1, 8))
    assert bytes_of(q).tolist() == [[0x7E, 0x38, 0x3A, 0x00, 0x02, 0x7E, 0xB8, 0x80]]


def test_fp8_amax_floor():
    gen = torch.Generator().manual_seed(61)
    w = torch.randn(8, 8, generator=gen) * 1e-6  # amax < 1e-4
    _, scale = formats.quantize_fp8_block(w, (8, 8))
    # 1e-4 / 448 = 2.23e-7 -> 2^-22
    assert bytes_of(scale).tolist() == [[127 - 22]]


# ---------------------------------------------------------------- MXFP4

def test_e2m1_every_code_decodes_low_nibble_first():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    # element 2i in the low nibble, 2i+1 in the high nibble
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = torch.tensor([[codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)]], dtype=torch.uint8)
    assert packed[0, 0].item() == 0x10
    scale = torch.tensor([[127]], dtype=torch.uint8).view(E8M0)
    out = formats.dequantize_mxfp4(packed, scale, dtype=torch.float32)[0].tolist()
    assert out == [expected[c] for c in codes]
    assert [math.copysign(1.0, v) for v in out] == [math.copysign(1.0, expected[c]) for c in codes]
    assert formats.unpack_e2m1(packed)[0].tolist() == codes
    # a literal byte: 0x71 is element 0 = code 1 (0.5), element 1 = code 7 (6.0)
    literal = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)
    assert formats.dequantize_mxfp4(literal, scale, dtype=torch.float32)[0, :2].tolist() == [0.5, 6.0]


def test_mxfp4_quantize_packs_low_nibble_first():
    gen = torch.Generator().manual_seed(71)
    w = torch.rand(1, 32, generator=gen) * 0.2  # all round to code 0
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 0.5, 6.0, -1.0, 3.0
    packed, scale = formats.quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert bytes_of(scale).tolist() == [[127]]
    assert packed[0, :2].tolist() == [0x71, 0x5A]


@pytest.mark.parametrize("dtype,k_lo,k_hi", [(torch.float32, -126, 125), (torch.bfloat16, -126, 125),
                                             (torch.float16, -14, 12)])
def test_mxfp4_round_trip_is_bit_exact(dtype, k_lo, k_hi):
    gen = torch.Generator().manual_seed(81)
    shape = (2, 3, 256)
    codes = torch.randint(0, 16, shape, generator=gen).reshape(2, 3, 8, 32)
    # Each group gets a magnitude-6 value (code 7 or 15), so its scale is exactly 2^k.
    pos = torch.randint(0, 32, (2, 3, 8, 1), generator=gen)
    codes.scatter_(-1, pos, 7 + 8 * torch.randint(0, 2, (2, 3, 8, 1), generator=gen))
    exps = torch.randint(k_lo, k_hi + 1, (2, 3, 8), generator=gen)
    grid = torch.tensor(np.concatenate([E2M1_GRID, -E2M1_GRID]), dtype=torch.float64)
    w = (grid[codes] * torch.exp2(exps.double()).unsqueeze(-1)).reshape(shape).to(dtype)
    packed, scale = formats.quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 128)
    assert scale.dtype == E8M0 and scale.shape == (2, 3, 8)
    assert np.array_equal(bytes_of(scale), (exps + 127).numpy())
    assert np.array_equal(bytes_of(packed), pack_low_first(codes.reshape(shape).numpy()))
    assert torch.equal(formats.dequantize_mxfp4(packed, scale, dtype=torch.float32), w.float())
    # checkpoints store the bytes as int8
    assert torch.equal(formats.dequantize_mxfp4(packed.view(torch.int8), scale, dtype=torch.float32), w.float())


@pytest.mark.parametrize("lo_exp,hi_exp", [(-30, 30), (-1, 1), (-40, -37)])
def test_mxfp4_quantize_matches_float64_reference(lo_exp, hi_exp):
    gen = torch.Generator().manual_seed(91 + lo_exp)
    w = random_magnitude_rows(gen, 24, 256, lo_exp, hi_exp).reshape(4, 6, 256)
    w[0, 0, :32] = 0.0  # a zero group inside nonzero data
    w[0, 1, :32] = -0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        packed, scale = formats.quantize_mxfp4(x)
        ref_codes, ref_scale = ref_quantize_mxfp4(x)
        assert np.array_equal(bytes_of(scale), ref_scale)
        assert np.array_equal(bytes_of(packed), pack_low_first(ref_codes))
        assert bytes_of(scale)[0, 0, 0] == 1  # zero group: scale floor 2^-126
        assert (formats.unpack_e2m1(packed)[0, 1, :32] == 8).all()  # -0.0 keeps its sign


def test_mxfp4_ties_round_to_even():
    gen = torch.Generator().manual_seed(101)
    k = int(torch.randint(-20, 21, (), generator=gen))
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    tie_codes = [0, 2, 2, 4, 4, 6, 6]
    # values just off the ties, to check which side each comparison puts them
    near = [0.2, 0.3, 0.7, 0.8, 1.2, 1.3, 1.7, 1.8, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1]
    near_codes = [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7]
    values = [6.0] + ties + [-t for t in ties] + near + [-0.1, 0.0, -0.0]
    expected = [7] + tie_codes + [c | 8 for c in tie_codes] + near_codes + [8, 0, 8]
    w = torch.tensor(values, dtype=torch.float32) * 2.0 ** k
    w = w.reshape(1, 32)
    packed, scale = formats.quantize_mxfp4(w)
    assert bytes_of(scale).tolist() == [[k + 127]]
    assert formats.unpack_e2m1(packed)[0].tolist() == expected
    ref_codes, _ = ref_quantize_mxfp4(w)
    assert ref_codes[0].tolist() == expected


# ---------------------------------------------------------------- errors

def test_error_paths():
    gen = torch.Generator().manual_seed(111)
    w = torch.randn(64, 64, generator=gen)
    with pytest.raises(ValueError, match="K=48"):
        formats.quantize_mxfp4(torch.randn(4, 48, generator=gen))
    packed, scale = formats.quantize_mxfp4(w)
    with pytest.raises(ValueError, match=r"scale shape mismatch: expected \(64, 2\).*found \(64, 3\)"):
        formats.dequantize_mxfp4(packed, torch.ones(64, 3).to(E8M0))
    with pytest.raises(ValueError, match="K=16"):
        formats.dequantize_mxfp4(packed[:, :8], scale[:, :1])
    q, scale = formats.quantize_fp8_block(w, (32, 32))
    with pytest.raises(ValueError, match=r"expected \(2, 2\).*found \(1, 2\)"):
        formats.dequantize_fp8_block(q, scale[:1], (32, 32))
    with pytest.raises(ValueError, match="2-D"):
        formats.quantize_fp8_block(torch.randn(2, 64, 64, generator=gen))
    with pytest.raises(ValueError, match="2-D"):
        formats.quantize_fp8_block(torch.randn(64, generator=gen))
    with pytest.raises(ValueError, match="block"):
        formats.quantize_fp8_block(w, (0, 128))
    for bad in (math.inf, math.nan):
        w_bad = w.clone()
        w_bad[3, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            formats.quantize_fp8_block(w_bad)
        with pytest.raises(ValueError, match="non-finite"):
            formats.quantize_mxfp4(w_bad)
    with pytest.raises(ValueError, match="dtype"):
        formats.quantize_fp8_block(w.double())
