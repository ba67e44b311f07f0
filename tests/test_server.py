"""`monodecode serve` on loopback (tiny preset, fp32, byte-level text): the openai client,
batching, disconnects, errors, lm-eval's payloads, a bounded load test. Every call has a client
timeout, and the server always shuts down."""

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

import monodecode
from monodecode.generate import generate
from monodecode.serve import make_app

MODEL, SLOTS, TIMEOUT = "tiny", 8, 60


@pytest.fixture(scope="module")
def model():
    return monodecode.load(MODEL)


@contextlib.contextmanager
def running(app):
    """The base URL of `app` served on 127.0.0.1 (a free port) until the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while get(url, "/health")[0] != 200:
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        yield url
    finally:
        uv.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


@pytest.fixture(scope="module")
def server(model):
    with running(make_app(model, MODEL, max_model_len=256, max_num_seqs=SLOTS, mono="auto")) as url:
        yield url


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, ConnectionError) as e:
        return getattr(e, "code", None), ""


def post(url, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def client(url, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def metric(url, name):
    line = next(l for l in get(url, "/metrics")[1].splitlines() if l.startswith(name + " ") or l.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_openai_client_completions_stream_and_chat(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    whole = c.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == len("Hello, my name is")  # byte-level fallback: a token a byte
    chunks = list(c.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    streamed = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == chat.choices[0].message.content


def test_concurrent_greedy_requests_equal_offline_generation(server, model):
    """16 requests at once through 8 slots give the tokens of plain one-at-a-time generation."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + i)] for i in range(16)]

    async def ask(c, prompt):
        r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    async def ask_all():
        async with client(server, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(ask(c, p) for p in prompts))

    assert asyncio.run(ask_all()) == [generate(model, p, 10) for p in prompts]


def test_speculative_server_equals_offline_generation(model):
    """With DSpark block verification, concurrent greedy requests (several verify rows each, in
    one step) still give the tokens of plain generation; /metrics reports the acceptance."""
    spec = {"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}
    prompts = [[(11 * i + j) % 500 + 3 for j in range(2 + i)] for i in range(6)]
    with running(make_app(model, MODEL, max_model_len=128, max_num_seqs=4, speculative_config=spec)) as url:
        async def ask_all():
            async with client(url, openai.AsyncOpenAI) as c:
                replies = await asyncio.gather(*(
                    c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
                    for p in prompts))
                return [r.choices[0].model_extra["token_ids"] for r in replies]

        assert asyncio.run(ask_all()) == [generate(model, p, 12) for p in prompts]
        assert metric(url, "monodecode_mean_acceptance_length") >= 1.0


def test_disconnect_mid_stream_frees_the_slot(server):
    c = client(server)
    stream = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + TIMEOUT
    while metric(server, 'monodecode_requests_total{finish_reason="abort"}') < 1:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    # a batch that needs every slot at once completes: none is held by the abandoned request
    r = c.completions.create(model=MODEL, prompt=[[9, 10 + i] for i in range(SLOTS)], max_tokens=3)
    assert len(r.choices) == SLOTS and all(ch.finish_reason in ("stop", "length") for ch in r.choices)
    assert metric(server, "monodecode_num_requests_running") == 0


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "gpt-5", "prompt": "a"}, 404, "model"),
    ({"model": MODEL, "prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": list(range(3, 250)), "max_tokens": 16}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    got, answer = post(server, "/v1/completions", body)
    assert got == status and answer["error"]["param"] == param and answer["error"]["message"]
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1})[0] == 200


def test_openai_client_sees_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=MODEL, prompt="a" * 250, max_tokens=16)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], temperature=-1)


def test_lm_eval_loglikelihood_and_generation_payloads(server, model):
    """Payloads shaped as lm-eval's `local-completions` sends them (tokenized_requests=False),
    parsed as it parses them: the continuation's log-likelihood equals a full prefill's."""
    context, continuation = "The capital of France is", " Paris"
    ids = list((context + continuation).encode())
    ids = [b + 3 for b in ids]  # the byte-level fallback
    ctxlen = len(context.encode())
    for prompt in (context + continuation, [context + continuation, context + continuation]):
        status, out = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0,
                                                       "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
        assert status == 200
        expected = model.score(ids).log_softmax(-1)
        want = sum(expected[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
        greedy = all(expected[i - 1].argmax() == ids[i] for i in range(ctxlen, len(ids)))
        for choice in sorted(out["choices"], key=lambda ch: ch["index"]):
            logprobs = choice["logprobs"]
            assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
            assert abs(sum(logprobs["token_logprobs"][ctxlen:-1]) - want) < 1e-3
            tops = zip(logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1])
            assert all(lp == max(top.values()) for lp, top in tops) == greedy
    status, out = post(server, "/v1/completions", {"model": MODEL, "prompt": ["Question: 1+1?\nAnswer:"] * 2,
                                                   "max_tokens": 8, "temperature": 0, "stop": ["\n\n", "Question:"],
                                                   "seed": 1234})
    assert status == 200 and [ch["index"] for ch in out["choices"]] == [0, 1]
    assert out["choices"][0]["text"] == out["choices"][1]["text"]
    # lm-eval's remote-tokenizer probe: tokenizer_info with eos_token, then tokenize
    assert "eos_token" in json.loads(get(server, "/tokenizer_info")[1])
    assert post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})[1]["tokens"] == [
        b + 3 for b in b"test"]


def test_load_200_requests_at_concurrency_32(server):
    async def ask(c, sem, i):
        async with sem:
            r = await c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4, temperature=0.7,
                                           seed=i, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason, r.usage.completion_tokens

    async def load():
        sem = asyncio.Semaphore(32)
        async with client(server, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(ask(c, sem, i) for i in range(200)))

    before = metric(server, "monodecode_generation_tokens_total")
    results = asyncio.run(load())
    assert results == [("length", 4)] * 200
    assert metric(server, "monodecode_generation_tokens_total") - before == 800
    assert metric(server, 'monodecode_decode_steps_total{path="per-op"}') > 0
    assert metric(server, 'monodecode_decode_steps_total{path="mono"}') == 0
    assert metric(server, "monodecode_time_to_first_token_seconds_count") >= 200


def test_readme_main_job_serves_the_default_model(tmp_path):
    """The README's first command ends in `monodecode serve`; that server (the real CLI, in a
    child process) answers the README's example request."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    main_job = readme.split("```bash\n", 1)[1].splitlines()[0]
    assert main_job.endswith("&& monodecode serve")
    example = json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "monodecode.cli", "serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while get(url, "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        status, out = post(url, "/v1/completions", example)
        assert status == 200 and out["model"] == MODEL and out["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert "mono auto: runs per-op: " in (tmp_path / "serve.log").read_text()  # the reasons, logged once
