"""Token sampling from fp32 logits: greedy at temperature 0, else temperature, top-k and top-p.

top_k <= 0 keeps every token (vLLM spells "off" as -1, some clients as 0); top_p = 1 keeps the
whole distribution. Top-k cuts first, then top-p takes its nucleus of what is left.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an integer (<= 0 for no limit), got {top_k!r}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, top_k: int = 0) -> torch.Tensor:
    """logits [N, vocab] -> token ids [N]."""
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        return logits.argmax(dim=-1)  # exact, and draws nothing from the generator
    return sample_from(probabilities(logits, temperature, top_p, top_k), generator)


def probabilities(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """logits [..., vocab] -> the fp32 distribution [..., vocab] that `sample` draws from: at
    temperature 0 a one-hot of the argmax, else softmax(logits / temperature) cut to the top-k
    tokens and then to the top-p nucleus. Speculative verification compares these
    distributions, so draft and target must both come from here."""
    check_sampling(temperature, top_p, top_k)
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = (logits / temperature).softmax(dim=-1)
    return top_p_filter(probs, top_p) if top_p < 1 else probs


def grouped_probabilities(logits: torch.Tensor, settings: list[tuple[float, float, int]]) -> torch.Tensor:
    """`probabilities` of each request's logits (logits [R, ..., vocab], request i's
    (temperature, top_p, top_k) in settings[i]): the requests that share their settings are
    computed together, one set of launches for a batch of like requests, not one a request."""
    together: dict[tuple, list[int]] = {}
    for i, setting in enumerate(settings):
        together.setdefault(tuple(setting), []).append(i)
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for setting, rows in together.items():
        index = torch.tensor(rows, device=logits.device)
        probs[index] = probabilities(logits[index], *setting)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., vocab] (non-negative weights; need not sum to 1) -> token ids [...]."""
    rows = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(rows, 1, generator=generator).view(probs.shape[:-1])


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
