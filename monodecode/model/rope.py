"""Interleaved rotary embeddings on the trailing `rope_dim` channels of each head.

Pairs are channels (2i, 2i+1) of the rope slice, rotated by angle `position * freq_i`. Window-only
layers use `rope_theta` as is; CSA/HCA layers (their attention, compressor and indexer alike) use
`compress_rope_theta` with YaRN frequency blending and no mscale.
The rotation is computed in fp32 and cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig, YarnScaling


def inverse_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs
    low, high = _correction_range(yarn, rope_dim, theta)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: high-frequency pairs keep their frequency; 0: interpolated by `factor`
    return freqs / yarn.factor * (1 - keep) + freqs * keep


def _correction_range(yarn: YarnScaling, rope_dim: int, theta: float) -> tuple[float, float]:
    def dim_of(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(dim_of(yarn.beta_fast)), 0)
    high = min(math.ceil(dim_of(yarn.beta_slow)), rope_dim - 1)
    return low, (high + 0.001 if low == high else high)


def layer_frequencies(config: ModelConfig, compressed: bool) -> torch.Tensor:
    if compressed:
        return inverse_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)
    return inverse_frequencies(config.qk_rope_head_dim, config.rope_theta, None)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2 * len(freqs)` channels of x [..., N, (H,) D] at positions [N].
    `inverse` applies the conjugate rotation (used to de-rotate the attention output)."""
    rope_dim = 2 * freqs.shape[0]
    angles = positions.to(torch.float32)[:, None] * freqs.to(positions.device)[None, :]  # [N, rd/2]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    while cos.dim() < x.dim():  # broadcast over the head axes between N and D
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)
