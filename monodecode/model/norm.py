"""RMSNorm, weighted and unweighted. Statistics in fp32; the result is cast back to the input dtype
once, after the weight is applied (the reference keeps norm weights in fp32)."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)
