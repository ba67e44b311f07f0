"""DeepSeek-V4.1 configs: both model_type spellings, the presets' layer maps, every new field's checks."""

import json
import random

import pytest

from monodecode import v41
from monodecode.config import ConfigError, ModelConfig, preset

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
         "expert_dtype": "fp4"}

# DeepSeek-V4.1-Flash's text config, official spelling (compress_ratios with the 3 DSpark entries,
# transformers-style flat rope_parameters holding the YaRN settings).
V41_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2304,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                        "beta_fast": 32, "beta_slow": 1},
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "quantization_config": QUANT,
}


def multimodal(text: dict, **wrapper) -> dict:
    """The text config nested in the multimodal deepseek_v41 config, with a vision part."""
    return {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
            "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024, "patch_size": 14},
            "image_token_id": 128815, **wrapper}


def test_text_config_parses_to_the_v41_flash_preset():
    c = ModelConfig.from_dict(V41_TEXT)
    assert c == preset("v4.1-flash")
    assert c.is_v41 and c.model_type == "deepseek_v41_text"
    assert len(c.compress_ratios) == 40  # the DSpark entries are dropped


def test_multimodal_config_reads_the_nested_text_model():
    assert ModelConfig.from_dict(multimodal(V41_TEXT)) == preset("v4.1-flash")
    # the text config may leave model_type out, and the quantization_config to the wrapper
    text = {k: v for k, v in V41_TEXT.items() if k not in ("model_type", "quantization_config")}
    assert ModelConfig.from_dict(multimodal(text, quantization_config=QUANT)) == preset("v4.1-flash")


def test_released_quantization_spelling_without_fmt_is_read():
    q = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32], "expert_dtype": "fp4"}
    c = ModelConfig.from_dict({**V41_TEXT, "quantization_config": q})
    assert c.fp8_block == (32, 32) and c.experts_fp4


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "deepseek_v41"}, "model_type 'deepseek_v41' nests its text model under text_config"),
        (multimodal({**V41_TEXT, "model_type": "deepseek_v4"}), "text_config.model_type must be 'deepseek_v41_text'"),
        ({"model_type": "deepseek_v41", "text_config": "v41"}, 'text_config must be an object, got "v41"'),
    ],
)
def test_bad_multimodal_wrappers_are_named(raw, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)


def test_to_dict_round_trips_the_v41_presets():
    for name in ("v4.1-flash", "tiny-v4.1"):
        c = preset(name)
        d = json.loads(json.dumps(c.to_dict()))
        assert d["model_type"] == "deepseek_v41_text" and d["kv_source_layer_ids"] == list(c.kv_source_layer_ids)
        assert ModelConfig.from_dict(d) == c
    assert "kv_source_layer_ids" not in preset("v4-flash").to_dict()  # V4's spelling is unchanged


def expected_source(sources, layer):
    """The rule of dsv4 V4.1: the latest source at or below the layer (brute force)."""
    return max(s for s in sources if s <= layer)


def test_v41_flash_layer_maps():
    c = preset("v4.1-flash")
    assert c.layer_kinds == ("window",) * 2 + ("csa",) * 38
    assert c.compress_ratios[2:20] == (2,) * 18 and c.compress_ratios[20:] == (1,) * 20
    for i in range(40):
        kv, index = c.kv_source_of(i), c.index_source_of(i)
        if i < 2:
            assert kv is None and index is None
            continue
        assert kv == (2 if i < 8 else 8 if i < 14 else 14 if i < 20 else 20)
        assert index == expected_source((2, 8, 14, 20, 24, 28, 32, 36), i)
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]
    assert [i for i in range(40) if c.is_engram_layer(i)] == [1, 14]
    assert c.engram_hash_columns == 24  # 3 n-gram orders x 8 heads
    assert (c.num_hash_layers, c.rms_norm_eps, c.fp8_block, c.index_n_heads) == (0, 1e-20, (32, 32), 32)
    assert c.delayed_hc_pre and not c.has_hc_head and c.dspark_captures_layer_input
    assert (c.draft_n_routed_experts, c.draft_num_experts_per_tok) == (128, 3)
    assert c.dspark_target_layer_ids == (37, 38, 39)


def test_engram_table_sizes_follow_from_their_primes():
    # the published sizes of V4.1-Flash's two tables, from the bucket-prime rule alone
    assert v41.engram_table_rows(2, 4, 8, 16_000_000) == (384006168, 384016682)
    rows = v41.engram_table_rows(2, 3, 2, 61)  # tiny-v4.1: 61+67 + 71+73 | 79+83 + 89+97
    assert rows == (272, 348) == preset("tiny-v4.1").engram_num_embeddings


def test_primality_against_trial_division():
    rng = random.Random(5)
    for n in [0, 1, 2, 3, 4, 17, 561, 1105, 16000057] + [rng.randrange(10**6, 10**8) for _ in range(300)]:
        assert v41._is_prime(n) == (n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))), n


def test_tiny_v41_has_every_v41_feature():
    c = preset("tiny-v4.1")
    assert set(c.compress_ratios) == {0, 1, 2} and c.is_v41
    compressed = [i for i, r in enumerate(c.compress_ratios) if r]
    for ratio in (1, 2):
        layers = [i for i in compressed if c.compress_ratios[i] == ratio]
        # a source, a layer that reuses both, and a layer with its own indexer over another's KV
        assert any(c.kv_source_of(i) == i for i in layers)
        assert any(c.kv_source_of(i) != i and c.index_source_of(i) != i for i in layers)
        assert any(c.kv_source_of(i) != i and c.index_source_of(i) == i for i in layers)
    assert any(c.uses_candidates(i) for i in compressed)
    assert c.candidate_topk_blocks * c.candidate_block_size < 64  # the candidates filter a 64-token sequence
    assert c.engram_layer_ids and c.has_dspark and c.draft_n_routed_experts < c.n_routed_experts
    assert c.rms_norm_eps == 1e-20 and c.fp8_block == (32, 32) and c.num_hash_layers == 0


def test_v4_presets_keep_v4_semantics():
    for name in ("tiny", "v4-flash", "v4-pro"):
        c = preset(name)
        assert not c.is_v41 and c.has_hc_head and not c.delayed_hc_pre and not c.engram_layer_ids
        for i, r in enumerate(c.compress_ratios):
            assert c.kv_source_of(i) == (i if r else None)
            assert c.index_source_of(i) == (i if r == 4 else None)
            assert not c.uses_candidates(i)


def test_source_maps_on_random_layouts():
    rng = random.Random(31)
    for _ in range(200):
        n = rng.randrange(3, 30)
        split = rng.randrange(1, n)  # window layers, then ratio 2, then ratio 1 from some layer on
        two_end = rng.randrange(split, n + 1)
        ratios = (0,) * split + (2,) * (two_end - split) + (1,) * (n - two_end)
        starts = [s for s in (split, two_end) if s < n and ratios[s]]
        kv = sorted(set(starts) | {rng.randrange(split, n) for _ in range(rng.randrange(3))})
        index = sorted(set(kv) | {rng.randrange(split, n) for _ in range(rng.randrange(4))})
        c = preset("tiny-v4.1", num_hidden_layers=n, compress_ratios=ratios, kv_source_layer_ids=tuple(kv),
                   index_source_layer_ids=tuple(index), engram_layer_ids=None, engram_num_embeddings=None,
                   **dict.fromkeys(v41.ENGRAM_SCALARS + v41.CANDIDATE_FIELDS))
        for i in range(n):
            assert c.kv_source_of(i) == (expected_source(kv, i) if ratios[i] else None)
            assert c.index_source_of(i) == (expected_source(index, i) if ratios[i] else None)
            assert ratios[c.kv_source_of(i) or 0] == ratios[i] or not ratios[i]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hash_layers": 3}, "num_hash_layers must be 0: DeepSeek-V4.1 has no hash-routed layers, got 3"),
        ({"compress_ratios": [0, 0, 4] + [2] * 17 + [1] * 20}, "compress_ratios[2] = 4: DeepSeek-V4.1 layers have ratio 0"),
        ({"kv_source_layer_ids": None}, "a deepseek_v41_text config needs kv_source_layer_ids"),
        ({"index_source_layer_ids": None}, "needs index_source_layer_ids"),
        ({"kv_source_layer_ids": [8, 2, 14, 20]}, "kv_source_layer_ids must be strictly ascending, got [8, 2, 14, 20]"),
        ({"kv_source_layer_ids": [2, 2, 8, 14, 20]}, "strictly ascending"),
        ({"kv_source_layer_ids": [1, 2, 8, 14, 20]}, "kv_source_layer_ids contains 1, a window layer"),
        ({"kv_source_layer_ids": [2, 8, 14, 20, 40]}, "kv_source_layer_ids contains 40, outside 0..39"),
        ({"kv_source_layer_ids": [8, 14, 20]}, "layer 2 is compressed but no kv_source_layer_ids entry is at or below it"),
        ({"kv_source_layer_ids": [2, 8, 14]},
         "layer 20 (ratio 1) would read layer 14 of kv_source_layer_ids, whose ratio is 2"),
        ({"index_source_layer_ids": [2, 8, 14, 24]}, "layer 20 (ratio 1) would read layer 14 of index_source_layer_ids"),
        ({"index_source_layer_ids": "2,8"}, 'index_source_layer_ids must be a list of integers, got "2,8"'),
        ({"candidate_source_layer_id": 21}, "candidate_source_layer_id 21 is not in index_source_layer_ids"),
        ({"candidate_block_size": None}, "given without candidate_block_size: the candidate filter needs all three"),
        ({"candidate_topk_blocks": 0}, "candidate_topk_blocks must be a positive integer, got 0"),
        ({"candidate_topk_blocks": 10}, "= 80 positions, fewer than index_topk = 512"),
        ({"candidate_block_size": 8.5}, "candidate_block_size must be an integer or null, got 8.5"),
        ({"engram_layer_ids": [14, 1]}, "engram_layer_ids must be strictly ascending"),
        ({"engram_layer_ids": [1, 40]}, "engram_layer_ids contains 40, outside 0..39"),
        ({"engram_layer_ids": [], "engram_num_embeddings": None}, "engram_max_ngram_size is given but engram_layer_ids is empty"),
        ({"engram_head_dim": None}, "engram_layer_ids is given without engram_head_dim"),
        ({"engram_num_embeddings": [384006168]}, "engram_num_embeddings has 1 entries, engram_layer_ids 2"),
        ({"engram_num_embeddings": [384006168, 384016683]}, "make tables of [384006168, 384016682] rows"),
        ({"engram_n_heads": 7}, "engram_n_heads 7 and engram_vocab_size 16000000 make tables of"),
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size must be >= 2"),
        ({"engram_pad_token_id": 129280}, "engram_pad_token_id must be a token id in [0, vocab_size = 129280), got 129280"),
        ({"engram_compressed_vocab_size": 200000}, "engram_compressed_vocab_size 200000 exceeds vocab_size 129280"),
        ({"engram_head_dim": 250}, "engram_head_dim 250 is not a multiple of 32"),
        ({"engram_vocab_size": 0}, "engram_vocab_size must be a positive integer, got 0"),
        ({"engram_vocab_size": "16000000"}, 'engram_vocab_size must be an integer or null, got "16000000"'),
        ({"engram_num_embeddings": [384006168, True]}, "engram_num_embeddings must be a list of integers"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be positive, got 0"),
        ({"compress_ratios": None, "layer_types": ["sliding_attention"] * 40},
         "a deepseek_v41 config must give compress_ratios"),
    ],
)
def test_bad_v41_configs_name_the_field(change, message):
    raw = {k: v for k, v in {**V41_TEXT, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)


def test_errors_through_the_wrapper_name_the_field_too():
    with pytest.raises(ConfigError, match="candidate_source_layer_id 21 is not in index_source_layer_ids"):
        ModelConfig.from_dict(multimodal({**V41_TEXT, "candidate_source_layer_id": 21}))


@pytest.mark.parametrize("name", v41.FIELDS)
def test_v4_configs_cannot_carry_v41_fields(name):
    value = getattr(preset("v4.1-flash"), name)
    with pytest.raises(ConfigError, match=f"{name} is a DeepSeek-V4.1 field .* a deepseek_v4 config cannot have it"):
        preset("v4-flash", **{name: value})


def test_the_wrapper_type_is_not_a_model_config_type():
    with pytest.raises(ConfigError, match="'deepseek_v41' is the multimodal wrapper.*use 'deepseek_v41_text'"):
        preset("v4.1-flash", model_type="deepseek_v41")


def test_vision_fields_are_refused_by_name():
    c = ModelConfig.from_dict(multimodal(V41_TEXT))
    for name in v41.VISION_ONLY_FIELDS:
        with pytest.raises(ConfigError, match=f"{name} belongs to DeepSeek-V4.1's vision part, which monodecode "
                                              "does not support: it reads the text model only"):
            getattr(c, name)
        assert not hasattr(c, name)  # hasattr and getattr(..., default) keep working
    with pytest.raises(AttributeError) as e:
        c.no_such_field
    assert not isinstance(e.value, ConfigError)


def test_layer_count_overrides_cut_the_id_lists():
    c = preset("v4.1-flash", num_hidden_layers=21)
    assert (c.kv_source_layer_ids, c.index_source_layer_ids) == ((2, 8, 14, 20), (2, 8, 14, 20))
    assert c.candidate_source_layer_id == 20 and c.engram_layer_ids == (1, 14)
    assert c.dspark_target_layer_ids == (18, 19, 20)
    c = preset("v4.1-flash", num_hidden_layers=10)
    assert c.kv_source_layer_ids == (2, 8) and c.candidate_source_layer_id is None
    assert (c.engram_layer_ids, c.engram_num_embeddings) == ((1,), (384006168,))
    c = preset("v4.1-flash", num_hidden_layers=1)
    assert c.kv_source_layer_ids == () and c.engram_layer_ids is None and c.engram_head_dim is None
    c = preset("tiny-v4.1", num_hidden_layers=9)  # extended: the new layers read the last layer's sources
    assert c.compress_ratios[7:] == (1, 1) and c.kv_source_of(8) == 4 and c.index_source_of(8) == 6
