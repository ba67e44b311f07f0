"""`monodecode bench serve` against a fake OpenAI-compatible streaming server with known delays."""

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from monodecode.bench.serve import RequestResult, summarize_level
from monodecode.cli import main

FIRST_TOKEN_DELAY = 0.05  # seconds from request to first chunk
CHUNK_DELAY = 0.02        # seconds between chunks


@dataclass
class Behaviour:
    tokens_per_chunk: int = 1
    send_usage: bool = True
    list_token_ids: bool = False
    # request number (1-based, in arrival order) -> "http500" | "error-event" | "truncate" | "hang"
    failures: dict[int, str] = field(default_factory=dict)


class FakeServer(ThreadingHTTPServer):
    """Streams max_tokens tokens per completion, recording each request and the in-flight count."""

    daemon_threads = True
    request_queue_size = 64  # the default backlog of 5 would make a burst of connections wait

    def __init__(self, behaviour: Behaviour):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.behaviour = behaviour
        self.payloads: list[dict] = []
        self.in_flight_at_arrival: list[int] = []
        self.in_flight = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arrive(self, payload: dict) -> int:
        with self.lock:
            self.payloads.append(payload)
            self.in_flight += 1
            self.in_flight_at_arrival.append(self.in_flight)
            return len(self.payloads)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class FakeHandler(BaseHTTPRequestHandler):
    # HTTP/1.0 and no Content-Length: the client reads each response to the connection's close,
    # which comes after leave(), so a worker's next request never overlaps its last one here.
    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode())

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        number = self.server.arrive(payload)
        try:
            self.respond(payload, self.server.behaviour.failures.get(number))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on a hanging request
        finally:
            self.server.leave()

    def respond(self, payload: dict, failure: str | None) -> None:
        if failure == "http500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "injected"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if failure == "hang":
            self.server.stopping.wait(10)
            return
        behaviour, total = self.server.behaviour, payload["max_tokens"]
        time.sleep(FIRST_TOKEN_DELAY)
        self.event(":keep-alive comment, to be ignored")
        for sent in range(0, total, behaviour.tokens_per_chunk):
            if sent:
                time.sleep(CHUNK_DELAY)
            count = min(behaviour.tokens_per_chunk, total - sent)
            choice = {"index": 0, "text": " tok" * count,
                      "finish_reason": "length" if sent + count == total else None}
            if behaviour.list_token_ids:
                choice["token_ids"] = list(range(sent, sent + count))
            self.data({"object": "text_completion", "choices": [choice]})
            if failure == "error-event":
                self.data({"error": {"message": "injected", "code": 500}})
                return
            if failure == "truncate":
                return
        if behaviour.send_usage and payload.get("stream_options", {}).get("include_usage"):
            self.data({"choices": [], "usage": {"prompt_tokens": len(payload["prompt"]),
                                                "completion_tokens": total}})
        self.event("data: [DONE]")

    def data(self, event: dict) -> None:
        self.event(f"data: {json.dumps(event)}")

    def event(self, line: str) -> None:
        self.wfile.write(f"{line}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def serve():
    servers = []

    def start(behaviour: Behaviour = Behaviour()) -> FakeServer:
        server = FakeServer(behaviour)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stopping.set()
        server.shutdown()
        server.server_close()


def bench(server: FakeServer, out, *options: str) -> dict:
    argv = ["bench", "serve", "--base-url", server.url, "--out", str(out), *options]
    assert main(argv) == 0
    return json.loads((out / "bench_serve.json").read_text())


def test_levels_complete_with_the_injected_latencies_and_concurrency(serve, tmp_path, capsys):
    server = serve()
    report = bench(server, tmp_path, "--concurrency", "1,4", "--num-prompts", "8", "--input-len", "16",
                   "--output-len", "8", "--ignore-eos", "--token-id-range", "3:512")
    assert report["model"] == "fake-model"  # read from /v1/models: no --model given
    assert "--concurrency 1,4" in report["command"] and report["config"]["input_len"] == 16
    assert not report["interrupted"]

    for level in report["levels"]:
        assert (level["completed"], level["failed"], level["errors"]) == (8, 0, {})
        assert level["total_output_tokens"] == 64 and level["output_tokens_from_usage"] == 8
        assert all(r["output_tokens"] == 8 and r["chunks"] == 8 for r in level["per_request"])
        assert level["mean_prompt_tokens"] == 16
        # the fake server sleeps 50 ms, then 20 ms between tokens: the first token cannot come sooner;
        # a gap can look shorter than its sleep (the chunk before it read late), hence the lower 0.5
        assert FIRST_TOKEN_DELAY * 1e3 <= level["ttft_ms"]["p50"] < FIRST_TOKEN_DELAY * 1e3 + 100
        for metric in ("tpot_ms", "itl_ms"):
            assert CHUNK_DELAY * 1e3 * 0.5 <= level[metric]["p50"] < CHUNK_DELAY * 1e3 * 1.5
        assert level["e2el_ms"]["p50"] >= (FIRST_TOKEN_DELAY + 7 * CHUNK_DELAY) * 1e3
        seconds_per_token = [r["e2el_ms"] / 1e3 / r["output_tokens"] for r in level["per_request"]]
        assert level["interactivity_tok_s_user"] == pytest.approx(1 / np.percentile(seconds_per_token, 90))
        assert level["output_throughput_tok_s"] == pytest.approx(64 / level["duration_s"])
    serial, parallel = report["levels"]
    assert serial["duration_s"] >= 8 * (FIRST_TOKEN_DELAY + 7 * CHUNK_DELAY)
    assert parallel["request_throughput_req_s"] > 2.5 * serial["request_throughput_req_s"]

    # each level kept exactly its concurrency in flight: the first 8 arrivals, then the next 8
    assert max(server.in_flight_at_arrival[:8]) == 1 and max(server.in_flight_at_arrival[8:]) == 4
    completions = server.payloads
    assert all(len(p["prompt"]) == 16 and all(3 <= t < 512 for t in p["prompt"]) for p in completions)
    first_level_prompts = {tuple(p["prompt"]) for p in completions[:8]}
    assert first_level_prompts.isdisjoint(tuple(p["prompt"]) for p in completions[8:])
    assert all(p["max_tokens"] == 8 and p["temperature"] == 0 and p["stream"] and p["ignore_eos"]
               and p["stream_options"] == {"include_usage": True} and p["model"] == "fake-model"
               for p in completions)
    table = capsys.readouterr().out
    assert "interactivity (tok/s/user)" in table and "c=4    TPOT" in table


@pytest.mark.parametrize("send_usage, list_token_ids, counted", [
    (True, False, 9),    # usage.completion_tokens
    (False, True, 9),    # the chunks' token_ids
    (False, False, 3),   # neither: one per chunk, a lower bound
])
def test_multi_token_chunks_are_one_itl_gap_each(serve, tmp_path, send_usage, list_token_ids, counted):
    server = serve(Behaviour(tokens_per_chunk=3, send_usage=send_usage, list_token_ids=list_token_ids))
    report = bench(server, tmp_path, "--model", "m", "--concurrency", "2", "--num-prompts", "4",
                   "--input-len", "4", "--output-len", "9")
    level = report["levels"][0]
    assert level["completed"] == 4 and level["total_output_tokens"] == 4 * counted
    assert all(r["chunks"] == 3 and r["tokens_from_usage"] == send_usage for r in level["per_request"])
    # ITL: one gap per chunk, so the chunk delay; TPOT spreads the same two gaps over counted - 1 tokens.
    # A miscount is off by 3x or more (9 tokens counted as 3 chunks, or a gap split over a chunk's 3
    # tokens), so bounds of 2x either way still catch it and leave a busy machine room: sleeps
    # overrun, and a chunk read late makes the gap after it look shorter (TPOT 4.96 ms for 5 seen).
    assert CHUNK_DELAY * 1e3 / 2 <= level["itl_ms"]["p50"] < CHUNK_DELAY * 1e3 * 2
    expected_tpot = 2 * CHUNK_DELAY / (counted - 1) * 1e3
    assert expected_tpot / 2 <= level["tpot_ms"]["p50"] < expected_tpot * 2


def test_failed_requests_are_counted_and_named(serve, tmp_path, capsys):
    failures = {2: "http500", 4: "error-event", 5: "truncate", 7: "hang"}
    server = serve(Behaviour(failures=failures))
    report = bench(server, tmp_path, "--model", "m", "--concurrency", "2", "--num-prompts", "8",
                   "--input-len", "4", "--output-len", "4", "--request-timeout", "0.5")
    level = report["levels"][0]
    assert (level["requests"], level["completed"], level["failed"]) == (8, 4, 4)
    errors = " | ".join(level["errors"])
    for expected in ("HTTP 500", "error event", "before [DONE]", "--request-timeout 0.5 s"):
        assert expected in errors
    assert level["total_output_tokens"] == 16  # only the successful requests' tokens
    assert sum(r["ok"] for r in level["per_request"]) == 4
    assert all(r["ttft_ms"] is None for r in level["per_request"] if not r["ok"])
    assert "c=2 failed x1: HTTP 500" in capsys.readouterr().out


def test_every_request_failing_exits_1(serve, tmp_path, capsys):
    server = serve(Behaviour(failures={n: "http500" for n in range(1, 5)}))
    argv = ["bench", "serve", "--base-url", server.url, "--out", str(tmp_path), "--model", "m", "--concurrency", "1,2",
            "--num-prompts", "2", "--input-len", "4", "--output-len", "4"]
    assert main(argv) == 1
    assert "error: every request failed" in capsys.readouterr().err
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    assert [level["failed"] for level in report["levels"]] == [2, 2]  # still reported


def test_text_prompts_are_words(serve, tmp_path):
    server = serve()
    bench(server, tmp_path, "--model", "m", "--concurrency", "1", "--num-prompts", "2", "--input-len", "5",
          "--output-len", "2", "--prompt-format", "text")
    assert all(isinstance(p["prompt"], str) and len(p["prompt"].split()) == 5 for p in server.payloads)
    assert all("ignore_eos" not in p for p in server.payloads)


def test_bad_options_are_refused(capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--input-len", "1",
            "--output-len", "1"]
    assert main([*argv, "--concurrency", "1,0"]) == 2
    assert main([*argv, "--concurrency", "1", "--token-id-range", "5:5"]) == 2
    assert main([*argv, "--concurrency", "1"]) == 2  # nothing listening: no model to read
    err = capsys.readouterr().err
    assert "at least 1" in err and "LOW < HIGH" in err and "pass --model" in err


def test_plot_is_written(serve, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed: no PNG to check")
    bench(serve(), tmp_path, "--model", "m", "--concurrency", "1,2", "--num-prompts", "2", "--input-len", "2",
          "--output-len", "2")
    assert (tmp_path / "bench_serve.png").read_bytes().startswith(b"\x89PNG")


def test_ctrl_c_stops_and_reports_the_finished_levels(serve, tmp_path):
    server = serve()
    command = [sys.executable, "-m", "monodecode.cli", "bench", "serve", "--base-url", server.url,
               "--model", "m", "--concurrency", "1,2", "--num-prompts", "1000", "--input-len", "2",
               "--output-len", "4", "--out", str(tmp_path)]
    # A child inherits an ignored SIGINT (pytest started in the background by a shell without job
    # control ignores it), and Python then never turns it into KeyboardInterrupt: start the child
    # with the default handling, whatever the test run's.
    ours = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, ours)
    deadline = time.monotonic() + 15
    while len(server.payloads) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=10)
    assert process.returncode == 130, err
    assert "interrupted" in err
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    assert report["interrupted"] and report["levels"] == []  # the unfinished level is dropped


def test_metrics_follow_their_definitions():
    # two requests: chunk arrival times (from start) 0.1, 0.3, 0.4 and 0.2, 0.6
    results = [
        RequestResult(ok=True, ttft=0.1, e2el=0.4, itl=[0.2, 0.1], output_tokens=4),
        RequestResult(ok=True, ttft=0.2, e2el=0.6, itl=[0.4], output_tokens=2),
        RequestResult(error="HTTP 503: busy"),
    ]
    level = summarize_level(2, results, duration=2.0)
    assert (level["completed"], level["failed"], level["errors"]) == (2, 1, {"HTTP 503: busy": 1})
    assert level["tpot_ms"]["mean"] == pytest.approx((300 / 3 + 400 / 1) / 2)
    assert level["itl_ms"]["p50"] == pytest.approx(200)
    assert level["e2el_ms"]["p99"] == pytest.approx(400 + 0.99 * 200)
    # E2EL / tokens: 0.1 and 0.3 s; P90 by linear interpolation 0.28 s
    assert level["interactivity_tok_s_user"] == pytest.approx(1 / 0.28)
    assert level["request_throughput_req_s"] == 1.0 and level["output_throughput_tok_s"] == 3.0
