"""Token sampling from fp32 logits: greedy at temperature 0, else temperature and top-p."""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, vocab] -> token ids [N]."""
    check_sampling(temperature, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = (logits.float() / temperature).softmax(dim=-1)
    if top_p < 1:
        probs = top_p_filter(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
