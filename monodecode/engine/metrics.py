"""Serving metrics, written by the engine thread and read by `/metrics` in Prometheus text format.

Counters: requests (by how they ended), prompt and generation tokens, decode steps by path
(mono or per-op: the path of the step, or of a speculative step's verify rows; whole: a whole
speculative step on the kernels, spec/step_graph.py), prefill chunks; gauges: running and
waiting requests, mean acceptance length of speculative decoding; histograms: time to first
token and inter-token latency (seconds).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from itertools import accumulate

PREFIX = "monodecode"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Observations counted by the first bucket bound at or above them (one search an
    observation, on the engine's path of every token); rendered with Prometheus' cumulative
    buckets."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets, self.sum, self.count = buckets, 0.0, 0
        self.counts = [0] * (len(buckets) + 1)  # [i]: observations in (bound i - 1, bound i]; the last: above all

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value`."""
        self.sum += value * times
        self.count += times
        self.counts[bisect_left(self.buckets, value)] += times

    def lines(self, name: str) -> list[str]:
        cumulative = accumulate(self.counts[:-1])
        out = [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(self.buckets, cumulative)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter(dict.fromkeys(("stop", "length", "abort", "error"), 0))  # by finish reason
        self.prompt_tokens = self.generation_tokens = self.prefill_chunks = 0
        self.steps = Counter({"mono": 0, "per-op": 0, "whole": 0})
        self.running = self.waiting = 0
        self.acceptance_length = 0.0
        self.ttft, self.itl = Histogram(), Histogram()

    def count_step(self, path: str) -> None:
        with self._lock:
            self.steps[path] += 1

    def count_prefill_chunk(self, tokens: int) -> None:
        with self._lock:
            self.prefill_chunks += 1
            self.prompt_tokens += tokens

    def count_tokens(self, n: int, ttft: float | None, gap: float | None) -> None:
        """n tokens emitted at once; the first token's latency, or the gap since the last ones."""
        with self._lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            if gap is not None:
                self.itl.observe(gap / n, times=n)

    def count_finished(self, reason: str) -> None:
        with self._lock:
            self.requests[reason] += 1

    def set_load(self, running: int, waiting: int, acceptance_length: float) -> None:
        with self._lock:
            self.running, self.waiting, self.acceptance_length = running, waiting, acceptance_length

    def render(self) -> str:
        with self._lock:
            p = PREFIX
            lines = [f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.requests.items())]
            for name, value in (("prompt_tokens_total", self.prompt_tokens),
                                ("generation_tokens_total", self.generation_tokens),
                                ("prefill_chunks_total", self.prefill_chunks)):
                lines += [f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
            lines.append(f"# TYPE {p}_decode_steps_total counter")
            lines += [f'{p}_decode_steps_total{{path="{path}"}} {n}' for path, n in sorted(self.steps.items())]
            for name, value in (("num_requests_running", self.running), ("num_requests_waiting", self.waiting),
                                ("mean_acceptance_length", self.acceptance_length)):
                lines += [f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
            for name, hist in (("time_to_first_token_seconds", self.ttft),
                               ("inter_token_latency_seconds", self.itl)):
                lines += [f"# TYPE {p}_{name} histogram"] + hist.lines(f"{p}_{name}")
            return "\n".join(lines) + "\n"
