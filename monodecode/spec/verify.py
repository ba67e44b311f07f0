"""Verification of one request's speculative draft: which draft tokens it keeps, and the one token
the target adds after them.

Notation. The draft proposed k tokens x_1..x_k. P_i = target_probs[i] (i = 0..k) is the target's
distribution of the token after the context and x_1..x_i, so P_k gives the bonus token.
Q_i = draft_probs[i] (i = 0..k-1) is the distribution x_{i+1} was drawn from. Both come from
`sampling.probabilities` with the request's temperature and top-p. A step keeps x_1..x_a and
appends one token y: it commits a + 1 tokens.

greedy     a = the length of the longest prefix with x_{i+1} = argmax P_i, and y = argmax P_a,
           whatever the temperature (it reads logits).
standard   (Leviathan et al. 2023; Chen et al. 2023) for i = 0..k-1 in turn, keep x_{i+1} with
           probability min(1, P_i(x_{i+1}) / Q_i(x_{i+1})). At the first rejection, a = i and
           y ~ norm(max(P_i - Q_i, 0)). If none is rejected, a = k and y ~ P_k.
block      (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444,
           Algorithm 2; the paper's M_b(.|X^i) is P_i and its M_s(.|X^i) is Q_i.) Whole prefixes are
           scored, not tokens:
             w_0 = 1,  w_i = min(1, w_{i-1} P_{i-1}(x_i) / Q_{i-1}(x_i))          (the paper's p_i)
             r_i = sum_x max(w_i P_i(x) - Q_i(x), 0)                             for i < k
             h_i = r_i / (r_i + 1 - w_i) for i < k,  h_k = w_k.
           With eta_1..eta_k uniform, a = the LAST i with eta_i < h_i (0 if there is none), so a
           prefix can be kept past a token that token-wise verification would have rejected.
           y ~ P_k if a = k, else y ~ norm(max(w_a P_a - Q_a, 0)).
synthetic  NOT lossless, for benchmarks only: see `synthetic_rows`.

Standard and block are lossless: the committed tokens, continued by sampling from the target, are
distributed exactly as sampling from the target alone; block keeps at least as many draft tokens
as standard in expectation (Sun et al., Theorem 2). At temperature 0 every P_i is a one-hot of its
argmax a_i, and both commit exactly what greedy commits, whatever the draft rows Q_i. Standard: a
draft token equal to a_i has ratio >= 1 and is kept surely, any other has P_i(x) = 0 and is never
kept. Block: w_i = 1 along the matching prefix and 0 from the first mismatch on, so h_i = 1
before it and 0 after. Every residual is then a one-hot of a_i.

Edge cases, none of which changes the distributions above:
- Q_i(x_{i+1}) = 0 (x_{i+1} could not have been drafted): the ratio counts as 1 if the target
  gives x_{i+1} a positive probability, else 0.
- An all-zero residual (P_i == Q_i up to rounding, where a rejection has probability 0 but
  rounding can still produce one): y is drawn from P_i instead.
- Block's h_i when r_i = 0 and w_i = 1 (0/0): 1, its limit as w_i -> 1. In exact arithmetic a
  later prefix is then kept surely, so the value never matters; 1 keeps temperature 0 equal to
  greedy.
- A uniform u in [0, 1) passes a probability h when u < h, so h = 0 never passes and h = 1
  always does.

The rules take their randomness as k + 1 uniforms a request (the acceptances u_1..u_k, then the
appended token's, which `sampling.pick` turns into y by the inverse CDF), drawn before the device
work (spec/draws.py), so that `verify_rows` runs with no host read and no generator: a whole
speculative step holds it in its CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..sampling import RowSettings, argmax_rows, pick, row_probabilities
from .config import REJECTION_SAMPLE_METHODS
from .draws import draw_uniforms


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted, 0..k
    tokens: list[int]  # the tokens to commit: draft[:accepted] + [one more token]


def verify(method: str, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None, *, temperature: float, top_p: float, top_k: int = 0,
           generator: torch.Generator | None, acceptance_length: float | None = None) -> Verdict:
    """Verify one request's draft with `method` (a SpeculativeConfig.rejection_sample_method).
    target_logits [k + 1, V], draft_tokens [k], draft_probs [k, V]; `acceptance_length` is read
    by "synthetic" only; greedy and synthetic read no draft_probs (None will do)."""
    return verify_batch(method, target_logits[None], draft_tokens[None], None if draft_probs is None else draft_probs[None],
                        [(temperature, top_p, top_k, generator)], acceptance_length)[0]


def verify_batch(method: str, target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 sampling: list[tuple[float, float, int, torch.Generator | None]],
                 acceptance_length: float | None = None) -> list[Verdict]:
    """`verify` for R requests at once: target_logits [R, k + 1, V], draft_tokens [R, k],
    draft_probs [R, k, V], request i's (temperature, top_p, top_k, generator) in sampling[i].
    Each request draws its k + 1 uniforms from its own generator (spec/draws.py: none where no
    draw can change its tokens), then `verify_rows` decides all of them on the device, which is
    read once."""
    _check_method(method)
    uniforms = torch.empty(len(sampling), draft_tokens.shape[1] + 1, device=target_logits.device)
    settings = RowSettings.of([setting for *setting, _ in sampling], target_logits.device)
    rows = verify_rows(method, target_logits, draft_tokens, draft_probs, settings, draw_uniforms(sampling, method, uniforms),
                       acceptance_length)
    return read_verdicts(rows)


def verify_rows(method: str, target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                settings: RowSettings, uniforms: torch.Tensor, acceptance_length: float | None = None) -> torch.Tensor:
    """Verification's device part, with no host read (`verdict_rows`): target_logits [R, k + 1, V],
    draft_tokens [R, k], draft_probs [R, k, V] (read by standard and block), each request's
    settings, and its uniforms [R, k + 1] (the acceptances, then the appended token's). Where
    every request is greedy, standard and block commit what greedy commits (the module's
    docstring), and greedy's argmax stands for them."""
    _check_method(method)
    k = _check_rows(target_logits, draft_tokens, draft_probs if method in ("standard", "block") else None)
    if method == "greedy" or (settings.greedy and method != "synthetic"):
        return greedy_verdict_rows(target_logits, draft_tokens)
    if method == "synthetic":
        accepted = synthetic_accepted(uniforms[:, :k], synthetic_acceptance_rate(acceptance_length, k))
        if settings.greedy:
            return greedy_verdict_rows(target_logits, draft_tokens, accepted)
        return synthetic_rows(row_probabilities(target_logits, settings), draft_tokens, accepted, uniforms[:, k])
    rule = block_rows if method == "block" else standard_rows
    return rule(row_probabilities(target_logits, settings), draft_tokens, draft_probs, uniforms)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    _check_rows(target_logits[None], draft_tokens[None])
    return read_verdicts(greedy_verdict_rows(target_logits[None], draft_tokens[None]))[0]


def greedy_verdict_rows(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                        accepted: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy verification's device part (`verdict_rows`). `accepted` [R]: these counts instead of
    the matching prefixes' (synthetic verification's of greedy requests, `synthetic_accepted`), the
    appended token still the target's argmax after them."""
    k = draft_tokens.shape[-1]
    best = argmax_rows(target_logits)
    if accepted is None:
        accepted = (best[:, :k] == draft_tokens).cumprod(dim=1).sum(dim=1)
    return verdict_rows(draft_tokens, accepted, best.gather(1, accepted[:, None]).squeeze(1))


# One request's rules on its distributions, drawing its k + 1 uniforms from `generator`: the tests'
# entry points (a batch of one through the rows' rules).
def verify_standard(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    return _one_request(standard_rows, target_probs, draft_tokens, draft_probs, generator)


def verify_block(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                 generator: torch.Generator | None) -> Verdict:
    return _one_request(block_rows, target_probs, draft_tokens, draft_probs, generator)


def verify_synthetic(target_probs: torch.Tensor, draft_tokens: torch.Tensor, acceptance_length: float,
                     generator: torch.Generator | None) -> Verdict:
    def rule(target, drafts, _, uniforms):
        k = drafts.shape[1]
        accepted = synthetic_accepted(uniforms[:, :k], synthetic_acceptance_rate(acceptance_length, k))
        return synthetic_rows(target, drafts, accepted, uniforms[:, k])

    return _one_request(rule, target_probs, draft_tokens, None, generator)


def _one_request(rule, target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 generator) -> Verdict:
    """`rule` (a rows rule: target, drafts, draft rows, uniforms) on one request as a batch of one."""
    _check_rows(target_probs[None], draft_tokens[None], None if draft_probs is None else draft_probs[None])
    uniforms = torch.rand(1, draft_tokens.shape[0] + 1, generator=generator, device=target_probs.device)
    return read_verdicts(rule(target_probs[None], draft_tokens[None],
                              None if draft_probs is None else draft_probs[None], uniforms))[0]


def standard_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """Token by token: x_{i+1} kept while u_i < min(1, P_i(x) / Q_i(x)); the first rejection
    draws from the residual, a full acceptance from P_k (with u_k)."""
    k = draft_tokens.shape[1]
    ratios = _capped_ratio(_at_drafts(target_probs, draft_tokens), _at_drafts(draft_probs, draft_tokens))
    accepted = (uniforms[:, :k] < ratios).cumprod(dim=1).sum(dim=1)
    return verdict_rows(draft_tokens, accepted, _draw_last(target_probs, draft_probs, accepted, None, uniforms[:, k]))


def block_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
               uniforms: torch.Tensor) -> torch.Tensor:
    """Whole prefixes (the module's docstring): a = the last i with u_i < h_i; the appended
    token from P_k if a = k, else from the residual scaled by w_a (with u_k)."""
    k = draft_tokens.shape[1]
    weights = _prefix_weights(target_probs, draft_tokens, draft_probs)
    thresholds = _block_thresholds(weights, target_probs, draft_probs)
    passed = (uniforms[:, :k] < thresholds) * torch.arange(1, k + 1, device=uniforms.device)
    accepted = passed.amax(dim=1)
    return verdict_rows(draft_tokens, accepted, _draw_last(target_probs, draft_probs, accepted, weights, uniforms[:, k]))


def synthetic_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor,
                   last_uniforms: torch.Tensor) -> torch.Tensor:
    """NOT lossless, for benchmarks only: keeps draft tokens whatever they are, to run the engine
    at a chosen expected acceptance length L (tokens committed per step, accepted drafts + 1).
    Each position is kept with the rate r that solves 1 + r + ... + r^k = L, in turn until the
    first one that is not (`synthetic_accepted`, which gives `accepted`); the appended token is
    picked from the target's row at that position by its uniform (a greedy request's row is a
    one-hot: its argmax)."""
    rows = target_probs.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    return verdict_rows(draft_tokens, accepted, pick(rows, last_uniforms))


def synthetic_accepted(uniforms: torch.Tensor, rate: float) -> torch.Tensor:
    """Synthetic verification's accepted counts [R] from each request's k uniforms [R, k]: the
    positions kept in turn while u < rate."""
    return (uniforms < rate).cumprod(dim=1).sum(dim=1)


@lru_cache(maxsize=64)
def synthetic_acceptance_rate(acceptance_length: float, k: int) -> float:
    """The per-position rate r in [0, 1] with 1 + r + ... + r^k = acceptance_length (bisection:
    the sum increases with r)."""
    if acceptance_length is None or not 1 <= acceptance_length <= k + 1:
        raise ValueError(f"synthetic acceptance length must be in [1, k + 1] = [1, {k + 1}], "
                         f"got {acceptance_length!r}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid**j for j in range(k + 1)) < acceptance_length else (low, mid)
    return (low + high) / 2


def _prefix_weights(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Block verification's w_0..w_k, [R, k + 1]."""
    at_target, at_draft = _at_drafts(target_probs, draft_tokens), _at_drafts(draft_probs, draft_tokens)
    weights = [torch.ones_like(at_target[:, 0])]
    for i in range(at_target.shape[1]):
        weights.append(_capped_ratio(weights[-1] * at_target[:, i], at_draft[:, i]))
    return torch.stack(weights, dim=1)


def _block_thresholds(weights: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Block verification's h_1..h_k, [R, k]."""
    k = weights.shape[1] - 1
    inner = weights[:, 1:k]
    masses = (inner[..., None] * target_probs[:, 1:k] - draft_probs[:, 1:k]).clamp(min=0).sum(dim=-1)
    return torch.cat([_keep_probability(masses, inner), weights[:, k:]], dim=1)


def _keep_probability(residual_mass: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    denominator = residual_mass + 1 - weight
    return torch.where(denominator > 0, residual_mass / denominator.clamp(min=torch.finfo(denominator.dtype).tiny),
                       1.0)


def _draw_last(target_probs: torch.Tensor, draft_probs: torch.Tensor, accepted: torch.Tensor,
               weights: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """The appended token of each request: from P_k where all k were kept, else from the
    residual at the first position not kept (scaled by w_a for block, `weights` given)."""
    k, vocab = draft_probs.shape[1], target_probs.shape[-1]
    at = accepted.clamp(max=k - 1).view(-1, 1, 1).expand(-1, 1, vocab)
    weight = 1.0 if weights is None else weights.gather(1, accepted.clamp(max=k - 1)[:, None])
    residual = _residual(target_probs.gather(1, at).squeeze(1), draft_probs.gather(1, at).squeeze(1), weight)
    rows = torch.where((accepted == k)[:, None], target_probs[:, k], residual)
    return pick(rows, uniforms)


def _residual(target_rows: torch.Tensor, draft_rows: torch.Tensor, weight=1.0) -> torch.Tensor:
    """max(weight * target - draft, 0) per row [R, V], unnormalised (`pick` normalises); a
    row's target row itself when that is all zero."""
    residual = (weight * target_rows - draft_rows).clamp(min=0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_rows)


def _capped_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """min(1, numerator / denominator) for numerators >= 0, with 0 wherever the numerator is 0."""
    ratio = numerator / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
    return torch.where(numerator <= 0, 0.0, torch.where(numerator >= denominator, 1.0, ratio))


def _at_drafts(probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """probs[:, i, x_{i+1}] for i = 0..k-1, [R, k]."""
    k = draft_tokens.shape[1]
    return probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)


def _check_method(method: str) -> None:
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {list(REJECTION_SAMPLE_METHODS)}")


def _check_rows(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> int:
    k = draft_tokens.shape[1]
    if target.shape[1] != k + 1 or (draft_probs is not None and draft_probs.shape[1] != k):
        draft_rows = "" if draft_probs is None else f" and {draft_probs.shape[1]} draft rows"
        raise ValueError(f"{k} draft tokens need {k + 1} target rows and {k} draft rows, "
                         f"got {target.shape[1]} target rows{draft_rows}")
    return k


def verdict_rows(draft_tokens: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The requests' verdicts as one device tensor [R, k + 2]: row i's first a_i + 1 entries are
    the tokens it commits (its a_i accepted drafts, then `last`), its final entry a_i."""
    committed = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1).scatter(1, accepted[:, None], last[:, None])
    return torch.cat([committed, accepted[:, None]], dim=1)


def read_verdicts(rows: torch.Tensor) -> list[Verdict]:
    """The verdicts of `verdict_rows`, from one read of the device."""
    return verdicts(rows.tolist())


def verdicts(rows: list[list[int]]) -> list[Verdict]:
    """The verdicts of verdict rows read to the host (as lists of ints)."""
    return [Verdict(row[-1], row[:row[-1] + 1]) for row in rows]
