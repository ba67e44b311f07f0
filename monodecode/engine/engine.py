"""Engine: requests in, tokens out, with continuous batching on one model (one thread).

Each `step()`:
1. the scheduler admits waiting requests into free cache slots and picks the prompt chunks to
   prefill (per-op) within the step's token budget;
2. every request whose prompt is done decodes in one step: a row each (`Decoder.step`, which
   picks the path: the mono kernels or per-op), or under speculation 1 + k rows each
   (`SpeculativeDecoder.step`, its verify rows through the same `Decoder`, or, with the kernels
   running target and draft, the whole step at once); the metrics count the path each
   decode step took (mono, per-op, or whole);
3. the prompt chunks run, together in one per-op step (one step each under speculation); the
   last chunk of a prompt samples the request's first token;
4. finished requests leave, their slots cleared and freed.
It returns one RequestOutput per request that produced something. `abort` ends a request at
once and frees its slot. The running and waiting gauges are published at every change (admission,
arrival, release), so they are true between steps too. The engine is not thread-safe:
AsyncEngine drives it from one thread.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from ..decode import Decoder
from ..model import Model
from ..sampling import sample
from ..spec.config import SpeculativeConfig
from ..spec.decoder import SpecRequest, SpeculativeDecoder
from .logprobs import token_logprobs
from .metrics import Metrics
from .params import SamplingParams
from .request import Request, RequestOutput
from .scheduler import Scheduler


class Engine:
    def __init__(self, model: Model | Decoder, *, max_model_len: int, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512, speculative: SpeculativeConfig | None = None,
                 mono: str = "auto", tokenizer=None, metrics: Metrics | None = None):
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        # the model's steps on the path each takes: the mono kernels ("auto", "on") or per-op
        self.model = Decoder(model, mono)
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.decoder = None
        if speculative is not None:
            self.decoder = SpeculativeDecoder(self.model, speculative, target_step=self._decode_step,
                                              count_path=self._count_speculative_step)
            self.caches = self.decoder.make_caches(max_num_seqs, max_model_len + self.decoder.block_size + 1)
        else:
            self.caches = self.model.make_cache(max_num_seqs, max_model_len, max_step_rows=1)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot run; safe to call from any thread."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary of {vocab}")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # it could never stop the request
            raise ValueError(f"stop_token_ids contains {bad}, outside the vocabulary of {vocab}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens} "
                             f"({len(prompt_ids) + params.max_tokens} in all)")
        if self.decoder is not None:
            self.decoder.config.check_temperature(params.temperature)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check(prompt_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        eos = self.model.config.eos_token_id
        stop_ids = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        request = Request(request_id, list(prompt_ids), params, stop_ids, self.tokenizer, self.model.device)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._publish_load()

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.abort()
            self._release(request)

    def fail_all(self, error: str, finish_reason: str = "error") -> list[RequestOutput]:
        """End every request with `error` (after a step raised: "error"; at shutdown: "abort"), the
        outputs that tell their callers; the engine stays usable."""
        outputs = []
        for request in list(self.requests.values()):
            request.finish_reason = finish_reason
            self._release(request)
            outputs.append(RequestOutput(request.id, [], "", finished=True, finish_reason=finish_reason, error=error))
        return outputs

    def warm_up(self) -> None:
        """One decode step of pad rows (slot -1: no cache written, no expert routed) at every width
        this engine's decode steps can have (1 to max_num_seqs requests, 1 + k rows each under
        speculation), so that what a width costs the first time (on a GPU: the CUDA-graph
        capture; on mono the kernels' builds at that width, a minute or more) is paid now and not
        in the first steps of the requests that reach it. Touches no request, slot or metric."""
        per_request = 1 if self.decoder is None else self.decoder.block_size + 1
        cache = self.caches if self.decoder is None else self.caches.target
        fallbacks = self.model.fallbacks.copy()  # steps too wide for the kernels
        for n in tqdm(range(1, self.max_num_seqs + 1), desc="warming up the decode steps", unit="width"):
            rows = n * per_request
            self.model.step(cache, [0] * rows, [0] * rows, [-1] * rows)
        self.model.fallbacks = fallbacks

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self._publish_load()  # admissions
        if plan.decode:
            self._decode(plan.decode)
        if plan.prefill:
            self._prefill(plan.prefill)
        outputs = []
        for request in plan.decode + [r for r, _, _ in plan.prefill]:
            out = request.take_output()
            if out is not None:
                outputs.append(out)
                self._count(request, out)
            if request.finished:
                self._release(request)
        self._publish_load()  # the acceptance length
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline: run every prompt to the end, batched; the output token ids of each."""
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        tokens = {request_id: [] for request_id in ids}
        while self.has_work():
            for out in self.step():
                tokens[out.request_id] += out.token_ids
        return [tokens[request_id] for request_id in ids]

    def _decode(self, requests: list[Request]) -> None:
        if self.decoder is not None:
            # the verify rows' logits only for logprobs (a whole step's are the graph's: copied out)
            if any(r.params.logprobs is not None for r in requests):
                committed, logits = self.decoder.step(self.caches, [r.spec for r in requests], return_logits=True)
            else:
                committed = self.decoder.step(self.caches, [r.spec for r in requests])
                logits = [None] * len(requests)
            for request, tokens, rows in zip(requests, committed, logits):
                for token, logprob in zip(tokens, self._logprobs(request, rows, tokens)):
                    request.append(token, logprob)
            return
        logits = self._decode_step(self.caches, [r.output_ids[-1] for r in requests],
                                   [r.next_position for r in requests], [r.slot for r in requests])
        for request, row in zip(requests, logits):
            self._sample(request, row[None])

    def _decode_step(self, cache, tokens, positions, slots, return_hidden: bool = False):
        """A decode or verify step, counted by the path it took (prefill chunks are not counted)."""
        out = self.model.step(cache, tokens, positions, slots, return_hidden=return_hidden)
        self.metrics.count_step(self.model.last_path)
        return out

    def _count_speculative_step(self, path: str) -> None:
        """A whole speculative step is counted as such; a stepwise one was counted by the path
        its verify step took (`_decode_step`)."""
        if path == "whole":
            self.metrics.count_step(path)

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> None:
        """Run prompt chunks: in one step for all of them, or one each under speculation (the
        draft's rings take each request's features)."""
        if self.decoder is not None:
            logits = [self.decoder.prefill_chunk(self.caches, r.slot, r.prompt_ids[start:end], start)
                      for r, start, end in chunks]
        else:
            tokens = [t for r, start, end in chunks for t in r.prompt_ids[start:end]]
            positions = [p for _, start, end in chunks for p in range(start, end)]
            slots = [r.slot for r, start, end in chunks for _ in range(start, end)]
            logits = self.model.step(self.caches, tokens, positions, slots).split([end - start for _, start, end in chunks])
        for (request, start, end), rows in zip(chunks, logits):
            self._after_prefill(request, start, end, rows)

    def _after_prefill(self, request: Request, start: int, end: int, logits) -> None:
        self.metrics.count_prefill_chunk(end - start)
        request.computed = end
        if request.params.echo:
            scored = request.prompt_ids[start + 1:end + 1]  # row i predicts the token after it
            request.add_prompt_logprobs(token_logprobs(logits, scored, request.params.logprobs or 0))
        if request.prefilled:
            token = self._sample(request, logits[-1:])
            if self.decoder is not None:
                p = request.params
                request.spec = SpecRequest(request.slot, len(request.prompt_ids), token, p.temperature, p.top_p,
                                           request.generator, p.top_k)

    def _sample(self, request: Request, logits) -> int:
        p = request.params
        token = int(sample(logits, p.temperature, p.top_p, request.generator, p.top_k))
        request.append(token, self._logprobs(request, logits, [token])[0])
        return token

    def _logprobs(self, request: Request, logits, tokens: list[int]) -> list:
        if request.params.logprobs is None:
            return [None] * len(tokens)
        return token_logprobs(logits, tokens, request.params.logprobs)

    def _count(self, request: Request, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.token_ids:
            first = request.first_token_at is None
            ttft = now - request.arrival if first else None
            gap = None if first else now - request.last_token_at
            self.metrics.count_tokens(len(out.token_ids), ttft, gap)
            request.first_token_at = request.first_token_at or now
            request.last_token_at = now

    def _release(self, request: Request) -> None:
        if self.requests.pop(request.id, None) is None:
            return
        slot = self.scheduler.remove(request)
        if slot is not None and self.decoder is not None:
            self.caches.target.clear(slot)
            self.caches.draft.clear(slot)
        elif slot is not None:
            self.caches.clear(slot)
        self._publish_load()  # before the count, so that a reader who sees the count sees the slot free
        self.metrics.count_finished(request.finish_reason)

    def _publish_load(self) -> None:
        acceptance = self.decoder.stats.mean_acceptance_length if self.decoder else 0.0
        self.metrics.set_load(len(self.scheduler.running), len(self.scheduler.waiting), acceptance)
