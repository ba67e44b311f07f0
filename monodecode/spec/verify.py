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

from ..sampling import probabilities, sample_from
from .config import REJECTION_SAMPLE_METHODS


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted, 0..k
    tokens: list[int]  # the tokens to commit: draft[:accepted] + [one more token]


def verify(method: str, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor, *, temperature: float, top_p: float, top_k: int = 0,
           generator: torch.Generator | None, acceptance_length: float | None = None) -> Verdict:
    """Verify one request's draft with `method` (a SpeculativeConfig.rejection_sample_method).
    target_logits [k + 1, V], draft_tokens [k], draft_probs [k, V]; `acceptance_length` is read
    by "synthetic" only."""
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {list(REJECTION_SAMPLE_METHODS)}")
    if method == "greedy":
        return verify_greedy(target_logits, draft_tokens)
    target_probs = probabilities(target_logits, temperature, top_p, top_k)
    if method == "synthetic":
        return verify_synthetic(target_probs, draft_tokens, acceptance_length, generator)
    verifier = verify_block if method == "block" else verify_standard
    return verifier(target_probs, draft_tokens, draft_probs, generator)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    _check_rows(target_logits, draft_tokens)
    return verify_greedy_batch(target_logits[None], draft_tokens[None])[0]


def verify_greedy_batch(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> list[Verdict]:
    """`verify_greedy` for R requests at once: target_logits [R, k + 1, V], draft_tokens [R, k];
    one read of the device's results for all of them."""
    k = draft_tokens.shape[-1]
    best = target_logits.argmax(dim=-1)
    accepted = (best[:, :k] == draft_tokens).cumprod(dim=1).sum(dim=1)
    drafts, accepted, best = draft_tokens.tolist(), accepted.tolist(), best.tolist()
    return [Verdict(a, d[:a] + [b[a]]) for d, a, b in zip(drafts, accepted, best)]


def verify_standard(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    k = _check_rows(target_probs, draft_tokens, draft_probs)
    uniforms = _uniforms(k, target_probs, generator)
    ratios = zip(_at_drafts(target_probs, draft_tokens), _at_drafts(draft_probs, draft_tokens))
    for i, (u, (target_p, draft_p)) in enumerate(zip(uniforms, ratios)):
        if not u < _capped_ratio(target_p, draft_p):
            return _verdict(draft_tokens, i, sample_from(_residual(target_probs[i], draft_probs[i]), generator))
    return _verdict(draft_tokens, k, sample_from(target_probs[k], generator))


def verify_block(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                 generator: torch.Generator | None) -> Verdict:
    k = _check_rows(target_probs, draft_tokens, draft_probs)
    uniforms = _uniforms(k, target_probs, generator)
    weights = _prefix_weights(target_probs, draft_tokens, draft_probs)
    thresholds = _block_thresholds(weights, target_probs, draft_probs)
    accepted = max((i + 1 for i, (u, h) in enumerate(zip(uniforms, thresholds)) if u < h), default=0)
    if accepted == k:
        return _verdict(draft_tokens, k, sample_from(target_probs[k], generator))
    residual = _residual(target_probs[accepted], draft_probs[accepted], weights[accepted])
    return _verdict(draft_tokens, accepted, sample_from(residual, generator))


def verify_synthetic(target_probs: torch.Tensor, draft_tokens: torch.Tensor, acceptance_length: float,
                     generator: torch.Generator | None) -> Verdict:
    """NOT lossless, for benchmarks only: keeps draft tokens whatever they are, to run the engine
    at a chosen expected acceptance length L (tokens committed per step, accepted drafts + 1).
    Each position is kept with the rate r that solves 1 + r + ... + r^k = L, in turn until the
    first one that is not; the appended token is drawn from the target's row at that position
    (its argmax at temperature 0)."""
    k = _check_rows(target_probs, draft_tokens)
    rate = synthetic_acceptance_rate(acceptance_length, k)
    uniforms = _uniforms(k, target_probs, generator)
    accepted = next((i for i, u in enumerate(uniforms) if not u < rate), k)
    return _verdict(draft_tokens, accepted, sample_from(target_probs[accepted], generator))


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


def _prefix_weights(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    draft_probs: torch.Tensor) -> list[float]:
    """Block verification's w_0..w_k."""
    weights = [1.0]
    for target_p, draft_p in zip(_at_drafts(target_probs, draft_tokens), _at_drafts(draft_probs, draft_tokens)):
        weights.append(_capped_ratio(weights[-1] * target_p, draft_p))
    return weights


def _block_thresholds(weights: list[float], target_probs: torch.Tensor, draft_probs: torch.Tensor) -> list[float]:
    """Block verification's h_1..h_k."""
    k = len(weights) - 1
    scale = torch.tensor(weights[1:k], dtype=target_probs.dtype, device=target_probs.device)[:, None]
    masses = (scale * target_probs[1:k] - draft_probs[1:k]).clamp(min=0).sum(dim=-1).tolist()
    return [_keep_probability(mass, w) for mass, w in zip(masses, weights[1:k])] + [weights[k]]


def _keep_probability(residual_mass: float, weight: float) -> float:
    denominator = residual_mass + 1 - weight
    return residual_mass / denominator if denominator > 0 else 1.0


def _residual(target_row: torch.Tensor, draft_row: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """max(weight * target - draft, 0), unnormalised (sample_from normalises); the target row
    itself when that is all zero."""
    residual = (weight * target_row - draft_row).clamp(min=0)
    return residual if residual.sum() > 0 else target_row


def _capped_ratio(numerator: float, denominator: float) -> float:
    """min(1, numerator / denominator) for a numerator >= 0, with 0 whenever the numerator is 0."""
    if numerator <= 0:
        return 0.0
    return 1.0 if numerator >= denominator else numerator / denominator


def _uniforms(k: int, like: torch.Tensor, generator: torch.Generator | None) -> list[float]:
    # Drawn first and k of them in every sampled method, so that one generator state gives standard
    # and block the same uniforms: the tests compare the two on equal draws.
    return torch.rand(k, generator=generator, device=like.device).tolist()


def _at_drafts(probs: torch.Tensor, draft_tokens: torch.Tensor) -> list[float]:
    """probs[i, x_{i+1}] for i = 0..k-1."""
    k = draft_tokens.shape[0]
    return probs[:k].gather(1, draft_tokens.view(k, 1)).view(k).tolist()


def _check_rows(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> int:
    k = draft_tokens.shape[0]
    if target.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        draft_rows = "" if draft_probs is None else f" and {draft_probs.shape[0]} draft rows"
        raise ValueError(f"{k} draft tokens need {k + 1} target rows and {k} draft rows, "
                         f"got {target.shape[0]} target rows{draft_rows}")
    return k


def _verdict(draft_tokens: torch.Tensor, accepted: int, last: torch.Tensor) -> Verdict:
    return Verdict(accepted, draft_tokens[:accepted].tolist() + [int(last)])
