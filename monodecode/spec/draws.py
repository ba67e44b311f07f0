"""The randomness of a speculative step: every uniform a step uses, drawn before its device work.

A request draws its step's 2B + 1 uniforms (B = the draft's block size) in one call on its own
generator, in this order:
- [0, B): the Markov head's draws, one a draft position (`sampling.pick`);
- [B, 2B): verification's acceptances, one a draft token (standard, block and synthetic);
- 2B: the token verification appends (`pick` from P_k or the residual).
It draws them when they can change its tokens: above temperature 0, or under synthetic
verification (which keeps drafts by the uniforms at any temperature). At temperature 0 under
greedy, standard or block verification every draw is decided by an argmax, and the request draws
nothing: its row holds zeros. Both forms of a step (stepwise and whole, spec/step_graph.py) draw
through `draw_uniforms`, so a request's generator gives the same uniforms to either, and the step's
device work reads them from one tensor, which a CUDA graph can hold.
"""

from __future__ import annotations

import torch


def uniforms_per_step(block_size: int) -> int:
    return 2 * block_size + 1


def draws(temperature: float, method: str) -> bool:
    """Whether a request at `temperature` draws its step's uniforms under verification `method`."""
    return temperature > 0 or method == "synthetic"


def draw_uniforms(sampling, method: str, out: torch.Tensor) -> torch.Tensor:
    """Each request's uniforms into its row of out [R, n] (n = `uniforms_per_step` for a step;
    verification alone draws k + 1), the rows of requests that draw none zeroed; `sampling`: each
    request's (temperature, top_p, top_k, generator)."""
    drawing = [draws(temperature, method) for temperature, *_ in sampling]
    if not all(drawing):
        out.zero_()
    for row, (*_, generator), drawn in zip(out, sampling, drawing):
        if drawn:
            torch.rand(out.shape[1], generator=generator, out=row)
    return out


def markov(uniforms: torch.Tensor, block_size: int) -> torch.Tensor:
    """The Markov head's uniforms [R, B] of a step's [R, 2B + 1]."""
    return uniforms[:, :block_size]


def verification(uniforms: torch.Tensor, block_size: int) -> torch.Tensor:
    """Verification's uniforms [R, B + 1] (the acceptances, then the appended token's)."""
    return uniforms[:, block_size:]
