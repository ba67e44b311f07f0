"""Reading a Hugging Face `config.json` object into `ModelConfig` fields.

Two spellings exist in the wild and both are accepted:
- the official one, as published with the checkpoints: `compress_ratios` (one int per layer, with
  trailing entries for the MTP/DSpark layers), `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling` (YaRN) and `compress_rope_theta`;
- transformers' one: `layer_types`, `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`
  and `rope_parameters` (nested as {"main": ..., "compress": ...}, or flat).
A V4.1 config is read as its text model (`v41.text_config`). Every field is checked for its type
before it is used; errors name the field.
"""

from __future__ import annotations

from typing import Any

from . import v41
from .config import (CSA_RATIO, DEFAULT_HCA_RATIO, KIND_BY_LAYER_TYPE, POSITIVE, READ_MODEL_TYPES, ModelConfig,
                     YarnScaling)
from .config_fields import ConfigError, as_json, check_fields, get_field

_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "routed_scaling_factor", "swiglu_limit",
)
_OPTIONAL = (
    "n_shared_experts", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
    "max_position_embeddings", "scoring_func", "norm_topk_prob", "num_key_value_heads",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "num_nextn_predict_layers",
    "dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok", "quantization_config", "model_type",
) + v41.SCALAR_FIELDS


def parse(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's keyword arguments from a config.json object (either spelling)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object of fields, got {as_json(raw)}")
    model_type = raw.get("model_type")
    if model_type not in READ_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(READ_MODEL_TYPES)})"
        )
    if model_type in (v41.MODEL_TYPE, v41.TEXT_MODEL_TYPE):
        raw = v41.text_config(raw)
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"config.json lacks required field(s) {missing}")
    out: dict[str, Any] = {k: raw[k] for k in _REQUIRED}
    out.update({k: raw[k] for k in _OPTIONAL if raw.get(k) is not None})
    if isinstance(out.get("eos_token_id"), list):  # several EOS ids: the engine stops at the first
        out["eos_token_id"] = get_field(raw, "eos_token_id", list[int])[0] if out["eos_token_id"] else None
    check_fields(ModelConfig, out, POSITIVE)  # before any of them is computed with
    n = raw["num_hidden_layers"]
    out["compress_ratios"] = _parse_ratios(raw, n)
    out["num_hash_layers"] = _parse_hash_layers(raw, n)
    out["qk_rope_head_dim"] = _parse_rope_dim(raw)
    out.update(_parse_rope(raw))
    for name in ("dspark_target_layer_ids",) + v41.LIST_FIELDS:
        values = get_field(raw, name, list[int])
        if values is not None:
            out[name] = tuple(values)
    q, expert_dtype = out.get("quantization_config"), get_field(raw, "expert_dtype", str)
    if q is not None and expert_dtype and "expert_dtype" not in q:
        out["quantization_config"] = {**q, "expert_dtype": expert_dtype}
    return out


def _parse_ratios(raw: dict[str, Any], n: int) -> tuple[int, ...]:
    ratios = get_field(raw, "compress_ratios", list[int])
    if ratios is not None:
        if len(ratios) < n:
            raise ConfigError(
                f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}"
            )
        return tuple(ratios[:n])  # trailing entries describe the MTP layers
    layer_types = get_field(raw, "layer_types", list[str])
    if layer_types is None:
        raise ConfigError("config.json has neither compress_ratios nor layer_types")
    if raw.get("model_type") == v41.TEXT_MODEL_TYPE:  # layer_types cannot spell ratios 2 and 1
        raise ConfigError("a deepseek_v41 config must give compress_ratios (layer_types only names V4's kinds)")
    if len(layer_types) != n:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
    rates = {
        "compressed_sparse_attention": CSA_RATIO,
        "heavily_compressed_attention": DEFAULT_HCA_RATIO,
        **get_field(raw, "compress_rates", dict[str, int], {}),
    }
    ratios = []
    for i, t in enumerate(layer_types):
        if t not in KIND_BY_LAYER_TYPE:
            raise ConfigError(f"layer_types[{i}] = {t!r} is not one of {list(KIND_BY_LAYER_TYPE)}")
        ratios.append(0 if t == "sliding_attention" else rates[t])
    if rates["compressed_sparse_attention"] != CSA_RATIO:
        raise ConfigError(f"compress_rates.compressed_sparse_attention must be {CSA_RATIO}, "
                          f"got {rates['compressed_sparse_attention']}")
    if rates["heavily_compressed_attention"] in (0, CSA_RATIO):
        raise ConfigError("compress_rates.heavily_compressed_attention must differ from 0 and "
                          f"{CSA_RATIO}, got {rates['heavily_compressed_attention']}")
    return tuple(ratios)


def _parse_hash_layers(raw: dict[str, Any], n: int) -> int:
    mlp_types = get_field(raw, "mlp_layer_types", list[str])
    if mlp_types is None:
        return min(get_field(raw, "num_hash_layers", int, 0), n)
    if len(mlp_types) != n:
        raise ConfigError(f"mlp_layer_types has {len(mlp_types)} entries but num_hidden_layers is {n}")
    num_hash = sum(t == "hash_moe" for t in mlp_types)
    expected = ["hash_moe"] * num_hash + ["moe"] * (n - num_hash)
    if list(mlp_types) != expected:
        raise ConfigError(
            f"mlp_layer_types = {mlp_types} is not supported: hash_moe layers must come first, "
            "then moe layers"
        )
    return num_hash


def _parse_rope_dim(raw: dict[str, Any]) -> int:
    dim = get_field(raw, "qk_rope_head_dim", int)
    if dim is not None:
        return dim
    factor = get_field(raw, "partial_rotary_factor", float)
    if factor is None:
        main, compress = _rope_parameters(raw)
        factor = get_field(main or compress, "partial_rotary_factor", float,
                      where="rope_parameters.main." if main else "rope_parameters.")
    if factor is None:
        raise ConfigError("config.json has neither qk_rope_head_dim nor partial_rotary_factor")
    return round(raw["head_dim"] * factor)


def _rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers' rope_parameters as (main, compress): nested, or flat (compress only)."""
    params = get_field(raw, "rope_parameters", dict, {})
    if isinstance(params.get("main"), dict):
        return params["main"], get_field(params, "compress", dict, {}, where="rope_parameters.")
    return {}, params


def _parse_rope(raw: dict[str, Any]) -> dict[str, Any]:
    main, compress = _rope_parameters(raw)
    nested = bool(main)
    scaling, where = get_field(raw, "rope_scaling", dict), "rope_scaling."
    if not scaling:
        scaling, where = compress, "rope_parameters.compress." if nested else "rope_parameters."
    if nested:
        rope_theta = get_field(main, "rope_theta", float, where="rope_parameters.main.")
        compress_rope_theta = get_field(compress, "rope_theta", float, where="rope_parameters.compress.")
        if rope_theta is None or compress_rope_theta is None:
            raise ConfigError("rope_parameters.main and rope_parameters.compress must both have a rope_theta")
    else:
        rope_theta = get_field(raw, "rope_theta", float, 10000.0)
        compress_rope_theta = get_field(raw, "compress_rope_theta", float, 160000.0)
    out = {"rope_theta": float(rope_theta), "compress_rope_theta": float(compress_rope_theta)}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "yarn":
        factor = get_field(scaling, "factor", float, where=where)
        original = get_field(scaling, "original_max_position_embeddings", int, where=where)
        if factor is None or original is None:
            raise ConfigError(f"{where}factor and {where}original_max_position_embeddings are required for yarn")
        out["rope_scaling"] = YarnScaling(
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(get_field(scaling, "beta_fast", float, 32, where=where)),
            beta_slow=float(get_field(scaling, "beta_slow", float, 1, where=where)),
        )
    elif rope_type in ("default", None):
        out["rope_scaling"] = None
    else:
        raise ConfigError(f"rope scaling type {rope_type!r} is not supported (only yarn or none)")
    return out
