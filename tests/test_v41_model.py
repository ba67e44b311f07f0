"""DeepSeek-V4.1's per-op model against an independent whole-sequence oracle (v41_oracle.py), one
test per V4.1 rule showing that the model follows it and not V4's alternative, the V4.1 DSpark
draft (lossless greedy speculation), the engine, and a tiny V4.1 checkpoint through make-checkpoint,
generate and serve. Decode equals prefill for V4.1 is in test_model.py (its model fixture runs
both), tensor parallelism in test_tensor_parallel.py."""

import pytest
import torch

from monodecode.checkpoint import Checkpoint, SyntheticCheckpoint
from monodecode.cli import main
from monodecode.config import preset
from monodecode.engine import Engine, SamplingParams
from monodecode.engine.tokenizer import ByteTokenizer
from monodecode.generate import generate, generate_speculative
from monodecode.model import Model, load_model
from monodecode.model.weights import read_weights
from monodecode.serve import make_app
from monodecode.spec.config import SpeculativeConfig

from test_server import client, running
from v41_oracle import RULES, oracle_forward

NAME, SEED, LENGTH = "tiny-v4.1", 5, 64


@pytest.fixture(scope="module")
def config():
    return preset(NAME)


@pytest.fixture(scope="module")
def weights(config):
    return read_weights(SyntheticCheckpoint(config, SEED), "model", "cpu", torch.float32)


@pytest.fixture(scope="module")
def token_map(config):
    return torch.arange(config.vocab_size) % config.engram_compressed_vocab_size  # the tokenizer-less map


def random_ids(seed: int, n: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def model_forward(config, weights, ids):
    """The per-op model's (logits, draft features) of one prefill of `ids`."""
    model = Model(config, weights, "cpu", torch.float32)
    cache = model.make_cache(num_slots=1, max_context=len(ids))
    return model.step(cache, ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long),
                      return_hidden=True)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_model_equals_the_independent_oracle(config, weights, token_map):
    """Every V4.1 rule at once, 64 tokens: ratio-2 and ratio-1 layers reading their KV and index
    sources, the candidate filter dropping entries (16 of 64 entries are candidates), Engram."""
    ids = random_ids(1)
    logits, features = model_forward(config, weights, ids)
    ref_logits, ref_features = oracle_forward(config, weights, ids, token_map)
    assert rel(logits, ref_logits) < 1e-5 and rel(features, ref_features) < 1e-5


@pytest.mark.parametrize("rule", RULES)
def test_each_v41_rule_is_followed_not_v4s(config, weights, token_map, rule):
    """The model agrees with the oracle, and not with the oracle that has one V4.1 rule replaced
    by V4's (or, where V4 has no counterpart weights, by the nearest V4-like alternative: see
    v41_oracle.RULES): the delayed collapse, no per-head query norm, the KV-source and index-source
    reuse, the candidate mask, the Engram gate, eps 1e-20, no hc_head, the draft's capture point.
    eps 1e-20 only shows on small activations: the embedding is scaled by 1e-4 for it."""
    if rule == "eps_1e-6":
        weights = {**weights, "embed": weights["embed"] * 1e-4}
    ids = random_ids(2)
    logits, features = model_forward(config, weights, ids)
    ref_logits, ref_features = oracle_forward(config, weights, ids, token_map)
    assert rel(logits, ref_logits) < 1e-5 and rel(features, ref_features) < 1e-5
    alt_logits, alt_features = oracle_forward(config, weights, ids, token_map, frozenset([rule]))
    changed = rel(features, alt_features) if rule == "capture_output" else rel(logits, alt_logits)
    assert changed > 1e-2, f"{rule}: the V4-like alternative gives the same output ({changed:.2e})"


@pytest.mark.parametrize("method", ["greedy", "block"])
def test_greedy_speculation_with_the_v41_draft_is_lossless(method):
    model = load_model(NAME, seed=SEED)
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                        "rejection_sample_method": method})
    prompt = random_ids(3, 9).tolist()
    fast, stats = generate_speculative(model, prompt, 40, spec, seed=0)
    assert fast == generate(model, prompt, 40)
    assert stats.steps >= 1 and 1 <= stats.mean_acceptance_length <= 6


def test_the_v41_draft_has_its_own_experts_and_no_hc_head(config):
    model = load_model(NAME, seed=SEED)
    draft = model.draft()
    assert not any("hc_head" in name for name in draft.w)
    assert draft.markov_w1.endswith("markov_head.embed") and draft.markov_w2.endswith("markov_head.head")
    for stage in draft.stages:
        assert stage.moe.topk == config.dspark_num_experts_per_tok
        assert stage.moe.gate.shape[0] == config.dspark_n_routed_experts != config.n_routed_experts


def test_a_step_without_its_requests_history_is_refused():
    """Engram hashes the tokens before a row: a step that does not follow its request's previous
    one has none, and says so rather than hashing as if the sequence started there."""
    model = load_model(NAME, seed=SEED)
    cache = model.make_cache(num_slots=1, max_context=32)
    model.step(cache, random_ids(4, 8), range(8), [0] * 8)
    with pytest.raises(RuntimeError, match=r"slot 0: the token ids of positions \[10, 11\] are not in the cache"):
        model.step(cache, [5], [12], [0])


def test_a_tiny_v41_checkpoint_through_make_checkpoint_generate_and_serve(tmp_path, capsys):
    out = tmp_path / "tiny41"
    assert main(["make-checkpoint", "--preset", NAME, "--seed", "7", "--out", str(out)]) == 0
    model = Model.from_checkpoint(Checkpoint(out))
    prompt = [7, 70, 300, 12]
    expected = generate(model, prompt, 8)
    assert expected == generate(load_model(NAME, seed=7), prompt, 8)  # the written weights are the preset's
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt-ids", "7,70,300,12", "--max-tokens", "8"]) == 0
    until_eos = generate(model, prompt, 8, stop_ids=(model.config.eos_token_id,))
    assert capsys.readouterr().out == ByteTokenizer().decode(until_eos) + "\n"  # the preset's text: bytes
    with running(make_app(model, str(out), max_model_len=64, max_num_seqs=2, mono="auto")) as url:
        reply = client(url).completions.create(model=str(out), prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.choices[0].model_extra["token_ids"] == expected


@pytest.mark.parametrize("method", [None, "block"])
def test_the_engine_runs_v41_as_one_request_at_a_time(method):
    """Six prompts through three slots, prefilled seven tokens a step (chunks that cut Engram's
    n-grams and the ratio-2 groups, queueing, mixed prefill and decode steps), greedy, with and
    without speculation: each output equals plain generation of its prompt alone."""
    model = load_model(NAME, seed=SEED)
    prompts = [[5, 9, 14], list(range(40, 61)), [300, 300, 7], [11], list(range(100, 140)), [77] * 9]
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                        "rejection_sample_method": method}) if method else None
    engine = Engine(model, max_model_len=128, max_num_seqs=3, max_num_batched_tokens=7, mono="off", speculative=spec)
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert got == [generate(model, p, 12) for p in prompts]
