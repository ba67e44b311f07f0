"""`rounding.bf16` inside a kernel: fp32 -> the nearest bf16 (ties to even), still as fp32, as torch
rounds; under the interpreter and compiled (MONODECODE_TEST_DEVICE=cuda)."""

import torch
import triton
import triton.language as tl

from monodecode.mono.rounding import bf16

BLOCK = 1024


@triton.jit
def _rounded(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, bf16(tl.load(x_ptr + offsets, mask=mask)), mask=mask)


def values(g: torch.Generator) -> torch.Tensor:
    """fp32 values over the whole exponent range, exact ties (bf16 bits + half an ulp, both
    parities), subnormals, and the edges: zeros, infinities, the largest finite bf16 and the
    values that round past it."""
    spread = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-140, 127, (4096,), generator=g).float())
    tie_bits = (torch.randint(0, 2**15, (1024,), generator=g, dtype=torch.int32) << 16) | 0x8000
    ties = torch.cat([tie_bits, tie_bits | (1 << 16)]).view(torch.float32)
    ties = torch.cat([ties, -ties])
    subnormal = torch.randint(1, 2**23, (512,), generator=g, dtype=torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895314e38, 3.3961776e38, 3.4e38, -3.4e38,
                          1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20])
    return torch.cat([spread, ties, subnormal, -subnormal, edges])


def test_bf16_rounds_to_nearest_even_as_torch(device):
    x = values(torch.Generator().manual_seed(11))
    x = x[torch.isfinite(x) | torch.isinf(x)]  # the random spread may overflow to inf: kept, as an edge
    y = torch.full_like(x, float("nan"))  # poison: an element the kernel does not write stays NaN
    xd, yd = x.to(device), y.to(device)
    _rounded[(triton.cdiv(x.numel(), BLOCK),)](xd, yd, x.numel(), BLOCK=BLOCK)
    expected = x.to(torch.bfloat16).float()
    assert torch.equal(yd.cpu().view(torch.int32), expected.view(torch.int32))


def test_bf16_keeps_nan(device):
    x = torch.tensor([float("nan"), -float("nan"), 1.5], device=device)
    y = torch.zeros_like(x)
    _rounded[(1,)](x, y, 3, BLOCK=BLOCK)
    assert torch.isnan(y[:2]).all() and y[2] == 1.5
