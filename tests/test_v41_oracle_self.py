"""Self-checks of the V4.1 test oracle (v41_oracle.py) alone: it is causal, each of its V4.1 rules
changes its output, its candidate filter really drops entries, and the constants it derives
(Engram multipliers and offsets, RoPE frequencies) are the specs' values. It is not compared with
the per-op model here."""

import math

import pytest
import torch

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.model.rope import layer_frequencies
from monodecode.model.weights import read_weights
from monodecode.presets import preset
from monodecode.v41 import engram_primes
from v41_oracle import RULES, engram_hashes, hash_multipliers, hash_offsets, oracle_forward, oracle_trace

T = 64
CLEAR = 1e-2  # a rule must move the compared output by more than this, relative to its largest entry
NOISE = 1e-4  # fp32 noise, relative (the oracle's own causality differences are ~3e-6)


@pytest.fixture(scope="module")
def setup():
    config = preset("tiny-v4.1")
    weights = read_weights(SyntheticCheckpoint(config, 0), "model", "cpu", torch.float32)
    token_map = torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
    ids = torch.randint(0, config.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    return config, weights, token_map, ids


@pytest.fixture(scope="module")
def baseline(setup):
    config, weights, token_map, ids = setup
    return oracle_forward(config, weights, ids, token_map)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_shapes_and_interface(setup, baseline):
    config, weights, token_map, ids = setup
    logits, features = baseline
    assert logits.shape == (T, config.vocab_size) and logits.dtype == torch.float32
    assert features.shape == (T, len(config.dspark_target_layer_ids) * config.hidden_size)
    assert torch.isfinite(logits).all() and torch.isfinite(features).all()
    again = oracle_forward(config, weights, ids.tolist(), token_map)  # a list of ids works alike
    assert torch.equal(again[0], logits) and torch.equal(again[1], features)
    with pytest.raises(ValueError, match="unknown rule"):
        oracle_forward(config, weights, ids, token_map, frozenset({"no_such_rule"}))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 40])
def test_causal(setup, baseline, n):
    """A prefix's logits and features are the first rows of the longer sequence's."""
    config, weights, token_map, ids = setup
    logits, features = oracle_forward(config, weights, ids[:n], token_map)
    assert rel(logits, baseline[0][:n]) < NOISE
    assert rel(features, baseline[1][:n]) < NOISE


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_matters(setup, baseline, rule):
    """Each rule changes the logits (capture_output: the features) by a clear margin.
    eps_1e-6 runs on a copy whose `embed` is scaled by 1e-4: at the synthetic weights' O(1)
    activations, rsqrt(mean(x^2) + 1e-6) and rsqrt(mean(x^2) + 1e-20) differ by ~1e-6 relative,
    fp32 noise; with embedding rows of mean square ~1e-8 the eps dominates layer 0's attention
    norm, its mHC mixes and the Engram gate at layer 0, so the rule shows."""
    config, weights, token_map, ids = setup
    if rule == "eps_1e-6":
        plain = oracle_forward(config, weights, ids, token_map, frozenset({rule}))
        assert rel(plain[0], baseline[0]) < NOISE  # invisible at O(1) scale, hence the scaled copy
        weights = {**weights, "embed": weights["embed"] * 1e-4}
        base = oracle_forward(config, weights, ids, token_map)
    else:
        base = baseline
    logits, features = oracle_forward(config, weights, ids, token_map, frozenset({rule}))
    if rule == "capture_output":
        assert torch.equal(logits, base[0])
        assert rel(features, base[1]) > CLEAR
    else:
        assert rel(logits, base[0]) > CLEAR


def test_candidate_filter_drops_entries(setup):
    """Layer 6 (own indexer above the candidate layer 4) selects only inside 4's candidate blocks,
    the candidates cover fewer entries than are visible, and the filter changes 6's selection."""
    config, weights, token_map, ids = setup
    cand_layer = config.candidate_source_layer_id
    consumers = [L for L in range(config.num_hidden_layers) if config.uses_candidates(L)]
    assert consumers == [6] and cand_layer == 4
    trace = oracle_trace(config, weights, ids, token_map)["layers"]
    candidates = trace[cand_layer]["candidates"]
    six = trace[6]
    visible = six["visible"]
    assert (six["selected"] & ~candidates).sum() == 0
    assert torch.equal(six["attended"], six["selected"])
    kept = (candidates & visible).sum(1)
    assert (kept < visible.sum(1)).any()
    assert kept[-1] == config.candidate_topk_blocks * config.candidate_block_size < visible[-1].sum()
    # every index source still fills its top-k: min(index_topk, visible) entries a row
    for L in config.index_source_layer_ids:
        want = trace[L]["visible"].sum(1).clamp(max=config.index_topk)
        assert torch.equal(trace[L]["selected"].sum(1), want)
    free = oracle_trace(config, weights, ids, token_map, frozenset({"no_candidates"}))["layers"][6]
    assert (free["selected"] & ~candidates).any()  # without the filter, 6 would pick outside


def test_reuse_roles(setup):
    """Layers 2 and 5 attend their index source's top-k; the KV sources' entries are read by
    the layers above them (2, 3 over 1's entries; 5, 6 over 4's)."""
    config, weights, token_map, ids = setup
    trace = oracle_trace(config, weights, ids, token_map)["layers"]
    assert torch.equal(trace[2]["attended"], trace[1]["selected"])
    assert torch.equal(trace[5]["attended"], trace[4]["selected"])
    assert trace[3]["visible"].shape == trace[1]["visible"].shape == (T, T // 2)
    assert trace[6]["visible"].shape == (T, T)


def test_engram_constants():
    """DeepSeek-V4.1-Flash's multipliers and table offsets, as engram.md computed them."""
    assert hash_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(14, 4, 99092) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    primes = engram_primes(2, 4, 8, 16_000_000)
    assert [hash_offsets(p)[-1] for p in primes] == [368005705, 368015793]


def test_engram_hash_locality(setup):
    """A position's hashes depend on its last max_ngram_size tokens only, and lie in the table."""
    config, _, token_map, ids = setup
    n = config.engram_max_ngram_size
    base = engram_hashes(config, ids, token_map)
    changed = ids.clone()
    changed[20] = (changed[20] + 1) % config.vocab_size
    moved = engram_hashes(config, changed, token_map)
    differs = (base != moved).any(-1).any(-1)
    assert differs.nonzero().flatten().tolist() == list(range(20, 20 + n))
    for slot, rows in enumerate(config.engram_num_embeddings):
        assert 0 <= base[:, slot].min() and base[:, slot].max() < rows


def official_inv_freq(dim, base, yarn):
    """DeepSeek's precompute_freqs_cis (V4 / V4.1 inference/model.py), its frequency part."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs

    def corr(rot):
        return dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


@pytest.mark.parametrize("name", ["tiny-v4.1", "v4.1-flash"])
def test_rope_frequencies_follow_the_spec(name):
    """The V4 helper the oracle imports gives V4.1's frequencies: compressed layers
    compress_rope_theta with YaRN, window layers rope_theta without."""
    c = preset(name)
    assert torch.allclose(layer_frequencies(c, True),
                          official_inv_freq(c.qk_rope_head_dim, c.compress_rope_theta, c.rope_scaling), rtol=1e-6)
    assert torch.allclose(layer_frequencies(c, False),
                          official_inv_freq(c.qk_rope_head_dim, c.rope_theta, None), rtol=1e-6)
