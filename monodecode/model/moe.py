"""The MoE FFN: router, routed experts, shared expert.

Router: sqrtsoftplus scores of `gate` (fp32); experts chosen by the token's `tid2eid` row on
hash-routed layers, else by top-k of score + bias; weights are the unbiased scores of the chosen
experts, renormalised, times `routed_scaling_factor`. Experts: SwiGLU in fp32 with the clamp
(gate <= limit, |up| <= limit), the routing weight applied before `w2` and rounded to the
activation dtype there, as the reference does; each expert's output rounded to the activation dtype
(its w2 projection), summed in fp32 per row, expert by expert in ascending id order. `experts`
is anything whose `expert(e)` gives expert e's (w1, w2, w3) in the compute dtype: the
checkpoint's bank (`weights.ExpertBank`), or another holder of the same weights that
`Model.replace_experts` installed. Under tensor parallelism (parallel.py) a rank runs its own
range of the picked experts and its slice of the shared expert, and the ranks' fp32 sums are
added in rank order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .parallel import SINGLE, TensorParallel


class MoE:
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str, experts,
                 hash_routed: bool, topk: int, tp: TensorParallel = SINGLE):
        self.gate = w[f"{prefix}gate"]
        self.tid2eid = w.get(f"{prefix}gate.tid2eid") if hash_routed else None
        self.bias = None if hash_routed else w[f"{prefix}gate.bias"]
        self.shared = tuple(w[f"{prefix}shared_experts.{m}"] for m in ("w1", "w2", "w3")) if config.n_shared_experts else None
        self.experts, self.topk, self.tp = experts, topk, tp
        self.held = tp.part(self.gate.shape[0]) if tp.size > 1 else None  # this rank's routed experts; None: all
        self.limit, self.route_scale = config.swiglu_limit, config.routed_scaling_factor

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The router's scores [N, E] fp32 (unbiased: they weight the picks)."""
        return F.softplus(F.linear(x.float(), self.gate.float())).sqrt()

    def margin(self, x: torch.Tensor) -> torch.Tensor:
        """[N] fp32: the k-th minus the (k+1)-th biased score of a bias-routed layer, how near a
        row's picks are to a flip (bf16 noise of that size can swap an expert); infinite on a
        hash-routed layer, whose picks follow the tokens."""
        if self.tid2eid is not None:
            return torch.full((len(x),), float("inf"), device=x.device)
        top = (self.scores(x) + self.bias).topk(self.topk + 1, dim=-1).values
        return top[:, -2] - top[:, -1]

    def route(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k] fp32)."""
        scores = self.scores(x)
        if self.tid2eid is not None:
            ids = self.tid2eid[tokens]
        else:
            ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(dim=-1, keepdim=True) * self.route_scale

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x, tokens)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            if self.held is not None and e not in self.held:
                continue
            rows, k = (ids == e).nonzero(as_tuple=True)
            y = self._swiglu(x[rows], *self.experts.expert(e), weights[rows, k])
            out.index_add_(0, rows, y.float())
        if self.shared:
            out += self._swiglu(x, *self.shared, None).float()
        return self.tp.reduce(out).to(x.dtype)

    def _swiglu(self, x, w1, w2, w3, weight):
        gate = F.linear(x, w1).float().clamp(max=self.limit)
        up = F.linear(x, w3).float().clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return F.linear(h.to(x.dtype), w2)
