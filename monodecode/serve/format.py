"""Engine outputs -> OpenAI response bodies: completions and chat, whole or as stream chunks.

Token strings in logprobs are the token's own decoded text, or `token_id:N` where a token has
none (no tokenizer, or a byte-level id outside the bytes). Completions logprobs follow the
legacy shape (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`);
with `echo` the prompt's tokens come first, the very first with null logprobs. Chat logprobs
follow the chat shape (`content`: [{token, logprob, bytes, top_logprobs}]).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..engine.logprobs import TokenLogprob
from ..engine.request import RequestOutput


@dataclass
class Result:
    """A request's outputs added up."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.prompt_logprobs = out.prompt_logprobs if out.prompt_logprobs is not None else self.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens


class Formatter:
    def __init__(self, model_name: str, tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
        return text or f"token_id:{token_id}"

    def head(self, request_id: str, kind: str) -> dict:
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    def completion_logprobs(self, entries: list[TokenLogprob | None], prompt_ids: list[int],
                            offset: int = 0) -> dict:
        """Legacy logprobs; `prompt_ids` name the entries that are None (the first prompt token)."""
        tokens, values, tops, offsets = [], [], [], []
        for i, entry in enumerate(entries):
            token = self.token_text(entry.token_id if entry is not None else prompt_ids[i])
            tokens.append(token)
            values.append(entry.logprob if entry is not None else None)
            tops.append({self.token_text(t): lp for t, lp in entry.top} if entry is not None else None)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def completion_choice(self, index: int, result: Result, prompt_ids: list[int], prompt_text: str,
                          echo: bool, logprobs: bool, return_token_ids: bool) -> dict:
        choice = {"index": index, "text": (prompt_text if echo else "") + result.text, "logprobs": None,
                  "finish_reason": result.finish_reason}
        if logprobs:
            entries = (result.prompt_logprobs or []) + result.logprobs if echo else result.logprobs
            choice["logprobs"] = self.completion_logprobs(entries, prompt_ids)
        if return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, result.token_ids
        return choice


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
