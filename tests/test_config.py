import json

import pytest

from monodecode.config import ConfigError, ModelConfig, load_config, preset

# The published DeepSeek-V4-Flash-Base config.json (official spelling), trimmed of fields we ignore.
FLASH_OFFICIAL = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 129280, "compress_rope_theta": 160000,
    "topk_method": "noaux_tc", "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
}


def transformers_spelling(official: dict) -> dict:
    """The same model as transformers' DeepseekV4Config writes it."""
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    raw = {k: v for k, v in official.items()
           if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling",
                        "compress_rope_theta")}
    n = official["num_hidden_layers"]
    raw["layer_types"] = [kinds[r] for r in official["compress_ratios"][:n]]
    raw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    raw["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * (n - 3)
    raw["partial_rotary_factor"] = 0.125
    raw["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                     "attention_factor": 1.0, "partial_rotary_factor": 0.125},
    }
    return raw


def test_official_spelling_parses_to_v4_flash():
    c = ModelConfig.from_dict(FLASH_OFFICIAL)
    assert c.layer_kinds[:4] == ("window", "window", "csa", "hca")
    assert c.layer_kinds.count("csa") == 21 and c.layer_kinds.count("hca") == 20
    assert len(c.compress_ratios) == 43  # the trailing MTP entry is dropped
    assert c.num_hash_layers == 3 and c.is_hash_layer(2) and not c.is_hash_layer(3)
    assert c.rope_scaling.factor == 16 and c.rope_scaling.original_max_position_embeddings == 65536
    assert c.compress_rope_theta == 160000 and c.rope_theta == 10000
    assert c.fp8_block == (128, 128) and c.experts_fp4
    assert c.nope_head_dim == 448


def test_both_spellings_give_the_same_config():
    a = ModelConfig.from_dict(FLASH_OFFICIAL)
    b = ModelConfig.from_dict(transformers_spelling(FLASH_OFFICIAL))
    assert a == b


def test_presets_match_published_sizes():
    flash, pro = preset("v4-flash"), preset("v4-pro")
    assert (flash.hidden_size, flash.num_hidden_layers, flash.n_routed_experts) == (4096, 43, 256)
    assert (pro.hidden_size, pro.num_hidden_layers, pro.n_routed_experts) == (7168, 61, 384)
    assert pro.layer_kinds[:2] == ("hca", "hca") and pro.layer_kinds[-1] == "csa"
    assert flash.dspark_target_layer_ids == (40, 41, 42) and pro.dspark_target_layer_ids == (58, 59, 60)
    assert flash.compress_ratios == ModelConfig.from_dict(FLASH_OFFICIAL).compress_ratios


def test_tiny_preset_has_every_layer_kind_and_routing():
    c = preset("tiny")
    assert set(c.layer_kinds) == {"window", "csa", "hca"}
    hash_kinds = {c.layer_kinds[i] for i in range(c.num_hidden_layers) if c.is_hash_layer(i)}
    bias_kinds = {c.layer_kinds[i] for i in range(c.num_hidden_layers) if not c.is_hash_layer(i)}
    assert hash_kinds and bias_kinds
    assert c.hc_mult == 4 and c.has_dspark
    hca_ratio = max(c.compress_ratios)
    assert 64 // hca_ratio >= 3 and 64 // 4 > c.index_topk  # several windows; top-k selects
    assert 64 > c.sliding_window


def test_preset_overrides_trim_layers_and_move_draft_targets():
    c = preset("v4-flash", num_hidden_layers=2)
    assert c.num_hidden_layers == 2 and c.compress_ratios == (0, 0)
    assert c.num_hash_layers == 2
    assert all(t < 2 for t in c.dspark_target_layer_ids)
    c = preset("v4-flash", num_hidden_layers=4, compress_ratios=(0, 4, 128, 4))
    assert c.layer_kinds == ("window", "csa", "hca", "csa")
    assert preset("tiny", num_hidden_layers=6).layer_kinds[4:] == ("csa", "hca")


def test_to_dict_round_trips_through_json():
    for name in ("tiny", "v4-flash", "v4-pro"):
        c = preset(name)
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_load_config_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_OFFICIAL))
    assert load_config(tmp_path) == ModelConfig.from_dict(FLASH_OFFICIAL)
    assert load_config(tmp_path, num_hidden_layers=3).num_hidden_layers == 3


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type 'llama'"),
        ({"model_type": "deepseek_v41"}, "model_type 'deepseek_v41'"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries but num_hidden_layers is 43"),
        ({"num_key_value_heads": 8}, "num_key_value_heads must be 1"),
        ({"o_groups": 7}, "not divisible by o_groups=7"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok=300 exceeds"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"rope_scaling": {"type": "longrope", "factor": 2}}, "rope scaling type 'longrope'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
        ({"vocab_size": None}, "lacks required field(s) ['vocab_size']"),
        ({"compress_ratios": "0,4,16,4"}, 'compress_ratios must be a list of integers, got "0,4,16,4"'),
        ({"rope_theta": "abc"}, 'rope_theta must be a number, got "abc"'),
        ({"num_hidden_layers": 4.5}, "num_hidden_layers must be an integer, got 4.5"),
        ({"hidden_size": True}, "hidden_size must be an integer, got true"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
        ({"eos_token_id": "1"}, 'eos_token_id must be an integer or null, got "1"'),
        ({"eos_token_id": [1, "2"]}, 'eos_token_id must be a list of integers, got [1, "2"]'),
        ({"eos_token_id": 129280}, "eos_token_id must be a token id in [0, vocab_size = 129280), got 129280"),
        ({"rope_scaling": {"type": "yarn", "factor": "16", "original_max_position_embeddings": 65536}},
         'rope_scaling.factor must be a number, got "16"'),
        ({"quantization_config": {**FLASH_OFFICIAL["quantization_config"], "fmt": "e5m2"}},
         "quantization_config.fmt 'e5m2' is not supported (e4m3"),
        ({"quantization_config": {"weight_block_size": 128}},
         "weight_block_size must be two positive integers, got 128"),
        ({"norm_topk_prob": "yes"}, 'norm_topk_prob must be true or false, got "yes"'),
    ],
)
def test_bad_configs_name_the_field(change, message):
    raw = {**FLASH_OFFICIAL, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["sliding_attention"] * 42}, "layer_types has 42 entries"),
        ({"layer_types": ["dense_attention"] * 43}, "layer_types[0] = 'dense_attention'"),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, "hash_moe layers must come first"),
        ({"compress_rates": {"compressed_sparse_attention": 8}}, "compressed_sparse_attention must be 4"),
        ({"compress_rates": {"heavily_compressed_attention": "128"}},
         'compress_rates must be an object of integers, got {"heavily_compressed_attention": "128"}'),
        ({"layer_types": "sliding_attention"}, 'layer_types must be a list of strings, got "sliding_attention"'),
        ({"rope_parameters": {"main": {"rope_theta": "x"}, "compress": {}}},
         'rope_parameters.main.rope_theta must be a number, got "x"'),
    ],
)
def test_bad_transformers_configs_name_the_field(change, message):
    raw = {**transformers_spelling(FLASH_OFFICIAL), **change}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)


def test_unknown_preset_and_override_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'v5'"):
        preset("v5")
    with pytest.raises(ConfigError, match="unknown config field"):
        preset("tiny", hidden=3)
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_config_file_errors_name_the_file(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_bytes(b'{"model_type": "deepseek_v4", "name": "\xff"}')
    with pytest.raises(ConfigError, match=f"{config_file} is not UTF-8 text"):
        load_config(tmp_path)
    config_file.write_text(json.dumps([FLASH_OFFICIAL]))
    with pytest.raises(ConfigError, match=f"{config_file}: config.json must hold a JSON object of fields, got \\[{{"):
        load_config(tmp_path)
    config_file.write_text(json.dumps({**FLASH_OFFICIAL, "hidden_size": True}))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"{config_file}: hidden_size must be an integer, got true"


def test_overrides_are_type_checked_too():
    with pytest.raises(ConfigError, match="num_hidden_layers must be an integer, got true"):
        preset("tiny", num_hidden_layers=True)
    with pytest.raises(ConfigError, match="rope_theta must be a number"):
        preset("tiny", rope_theta="abc")
