"""`monodecode bench serve`: a streaming load generator for OpenAI-compatible completion servers.

Each request is a streamed `POST {base}/v1/completions` (`stream: true`, SSE) with `max_tokens` =
--output-len, temperature 0, `stream_options: {"include_usage": true}`, and with --ignore-eos
vLLM's extra field `ignore_eos: true`. Prompts are random and seeded: lists of exactly --input-len
token ids (the OpenAI API's token-id form of `prompt`), or, with --prompt-format text, --input-len
random common words (about one token each; the server's `usage.prompt_tokens` says exactly).

For each concurrency level C, exactly C requests are in flight (C workers, each sending the next
prompt the moment its previous request ends) until --num-prompts requests have ended.

Metrics, per level. A request fails on a non-200 status, an `error` event in the stream, a stream
that ends without `[DONE]` or without any token, a transport error, or not ending within
--request-timeout; failures are counted and their errors listed, and the metrics below are over
the successful requests only.

- start: just before the request is sent. A chunk carries tokens when its `choices` list is not
  empty (as in vLLM's benchmark_serving: its text may be empty, e.g. for a special token); the
  trailing usage-only chunk and `[DONE]` carry none.
- TTFT: start -> arrival of the first token-carrying chunk.
- E2EL: start -> arrival of the last token-carrying chunk.
- output tokens: the stream's `usage.completion_tokens`; when the server sends no usage, the sum
  over token-carrying chunks of len(`token_ids`) where a chunk lists them, else 1 (a lower bound
  when a chunk carries several tokens and does not list them).
- TPOT: (E2EL - TTFT) / (output tokens - 1), for each request with more than one output token.
- ITL: every gap between the arrivals of two consecutive token-carrying chunks of a request, pooled
  over the requests. A chunk carrying several tokens (speculative decoding) is one gap, not split
  among its tokens, as vLLM's benchmark_serving counts it: with speculation ITL is the time per
  decode step, TPOT the time per token.
- TTFT, TPOT, ITL and E2EL are each reported as mean, p50, p90 and p99 (numpy's linear
  interpolation), in milliseconds.
- interactivity: 1 / P90 over the requests of (E2EL / output tokens), in tok/s/user: the per-user
  token rate that 90 % of the requests meet or beat.
- duration: first request sent -> last request ended, at that level.
- request throughput: successful requests / duration (req/s).
- output token throughput: output tokens of the successful requests / duration (tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

# Common English words, one token each (with their leading space) in the usual BPE vocabularies.
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
         "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
         "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there")
PERCENTILES = (50, 90, 99)
JSON_NAME, PLOT_NAME = "bench_serve.json", "bench_serve.png"
MODELS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None
    concurrency: tuple[int, ...]
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool
    seed: int
    prompt_format: str
    token_id_range: tuple[int, int]
    request_timeout: float
    out: Path

    @property
    def api_root(self) -> str:
        # Accept the base URL with or without the /v1 suffix, as OpenAI clients do.
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    def command(self) -> str:
        """The command line that repeats this run, every option spelled out."""
        words = ["monodecode", "bench", "serve", "--base-url", self.base_url,
                 "--concurrency", ",".join(map(str, self.concurrency)),
                 "--num-prompts", str(self.num_prompts), "--input-len", str(self.input_len),
                 "--output-len", str(self.output_len), "--seed", str(self.seed),
                 "--prompt-format", self.prompt_format,
                 "--token-id-range", f"{self.token_id_range[0]}:{self.token_id_range[1]}",
                 "--request-timeout", f"{self.request_timeout:g}", "--out", str(self.out)]
        if self.model is not None:
            words += ["--model", self.model]
        if self.ignore_eos:
            words.append("--ignore-eos")
        return shlex.join(words)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The parsed command line as a checked BenchConfig (ValueError names the bad option)."""
    config = BenchConfig(
        base_url=args.base_url, model=args.model, concurrency=parse_concurrency(args.concurrency),
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        ignore_eos=args.ignore_eos, seed=args.seed, prompt_format=args.prompt_format,
        token_id_range=parse_token_id_range(args.token_id_range),
        request_timeout=args.request_timeout,
        out=args.out or Path(f"bench-serve-{datetime.now():%Y%m%d-%H%M%S}"),
    )
    for name in ("num_prompts", "input_len", "output_len", "request_timeout"):
        if getattr(config, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    return config


def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if min(levels) < 1 or len(set(levels)) != len(levels):
        raise ValueError(f"--concurrency levels must be distinct and at least 1, got {text!r}")
    return levels


def parse_token_id_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise ValueError(f"--token-id-range must be LOW:HIGH, got {text!r}") from None
    if not 0 <= bounds[0] < bounds[1]:
        raise ValueError(f"--token-id-range needs 0 <= LOW < HIGH, got {text!r}")
    return bounds


def make_prompts(config: BenchConfig, concurrency: int) -> list[list[int] | str]:
    # Seeded per level, so that no two levels share prompts (a prefix cache would make the later
    # level look faster) and one level run alone gets the same prompts as within a sweep.
    rng = random.Random(f"{config.seed}/{concurrency}")
    if config.prompt_format == "text":
        return [" ".join(rng.choices(WORDS, k=config.input_len)) for _ in range(config.num_prompts)]
    low, high = config.token_id_range
    return [[rng.randrange(low, high) for _ in range(config.input_len)] for _ in range(config.num_prompts)]


def make_payload(config: BenchConfig, model: str, prompt: list[int] | str) -> dict:
    payload = {
        "model": model, "prompt": prompt, "max_tokens": config.output_len, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        # vLLM's extra field, sent only when asked for: strict servers refuse unknown fields.
        payload["ignore_eos"] = True
    return payload


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = float("nan")  # seconds, like e2el and itl
    e2el: float = float("nan")
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False


class StreamError(Exception):
    """A 200 stream that reports an error or is not OpenAI's SSE of JSON chunks."""


class CompletionStream:
    """The arrival times of one streamed completion's token-carrying chunks, and its usage."""

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.chunk_tokens = 0
        self.usage: dict = {}
        self.done = False

    def feed(self, line: str, now: float) -> None:
        # Only data lines matter: blank lines end events, lines starting ":" are keep-alive comments.
        if not line.startswith("data:"):
            return
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"a data line that is not JSON: {data[:200]!r}") from None
        if "error" in event:
            raise StreamError(f"error event: {json.dumps(event['error'])[:300]}")
        self.usage = event.get("usage") or self.usage
        if choices := event.get("choices"):
            self.chunk_times.append(now)
            self.chunk_tokens += len(choices[0].get("token_ids") or ()) or 1

    def result(self, start: float) -> RequestResult:
        if not self.done:
            return RequestResult(error="stream ended before [DONE]")
        if not self.chunk_times:
            return RequestResult(error="stream carried no token")
        times = self.chunk_times
        usage_tokens = self.usage.get("completion_tokens")
        return RequestResult(
            ok=True, ttft=times[0] - start, e2el=times[-1] - start,
            itl=[later - earlier for earlier, later in zip(times, times[1:])],
            output_tokens=self.chunk_tokens if usage_tokens is None else usage_tokens,
            prompt_tokens=self.usage.get("prompt_tokens"), tokens_from_usage=usage_tokens is not None,
        )


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, timeout: float) -> RequestResult:
    stream = CompletionStream()
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestResult(error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                stream.feed(line, time.perf_counter())
    except TimeoutError:
        return RequestResult(error=f"not done within --request-timeout {timeout:g} s")
    except (httpx.HTTPError, StreamError) as e:
        return RequestResult(error=f"{type(e).__name__}: {e}")
    return stream.result(start)


async def run_level(client: httpx.AsyncClient, config: BenchConfig, model: str, concurrency: int) -> dict:
    payloads = [make_payload(config, model, p) for p in make_prompts(config, concurrency)]
    results: list[RequestResult | None] = [None] * len(payloads)
    # One iterator shared by the workers: each takes the next prompt the moment its request ends,
    # which keeps exactly `concurrency` requests in flight until the prompts run out.
    pending = iter(enumerate(payloads))
    url = f"{config.api_root}/completions"
    progress = tqdm(total=len(payloads), desc=f"concurrency {concurrency}", file=sys.stderr)

    async def worker() -> None:
        for i, payload in pending:
            results[i] = await send_request(client, url, payload, config.request_timeout)
            progress.update()

    with progress:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(payloads))):
                group.create_task(worker())
        duration = time.perf_counter() - start
    return summarize_level(concurrency, results, duration)


def summarize_level(concurrency: int, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common()),
        "duration_s": duration,
        "request_throughput_req_s": len(done) / duration,
        "output_throughput_tok_s": output_tokens / duration,
        "interactivity_tok_s_user": interactivity(done),
        "total_output_tokens": output_tokens,
        "output_tokens_from_usage": sum(r.tokens_from_usage for r in done),
        "mean_prompt_tokens": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([time_per_output_token(r) for r in done if r.output_tokens > 1]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2el_ms": distribution([r.e2el for r in done]),
        "per_request": [per_request_record(r) for r in results],
    }


def time_per_output_token(r: RequestResult) -> float:
    return (r.e2el - r.ttft) / (r.output_tokens - 1)


def interactivity(done: list[RequestResult]) -> float | None:
    seconds_per_token = [r.e2el / r.output_tokens for r in done if r.output_tokens > 0]
    return 1.0 / float(np.percentile(seconds_per_token, 90)) if seconds_per_token else None


def distribution(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(seconds) * 1e3
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def per_request_record(r: RequestResult) -> dict:
    # The ITL lists are left out (num-prompts x output-len numbers); their count is kept.
    record = asdict(r)
    record["chunks"] = len(record.pop("itl")) + 1 if r.ok else 0
    for name in ("ttft", "e2el"):
        seconds = record.pop(name)
        record[f"{name}_ms"] = seconds * 1e3 if r.ok else None  # not NaN, which JSON lacks
    return record


@dataclass
class BenchRun:
    config: BenchConfig
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    model: str | None = None
    levels: list[dict] = field(default_factory=list)
    interrupted: bool = False


async def run_levels(run: BenchRun) -> None:
    """Runs the levels in order, appending each summary as it ends so that an interrupt keeps them."""
    config = run.config
    # The pool must hold every in-flight request: httpx's default of 100 connections would queue
    # the requests of a higher level inside the client, where they would not be in flight.
    most = max(config.concurrency)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # No httpx timeout: asyncio.timeout in send_request bounds each whole request instead.
    async with httpx.AsyncClient(limits=limits, headers=headers, timeout=None) as client:
        run.model = config.model or await served_model(client, config.api_root)
        for concurrency in config.concurrency:
            run.levels.append(await run_level(client, config, run.model, concurrency))


async def served_model(client: httpx.AsyncClient, api_root: str) -> str:
    try:
        async with asyncio.timeout(MODELS_TIMEOUT_S):
            response = await client.get(f"{api_root}/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (TimeoutError, httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"could not read the served model from {api_root}/models ({e!r}): "
                         "pass --model") from None


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `monodecode bench serve` command: 0 when done, 1 when every request failed, 130 when
    stopped by Ctrl-C."""
    run = BenchRun(config_from_args(args))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"note: matplotlib is not installed, so no {PLOT_NAME} will be written "
              "(pip install 'monodecode[bench]')", file=sys.stderr)
    try:
        asyncio.run(run_levels(run))
    except KeyboardInterrupt:
        # asyncio.run has cancelled the in-flight requests; the level they belonged to is dropped.
        run.interrupted = True
        print(f"interrupted: reporting the {len(run.levels)} finished level(s)", file=sys.stderr)
    print(format_table(run))
    write_outputs(run)
    if run.interrupted:
        return 130
    if not any(level["completed"] for level in run.levels):
        print("error: every request failed", file=sys.stderr)
        return 1
    return 0


def format_table(run: BenchRun) -> str:
    config = run.config
    lines = [f"{run.model} at {config.base_url}: {config.num_prompts} prompts a level, input "
             f"{config.input_len}, output {config.output_len} tokens",
             f"{'concurrency':>11} {'completed':>9} {'failed':>6} {'req/s':>8} {'output tok/s':>12} "
             "interactivity (tok/s/user)"]
    for level in run.levels:
        lines.append(f"{level['concurrency']:>11} {level['completed']:>9} {level['failed']:>6} "
                     f"{level['request_throughput_req_s']:>8.2f} {level['output_throughput_tok_s']:>12.1f} "
                     f"{_number(level['interactivity_tok_s_user'], '26.1f')}")
    lines.append(f"\n{'latency (ms)':<16} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for level in run.levels:
        for metric in ("ttft", "tpot", "itl", "e2el"):
            stats = level[f"{metric}_ms"]
            lines.append(f"{'c=' + str(level['concurrency']):<6} {metric.upper():<9} "
                         + " ".join(_number(stats[k], "9.2f") for k in ("mean", "p50", "p90", "p99")))
    for level in run.levels:
        for error, count in level["errors"].items():
            lines.append(f"c={level['concurrency']} failed x{count}: {error}")
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else format("-", f">{spec.split('.')[0]}")


def write_outputs(run: BenchRun) -> None:
    out = run.config.out
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": run.config.command(),
        "config": {**asdict(run.config), "out": str(out)},
        "model": run.model,
        "started_at": run.started_at,
        "interrupted": run.interrupted,
        "levels": run.levels,
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / JSON_NAME}", file=sys.stderr)
    points = [lv for lv in run.levels if lv["interactivity_tok_s_user"] is not None]
    if points and importlib.util.find_spec("matplotlib") is not None:
        write_plot(run, points, out / PLOT_NAME)
        print(f"wrote {out / PLOT_NAME}", file=sys.stderr)


def write_plot(run: BenchRun, levels: list[dict], path: Path) -> None:
    # The object API with no pyplot: no GUI backend, no global figure state.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 5), layout="constrained")
    axes = figure.subplots()
    x = [lv["interactivity_tok_s_user"] for lv in levels]
    y = [lv["output_throughput_tok_s"] for lv in levels]
    axes.plot(x, y, marker="o")
    for level, xi, yi in zip(levels, x, y):
        axes.annotate(f"c={level['concurrency']}", (xi, yi), textcoords="offset points", xytext=(6, 6))
    axes.set_xlabel("interactivity (tok/s/user) = 1 / P90(E2EL / output tokens)")
    axes.set_ylabel("output throughput (tok/s)")
    config = run.config
    axes.set_title(f"{run.model}: input {config.input_len}, output {config.output_len} tokens")
    axes.grid(alpha=0.3)
    axes.margins(0.12)  # room for the labels of the outermost points
    figure.savefig(path, dpi=120)
