"""The mono decode: each decoder layer of a decode step of 1..48 rows as three persistent Triton
kernels (K1, K2, K3), with the per-op path for everything else. `build` is the entry point; it
imports the kernels only once it knows how Triton must run them (compiled, or interpreted on a
CPU), since Triton fixes that when a kernel module is imported."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from .plan import MonoRefused, refusals

log = logging.getLogger("monodecode.mono")
MODES = ("off", "auto", "on")


def check_mode(mono: str) -> None:
    """Refuse an unknown mono mode (before anything is loaded, where the caller can)."""
    if mono not in MODES:
        raise ValueError(f"mono must be one of {list(MODES)}, got {mono!r}")


def build(model, mono: str):
    """The MonoRunner for `mono` = "off" | "auto" | "on", or None (off; auto when refused, each
    reason logged once). "on" raises MonoRefused with every reason. Without a GPU, "on" runs the
    kernels under Triton's interpreter with grid (1,): slow, for tests; it warns."""
    check_mode(mono)
    if mono == "off":
        return None
    if mono == "on" and model.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        reasons = refusals(model.config, model.device, model.dtype, interpreter=True)
        if reasons:
            raise MonoRefused(reasons)
        if any(name.startswith("monodecode.mono.") and name.split(".")[-1] in ("k1", "k2", "experts")
               for name in sys.modules):
            raise MonoRefused(["no GPU, and the kernels were already imported for compiled Triton: set "
                               "TRITON_INTERPRET=1 before importing monodecode to run them interpreted"])
        warnings.warn("mono on without a GPU: the kernels run under Triton's interpreter, one program "
                      "(grid (1,)): correct but very slow", stacklevel=2)
        os.environ["TRITON_INTERPRET"] = "1"
    from .runner import MonoRunner

    try:
        return MonoRunner(model)
    except MonoRefused as refused:
        if mono == "on":
            raise
        for reason in refused.reasons:
            log.warning("mono auto: runs per-op: %s", reason)
        return None
