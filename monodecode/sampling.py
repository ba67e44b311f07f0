"""Token sampling from fp32 logits: greedy at temperature 0, else temperature, top-k and top-p.

top_k <= 0 keeps every token (vLLM spells "off" as -1, some clients as 0); top_p = 1 keeps the
whole distribution. Top-k cuts first, then top-p takes its nucleus of what is left.

One rule serves one request and many: `row_probabilities` takes each row's settings as device
tensors (`RowSettings`), so that requests with different settings are computed together with no
host work that depends on them (a CUDA graph can hold it). A token is drawn by the inverse CDF of
one uniform (`pick`): exact, and the uniform can be drawn before the device work that uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ARGMAX_PARTS = 128  # `argmax_rows`' first round: at most this many parts a row


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an integer (<= 0 for no limit), got {top_k!r}")


@dataclass(frozen=True)
class RowSettings:
    """Each request's (temperature, top_p, top_k) as the rows of `values` [3, R] (fp32 on the
    device; top_k is exact in fp32 below 2**24), and two facts the host knows from them: whether
    every request is greedy and whether any request cuts by top-k or top-p. The flags choose which
    operations run, so a CUDA graph of those operations is kept per (request count, flags)."""

    values: torch.Tensor
    greedy: bool
    filters: bool

    @classmethod
    def of(cls, settings, device=None, out: torch.Tensor | None = None) -> RowSettings:
        """The settings of requests (a list of (temperature, top_p, top_k)), checked, on `device`
        or copied into `out` [3, R] (a graph's input buffer)."""
        for setting in settings:
            check_sampling(*setting)
        host = torch.tensor([[float(setting[i]) for setting in settings] for i in range(3)], dtype=torch.float32)
        values = host.to(device) if out is None else out.copy_(host, non_blocking=True)
        return cls(values, greedy=all(t == 0 for t, _, _ in settings),
                   filters=any(t > 0 and (p < 1 or k > 0) for t, p, k in settings))

    @property
    def temperature(self) -> torch.Tensor:
        return self.values[0]

    @property
    def top_p(self) -> torch.Tensor:
        return self.values[1]

    @property
    def top_k(self) -> torch.Tensor:
        return self.values[2]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same index (the first of equal maxima), in two rounds: each row
    cut into parts of equal length (as many as divide it, at most ARGMAX_PARTS), each part's
    maximum and its first index, then the first part holding the row's maximum. On a GPU one
    reduction a row runs on one block of threads a row; the parts spread a decode step's few
    rows of a whole vocabulary over the device."""
    vocab = logits.shape[-1]
    length = vocab // math.gcd(vocab, ARGMAX_PARTS)
    best, within = logits.unflatten(-1, (-1, length)).max(dim=-1)
    part = best.argmax(dim=-1, keepdim=True)
    return within.gather(-1, part).add_(part, alpha=length).squeeze(-1)  # + part * length in one kernel


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, top_k: int = 0) -> torch.Tensor:
    """logits [N, vocab] -> token ids [N]."""
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        return argmax_rows(logits)  # exact, and draws nothing from the generator
    return sample_from(probabilities(logits, temperature, top_p, top_k), generator)


def probabilities(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """logits [..., vocab] -> the fp32 distribution [..., vocab] that `sample` draws from: at
    temperature 0 a one-hot of the argmax, else softmax(logits / temperature) cut to the top-k
    tokens and then to the top-p nucleus. Speculative verification compares these
    distributions, so draft and target must both come from here (`row_probabilities`)."""
    settings = RowSettings.of([(temperature, top_p, top_k)], logits.device)
    return row_probabilities(logits[None], settings)[0]


def row_probabilities(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """`probabilities` of each request's logits, logits [R, ..., vocab] with request i's settings
    in row i of `settings`: one set of launches for all of them, whatever their settings."""
    logits = logits.float()
    one_hot = torch.zeros_like(logits).scatter_(-1, argmax_rows(logits)[..., None], 1.0)
    if settings.greedy:
        return one_hot

    def per_row(value: torch.Tensor) -> torch.Tensor:
        return value.view(-1, *[1] * (logits.dim() - 1))

    temperature = per_row(settings.temperature)
    if settings.filters:
        logits = _top_k_filter(logits, per_row(settings.top_k))
    probs = (logits / torch.where(temperature > 0, temperature, 1.0)).softmax(dim=-1)
    if settings.filters:
        top_p = per_row(settings.top_p)
        probs = torch.where(top_p < 1, top_p_filter(probs, top_p), probs)
    return torch.where(temperature > 0, probs, one_hot)


def _top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """-inf below each row's k-th largest logit (ties with it kept); rows with top_k <= 0 or
    top_k >= vocab unchanged."""
    vocab = logits.shape[-1]
    k = top_k.long()
    k = torch.where((k > 0) & (k < vocab), k, vocab).expand(*logits.shape[:-1], 1)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, k - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, top_p) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (a number, or a
    tensor that broadcasts against probs[..., :1]), renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., vocab] (non-negative weights; need not sum to 1) -> token ids [...]: one
    uniform a row from `generator`, then `pick`."""
    return pick(probs, torch.rand(probs.shape[:-1], generator=generator, device=probs.device))


def pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row of probs [..., vocab] (non-negative weights, not all zero) that the
    uniform u in [0, 1) of uniforms [...] selects by the inverse CDF: the first token whose
    cumulative weight exceeds u times the row's total. A token of weight 0 is never picked: where
    rounding lands the search on one (a parallel scan's prefix sums need not stay flat across a
    zero) or past the row's end, the last token of positive weight before it is taken."""
    cdf = probs.float().cumsum(dim=-1)
    vocab = probs.shape[-1]
    index = torch.searchsorted(cdf, uniforms[..., None] * cdf[..., -1:], right=True).clamp(max=vocab - 1)
    ids = torch.arange(vocab, device=probs.device)
    positive_until = torch.where(probs > 0, ids, -1).cummax(dim=-1).values  # the last positive token <= each
    return positive_until.gather(-1, index).squeeze(-1)
