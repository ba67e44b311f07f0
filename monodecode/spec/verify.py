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
synthetic  NOT lossless, for benchmarks only: see `verify_synthetic`.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..sampling import grouped_probabilities, sample_from
from .config import REJECTION_SAMPLE_METHODS


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
    The rules run on the device for all requests together, each drawing from its own generator
    (k uniforms, then the one token; as one request alone would), and the device is read once."""
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {list(REJECTION_SAMPLE_METHODS)}")
    if method == "greedy":
        return verify_greedy_batch(target_logits, draft_tokens)
    target_probs = grouped_probabilities(target_logits, [settings for *settings, _ in sampling])
    generators = [g for *_, g in sampling]
    if method == "synthetic":
        greedy = [temperature == 0 for temperature, *_ in sampling]
        return verify_synthetic_batch(target_probs, draft_tokens, acceptance_length, generators, greedy)
    rule = verify_block_batch if method == "block" else verify_standard_batch
    return rule(target_probs, draft_tokens, draft_probs, generators)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    _check_rows(target_logits[None], draft_tokens[None])
    return verify_greedy_batch(target_logits[None], draft_tokens[None])[0]


def verify_greedy_batch(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> list[Verdict]:
    """`verify_greedy` for R requests at once: target_logits [R, k + 1, V], draft_tokens [R, k];
    one read of the device's results for all of them."""
    return read_verdicts(greedy_verdict_rows(target_logits, draft_tokens))


def greedy_verdict_rows(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                        accepted: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy verification's device part (`verdict_rows`), with no host read: a whole greedy step
    captures it in its CUDA graph (spec/step_graph.py). `accepted` [R]: these counts instead of the
    matching prefixes' (synthetic verification's at temperature 0, `synthetic_accepted`), the
    appended token still the target's argmax after them."""
    k = draft_tokens.shape[-1]
    best = target_logits.argmax(dim=-1)
    if accepted is None:
        accepted = (best[:, :k] == draft_tokens).cumprod(dim=1).sum(dim=1)
    return verdict_rows(draft_tokens, accepted, best.gather(1, accepted[:, None]).squeeze(1))


# One request's rules (the batched ones on a batch of one): the tests' entry points.
def verify_standard(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    return verify_standard_batch(target_probs[None], draft_tokens[None], draft_probs[None], [generator])[0]


def verify_block(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                 generator: torch.Generator | None) -> Verdict:
    return verify_block_batch(target_probs[None], draft_tokens[None], draft_probs[None], [generator])[0]


def verify_synthetic(target_probs: torch.Tensor, draft_tokens: torch.Tensor, acceptance_length: float,
                     generator: torch.Generator | None) -> Verdict:
    return verify_synthetic_batch(target_probs[None], draft_tokens[None], acceptance_length, [generator])[0]


def verify_standard_batch(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                          generators: list) -> list[Verdict]:
    """Token by token: x_{i+1} kept while u_i < min(1, P_i(x) / Q_i(x)); the first rejection
    draws from the residual, a full acceptance from P_k."""
    k = _check_rows(target_probs, draft_tokens, draft_probs)
    uniforms = _uniforms(k, target_probs, generators)
    ratios = _capped_ratio(_at_drafts(target_probs, draft_tokens), _at_drafts(draft_probs, draft_tokens))
    accepted = (uniforms < ratios).cumprod(dim=1).sum(dim=1)
    return _verdicts(draft_tokens, accepted, _draw_last(target_probs, draft_probs, accepted, None, generators))


def verify_block_batch(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                       generators: list) -> list[Verdict]:
    """Whole prefixes (the module's docstring): a = the last i with u_i < h_i; the appended
    token from P_k if a = k, else from the residual scaled by w_a."""
    k = _check_rows(target_probs, draft_tokens, draft_probs)
    uniforms = _uniforms(k, target_probs, generators)
    weights = _prefix_weights(target_probs, draft_tokens, draft_probs)
    thresholds = _block_thresholds(weights, target_probs, draft_probs)
    passed = (uniforms < thresholds) * torch.arange(1, k + 1, device=uniforms.device)
    accepted = passed.amax(dim=1)
    return _verdicts(draft_tokens, accepted, _draw_last(target_probs, draft_probs, accepted, weights, generators))


def verify_synthetic_batch(target_probs: torch.Tensor, draft_tokens: torch.Tensor, acceptance_length: float,
                           generators: list, greedy: list[bool] | None = None) -> list[Verdict]:
    """NOT lossless, for benchmarks only: keeps draft tokens whatever they are, to run the engine
    at a chosen expected acceptance length L (tokens committed per step, accepted drafts + 1).
    Each position is kept with the rate r that solves 1 + r + ... + r^k = L, in turn until the
    first one that is not (`synthetic_accepted`); the appended token is drawn from the target's row
    at that position. A request at temperature 0 (greedy[i]; its row a one-hot) takes the row's
    argmax without a draw: its generator gives the k uniforms a step and nothing else, as in the
    whole step (spec/step_graph.py), so both paths accept alike."""
    k = _check_rows(target_probs, draft_tokens)
    rate = synthetic_acceptance_rate(acceptance_length, k)
    accepted = synthetic_accepted(_uniforms(k, target_probs, generators), rate)
    rows = target_probs.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    last = rows.argmax(dim=-1)
    sampled = [i for i in range(len(generators)) if not (greedy and greedy[i])]
    if sampled:
        last[sampled] = _draw(rows[sampled], [generators[i] for i in sampled])
    return _verdicts(draft_tokens, accepted, last)


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
               weights: torch.Tensor | None, generators: list) -> torch.Tensor:
    """The appended token of each request: from P_k where all k were kept, else from the
    residual at the first position not kept (scaled by w_a for block, `weights` given)."""
    k, vocab = draft_probs.shape[1], target_probs.shape[-1]
    at = accepted.clamp(max=k - 1).view(-1, 1, 1).expand(-1, 1, vocab)
    weight = 1.0 if weights is None else weights.gather(1, accepted.clamp(max=k - 1)[:, None])
    residual = _residual(target_probs.gather(1, at).squeeze(1), draft_probs.gather(1, at).squeeze(1), weight)
    rows = torch.where((accepted == k)[:, None], target_probs[:, k], residual)
    return _draw(rows, generators)


def _residual(target_rows: torch.Tensor, draft_rows: torch.Tensor, weight=1.0) -> torch.Tensor:
    """max(weight * target - draft, 0) per row [R, V], unnormalised (sample_from normalises); a
    row's target row itself when that is all zero."""
    residual = (weight * target_rows - draft_rows).clamp(min=0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_rows)


def _capped_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """min(1, numerator / denominator) for numerators >= 0, with 0 wherever the numerator is 0."""
    ratio = numerator / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
    return torch.where(numerator <= 0, 0.0, torch.where(numerator >= denominator, 1.0, ratio))


def _uniforms(k: int, like: torch.Tensor, generators: list) -> torch.Tensor:
    # Drawn first and k of them in every sampled method, so that one generator state gives standard
    # and block the same uniforms: the tests compare the two on equal draws.
    return torch.stack([torch.rand(k, generator=g, device=like.device) for g in generators])


def _draw(rows: torch.Tensor, generators: list) -> torch.Tensor:
    """One token from each row [R, V], request i with generators[i]."""
    return torch.stack([sample_from(row, g) for row, g in zip(rows, generators)])


def _at_drafts(probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """probs[:, i, x_{i+1}] for i = 0..k-1, [R, k]."""
    k = draft_tokens.shape[1]
    return probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)


def _check_rows(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> int:
    k = draft_tokens.shape[1]
    if target.shape[1] != k + 1 or (draft_probs is not None and draft_probs.shape[1] != k):
        draft_rows = "" if draft_probs is None else f" and {draft_probs.shape[1]} draft rows"
        raise ValueError(f"{k} draft tokens need {k + 1} target rows and {k} draft rows, "
                         f"got {target.shape[1]} target rows{draft_rows}")
    return k


def _verdicts(draft_tokens: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> list[Verdict]:
    return read_verdicts(verdict_rows(draft_tokens, accepted, last))


def verdict_rows(draft_tokens: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The requests' verdicts as one device tensor [R, k + 2]: row i's first a_i + 1 entries are
    the tokens it commits (its a_i accepted drafts, then `last`), its final entry a_i."""
    committed = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1).scatter(1, accepted[:, None], last[:, None])
    return torch.cat([committed, accepted[:, None]], dim=1)


def read_verdicts(rows: torch.Tensor) -> list[Verdict]:
    """The verdicts of `verdict_rows`, from one read of the device."""
    return [Verdict(row[-1], row[:row[-1] + 1]) for row in rows.tolist()]
