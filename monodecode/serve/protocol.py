"""OpenAI request bodies -> engine inputs. Each endpoint's body is a strict pydantic model (a
number is not a string, an integer is not `true` or `4.5`), and a bad value is a 400 naming its
field (`param`, e.g. `messages[0].content`); sampling values out of range are refused by
SamplingParams, in the same shape. Null means "not given" for every optional field.

Both endpoints take `model`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `n` (1 only), `stream`, `stream_options.include_usage` (with
`stream` only) and `user` (accepted and ignored: it names the end user and changes nothing).
Completions: `prompt` (a string, a list of strings, a list of token ids, or a list of lists of
token ids: one choice each), `logprobs` (an int), `echo`, `return_token_ids`. Chat: `messages`
(role system, developer, user, assistant or tool; content a string or a list of text parts,
required but for the assistant's), `max_completion_tokens`, `logprobs` (a bool), `top_logprobs`. /tokenize: `model`, `prompt`,
`add_special_tokens`; /detokenize: `model`, `tokens`.

Any other field is refused with a 400 naming it (code `unsupported_parameter`), as OpenAI refuses
arguments it does not know, unless it is null or at the value that changes nothing
(`NO_OP_VALUES`: `best_of` 1, `presence_penalty` 0, ...), which some clients send by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..engine.params import MAX_LOGPROBS, SamplingParams
from .errors import APIError, bad_request

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 1.0, 1.0, 0
NO_OP_VALUES = {
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": "",
    "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
    "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,  # vLLM's sampling extensions
}


def _one_of(description: str, accepts: Callable[[Any], bool]):
    """A field of several shapes, refused with one message (pydantic's would name every shape)."""
    def check(value):
        if not accepts(value):
            raise PydanticCustomError("invalid_shape", "Input should be {description}", {"description": description})
        return value

    return Annotated[Any, AfterValidator(check)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _is_prompt(value) -> bool:
    return isinstance(value, str) or _is_token_ids(value) or (
        isinstance(value, list) and bool(value) and all(isinstance(p, str) or _is_token_ids(p) for p in value))


def _is_stop(value) -> bool:
    return value is None or isinstance(value, str) or isinstance(value, list) and all(isinstance(s, str) for s in value)


def _is_content(value) -> bool:
    return value is None or isinstance(value, str) or isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value)


Prompt = _one_of("a string, a list of strings, a non-empty list of token ids, or a list of such lists", _is_prompt)
Stop = _one_of("a string or a list of strings", _is_stop)
Content = _one_of('a string or a list of text parts ({"type": "text", "text": ...}); image, audio and file parts '
                  'are not supported: monodecode serves the text model only', _is_content)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the chat template may read them
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and self.role != "assistant":  # an assistant's may be null (tool calls)
            raise PydanticCustomError("missing_content", "a {role} message needs content", {"role": self.role})
        return self


class _Body(_Strict):
    model_config = ConfigDict(extra="allow")  # kept to be refused by name (`parse`)
    model: str | None = None


class _Request(_Body):
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None
    return_token_ids: bool | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(_Body):  # POST /tokenize, as vLLM's
    prompt: str
    add_special_tokens: bool | None = None


class DetokenizeRequest(_Body):  # POST /detokenize
    tokens: list[int]


@dataclass
class Options:
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def parse(model: type[_Body], body: dict):
    """The body as `model`, or an APIError naming the first bad or unsupported field."""
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _field_error(e.errors()[0]) from None
    refused = [name for name, value in request.model_extra.items() if not _is_no_op(name, value)]
    if refused:
        only = [f"{name} only as {json.dumps(NO_OP_VALUES[name])}" for name in refused if name in NO_OP_VALUES]
        raise APIError(400, f"unsupported field(s) {', '.join(refused)}: this server does not implement them"
                            + (f" (it accepts {', '.join(only)}, which changes nothing)" if only else ""),
                       param=refused[0], code="unsupported_parameter")
    return request


def sampling_params(request: _Request, *, max_tokens: int | None, logprobs: int | None,
                    echo: bool = False) -> SamplingParams:
    stop = request.stop or []
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=_given(request.temperature, DEFAULT_TEMPERATURE),
            top_p=_given(request.top_p, DEFAULT_TOP_P), top_k=_given(request.top_k, DEFAULT_TOP_K),
            seed=request.seed, stop=tuple([stop] if isinstance(stop, str) else stop),
            stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=bool(request.ignore_eos),
            logprobs=logprobs, echo=echo)
    except ValueError as e:
        param = param_of(str(e))
        if param == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"  # chat's newer name for it, the one the client sent
        raise bad_request(str(e), param) from None


def options(request: _Request) -> Options:
    if _given(request.n, 1) != 1:
        raise bad_request(f"n: only 1 is supported, got {request.n}", "n")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options: only allowed with stream: true", "stream_options")
    include_usage = request.stream_options is not None and bool(request.stream_options.include_usage)
    return Options(bool(request.stream), include_usage, bool(getattr(request, "return_token_ids", False)))


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    prompt = request.prompt
    return [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else prompt


def completion_max_tokens(request: CompletionRequest) -> int:
    return _given(request.max_tokens, DEFAULT_COMPLETION_TOKENS)


def chat_max_tokens(request: ChatRequest, prompt_len: int, max_model_len: int) -> int:
    """The client's limit, or whatever room the model length leaves (as vLLM does)."""
    given = _given(request.max_completion_tokens, request.max_tokens)
    return given if given is not None else max(max_model_len - prompt_len, 1)


def chat_logprobs(request: ChatRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs: only allowed with logprobs: true", "top_logprobs")
    return _given(request.top_logprobs, 0) if request.logprobs else None


def param_of(message: str) -> str | None:
    """The field an error message starts with ("temperature must be >= 0, ...")."""
    name = message.split(" ", 1)[0]
    return name if name.isidentifier() else None


def _given(value, default):
    return default if value is None else value


def _is_no_op(name: str, value) -> bool:
    if value is None:
        return True
    if name not in NO_OP_VALUES:
        return False
    no_op = NO_OP_VALUES[name]
    return value == no_op and isinstance(value, bool) == isinstance(no_op, bool)  # true is not 1 here


def _field_error(error: dict) -> APIError:
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
    got = "" if error["type"] == "missing" else f", got {_short(error['input'])}"
    return bad_request(f"{param}: {error['msg']}{got}", param or None)


def _short(value) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."
