"""The float64 reference of the routed-expert stage, from the same MXFP4 weights (dequantized
exactly) and with the same bf16 rounding of each pick's weighted SwiGLU output (experts.py)."""

from __future__ import annotations

import torch

from .. import formats
from .experts import ExpertWeights


def reference(x: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, weights: ExpertWeights,
              limit: float) -> torch.Tensor:
    """y [R, d] float64: for each row, the sum over its picks (ids [R, k], -1 skipped) of
    w2 bf16(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) * weight)."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    dequantized = {}
    for row in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[row, slot])
            if e < 0:
                continue
            if e not in dequantized:
                dequantized[e] = [formats.dequantize_mxfp4(*m, dtype=torch.float64)
                                  for m in weights.checkpoint_tensors(e)]
            w1, w2, w3 = dequantized[e]
            xr = x[row].double()
            gate, up = (w1 @ xr).clamp(max=limit), (w3 @ xr).clamp(-limit, limit)
            h = (torch.nn.functional.silu(gate) * up * float(route_weights[row, slot])).to(torch.bfloat16)
            y[row] += w2 @ h.double()
    return y
