"""Generation for one request, plain or speculative (CLI and tests): `Model.step`, so decode
steps run on the mono kernels where the model uses them, the rest per-op."""

from __future__ import annotations

import torch

from .model import Model
from .sampling import check_sampling, sample


def generate(model: Model, prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The continuation of `prompt_ids`: up to `max_tokens` tokens, ending early at a stop id."""
    _check_prompt(model, prompt_ids, max_tokens, temperature, top_p)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    n = len(prompt_ids)
    cache = model.make_cache(num_slots=1, max_context=n + max_tokens, max_step_rows=1)
    logits = model.step(cache, prompt_ids, range(n), [0] * n)[-1:]
    out: list[int] = []
    while True:
        token = int(sample(logits, temperature, top_p, generator))
        out.append(token)
        if token in stop_ids or len(out) == max_tokens:
            return out
        logits = model.step(cache, [token], [n + len(out) - 1], [0])


def _check_prompt(model: Model, prompt_ids: list[int], max_tokens: int, temperature: float,
                  top_p: float) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    check_sampling(temperature, top_p)
    vocab = model.config.vocab_size
    bad = [i for i, t in enumerate(prompt_ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {prompt_ids[bad[0]]} at index {bad[0]} is outside the "
                         f"vocabulary of {vocab}")


def generate_speculative(model: Model, prompt_ids: list[int], max_tokens: int, config, *,
                         temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                         stop_ids: tuple[int, ...] = ()):
    """Like `generate`, with DSpark speculative decoding per `config` (a SpeculativeConfig).
    Returns (tokens, acceptance stats)."""
    from .spec.decoder import SpeculativeDecoder

    _check_prompt(model, prompt_ids, max_tokens, temperature, top_p)
    decoder = SpeculativeDecoder(model, config)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    caches = decoder.make_caches(num_slots=1, max_context=len(prompt_ids) + max_tokens + decoder.block_size + 1)
    request = decoder.prefill(caches, 0, prompt_ids, temperature, top_p, generator)
    out = [request.anchor]
    while out[-1] not in stop_ids and len(out) < max_tokens:
        out += decoder.step(caches, [request])[0]
    return _until_stop(out, stop_ids)[:max_tokens], decoder.stats


def _until_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens
