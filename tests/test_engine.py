"""The engine (monodecode.engine) offline: continuous batching changes no token, chunked prefill,
slots, stop conditions, logprobs, refusals."""

import warnings

import pytest
import torch

from monodecode.engine import Engine, SamplingParams
from monodecode.engine.tokenizer import ByteTokenizer
from monodecode.generate import generate
from monodecode.model import load_model
from monodecode.sampling import sample
from monodecode.spec.config import SpeculativeConfig

PROMPTS = [[5, 9, 14], list(range(40, 61)), [300, 300, 7], [11], list(range(100, 140)), [77] * 9]


@pytest.fixture(scope="module")
def model(device):
    return load_model("tiny", seed=3, device=device)


def engine(model, **kw):
    kw = {"max_model_len": 128, "max_num_seqs": 3, "max_num_batched_tokens": 7, "mono": "off", **kw}
    return Engine(model, **kw)


def run(eng, prompt, params, request_id="r"):
    """One request through add_request/step: (token ids, text, finish reason, outputs)."""
    eng.add_request(request_id, prompt, params)
    return finish(eng, request_id)


def finish(eng, request_id):
    outputs = []
    while eng.has_work():
        outputs += [o for o in eng.step() if o.request_id == request_id]
    return [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs), outputs[-1].finish_reason, outputs


@pytest.mark.parametrize("method", [None, "block"])
def test_batched_engine_equals_one_request_at_a_time(model, method):
    """6 prompts through 3 slots, prefilled 7 tokens a step (chunks, queueing, mixed
    prefill/decode steps), greedy: every output equals plain generation of that prompt alone;
    with speculation too (lossless verification)."""
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                        "rejection_sample_method": method}) if method else None
    got = engine(model, speculative=spec).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert got == [generate(model, p, 12) for p in PROMPTS]


def test_a_whole_speculative_step_is_counted_as_such(model):
    """The engine gives the speculative decoder its step counter: a whole step on the
    kernels (spec/step_graph.py; run in tests/test_mono_draft.py) counts as `whole`, a stepwise
    one only by the path of its verify step (here per-op: the kernels are off)."""
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5})
    eng = engine(model, speculative=spec)
    eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = dict(eng.metrics.steps)
    assert steps["whole"] == 0 and steps["per-op"] == eng.decoder.stats.steps > 0
    eng.decoder.count_path("stepwise")
    eng.decoder.count_path("whole")
    assert eng.metrics.steps == {**steps, "whole": 1}
    assert 'monodecode_decode_steps_total{path="whole"} 1' in eng.metrics.render()


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    alone = engine(model).generate([PROMPTS[1]], params)[0]
    together = engine(model).generate(PROMPTS[:4], params)[1]
    assert alone == together
    assert engine(model).generate([PROMPTS[1]], SamplingParams(**{**params.__dict__, "seed": 8}))[0] != alone


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    drawn = sample(logits, 1.0, 1.0, torch.Generator().manual_seed(1), top_k=1)
    assert torch.equal(drawn, logits.argmax(-1))


def test_stop_strings_stop_ids_and_eos(model):
    eng = engine(model, tokenizer=ByteTokenizer())
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids, text, reason, _ = run(eng, PROMPTS[1], free)
    assert reason == "length" and len(ids) == 40
    # a character the noise decodes to cleanly, not at the start (the tiny model's bytes are mostly not UTF-8)
    stop = next(c for c in text[1:] if c.isprintable() and c != "\ufffd" and text.find(c) > 0)
    cut_text = text[: text.find(stop)]
    _, got, reason, outputs = run(eng, PROMPTS[1], SamplingParams(**{**free.__dict__, "stop": ("zzz-never", stop)}))
    assert (got, reason) == (cut_text, "stop") and outputs[-1].finished
    stop_id = ids[5]
    got_ids, _, reason, _ = run(eng, PROMPTS[1], SamplingParams(**{**free.__dict__, "stop_token_ids": (stop_id,)}))
    assert got_ids == ids[: ids.index(stop_id) + 1] and reason == "stop"
    eos = model.config.eos_token_id
    ids_eos, _, _, _ = run(eng, PROMPTS[1], SamplingParams(max_tokens=40, temperature=0))
    assert ids_eos == (ids[: ids.index(eos) + 1] if eos in ids else ids)


def test_abort_frees_the_slot_for_the_next_request(model):
    eng = engine(model, max_num_seqs=1)
    eng.add_request("long", PROMPTS[4], SamplingParams(max_tokens=80, temperature=0))
    for _ in range(8):
        eng.step()
    eng.add_request("waiting", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.step()
    assert [r.id for r in eng.scheduler.waiting] == ["waiting"]
    eng.abort("long")
    assert eng.scheduler.free_slots == [0]
    ids, _, reason, _ = finish(eng, "waiting")
    # the slot's cache was cleared: the new request sees nothing of the aborted one
    assert ids == generate(model, PROMPTS[0], 6) and reason == "length"
    assert not eng.has_work() and eng.scheduler.free_slots == [0]


def test_load_gauges_are_true_between_steps(model):
    """The running and waiting gauges follow every arrival, admission and abort, not only the
    steps: aborting the last requests leaves them at 0 with no step to come."""
    eng = engine(model, max_num_seqs=1)
    load = lambda: (eng.metrics.running, eng.metrics.waiting)  # noqa: E731
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, temperature=0))
    assert load() == (0, 2)
    eng.step()
    assert load() == (1, 1)
    eng.abort("a")
    assert load() == (0, 1)
    eng.abort("b")
    assert load() == (0, 0) and eng.metrics.requests["abort"] == 2


def test_the_latency_histograms_render_cumulative_buckets():
    """The inter-token latency histogram after random gaps (some exactly on a bound, several tokens
    at once): each bucket counts the observations at or below its bound, +Inf all of them, and the
    sum is theirs, as Prometheus defines a histogram."""
    from monodecode.engine.metrics import LATENCY_BUCKETS, Metrics

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    metrics, seen = Metrics(), []
    for _ in range(200):
        bound = LATENCY_BUCKETS[int(torch.randint(0, len(LATENCY_BUCKETS), (), generator=g))]
        if torch.rand((), generator=g) < 0.5:  # one token, its gap on the bound
            n, gap = 1, bound
        else:
            n = int(torch.randint(1, 7, (), generator=g))
            gap = bound * n * float(torch.rand((), generator=g)) * 3
        metrics.count_tokens(n, None, gap)
        seen += [gap / n] * n
    lines = dict(line.rsplit(" ", 1) for line in metrics.itl.lines("itl"))
    for bound in LATENCY_BUCKETS:
        assert int(lines[f'itl_bucket{{le="{bound}"}}']) == sum(v <= bound for v in seen)
    assert int(lines['itl_bucket{le="+Inf"}']) == int(lines["itl_count"]) == len(seen)
    assert float(lines["itl_sum"]) == pytest.approx(sum(seen))


def test_greedy_verification_refuses_sampling(model):
    """Greedy verification decodes greedily, so it cannot honour a temperature: refused, not
    sampled at the first token and greedy after."""
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                        "rejection_sample_method": "greedy"})
    eng = engine(model, speculative=spec)
    with pytest.raises(ValueError, match="temperature must be 0 with greedy speculative verification"):
        eng.add_request("hot", PROMPTS[0], SamplingParams(temperature=0.7))
    assert eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) == [
        generate(model, PROMPTS[0], 6)]


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_and_echo_match_a_full_prefill(model, speculative):
    """Under speculation each committed token's logprobs come from the verify rows, in steps
    shared with a request that asks for none (whose steps skip them)."""
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5}) if speculative else None
    eng = engine(model, speculative=spec)
    prompt = PROMPTS[4]  # 40 tokens: 6 prefill chunks of at most 7
    if speculative:
        eng.add_request("other", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    ids, _, _, outputs = run(eng, prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, echo=True))
    sequence = prompt + ids
    expected = model.score(sequence).log_softmax(-1)
    prompt_lp = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
    assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
    sampled = [e for o in outputs for e in o.logprobs]
    for i, entry in enumerate(prompt_lp[1:] + sampled, start=1):
        assert entry.token_id == sequence[i]
        assert abs(entry.logprob - expected[i - 1, sequence[i]].item()) < 1e-4
        assert len(entry.top) == 3 and abs(entry.top[0][1] - expected[i - 1].max().item()) < 1e-4
    for entry in sampled:  # greedy: the sampled token is the most likely one
        assert entry.top[0][0] == entry.token_id


def test_requests_that_cannot_fit_are_refused(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="maximum context length is 128"):
        eng.add_request("a", list(range(120)), SamplingParams(max_tokens=9))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("b", [1, 512], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("c", [], SamplingParams())
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"seed": 2**64}, {"seed": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # the largest seed a torch.Generator takes
    with pytest.raises(RuntimeError, match="activations and caches in bfloat16; the model is torch.float32"):
        engine(model, mono="on")
    assert not eng.has_work()


@pytest.mark.parametrize("max_tokens", [pytest.param(4, marks=pytest.mark.slow), 2], ids=lambda n: f"{n}_tokens")
def test_decode_steps_take_the_mono_path_when_it_is_on(device, max_tokens):
    """bf16, mono on (on a CPU: Triton's interpreter): the decode steps run on the kernels, are
    counted as such, and greedy outputs equal the per-op path's. 4 tokens a request are `slow`;
    by default 2 (a decode step each, the first token coming from the prefill)."""
    model = load_model("tiny", seed=3, dtype=torch.bfloat16, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    per_op = engine(model, mono="off").generate(PROMPTS[:2], params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "mono on without a GPU": slow, and said once
        eng = engine(model, mono="on")
    assert eng.generate(PROMPTS[:2], params) == per_op
    assert eng.metrics.steps["mono"] >= max_tokens - 1 and eng.metrics.steps["per-op"] == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_the_warm_up_steps_every_decode_width_and_touches_nothing(model, monkeypatch, speculative):
    """`Engine.warm_up`: one step of pad rows at every width a decode (or verify) step can have;
    no cache entry written, no step counted; the engine serves the same tokens after it."""
    import copy

    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5}) if speculative else None
    eng = engine(model, speculative=spec)
    caches, widths = copy.deepcopy(eng.caches), []
    step = model.step

    def recording_step(cache, tokens, positions, slots, **kw):
        widths.append(len(tokens))
        assert all(s == -1 for s in slots)
        return step(cache, tokens, positions, slots, **kw)

    monkeypatch.setattr(model, "step", recording_step)
    eng.warm_up()
    monkeypatch.undo()
    assert widths == [n * (6 if speculative else 1) for n in (1, 2, 3)]  # max_num_seqs 3; 1 + 5 rows a request
    target, before = (eng.caches.target, caches.target) if speculative else (eng.caches, caches)
    for now, then in zip(target.layers, before.layers):
        assert torch.equal(now.window.pos, then.window.pos)
        assert torch.equal(now.window.data["kv"], then.window.data["kv"])
    assert sum(eng.metrics.steps.values()) == 0
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert eng.generate(PROMPTS[:2], params) == engine(model, speculative=spec).generate(PROMPTS[:2], params)
