"""SpeculativeConfig: how speculative decoding runs, from the JSON that vLLM's `--speculative-config`
takes, e.g. `{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}`.

Keys:
- `method` (required): the draft model; "dspark" is the only one monodecode has.
- `num_speculative_tokens` (required, >= 1): draft tokens verified per step. DSpark proposes a whole
  block per step, so this must equal the draft's block size (`check_block_size`).
- `rejection_sample_method`: how the target verifies the draft (spec/verify.py): "standard"
  (the default; "probabilistic" is an alias), "block", "greedy" or "synthetic".
- `synthetic_acceptance_length`: only, and always, with "synthetic": the expected tokens committed
  per step, in [1, num_speculative_tokens + 1].

"greedy" verification keeps the drafts that equal the target's argmax and adds the argmax, so it
decodes greedily whatever the temperature: a request at temperature > 0 is refused with it
(`check_temperature`) rather than sampled at its first token and greedy after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

DRAFT_METHODS = ("dspark",)
REJECTION_SAMPLE_METHODS = ("standard", "block", "greedy", "synthetic")
REJECTION_SAMPLE_ALIASES = {"probabilistic": "standard"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    rejection_sample_method: str = "standard"
    synthetic_acceptance_length: float | None = None

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"speculative config: method must be 'dspark' (the only draft monodecode has), "
                             f"got {self.method!r}")
        if not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative config: num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        # Frozen: the alias is resolved in place so that every reader sees the canonical name.
        object.__setattr__(self, "rejection_sample_method", _canonical_method(self.rejection_sample_method))
        self._check_synthetic_acceptance_length()

    @classmethod
    def from_json(cls, text_or_dict: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse the `--speculative-config` JSON (a string, or the already parsed dict)."""
        try:
            raw = json.loads(text_or_dict) if isinstance(text_or_dict, str) else text_or_dict
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON ({e}): {text_or_dict!r}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative config must be a JSON object, got {raw!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known keys are {known}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in raw]
        if missing:
            raise ValueError(f"speculative config: missing required keys {missing}")
        return cls(**raw)

    def check_block_size(self, block_size: int) -> None:
        """The draft proposes exactly `block_size` tokens a step; verifying another count would
        either drop drafts or verify tokens that were never drafted."""
        if self.num_speculative_tokens != block_size:
            raise ValueError(f"speculative config: num_speculative_tokens ({self.num_speculative_tokens}) must "
                             f"equal the DSpark draft's block size ({block_size}): the draft proposes a whole "
                             f"block per step")

    def check_temperature(self, temperature: float) -> None:
        """Refuse sampling (temperature > 0) under greedy verification, which cannot honour it."""
        if self.rejection_sample_method == "greedy" and temperature > 0:
            raise ValueError(f"temperature must be 0 with greedy speculative verification (it decodes greedily), "
                             f"got {temperature}; use rejection_sample_method 'standard' or 'block' to sample")

    def _check_synthetic_acceptance_length(self) -> None:
        length = self.synthetic_acceptance_length
        if self.rejection_sample_method != "synthetic":
            if length is not None:
                raise ValueError(f"speculative config: synthetic_acceptance_length ({length!r}) is only for "
                                 f"rejection_sample_method 'synthetic', not {self.rejection_sample_method!r}")
            return
        longest = self.num_speculative_tokens + 1
        if length is None:
            raise ValueError("speculative config: rejection_sample_method 'synthetic' needs "
                             "synthetic_acceptance_length")
        if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1 <= length <= longest:
            raise ValueError(f"speculative config: synthetic_acceptance_length must be a number in [1, "
                             f"num_speculative_tokens + 1] = [1, {longest}], got {length!r}")


def _canonical_method(name: Any) -> str:
    name = REJECTION_SAMPLE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"speculative config: rejection_sample_method must be one of "
                         f"{list(REJECTION_SAMPLE_METHODS)} (or 'probabilistic' for 'standard'), got {name!r}")
    return name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a token count
