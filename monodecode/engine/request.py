"""One request's life in the engine: waiting, prefilling (chunk by chunk), decoding, finished.

A request holds a cache slot from admission until it finishes or is aborted. Its prompt is
prefilled up to `computed`; after that its last sampled token (`output_ids[-1]`) is the one the
next decode step runs, at position `len(prompt_ids) + len(output_ids) - 1`.

Text: output ids are detokenized incrementally; the text is searched for the stop strings and
cut before the first one found (finish reason "stop"). While a request runs, the last
`len(longest stop) - 1` characters are held back, since they may be the start of a stop string.
Each output token's text offset is where its text starts in the request's text: the length of
the text before it, so a token inside an unfinished multi-byte character starts where that
character does, and none counts past a cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .logprobs import TokenLogprob
from .params import SamplingParams
from .tokenizer import IncrementalDetokenizer


@dataclass
class RequestOutput:
    """What one engine step produced for one request (deltas, not totals)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first output, when echo
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text_offsets: list[int] = field(default_factory=list)  # where each of token_ids' text starts in the request's text


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int],
                 tokenizer, device):
        self.id, self.prompt_ids, self.params, self.stop_ids = request_id, prompt_ids, params, stop_ids
        self.slot: int | None = None
        self.computed = 0  # prompt tokens prefilled
        self.output_ids: list[int] = []
        self.spec = None  # its SpecRequest once prefilled, under speculation
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.text, self.emitted = "", 0  # text so far (cut at a stop string), characters emitted
        self.finish_reason: str | None = None
        self.arrival, self.first_token_at, self.last_token_at = time.monotonic(), None, None
        self._delta_ids: list[int] = []
        self._delta_offsets: list[int] = []
        self._delta_logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.echo else None

    @property
    def prefilled(self) -> bool:
        return self.computed == len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_position(self) -> int:
        """The position of the token the next decode step runs (the last one sampled)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def add_prompt_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        self._prompt_logprobs += logprobs

    def append(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Take a sampled token unless the request has already finished (a speculative step may
        commit tokens past the end)."""
        if self.finished:
            return
        self.output_ids.append(token_id)
        self._delta_ids.append(token_id)
        self._delta_offsets.append(len(self.text))
        if logprob is not None:
            self._delta_logprobs.append(logprob)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"  # the stop token's text is not shown
        elif self.detokenizer is not None:
            self._add_text(self.detokenizer.add(token_id))
        if not self.finished and len(self.output_ids) == self.params.max_tokens:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None and self.finish_reason != "stop":
            self._add_text(self.detokenizer.flush())

    def abort(self) -> None:
        self.finish_reason = self.finish_reason or "abort"

    def take_output(self) -> RequestOutput | None:
        """The tokens and text since the last call, or None if nothing new."""
        hold = 0 if self.finished else max((len(s) for s in self.params.stop), default=1) - 1
        visible = max(len(self.text) - hold, self.emitted)
        if not self._delta_ids and not self.finished and visible == self.emitted:
            return None
        out = RequestOutput(self.id, self._delta_ids, self.text[self.emitted:visible], self._delta_logprobs,
                            finished=self.finished, finish_reason=self.finish_reason,
                            prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids),
                            text_offsets=[min(o, len(self.text)) for o in self._delta_offsets])
        if self._prompt_logprobs is not None and self.prefilled:
            out.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        self.emitted, self._delta_ids, self._delta_offsets, self._delta_logprobs = visible, [], [], []
        return out

    def _add_text(self, new: str) -> None:
        if not new or self.finished and self.finish_reason == "stop":
            return
        start = max(len(self.text) - max((len(s) for s in self.params.stop), default=0), 0)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
