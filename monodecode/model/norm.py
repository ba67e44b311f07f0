"""RMSNorm, weighted and unweighted. Statistics in fp32; the result is cast back to the input dtype
once, after the weight is applied (the reference keeps norm weights in fp32).

`F.rms_norm` on fp32 input and an fp32 weight: on a GPU one fused kernel; on the CPU the same
operations as the plain formula, so the same bits (tests/test_norm.py). It is handed fp32 for a
bf16 input: with a bf16 input and an fp32 weight it does not fuse."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] normalised over D, times `weight` [D], or one a head [H, D] over x [..., H, D]."""
    xf, shape = x.float(), x.shape[-1:]
    if weight is None or weight.shape == shape:
        return F.rms_norm(xf, shape, None if weight is None else weight.float(), eps).to(x.dtype)
    # F.rms_norm takes a weight of the normalised shape only: a weight a head is applied after
    return (weight.float() * F.rms_norm(xf, shape, eps=eps)).to(x.dtype)
