"""SamplingParams: what one request asks of the engine, checked once when it arrives.

Field meanings follow vLLM / OpenAI: temperature 0 is greedy; top_k <= 0 and top_p = 1 are off;
`seed` makes sampling reproducible per request (None: a fresh random seed); the request ends
at `max_tokens`, at any of `stop` (strings, cut from the text, finish reason "stop"), at any of
`stop_token_ids`, or at the model's EOS unless `ignore_eos`. `logprobs` (None or k >= 0) asks
for the log-probability of each sampled token under the target's raw logits (before
temperature) and its k most likely alternatives; `echo` adds the prompt's tokens with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import check_sampling

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # torch.Generator seeds are 64-bit (negative ones would alias positive ones)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {list(self.stop_token_ids)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")

