"""The one place where a decode step picks its path: mono kernels or the per-op model.

A step of at most MONO_MAX_ROWS rows takes the mono path when it is on; a bigger step, and
every prefill, runs per-op. The mono kernels (K1 + K2) are not built yet (monodecode/mono holds
only the routed-expert stage so far): `--mono auto` says so once and runs per-op, `--mono on`
is refused with that reason.
When the kernels land, `mono_step` is set here (same signature as Model.step) and nothing
else changes: plain decode steps and speculative verify steps both come through `decode`.
"""

from __future__ import annotations

import logging

from ..model import Model
from .metrics import Metrics

MONO_MAX_ROWS = 48
MONO_MODES = ("auto", "on", "off")
MONO_UNAVAILABLE = "the mono kernels are not built yet; every step runs on the per-op path"

log = logging.getLogger("monodecode.engine")


def check_mono(mono: str) -> None:
    """Refuse a mono mode that cannot run (all of `on`, for now), before anything is loaded."""
    if mono not in MONO_MODES:
        raise ValueError(f"mono must be one of {list(MONO_MODES)}, got {mono!r}")
    if mono == "on":
        raise ValueError(f"--mono on: {MONO_UNAVAILABLE} (use --mono auto or off)")


class StepRunner:
    def __init__(self, model: Model, mono: str, metrics: Metrics):
        check_mono(mono)
        if mono == "auto":
            log.warning("mono auto: %s", MONO_UNAVAILABLE)
        self.model, self.metrics = model, metrics
        self.mono_step = None

    def decode(self, cache, tokens, positions, slots, return_hidden: bool = False):
        """Model.step for a decode or verify step, on the path its row count allows."""
        mono = self.mono_step is not None and len(tokens) <= MONO_MAX_ROWS
        self.metrics.count_step("mono" if mono else "per-op")
        step = self.mono_step if mono else self.model.step
        return step(cache, tokens, positions, slots, return_hidden=return_hidden)
