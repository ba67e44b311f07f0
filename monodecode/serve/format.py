"""Engine outputs -> OpenAI response bodies: completions and chat, whole or as stream chunks.

Token strings in logprobs are the token's own decoded text, or `token_id:N` where a token has
none (no tokenizer, or a byte-level id outside the bytes). Completions logprobs follow the
legacy shape (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`);
with `echo` the prompt's tokens come first, the very first with null logprobs. As in OpenAI's,
`top_logprobs` holds the sampled token too; where two tokens decode alike, the later one is
keyed `token_id:N`, so none is lost and the sampled token keeps the key `tokens` shows.
`text_offset` is where each token's text starts in the choice's text (a token inside an
unfinished multi-byte character starts where that character does). Chat logprobs follow the
chat shape (`content`: [{token, logprob, bytes, top_logprobs}]).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..engine.logprobs import TokenLogprob
from ..engine.request import RequestOutput
from ..engine.tokenizer import text_offsets


@dataclass
class Result:
    """A request's outputs added up."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.text_offsets += out.text_offsets
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

    def completion_logprobs(self, out: RequestOutput | Result, prompt_ids: list[int], prompt_text: str,
                            echo: bool) -> dict:
        """Legacy logprobs of a request's output (whole or one chunk of it), offsets counted in
        the choice's text; with `echo`, the prompt's come first where `out` holds them."""
        shift = len(prompt_text) if echo else 0
        ids, entries, offsets = out.token_ids, out.logprobs, [shift + o for o in out.text_offsets]
        if echo and out.prompt_logprobs is not None:
            prompt_offsets = text_offsets(self.tokenizer, prompt_ids) if self.tokenizer else [0] * len(prompt_ids)
            ids, entries, offsets = prompt_ids + ids, out.prompt_logprobs + entries, prompt_offsets + offsets
        return {"tokens": [self.token_text(t) for t in ids],
                "token_logprobs": [e.logprob if e is not None else None for e in entries],
                "top_logprobs": [self.top_logprobs(e) if e is not None else None for e in entries],
                "text_offset": offsets}

    def top_logprobs(self, entry: TokenLogprob) -> dict[str, float]:
        """{token: logprob} of the most likely tokens and the sampled one, most likely first. The
        sampled token is keyed by its text (as in `tokens`); a token whose text is already a key is
        keyed `token_id:N` instead of overwriting it."""
        ranked = list(entry.top)
        if all(t != entry.token_id for t, _ in ranked):
            ranked = sorted(ranked + [(entry.token_id, entry.logprob)], key=lambda item: -item[1])
        keys = {entry.token_id: self.token_text(entry.token_id)}
        for t, _ in ranked:
            if t not in keys:
                text = self.token_text(t)
                keys[t] = text if text not in keys.values() else f"token_id:{t}"
        return {keys[t]: lp for t, lp in ranked}

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
            choice["logprobs"] = self.completion_logprobs(result, prompt_ids, prompt_text, echo)
        if return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, result.token_ids
        return choice


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
