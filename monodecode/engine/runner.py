"""The one place where the engine runs a decode step: `Model.step`, on the mono kernels when
they are in use (they send the steps they do not take to the per-op path themselves), counted
by the path each step took. Plain decode steps and speculative verify steps both come through
`decode`; prefill chunks go to Model.step directly and are per-op (too many rows a request).
"""

from __future__ import annotations

from ..model import Model
from ..mono import check_mode as check_mono  # noqa: F401 (the server checks the mode before loading)
from .metrics import Metrics


class StepRunner:
    def __init__(self, model: Model, mono: str, metrics: Metrics):
        model.use_mono(mono)
        self.model, self.metrics = model, metrics

    def decode(self, cache, tokens, positions, slots, return_hidden: bool = False):
        """Model.step for a decode or verify step, counted by the path it took."""
        out = self.model.step(cache, tokens, positions, slots, return_hidden=return_hidden)
        mono = self.model.mono
        self.metrics.count_step(mono.last_path if mono is not None else "per-op")
        return out
