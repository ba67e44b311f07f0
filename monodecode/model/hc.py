"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams per token.

`hc_mixes` computes a site's mixes from the RMS-normalised flattened streams (fp32): `pre` collapses
the streams into the sub-block input, `post` spreads the sub-block output back, `comb` (made
doubly stochastic by Sinkhorn) mixes the residual streams. `hc_pre` is V4's site input (its own
pre collapses the same streams); DeepSeek-V4.1 collapses each sub-block's input with the previous
sub-block's pre instead (delayed_block.py). `hc_post` applies post and comb; comb is consumed
transposed: stream k receives sum_j comb[j, k] * residual[j].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_norm


def _mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = rms_norm(streams.flatten(-2).float(), None, norm_eps)
    return F.linear(flat, fn.float())


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             *, hc_eps: float, norm_eps: float, sinkhorn_iters: int):
    """A site's mixes of streams [N, hc, d]: (pre [N, hc], post [N, hc], comb [N, hc, hc]), fp32."""
    hc = streams.shape[-2]
    pre_w, post_w, comb_w = _mixes(streams, fn, norm_eps).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax((comb_w * comb_s + comb_b).unflatten(-1, (hc, hc)), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre[:, j] * streams[:, j] in fp32, in the streams' dtype [N, d]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           *, hc_eps: float, norm_eps: float, sinkhorn_iters: int):
    """streams [N, hc, d] -> (collapsed [N, d] in the streams' dtype, post [N, hc], comb [N, hc, hc])."""
    pre, post, comb = hc_mixes(streams, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps,
                               sinkhorn_iters=sinkhorn_iters)
    return collapse(streams, pre), post, comb


def hc_post(output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """output [N, d], residual [N, hc, d] -> new streams [N, hc, d] in the residual's dtype."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual
    )


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            *, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse: sigmoid-weighted sum of the streams (no Sinkhorn, no post)."""
    return collapse(streams, torch.sigmoid(_mixes(streams, fn, norm_eps) * scale.float() + base.float()) + hc_eps)
