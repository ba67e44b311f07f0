"""Which requests a step runs: admission into cache slots, chunked prefill, decode.

Requests wait in arrival order until a cache slot is free (`max_num_seqs` slots); none is
refused for want of a slot. Each step decodes every request whose prompt is done, together,
and prefills waiting prompts chunk by chunk, oldest first, up to `max_num_batched_tokens`
prompt tokens a step, so that a long prompt never stalls the running requests for long.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .request import Request


@dataclass
class Schedule:
    decode: list[Request]
    prefill: list[tuple[Request, int, int]]  # (request, start, end) of its prompt


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> Schedule:
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop()
            self.running.append(request)
        decode = [r for r in self.running if r.prefilled]
        prefill, budget = [], self.max_num_batched_tokens
        for r in self.running:
            if budget and not r.prefilled:
                n = min(len(r.prompt_ids) - r.computed, budget)
                prefill.append((r, r.computed, r.computed + n))
                budget -= n
        return Schedule(decode, prefill)

    def remove(self, request: Request) -> int | None:
        """Take a finished or aborted request out; the slot it freed, if it held one."""
        if request in self.waiting:
            self.waiting.remove(request)
            return None
        self.running.remove(request)
        self.free_slots.append(request.slot)
        return request.slot
