"""OpenAI request bodies -> engine inputs, with every bad value an APIError naming its field.

Completions: `prompt` is a string, a list of strings, a list of token ids, or a list of lists
of token ids (one choice each). Both endpoints take `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`,
`ignore_eos`, `n` (1 only), `stream`, `stream_options.include_usage`; completions `logprobs`
(an int), `echo` and `return_token_ids`; chat `logprobs` (a bool) and `top_logprobs`. Other
fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.params import SamplingParams
from .errors import bad_request

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Options:
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def field(body: dict, name: str, kinds, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad_request(f"{name} must be {_names(kinds)}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {_names(kinds)}, got {value!r}", name)
    return value


def sampling_params(body: dict, *, max_tokens: int | None, logprobs: int | None, echo: bool = False) -> SamplingParams:
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(field(body, "temperature", (int, float), 1.0)),
            top_p=float(field(body, "top_p", (int, float), 1.0)), top_k=field(body, "top_k", int, 0),
            seed=field(body, "seed", int), stop=tuple(stop), stop_token_ids=tuple(field(body, "stop_token_ids", list, [])),
            ignore_eos=field(body, "ignore_eos", bool, False), logprobs=logprobs, echo=echo)
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from None


def options(body: dict) -> Options:
    if field(body, "n", int, 1) != 1:
        raise bad_request("only n = 1 is supported", "n")
    stream_options = field(body, "stream_options", dict, {})
    return Options(field(body, "stream", bool, False), bool(stream_options.get("include_usage")),
                   field(body, "return_token_ids", bool, False))


def completion_prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return prompt
    raise bad_request("prompt must be a string, a list of strings, a non-empty list of token ids, or a list "
                      "of such lists", "prompt")


def completion_max_tokens(body: dict) -> int:
    return field(body, "max_tokens", int, DEFAULT_COMPLETION_TOKENS)


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad_request("messages must be a non-empty list of objects with a role and content", "messages")
    return messages


def chat_max_tokens(body: dict, prompt_len: int, max_model_len: int) -> int:
    """The client's limit, or whatever room the model length leaves (as vLLM does)."""
    given = field(body, "max_completion_tokens", int)
    given = field(body, "max_tokens", int) if given is None else given
    return given if given is not None else max(max_model_len - prompt_len, 1)


def chat_logprobs(body: dict) -> int | None:
    if not field(body, "logprobs", bool, False):
        return None
    return field(body, "top_logprobs", int, 0)


def _param_of(message: str) -> str | None:
    name = message.split(" ", 1)[0]
    return name if name.isidentifier() else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    words = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
    return " or ".join(words[k] for k in kinds)
