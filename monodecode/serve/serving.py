"""The OpenAI endpoints' logic: parse, check, run on the AsyncEngine, answer (whole or streamed).

Every request is checked in full (fields, model name, length) before the engine sees it, so a
bad request costs nothing and gets a 400/404 in the OpenAI error shape. A request whose client
went away (its stream closed, or its task cancelled: app.py) leaves `AsyncEngine.generate`, which
aborts it and frees its slot. A request the engine aborted itself (the server shutting down) gets
a 503.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi.responses import StreamingResponse

from ..engine.async_engine import AsyncEngine
from ..engine.params import SamplingParams
from . import protocol
from .chat import ChatTemplate
from .errors import APIError, bad_request
from .format import Formatter, Result, sse, usage


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer, chat_template: ChatTemplate):
        self.engine, self.model_name, self.tokenizer, self.chat_template = engine, model_name, tokenizer, chat_template
        self.format = Formatter(model_name, tokenizer)
        self.max_model_len = engine.engine.max_model_len

    async def completions(self, body: dict):
        request = protocol.parse(protocol.CompletionRequest, body)
        self._check_model(request.model)
        opts = protocol.options(request)
        prompts = [self.encode(p) for p in protocol.completion_prompts(request)]
        logprobs = request.logprobs
        params = protocol.sampling_params(request, max_tokens=protocol.completion_max_tokens(request),
                                          logprobs=logprobs, echo=bool(request.echo))
        for prompt in prompts:
            self._check(prompt, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if opts.stream:
            if len(prompts) != 1:
                raise bad_request("stream takes a single prompt", "prompt")
            return self._stream(self._completion_chunks(request_id, prompts[0], params, opts))
        results = await asyncio.gather(*(self._run(f"{request_id}-{i}", p, params) for i, p in enumerate(prompts)))
        choices = [self.format.completion_choice(i, r, p, self._text(p), params.echo, logprobs is not None,
                                                 opts.return_token_ids)
                   for i, (p, r) in enumerate(zip(prompts, results))]
        return {**self.format.head(request_id, "text_completion"), "choices": choices,
                "usage": usage(sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results))}

    async def chat(self, body: dict):
        request = protocol.parse(protocol.ChatRequest, body)
        self._check_model(request.model)
        opts = protocol.options(request)
        text = self.chat_template.render([m.model_dump(exclude_none=True) for m in request.messages])
        prompt = self.encode(text, self.chat_template.adds_special_tokens)
        max_tokens = protocol.chat_max_tokens(request, len(prompt), self.max_model_len)
        params = protocol.sampling_params(request, max_tokens=max_tokens, logprobs=protocol.chat_logprobs(request))
        self._check(prompt, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if opts.stream:
            return self._stream(self._chat_chunks(request_id, prompt, params, opts))
        result = await self._run(request_id, prompt, params)
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": self.format.chat_logprobs(result.logprobs) if params.logprobs is not None else None,
                  "finish_reason": result.finish_reason}
        return {**self.format.head(request_id, "chat.completion"), "choices": [choice],
                "usage": usage(result.prompt_tokens, result.completion_tokens)}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(self.model_name)]}

    def model_card(self, model_id: str) -> dict:
        self._check_model(model_id)
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "monodecode",
                "max_model_len": self.max_model_len}

    def tokenize(self, body: dict) -> dict:
        request = protocol.parse(protocol.TokenizeRequest, body)
        self._check_model(request.model)
        tokens = self.encode(request.prompt, request.add_special_tokens is not False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def detokenize(self, body: dict) -> dict:
        request = protocol.parse(protocol.DetokenizeRequest, body)
        self._check_model(request.model)
        vocab = self.engine.engine.model.config.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary of {vocab}", "tokens")
        if self.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer: token ids have no text", "tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer: send the prompt as token ids", "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.engine.check(prompt, params)
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            param = "prompt" if code or "prompt" in str(e) else protocol.param_of(str(e))
            raise bad_request(str(e), param, code) from None

    def _text(self, prompt_ids: list[int]) -> str:
        return self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else ""

    async def _run(self, request_id: str, prompt: list[int], params: SamplingParams) -> Result:
        result = Result()
        async for out in self.engine.generate(request_id, prompt, params):
            _raise_on_error(out)
            result.add(out)
        return result

    async def _completion_chunks(self, request_id, prompt, params, opts):
        head, result = self.format.head(request_id, "text_completion"), Result()
        prompt_text = self._text(prompt)
        async for out in self.engine.generate(request_id, prompt, params):
            _raise_on_error(out)
            first = result.prompt_tokens == 0
            result.add(out)
            echoed = prompt_text if params.echo and first else ""
            logprobs = None
            if params.logprobs is not None:
                logprobs = self.format.completion_logprobs(out, prompt, prompt_text, params.echo)
            yield {**head, "choices": [{"index": 0, "text": echoed + out.text, "logprobs": logprobs,
                                        "finish_reason": out.finish_reason}]}
        if opts.include_usage:
            yield {**head, "choices": [], "usage": usage(result.prompt_tokens, result.completion_tokens)}

    async def _chat_chunks(self, request_id, prompt, params, opts):
        head, result = self.format.head(request_id, "chat.completion.chunk"), Result()
        yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        async for out in self.engine.generate(request_id, prompt, params):
            _raise_on_error(out)
            result.add(out)
            logprobs = self.format.chat_logprobs(out.logprobs) if params.logprobs is not None else None
            delta = {"content": out.text} if out.text else {}
            yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": out.finish_reason}]}
        if opts.include_usage:
            yield {**head, "choices": [], "usage": usage(result.prompt_tokens, result.completion_tokens)}

    @staticmethod
    def _stream(chunks) -> StreamingResponse:
        async def events():
            try:
                async for chunk in chunks:
                    yield sse(chunk)
            except APIError as e:  # headers are sent: the error travels as an event
                yield sse(e.body())
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def _raise_on_error(out) -> None:
    if out.finish_reason == "error":
        raise APIError(500, out.error or "the engine failed", type="server_error")
    if out.finish_reason == "abort":  # by the engine, not the client (it would not be listening)
        raise APIError(503, out.error or "the request was aborted", type="server_error")
