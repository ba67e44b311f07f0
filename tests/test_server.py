"""`monodecode serve` on loopback (tiny preset, fp32, byte-level text): the openai client,
batching, disconnects, errors, lm-eval's payloads, a bounded load test. Every call has a client
timeout, and the server always shuts down."""

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import uvicorn

import monodecode
from monodecode.engine.tokenizer import ByteTokenizer
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
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-5")
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


ABORTED = 'monodecode_requests_total{finish_reason="abort"}'


def wait_for(url, name, predicate, what):
    deadline = time.monotonic() + TIMEOUT
    while not predicate(metric(url, name)):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_every_slot_is_free(url):
    """A batch that needs every slot at once completes: none is held by an abandoned request."""
    r = client(url).completions.create(model=MODEL, prompt=[[9, 10 + i] for i in range(SLOTS)], max_tokens=3)
    assert len(r.choices) == SLOTS and all(ch.finish_reason in ("stop", "length") for ch in r.choices)


def test_disconnect_mid_stream_frees_the_slot(server):
    aborted = metric(server, ABORTED)
    stream = client(server).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=200, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    wait_for(server, ABORTED, lambda n: n > aborted, "the abandoned request was not aborted")
    # the gauge is back to 0 with the abort, without another request to step the engine
    assert metric(server, "monodecode_num_requests_running") == 0
    assert_every_slot_is_free(server)


def test_non_streaming_client_that_disconnects_is_aborted(server):
    """A client that gives up on a whole (non-streamed) response aborts its request at once,
    which frees its slot and its gauge; the request does not run on to max_tokens."""
    aborted, generated = metric(server, ABORTED), metric(server, "monodecode_generation_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=TIMEOUT) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(server, "monodecode_num_requests_running", lambda n: n == 1, "the request did not start")
    wait_for(server, ABORTED, lambda n: n > aborted, "the request of the departed client was not aborted")
    assert metric(server, "monodecode_num_requests_running") == 0
    assert metric(server, "monodecode_generation_tokens_total") - generated < 240
    assert_every_slot_is_free(server)


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
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[5], []]}, 400, "prompt"),
    ({"prompt": [5, True]}, 400, "prompt"),
    ({"prompt": "a", "model": 5}, 400, "model"),
    ({"prompt": "a", "seed": 2**64}, 400, "seed"),  # was a 500: "Overflow when unpacking long long"
    ({"prompt": "a", "seed": -1}, 400, "seed"),
    ({"prompt": "a", "seed": "7"}, 400, "seed"),
    ({"prompt": "a", "seed": 7.5}, 400, "seed"),
    ({"prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    (b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ({"prompt": "a", "top_p": True}, 400, "top_p"),
    ({"prompt": "a", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "a", "stop": 5}, 400, "stop"),
    ({"prompt": "a", "stop": ["\n", 5]}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "stop_token_ids": ["2"]}, 400, "stop_token_ids[0]"),
    ({"prompt": "a", "stop_token_ids": [2, 512]}, 400, "stop_token_ids"),
    ({"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "a", "stream": 1}, 400, "stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"prompt": "a", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options.usage"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "a", "echo": 1}, 400, "echo"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "user": 5}, 400, "user"),
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"prompt": "a", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": "a", "suffix": "!"}, 400, "suffix"),
    ({"prompt": "a", "max_token": 5}, 400, "max_token"),  # a typo is not ignored
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    got, answer = post(server, "/v1/completions", body)
    assert got == status and answer["error"]["param"] == param and answer["error"]["message"]
    assert answer["error"]["type"] == ("invalid_request_error" if status == 400 else answer["error"]["type"])
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1})[0] == 200


def test_unsupported_fields_are_named_and_their_no_op_values_accepted(server):
    status, answer = post(server, "/v1/completions", {"prompt": "a", "presence_penalty": 0.5, "tools": [{}]})
    assert status == 400 and answer["error"]["code"] == "unsupported_parameter"
    assert answer["error"]["message"].startswith("unsupported field(s) presence_penalty, tools")
    assert "presence_penalty only as 0" in answer["error"]["message"]
    no_ops = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None,
              "user": "someone", "top_p": None, "seed": 2**64 - 1}
    status, answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, **no_ops})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens"),
])
def test_bad_tokenizer_requests_name_the_field(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert post(server, "/detokenize", {"tokens": [b + 3 for b in b"ok"]}) == (200, {"prompt": "ok"})


@pytest.mark.parametrize("change, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"echo": True}, "echo"),
])
def test_bad_chat_requests_name_the_field(server, change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"], answer
    if "image_url" in str(change):
        assert "image, audio and file parts are not supported" in answer["error"]["message"]


def test_chat_accepts_text_parts_a_null_assistant_content_and_no_op_fields(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "again", "name": "me"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "logprobs": False}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant", answer


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


def test_top_logprobs_keep_tokens_that_decode_alike(server, model):
    """Byte-level ids 131-258 (bytes >= 0x80) all decode alone to U+FFFD: each keeps its own
    entry (the later ones keyed token_id:N), the sampled token keeps its text, and the values
    are the model's 20 most likely."""
    prompt = [5, 6, 7]
    status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 20,
                                                   "ignore_eos": True, "return_token_ids": True})
    assert status == 200
    choice = out["choices"][0]
    expected = model.score(prompt + choice["token_ids"][:-1]).log_softmax(-1)[len(prompt) - 1:]
    logprobs, renamed = choice["logprobs"], 0
    for i, (token, value, top) in enumerate(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])):
        assert len(top) == 20 and top[token] == value  # greedy: the sampled token is one of the 20
        assert list(top.values()) == pytest.approx(expected[i].topk(20).values.tolist(), abs=1e-4)
        renamed += sum(k.startswith("token_id:") and ByteTokenizer().decode([int(k[9:])]) != "" for k in top)
    assert renamed  # tokens did decode alike


def test_text_offsets_count_the_characters_of_the_text(server):
    """text_offset is where each token's text starts in the choice's text: multi-byte characters
    count once (their bytes are tokens of the byte-level fallback), and ids with no text add none."""
    prompt = "naïve €5 ✓"
    data = prompt.encode()
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0, "echo": True, "ignore_eos": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200
    choice = out["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[:len(data)] == [len(data[:i].decode("utf-8", "ignore")) for i in range(len(data))]
    assert offsets[len(data)] == len(prompt)  # the first generated token starts where the prompt ends
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])
    stream = client(server).completions.create(model=MODEL, stream=True, extra_body={"ignore_eos": True},
                                               **{k: v for k, v in body.items() if k != "ignore_eos"})
    assert [o for ch in stream for o in ch.choices[0].logprobs.text_offset] == offsets


@contextlib.contextmanager
def cli_server(log_path, *flags: str):
    """`monodecode serve` (the real CLI, in a child process; `flags` added) on a free loopback
    port, once it answers /health: (the process, its URL). The process is killed if still
    running at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "monodecode.cli", "serve", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + TIMEOUT
            while get(url, "/health")[0] != 200:
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_readme_main_job_serves_the_default_model(tmp_path):
    """The README's first command ends in `monodecode serve`; that server (the real CLI, in a
    child process) answers the README's example request."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    main_job = readme.split("```bash\n", 1)[1].splitlines()[0]
    assert main_job.endswith("&& monodecode serve")
    example = json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))
    with cli_server(tmp_path / "serve.log") as (proc, url):
        status, out = post(url, "/v1/completions", example)
        assert status == 200 and out["model"] == MODEL and out["usage"]["completion_tokens"] >= 1
        proc.terminate()
        proc.wait(TIMEOUT)
    assert "mono auto: runs per-op: " in (tmp_path / "serve.log").read_text()  # the reasons, logged once


def test_readme_request_at_tensor_parallel_size_2_answers_as_one_process(tmp_path):
    """`serve --tensor-parallel-size 2` (two processes over gloo) answers the README's request
    with the text one process gives, and stops its second rank when it exits."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))
    answers = []
    for size in ("1", "2"):
        log = tmp_path / f"serve_tp{size}.log"
        with cli_server(log, "--tensor-parallel-size", size) as (proc, url):
            status, out = post(url, "/v1/completions", example)
            assert status == 200 and out["usage"]["completion_tokens"] == example["max_tokens"], log.read_text()
            answers.append(out["choices"][0]["text"])
            proc.terminate()
            proc.wait(TIMEOUT)
    assert answers[0] == answers[1]
    assert "mono auto: runs per-op: " in (tmp_path / "serve_tp2.log").read_text()  # no GPU: the reasons, logged


def test_sigterm_with_a_request_running_exits_within_10_s(tmp_path):
    """SIGTERM aborts the running request (it gets a 503) and the server exits at once, instead
    of waiting for the request's 4,000 tokens."""
    with cli_server(tmp_path / "serve.log") as (proc, url):
        replies = []
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}
        asking = threading.Thread(target=lambda: replies.append(post(url, "/v1/completions", body)))
        asking.start()
        wait_for(url, "monodecode_num_requests_running", lambda n: n == 1, "the request did not start")
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)  # TimeoutExpired if the server waits for the request
        asking.join(TIMEOUT)
    assert proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
    assert "Finished server process" in (tmp_path / "serve.log").read_text()
    assert replies == [(503, {"error": {"message": "the server is shutting down", "type": "server_error",
                                        "param": None, "code": None}})]
