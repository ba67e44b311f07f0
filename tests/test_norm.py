"""model/norm.py's rms_norm (F.rms_norm) against the plain formula it replaced, bit for bit on the
CPU (on a GPU F.rms_norm is a fused kernel whose sums need not round as the formula's do)."""

import pytest
import torch

from monodecode.model.norm import rms_norm

DTYPES = [torch.bfloat16, torch.float32]
WEIGHTS = ["none", "one", "a head"]  # no weight, one [D], one a head [H, D]
SHAPES = [(1, 64), (5, 3, 128), (7, 512), (2, 4, 6, 72)]  # [..., (H,) D]


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_plain_formula_bit_for_bit(dtype, weight_kind, shape):
    """Random x of random scale (fresh each case), fp32 weights as the checkpoints keep them, the
    presets' two epsilons."""
    g = torch.Generator().manual_seed(100 * DTYPES.index(dtype) + 10 * WEIGHTS.index(weight_kind) + SHAPES.index(shape))
    scale = 10 ** torch.empty(()).uniform_(-4, 4, generator=g)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    weight = {"none": None, "one": torch.randn(shape[-1:], generator=g),
              "a head": torch.randn(shape[-2:], generator=g)}[weight_kind]
    for eps in (1e-6, 1e-20):
        out = rms_norm(x, weight, eps)
        assert out.dtype == dtype and torch.equal(out, plain_rms_norm(x, weight, eps))
