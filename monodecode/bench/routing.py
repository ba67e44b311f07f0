"""The per-op path's routing as the agreement checks see it: which experts a run of a layer's MoE
picked, how near each row was to picking another, and which rows the kernels routed differently.

A bias-routed row whose k-th and (k+1)-th scores nearly tie can pick another expert on bf16
noise alone (the two paths round the layer's input differently), and its FFN output then
differs by a whole expert: such a row is no sign of a wrong kernel, but it would swamp an
agreement measure, so the checks report these rows (how many, their margins) and compare the
rest.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def recorded_routes(moe):
    """While the `with` body runs, every `moe.route` call is recorded: yields a list that gets
    (ids [N, k] sorted, margins [N], `MoE.margin`) for each call."""
    seen = []

    def recording(x, tokens):
        ids, weights = type(moe).route(moe, x, tokens)
        seen.append((ids.sort(dim=-1).values, moe.margin(x)))
        return ids, weights

    moe.route = recording
    try:
        yield seen
    finally:
        del moe.route  # the instance attribute: back to the class's method


def routing_flips(mono_ids: torch.Tensor, picks: torch.Tensor, margins: torch.Tensor, live: torch.Tensor,
                  held: range | None = None) -> tuple[torch.Tensor, dict]:
    """Live rows whose picks differ between the kernels (`mono_ids` [N, k], the scratch's) and the
    per-op path (`picks` sorted, `margins`: `recorded_routes`), and the per-op margins at them.
    `held`: a tensor-parallel rank's experts, whose ids the kernels keep local to the rank (-1 for
    another rank's)."""
    picks = picks.long()
    if held is not None:
        mine = (picks >= held.start) & (picks < held.stop)
        picks = torch.where(mine, picks - held.start, -1).sort(dim=-1).values
    flipped = (mono_ids.long().sort(dim=-1).values != picks).any(dim=-1) & live
    return flipped, {"rows": int(flipped.sum()), "margins": [float(m) for m in margins[flipped]],
                     "median_margin": float(margins[live].median())}
