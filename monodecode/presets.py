"""Named configurations (`preset`) and `load_config` (a preset name or a checkpoint directory)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import v41
from .config import ModelConfig, YarnScaling, with_overrides
from .config_fields import ConfigError


def _v4_flash() -> ModelConfig:
    # DeepSeek-V4-Flash as published, with the DSpark draft of the 0731 release (3 stages).
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
        num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048, num_hash_layers=3,
        routed_scaling_factor=1.5, swiglu_limit=10.0, num_nextn_predict_layers=3,
        dspark_block_size=5, dspark_markov_rank=256, dspark_noise_token_id=128799,
        dspark_target_layer_ids=(40, 41, 42), quantization_config=_quant((128, 128)),
    )


def _v4_pro() -> ModelConfig:
    return dataclasses.replace(
        _v4_flash(), hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        q_lora_rank=1536, o_groups=16, compress_ratios=(128, 128) + (4, 128) * 29 + (4,),
        index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072,
        routed_scaling_factor=2.5, dspark_markov_rank=512, dspark_target_layer_ids=(58, 59, 60),
    )


def _tiny() -> ModelConfig:
    # Every layer kind at CPU-test size: window (hash-routed), CSA (hash), HCA (bias), CSA (bias).
    # Hidden and expert sizes of 128, the smallest the mono kernels take (the experts' fragment order
    # works in groups of 128 columns), so that the kernels' tests run on this preset. A 64-token sequence crosses the 16-token window, 16 CSA windows and 4 HCA windows; the
    # indexer keeps 8 of up to 16 compressed entries, so its top-k really selects; 16 indexer
    # heads keep its scores free of exact ties (a score is 0 when every head's q.k is negative).
    return ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=16,
        compress_ratios=(0, 4, 16, 4), index_n_heads=16, index_head_dim=32, index_topk=8,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        num_hash_layers=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32),
        max_position_embeddings=4096, num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_markov_rank=16, dspark_noise_token_id=511, dspark_target_layer_ids=(1, 2, 3),
        quantization_config=_quant((32, 32)),
    )


def _quant(block: tuple[int, int]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "weight_block_size": list(block), "expert_dtype": "fp4"}


def _v41_flash() -> ModelConfig:
    # DeepSeek-V4.1-Flash's text model as published, with its built-in DSpark draft. The vocabulary
    # and the DSpark noise token are V4's (not listed separately for V4.1).
    return ModelConfig(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
        sliding_window=128, compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        index_n_heads=32, index_head_dim=128, index_topk=512, n_routed_experts=384,
        num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2304, num_hash_layers=0,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20, num_nextn_predict_layers=3,
        dspark_block_size=5, dspark_markov_rank=256, dspark_noise_token_id=128799,
        dspark_target_layer_ids=(37, 38, 39), dspark_n_routed_experts=128, dspark_num_experts_per_tok=3,
        kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
        engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682), engram_max_ngram_size=4,
        engram_vocab_size=16_000_000, engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2,
        engram_compressed_vocab_size=99092, quantization_config=_quant((32, 32)),
        model_type=v41.TEXT_MODEL_TYPE,
    )


def _tiny_v41() -> ModelConfig:
    # Every V4.1 feature at CPU-test size (the tiny preset's widths):
    #   layer 0 window, Engram;   1 ratio 2, KV + index source;   2 ratio 2, reuses both of 1;
    #   3 ratio 2, KV of 1, its own indexer, Engram;   4 ratio 1, KV + index source, candidate layer;
    #   5 ratio 1, reuses both of 4;   6 ratio 1, KV of 4, its own indexer inside 4's candidates.
    # 4 candidate blocks of 4 positions: 16 of a 64-token sequence's 64 ratio-1 entries, more than
    # the indexer's top-8, so both levels really select. The Engram tables' sizes follow from their
    # bucket primes (v41.engram_table_rows); a smaller DSpark MoE than the target's, as in V4.1.
    return ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=7, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=16,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1), index_n_heads=8, index_head_dim=32, index_topk=8,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        num_hash_layers=0, routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32),
        max_position_embeddings=4096, num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_markov_rank=16, dspark_noise_token_id=511, dspark_target_layer_ids=(4, 5, 6),
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=1,
        kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 3, 4, 6), candidate_source_layer_id=4,
        candidate_topk_blocks=4, candidate_block_size=4, engram_layer_ids=(0, 3),
        engram_num_embeddings=v41.engram_table_rows(2, 3, 2, 61), engram_max_ngram_size=3,
        engram_vocab_size=61, engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=2,
        engram_compressed_vocab_size=300, quantization_config=_quant((32, 32)),
        model_type=v41.TEXT_MODEL_TYPE,
    )


PRESETS = {"v4-flash": _v4_flash, "v4-pro": _v4_pro, "tiny": _tiny, "v4.1-flash": _v41_flash,
           "tiny-v4.1": _tiny_v41}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration, optionally with fields overridden (e.g. `num_hidden_layers=2`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    config = PRESETS[name]()
    return with_overrides(config, **overrides) if overrides else config


def load_config(source: str | Path, **overrides: Any) -> ModelConfig:
    """A preset name or a checkpoint directory (or its config.json)."""
    if str(source) in PRESETS:
        return preset(str(source), **overrides)
    if not Path(source).exists():
        raise ConfigError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a path")
    config = ModelConfig.from_dir(source)
    return with_overrides(config, **overrides) if overrides else config
