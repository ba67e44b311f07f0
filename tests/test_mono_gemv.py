"""The dense GEMV stage against the per-op path's bf16 products and a float64 product.

On the CPU the kernel runs under Triton's interpreter (the portable decode); with
MONODECODE_TEST_DEVICE=cuda it runs compiled, with the fast decode.
"""

import pytest
import torch
import torch.nn.functional as F

from monodecode import formats
from monodecode.mono import gemv as G
from monodecode.mono import gemv_tiles as T

ROWS = [1, 5, 16, 48]


def fp8_weight(g, n, k, sb):
    """A random [n, k] weight in the FP8 block format: (codes e4m3, scales e8m0, bf16 dequantized)."""
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # uneven blocks
    q, s = formats.quantize_fp8_block(w, (sb, sb))
    return q, s, formats.dequantize_fp8_block(q, s, (sb, sb), torch.bfloat16)


def activations(g, rows, width):
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp8_tensor_cores(y) -> bool:
    """Whether the FP8 GEMV that gave y split x into e4m3 parts for FP8 tensor-core dots (compiled,
    2-32 rows: `fp8.e4m3_pair`)."""
    return y.is_cuda and 1 < T.row_block(y.shape[0]) <= G.SPLIT_X_ROWS.value


def assert_matches_bf16(y, ref, exact, magnitude, fp8=True):
    """y (the kernel) and ref (bf16 F.linear) both round an fp32 sum of the same exact products
    to bf16; they can differ only where the two accumulation orders straddle a rounding boundary:
    by one bf16 ulp plus the fp32 accumulation error (K <= 256 terms: < 2^-16 of `magnitude`,
    sum |x| |w|). Observed at these sizes, CPU and H200: every element equal (rel L2 0); at
    4096 x 1024 on the H200, 99.98 % equal, rel L2 <= 2e-4, the kernel as close to float64 as
    the reference (ratio 1.0000). FP8 tensor-core dots (`fp8_tensor_cores`; `fp8`: the weights
    are FP8) add the tensor core's own accumulation error within a K step: observed on an H100
    at most 2^-14 of `magnitude` beyond the ulp, >= 93.5 % equal, rel L2 <= 2.1e-3, ratio <= 1.042
    (the 64-output tiles, whose dots are warp-group FP8 MMAs; narrower tiles get fp16 MMAs and
    match as in fp32)."""
    tensor_cores = fp8 and fp8_tensor_cores(y)
    y, ref = y.cpu().double(), ref.cpu().double()
    assert not torch.isnan(y).any()
    assert F.cosine_similarity(y.flatten(), ref.flatten(), dim=0) >= 0.99999
    assert rel_l2(y, ref) <= (3e-3 if tensor_cores else 2e-3)
    ulp = 2.0 ** (torch.frexp(ref.abs().clamp(min=1e-30))[1] - 8)  # one bf16 ulp at ref
    assert ((y - ref).abs() <= ulp + (2.0**-12 if tensor_cores else 2.0**-16) * magnitude).all()
    assert (y == ref).double().mean() >= (0.9 if tensor_cores else 0.95)
    assert rel_l2(y, exact) <= (1.06 if tensor_cores else 1.01) * rel_l2(ref, exact) + 1e-6


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, sb", [(32, 64, 32), (64, 64, 32), (256, 32, 32), (64, 128, 32), (256, 256, 128)])
def test_fp8_matches_per_op(device, rows, n, k, sb):
    g = torch.Generator().manual_seed(rows * 1000 + n + k + sb)
    q, s, w = fp8_weight(g, n, k, sb)
    x = activations(g, rows, k)
    y = G.gemv(x.to(device), q.to(device), s.to(device), poison=True)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    ref = F.linear(x.to(device), w.to(device))
    assert_matches_bf16(y, ref, x.double() @ w.double().T, x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", ROWS)
def test_fp8_largest_tiles(device, rows):
    """BN 64 x BK 128 (the default on a GPU picks smaller BN for these small N)."""
    g = torch.Generator().manual_seed(50 + rows)
    q, s, w = fp8_weight(g, 192, 256, 128)
    x = activations(g, rows, 256)
    y = G.gemv(x.to(device), q.to(device), s.to(device), block=(64, 128), poison=True)
    assert_matches_bf16(y, F.linear(x.to(device), w.to(device)), x.double() @ w.double().T,
                        x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", [1, 48])
@pytest.mark.parametrize("sb, bk", [(32, 64), (32, 128), (128, 256)])
def test_fp8_k_steps_longer_than_a_scale_block(device, rows, sb, bk):
    """BK a multiple of SB: each weight scaled in registers before the dot."""
    g = torch.Generator().manual_seed(60 + rows + bk)
    q, s, w = fp8_weight(g, 64, 512, sb)
    x = activations(g, rows, 512)
    y = G.gemv(x.to(device), q.to(device), s.to(device), block=(32, bk), poison=True)
    assert_matches_bf16(y, F.linear(x.to(device), w.to(device)), x.double() @ w.double().T,
                        x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", [6, 24])
def test_rows_of_very_different_sizes(device, rows):
    """Rows 2^-20 .. 2^20 in size, one with an entry 300 times its others, one holding an
    infinity: every finite row matches the per-op product at its own scale (the tensor-core path
    scales each row of a K step by its own power of two before splitting it into e4m3 parts), and
    the row with the infinity gives no finite output (as the per-op product does not)."""
    g = torch.Generator().manual_seed(700 + rows)
    q, s, w = fp8_weight(g, 256, 512, 128)
    x = torch.randn(rows, 512, generator=g) * 2.0 ** torch.linspace(-20, 20, rows)[:, None]
    x[1, 3] *= 300.0
    x[2, 100] = float("inf")
    x = x.to(torch.bfloat16)
    y = G.gemv(x.to(device), q.to(device), s.to(device), poison=True).cpu()
    assert not torch.isfinite(y[2]).any()
    for r in (r for r in range(rows) if r != 2):
        ref = F.linear(x[r:r + 1], w)
        assert torch.isfinite(y[r]).all()
        assert F.cosine_similarity(y[r].double(), ref[0].double(), dim=0) >= 0.99999, r
        assert rel_l2(y[r], ref[0]) <= 3e-3, r


@pytest.mark.parametrize("rows", [1, 48])
def test_fp8_fp32_output_is_exact_up_to_accumulation_order(device, rows):
    """fp32 out; N = 100 (a partial last scale block and a masked tail task), two k steps a
    scale block. Observed rel L2 ~3e-8 against float64."""
    g = torch.Generator().manual_seed(7 + rows)
    q, s, w = fp8_weight(g, 100, 256, 32)
    x = activations(g, rows, 256)
    y = G.gemv(x.to(device), q.to(device), s.to(device), block=(32, 16), out_dtype=torch.float32, poison=True)
    assert y.dtype == torch.float32
    assert rel_l2(y.cpu(), x.double() @ w.double().T) <= 1e-6


@pytest.mark.parametrize("rows", [2, 5, 48])
@pytest.mark.parametrize("split", [2, 3, 8])
def test_k_split_into_slices_matches_per_op(device, rows, split):
    """Each output block's K in `split` slices (1 to 4 K steps each; 3 does not divide the
    block count evenly over slices), summed in slice order by the last to arrive; N = 100: a
    masked tail block and a partial scale block. Same result however the slices are timed."""
    g = torch.Generator().manual_seed(400 + rows + split)
    q, s, w = fp8_weight(g, 100, 768, 32)
    x = activations(g, rows, 768)
    y = G.gemv(x.to(device), q.to(device), s.to(device), block=(32, 32), split=split, poison=True)
    assert_matches_bf16(y, F.linear(x.to(device), w.to(device)), x.double() @ w.double().T,
                        x.double().abs() @ w.double().abs().T)
    again = G.gemv(x.to(device), q.to(device), s.to(device), block=(32, 32), split=split)
    assert torch.equal(y, again)


@pytest.mark.parametrize("rows", [2, 48])
def test_k_split_fp32_output_and_bf16_weights(device, rows):
    """The router gate's form split along K: bf16 weights, fp32 logits (rel L2 ~3e-8 expected)."""
    g = torch.Generator().manual_seed(500 + rows)
    gate = (torch.randn(40, 256, generator=g) / 16).to(torch.bfloat16)
    x = activations(g, rows, 256)
    y = G.gemv(x.to(device), gate.to(device), block=(16, 32), split=4, out_dtype=torch.float32, poison=True)
    assert not torch.isnan(y).any()
    assert rel_l2(y.cpu(), F.linear(x.float(), gate.float())) <= 1e-6


@pytest.mark.parametrize("rows", ROWS)
def test_grouped_wo_a_matches_attention_output(device, rows):
    """Two groups of 32 output rows, each reading its own 128 columns of x [R, 256]; the
    reference is the einsum of `Attention.output` (o_groups = 2, o_lora_rank = 32)."""
    g = torch.Generator().manual_seed(100 + rows)
    groups, rank, per_group = 2, 32, 128
    q, s, w = fp8_weight(g, groups * rank, per_group, 32)
    x = activations(g, rows, groups * per_group)
    y = G.gemv(x.to(device), q.to(device), s.to(device), group_rows=rank, poison=True)
    out, wo_a = x.to(device), w.to(device)
    ref = torch.einsum("ngi,gri->ngr", out.reshape(rows, groups, -1), wo_a.view(groups, rank, -1)).flatten(1)
    exact, magnitude = (torch.einsum("ngi,gri->ngr", a.reshape(rows, groups, -1), b.view(groups, rank, -1)).flatten(1)
                        for a, b in ((x.double(), w.double()), (x.double().abs(), w.double().abs())))
    assert_matches_bf16(y, ref, exact, magnitude)
    if rows > 1:  # each group's 128 columns in 2 slices
        y = G.gemv(x.to(device), q.to(device), s.to(device), block=(32, 32), split=2, group_rows=rank, poison=True)
        assert_matches_bf16(y, ref, exact, magnitude)


@pytest.mark.parametrize("rows", ROWS)
def test_router_gate_bf16_weights_fp32_out(device, rows):
    """N = 8 (the test model's experts: one masked 16-row block); reference as `MoE.route`.
    Observed: rel L2 ~3e-8 (fp32 sums of the same exact products)."""
    g = torch.Generator().manual_seed(200 + rows)
    gate = (torch.randn(8, 64, generator=g) / 8).to(torch.bfloat16)
    x = activations(g, rows, 64)
    y = G.gemv(x.to(device), gate.to(device), out_dtype=torch.float32, poison=True)
    assert y.dtype == torch.float32 and y.shape == (rows, 8)
    ref = F.linear(x.float(), gate.float())
    assert not torch.isnan(y).any()
    assert rel_l2(y.cpu(), ref) <= 1e-6


@pytest.mark.parametrize("rows", ROWS)
def test_swiglu_of_gate_and_up_as_x_matches_shared_expert(device, rows):
    """The shared expert's w2 reading the SwiGLU of its gate and up (`up`, `limit`) against
    `MoE._swiglu` (gate and up from bf16 GEMVs, h rounded to bf16, then w2): gate and up are the
    halves of one [R, 2I] buffer, as in the kernels; values up to ~±20 exercise the clamp at 10.
    The CPU's h is the reference's bit for bit; the GPU's exp may tip an h a bf16 ulp."""
    g = torch.Generator().manual_seed(400 + rows)
    d, inter, limit = 64, 128, 10.0
    x = activations(g, rows, d)
    w1, w3 = ((torch.randn(inter, d, generator=g) * 0.8).to(torch.bfloat16) for _ in range(2))
    q, s, w2 = fp8_weight(g, d, inter, 32)
    gate, up = F.linear(x, w1), F.linear(x, w3)
    assert (torch.cat([gate, up]).float().abs() > limit).any()
    h = (F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)).to(torch.bfloat16)
    ref = F.linear(h, w2)
    gate_up = torch.cat([gate, up], dim=1).to(device)
    y = G.gemv(gate_up[:, :inter], q.to(device), s.to(device), up=gate_up[:, inter:], limit=limit, poison=True)
    if device == "cpu":
        assert_matches_bf16(y, ref, h.double() @ w2.double().T, h.double().abs() @ w2.double().abs().T)
    else:
        assert F.cosine_similarity(y.cpu().double().flatten(), ref.double().flatten(), dim=0) >= 0.9999
    with pytest.raises(ValueError, match="up must be bf16"):
        G.gemv(gate_up[:, :inter], q.to(device), s.to(device), up=gate_up[:, inter:].float())


@pytest.mark.parametrize("rows", [5, 48])
def test_strided_x_slice(device, rows):
    """x a column slice of a wider buffer (row stride 200, offset 24), bf16 weights and output."""
    g = torch.Generator().manual_seed(300 + rows)
    big = activations(g, rows, 200).to(device)
    x = big[:, 24:24 + 128]
    w = (torch.randn(80, 128, generator=g) / 11).to(torch.bfloat16)
    y = G.gemv(x, w.to(device), poison=True)
    xd, wd = x.cpu().double(), w.double()
    assert_matches_bf16(y, F.linear(x, w.to(device)), xd @ wd.T, xd.abs() @ wd.abs().T, fp8=False)


def test_every_e4m3_code_decodes_exactly(device):
    """A 1 x 256 weight holding every non-NaN code (the two NaN codes replaced by 0), scale 1 and
    2^5 in its two 128-blocks; one-hot rows of x read the codes back one by one."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    scale = torch.tensor([[127, 132]], dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float() * torch.tensor([1.0, 32.0]).repeat_interleave(128)
    got = torch.empty(256)
    for start in range(0, 256, 48):
        rows = min(48, 256 - start)
        x = torch.zeros(rows, 256, dtype=torch.bfloat16)
        x[torch.arange(rows), start + torch.arange(rows)] = 1.0
        y = G.gemv(x.to(device), codes.view(1, 256).to(device), scale.to(device), out_dtype=torch.float32, poison=True)
        got[start:start + rows] = y[:, 0].cpu()
    assert torch.equal(got, expected)  # (torch.equal takes -0 == 0: the 0x80 code reads as zero)


def test_every_e4m3_code_decodes_exactly_in_one_row(device):
    """The one-row task's decode: a 256 x 128 weight whose column 0 holds every non-NaN code (the
    rest zero), scale 1 for output rows 0-127 and 2^5 for 128-255; x one row, 1 in column 0."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    w = torch.zeros(256, 128, dtype=torch.uint8)
    w[:, 0] = codes
    scale = torch.tensor([[127], [132]], dtype=torch.uint8)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x[0, 0] = 1.0
    y = G.gemv(x.to(device), w.to(device), scale.to(device), out_dtype=torch.float32, poison=True).cpu()
    expected = codes.view(torch.float8_e4m3fn).float() * torch.tensor([1.0, 32.0]).repeat_interleave(128)
    assert torch.equal(y[0], expected)


def test_nan_codes_give_nan(device):
    """0x7F and 0xFF are NaN in e4m3fn: an output column whose weights hold one is NaN."""
    g = torch.Generator().manual_seed(9)
    q, s, _ = fp8_weight(g, 32, 64, 32)
    codes = q.view(torch.uint8).clone()
    codes[3, 10], codes[17, 60] = 0x7F, 0xFF
    y = G.gemv(activations(g, 4, 64).to(device), codes.to(device), s.to(device)).cpu()
    assert torch.isnan(y[:, [3, 17]]).all()
    assert not torch.isnan(y[:, [c for c in range(32) if c not in (3, 17)]]).any()


def test_blocks_and_tasks():
    assert T.default_blocks(8, 64) == (16, 64)
    assert T.default_blocks(1024, 4096, 128) == (64, 128)
    assert T.default_blocks(64, 64, 32) == (32, 32)
    assert T.default_blocks(1536, 4096, 128, programs=132) == (16, 128)  # 96 tasks
    assert T.default_blocks(4096, 8192, 128, programs=132) == (32, 128)  # 128 tasks
    assert T.default_blocks(7168, 1024, 128, programs=132) == (64, 128)  # 112 tasks
    assert T.gemv_tasks(8, 16) == 1 and T.gemv_tasks(100, 32) == 4 and T.gemv_tasks(100, 32, split=4) == 16
    # (block_n, block_k, chunk, N, K, SB, programs, rows, warps) -> (BN, BK, SPLIT)
    assert T.kernel_blocks(0, 128, 1024, 4096, 8192, 128, 132, 6, 8) == (128, 128, 8)  # BN by warps, K split
    assert T.kernel_blocks(0, 128, 1024, 4096, 8192, 128, 132, 6, 4) == (64, 128, 8)
    assert T.kernel_blocks(0, 128, 1024, 32768, 1024, 128, 132, 48, 4) == (64, 128, 1)  # K within a chunk
    assert T.kernel_blocks(0, 128, 1024, 256, 4096, None, 132, 6, 8) == (128, 64, 4)  # bf16: half the K step
    assert T.kernel_blocks(64, 512, 1024, 32, 64, 32, 1, 48, 8) == (32, 64, 1)  # BN <= SB, BK <= K
    assert T.kernel_blocks(0, 32, 96, 64, 384, 32, 1, 2, 4) == (32, 32, 4)  # slices of 3 K steps
    assert T.kernel_blocks(0, 128, 96, 64, 384, 32, 1, 2, 4) == (32, 128, 3)  # a slice is at least a K step
    assert T.kernel_blocks(0, 32, 256, 64, 384, 32, 1, 2, 4) == (32, 32, 1)  # 256 does not divide 384
    # chunk 0: the slices that leave the busiest program the fewest K elements, the fewest among equals
    assert T.kernel_blocks(0, 128, 0, 1536, 4096, 128, 132, 6, 8) == (128, 128, 8)  # 12 blocks: 96 tasks of 512
    assert T.kernel_blocks(0, 128, 0, 4096, 8192, 128, 132, 6, 8) == (128, 128, 4)  # 128 tasks of 2048, not 256 of 1024
    assert T.kernel_blocks(0, 128, 0, 32768, 1024, 128, 132, 48, 8) == (128, 128, 1)  # 256 blocks fill the programs
    assert T.balanced_split(32, 2048, 128, 132) == 4 and T.balanced_split(3, 4096, 128, 132) == T.MAX_BALANCED_SPLIT
    assert T.balanced_split(4, 384, 128, 132) == 1  # 384 = 3 K steps: no whole-step slices but one
    assert T.balanced_split(12, 4096, 128, 1) == 1  # one program: slices only add sums
    # one row: 16 K weights a step, unsplit, whatever the launch shape says
    assert T.kernel_blocks(64, 128, 1024, 4096, 8192, 128, 132, 1, 8) == (32, 512, 1)  # 128 tasks
    assert T.split_scratch(4096, 128, 8, 16) == (4096 * 8 * 16, 32) and T.split_scratch(4096, 128, 1, 16) == (0, 0)
    assert T.split_needs([[(1024, (64, 128, 4)), (512, (64, 128, 4))], [(8192, (64, 128, 1))]], 6) == (
        (1024 + 512) * 4 * 16, 24)
    assert T.single_row_blocks(1536, 4096, 128, programs=132) == (16, 1024)  # 48 tasks at BN 32: too few
    assert T.single_row_blocks(256, 4096, None, programs=132) == (8, 2048)  # bf16: 32 tasks, not 16 of 16 rows
    assert T.single_row_blocks(2048, 4096, 128, programs=132) == (16, 1024)  # 256 tasks of 8: no fewer rows a program
    assert T.single_row_blocks(32768, 1024, 128, programs=132) == (32, 512)
    assert T.single_row_blocks(64, 64, 32, programs=1) == (32, 64)  # BN <= SB, BK <= K
    assert T.single_row_blocks(8, 64) == (8, 64)
    assert T.row_block(1) == 1 and T.row_block(2) == 16 and T.row_block(17) == 32 and T.row_block(48) == 64
    assert T.scale_block(256, 4096, (2, 32)) == 128
    assert T.scale_block(1, 256, (1, 2)) == 128


def test_invalid_tilings_raise():
    g = torch.Generator().manual_seed(11)
    x = activations(g, 2, 128)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="must divide K"):
        G.gemv(x[:, :96], w, block=(16, 64))
    q, s, _ = fp8_weight(g, 64, 128, 32)
    with pytest.raises(ValueError, match="must divide the scale block"):
        G.gemv(x, q, s, block=(64, 32))  # BN does not divide SB
    with pytest.raises(ValueError, match="group_rows"):
        G.gemv(x, q, s, group_rows=48)
    with pytest.raises(ValueError, match="block grid"):
        G.gemv(x, q, s[:, :3])
    with pytest.raises(ValueError, match="slices of whole"):
        G.gemv(x, q, s, block=(32, 64), split=4)  # 4 slices of 64 do not make K 128
    with pytest.raises(ValueError, match="not split"):
        G.gemv(x[:1], q, s, block=(32, 64), split=2)
    with pytest.raises(ValueError, match="BN=8 must be a power of two >= 16"):
        G.gemv(x, q, s, block=(8, 32))  # tasks of 8 rows are for one-row steps only
