"""Hugging Face transformers' `DeepseekV4ForCausalLM` as a test oracle (test-only dependency).

- `make_hf_model(seed, **config_overrides)`: an fp32 model whose every parameter and persistent
  buffer is re-drawn from a seeded generator. transformers' `_init_weights` is built for training:
  it zeroes the attention sinks, the mHC `base`, the compressor/indexer `position_bias`, the
  router's `e_score_correction_bias` and the hash table `tid2eid` (every token -> expert 0), and
  draws most weights with std 0.02. A model like that cannot tell a correct implementation from
  one that ignores half of those tensors, so all of them get non-trivial values here.
- `save_hf_model(model, directory, spelling=...)`: `save_pretrained`, optionally with config.json
  rewritten in the official spelling (`compress_ratios`, `num_hash_layers`, `rope_scaling`, ...).
- `hf_logits(model, token_ids)`: fp32 logits of one full prefill, no cache.
- `hf_decode_logits(model, token_ids, prompt_len)`: transformers' own incremental decode through
  its `DynamicCache` (one prefill of the prompt, then one token per call).
- `CONFIGS`: tiny `DeepseekV4Config` kwargs that together cover every layer kind, both routings,
  YaRN, partial RoPE, grouped output, mHC and sequences longer than every window.

Only the non-persistent RoPE tables (`*inv_freq`) keep their computed values: they are functions
of the config, not weights, and save_pretrained does not write them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_IMPORT_ERROR: Exception | None = None
try:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.cache_utils import DynamicCache
except Exception as e:  # pragma: no cover - only when transformers is missing or too old
    _IMPORT_ERROR = e
    DeepseekV4Config = DeepseekV4ForCausalLM = DynamicCache = None  # type: ignore[assignment]


def require_transformers() -> None:
    """Skip the calling test when transformers (with DeepSeek-V4) is unavailable."""
    if _IMPORT_ERROR is not None:
        import pytest

        pytest.skip(f"transformers with DeepseekV4 is unavailable: {_IMPORT_ERROR}")


# --- configs ----------------------------------------------------------------------------------
def _yarn(factor: float, original: int) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32, "beta_slow": 1}


_SMALL = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=64,
    partial_rotary_factor=0.25,  # rope on the last 16 of 64 dims (indexer: last 16 of 32)
    q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=16,
    # 16 indexer heads: with fewer, a compressed entry whose every head has q.k < 0 scores exactly
    # 0 (ReLU), such ties are common, and top-k breaks them by implementation detail.
    index_n_heads=16, index_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, hc_mult=4, max_position_embeddings=128,
)


@dataclass(frozen=True)
class OracleConfig:
    """One tiny configuration: DeepseekV4Config kwargs, the test sequence length, and which
    config.json spelling the saved checkpoint uses."""

    name: str
    kwargs: dict[str, Any]
    seq_len: int
    spelling: str = "transformers"  # or "official"
    covers: tuple[str, ...] = field(default_factory=tuple)


CONFIGS: dict[str, OracleConfig] = {c.name: c for c in [
    # Every attention kind in one model, like the `tiny` preset: window (hash-routed), CSA (hash),
    # HCA m=16 (bias-routed), CSA (bias). 80 tokens: 5 windows of 16, 20 CSA entries of which the
    # indexer keeps 8, 5 HCA entries; YaRN active (original length 32 < 80).
    OracleConfig("mixed", dict(
        _SMALL, num_hidden_layers=4,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], index_topk=8,
        rope_parameters=_yarn(4.0, 32),
    ), seq_len=80, covers=("window", "csa", "hca16", "hash", "bias", "yarn")),
    # Window-only layers with other head geometry (8 heads x 32, rope 8 of 32, 4 output groups),
    # a window of 8 on 64 tokens, and a swiglu_limit low enough that the clamps really bite.
    OracleConfig("window", dict(
        _SMALL, num_hidden_layers=2, num_attention_heads=8, head_dim=32, o_groups=4,
        o_lora_rank=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe"], index_topk=8, swiglu_limit=0.75,
        rope_theta=1000.0,
    ), seq_len=64, covers=("window", "hash", "bias", "swiglu_limit")),
    # CSA only: 96 tokens = 24 compressed entries, the indexer keeps 4; YaRN factor 8 on a smaller
    # compress theta, bias routing only.
    OracleConfig("csa", dict(
        _SMALL, num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "moe"], index_topk=4,
        compress_rope_theta=40000.0, rope_parameters=_yarn(8.0, 16),
    ), seq_len=96, covers=("csa", "bias", "yarn")),
    # HCA only, m=8: 96 tokens = 12 compressed entries, every one of them attended once complete.
    # YaRN with a long original length on a small theta, so that the beta_fast..beta_slow ramp
    # spans rope dims 1..4 (with the short original lengths above it starts at dim 0, where
    # beta_fast has no effect).
    OracleConfig("hca", dict(
        _SMALL, num_hidden_layers=2,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe"], index_topk=8, compress_rope_theta=10000.0,
        rope_parameters=_yarn(8.0, 640), max_position_embeddings=5120,
    ), seq_len=96, covers=("hca8", "hash", "bias", "yarn-ramp")),
    # Deeper, V4-Pro-like schedule: two HCA layers first, then CSA/HCA, a window layer last, and
    # the real 3 hash layers; 128 tokens = 32 CSA entries (indexer keeps 8) and 8 HCA entries.
    OracleConfig("deep", dict(
        _SMALL, num_hidden_layers=6,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3, index_topk=8,
        rope_parameters=_yarn(4.0, 32),
    ), seq_len=128, covers=("hca16", "csa", "window", "hash", "bias", "yarn")),
    # transformers' legacy kwargs (`compress_ratios`, `compress_rate_hca`, `num_hash_layers`,
    # `qk_rope_head_dim`), and the checkpoint's config.json rewritten in the official spelling,
    # so our official-spelling parser is checked against the same weights.
    OracleConfig("legacy", dict(
        {k: v for k, v in _SMALL.items() if k != "partial_rotary_factor"},
        num_hidden_layers=3, qk_rope_head_dim=16, compress_ratios=[128, 4, 0],
        compress_rate_hca=16, num_hash_layers=1, index_topk=8, rope_parameters=_yarn(4.0, 32),
    ), seq_len=72, spelling="official", covers=("hca16", "csa", "window", "hash", "bias", "yarn")),
]}


# --- model construction -----------------------------------------------------------------------
def make_hf_config(**kwargs: Any) -> "DeepseekV4Config":
    config = DeepseekV4Config(**kwargs)
    config._attn_implementation = "eager"  # the only backend V4 supports (it carries the sinks)
    return config


def make_hf_model(seed: int, **config_overrides: Any) -> "DeepseekV4ForCausalLM":
    """An fp32 `DeepseekV4ForCausalLM` with every parameter and persistent buffer drawn from a
    `torch.Generator` seeded with `seed` (same seed and config: bit-identical weights)."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"transformers with DeepseekV4 is unavailable: {_IMPORT_ERROR}")
    torch.manual_seed(seed)  # construction draws from the global RNG before we overwrite it all
    model = DeepseekV4ForCausalLM(make_hf_config(**config_overrides)).to(torch.float32).eval()
    randomize_(model, seed)
    return model


def _normal(shape, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


# (name regex, how to draw it). First match wins; every parameter must match one.
_PARAM_RULES: list[tuple[str, str]] = [
    (r"embed_tokens\.weight$", "embedding"),
    (r"\.sinks$", "sinks"),
    (r"\.position_bias$", "position_bias"),
    (r"(attn_hc|ffn_hc)\.fn$", "hc_fn"),
    (r"(attn_hc|ffn_hc)\.base$", "hc_base"),
    (r"(attn_hc|ffn_hc)\.scale$", "hc_scale"),
    (r"hc_head\.hc_fn$", "hc_fn"),
    (r"hc_head\.hc_base$", "hc_base"),
    (r"hc_head\.hc_scale$", "hc_scale"),
    (r"experts\.gate_up_proj$", "experts"),
    (r"experts\.down_proj$", "experts"),
    (r"mlp\.gate\.weight$", "router"),  # [n_experts, hidden], a bare Parameter
    (r"(_norm|_layernorm|\.norm)\.weight$", "norm"),
    (r"\.weight$", "linear"),  # every nn.Linear (incl. the grouped o_a_proj and lm_head)
]


def randomize_(model: "DeepseekV4ForCausalLM", seed: int) -> None:
    """Re-draw every parameter and persistent buffer of `model` in place, deterministically."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next((k for pattern, k in _PARAM_RULES if re.search(pattern, name)), None)
            if kind is None:
                raise AssertionError(f"hf_oracle does not know how to randomize parameter {name}")
            if kind == "linear":
                owner = modules[name.rsplit(".", 1)[0]]
                if not isinstance(owner, torch.nn.Linear):
                    raise AssertionError(f"{name}: expected an nn.Linear, found {type(owner).__name__}")
            shape = p.shape
            if kind == "embedding":
                value = _normal(shape, 1.0, gen)
            elif kind == "sinks":
                value = _normal(shape, 1.0, gen)
            elif kind == "position_bias":
                value = _normal(shape, 0.5, gen)
            elif kind in ("hc_fn", "linear", "router"):
                value = _normal(shape, 1.0 / math.sqrt(shape[-1]), gen)
            elif kind == "hc_base":
                value = _normal(shape, 0.5, gen)
            elif kind == "hc_scale":
                value = _normal(shape, 0.2, gen, mean=1.0)
            elif kind == "experts":  # [E, out, in]
                value = _normal(shape, 1.0 / math.sqrt(shape[-1]), gen)
            elif kind == "norm":
                value = _normal(shape, 0.1, gen, mean=1.0)
            else:  # pragma: no cover
                raise AssertionError(kind)
            p.copy_(value.to(p.dtype))

        persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
        for name, b in model.named_buffers():
            if name.endswith("inv_freq"):
                continue  # RoPE tables: functions of the config, not saved
            if name not in persistent:
                raise AssertionError(f"hf_oracle does not know the non-persistent buffer {name}")
            if name.endswith("e_score_correction_bias"):
                b.copy_(_normal(b.shape, 0.1, gen).to(b.dtype))
            elif name.endswith("tid2eid"):
                # each token: num_experts_per_tok DISTINCT experts, in random order
                vocab, k = b.shape
                picks = torch.rand(vocab, config.n_routed_experts, generator=gen).argsort(dim=-1)[:, :k]
                b.copy_(picks.to(b.dtype))
            else:
                raise AssertionError(f"hf_oracle does not know how to randomize buffer {name}")
    check_non_degenerate(model)


def check_non_degenerate(model: "DeepseekV4ForCausalLM") -> None:
    """Every saved tensor is finite and not constant (a zero or constant tensor hides bugs);
    every hash-table row names distinct experts."""
    k = model.config.num_experts_per_tok
    for name, t in model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        if t.is_floating_point():
            assert torch.isfinite(t).all(), f"{name} has non-finite values"
            assert t.abs().max() > 0, f"{name} is all zero"
            assert t.numel() == 1 or t.std() > 0, f"{name} is constant"
        if name.endswith("tid2eid"):
            assert t.shape[1] == k
            assert bool((t.sort(dim=-1).values.diff(dim=-1) != 0).all()), f"{name}: repeated experts"
            assert t.min() >= 0 and t.max() < model.config.n_routed_experts
            assert len(t[:, 0].unique()) > 1, f"{name}: every token routes to the same expert"


# --- saving -----------------------------------------------------------------------------------
def save_hf_model(model: "DeepseekV4ForCausalLM", directory: str | Path,
                  spelling: str = "transformers") -> Path:
    """`save_pretrained(directory)`; with `spelling="official"` config.json is rewritten in the
    official spelling (the tensors are the same either way).

    What save_pretrained writes (transformers 5.24): official-style tensor names under a `model.`
    prefix (`model.layers.0.attn.wq_a.weight`, `model.layers.0.attn.norm.weight` for the kv norm,
    `model.layers.0.attn.compressor.ape`, `model.layers.0.attn.indexer.compressor.wkv.weight`,
    `model.layers.0.ffn.experts.3.w1.weight` with the packed gate_up split into w1/w3,
    `model.layers.0.ffn.gate.tid2eid` (int64), `model.layers.0.ffn.gate.bias`,
    `model.layers.0.hc_attn_fn`, `model.embed_tokens.weight`, `model.hc_head.hc_fn`,
    `model.norm.weight`) plus an unprefixed `head.weight`; all fp32; and a config.json in
    transformers' spelling (`layer_types`, `compress_rates`, `mlp_layer_types`, nested
    `rope_parameters` {"main", "compress"} with `attention_factor: 1.0` on a YaRN compress rope).
    """
    directory = Path(directory)
    model.save_pretrained(directory)
    if spelling == "official":
        config_file = directory / "config.json"
        config_file.write_text(json.dumps(official_config_dict(model.config), indent=2))
    elif spelling != "transformers":
        raise ValueError(f"unknown spelling {spelling!r}")
    return directory


def official_config_dict(config: "DeepseekV4Config") -> dict[str, Any]:
    """`config` in the spelling of the published DeepSeek-V4 config.json."""
    d = config.to_dict()
    n = config.num_hidden_layers
    ratio_of = {"sliding_attention": 0, **config.compress_rates}
    d["compress_ratios"] = [int(ratio_of[t]) for t in config.layer_types] + [0]  # + the MTP layer
    mlp = list(config.mlp_layer_types)
    n_hash = sum(t == "hash_moe" for t in mlp)
    assert mlp == ["hash_moe"] * n_hash + ["moe"] * (n - n_hash), mlp
    d["num_hash_layers"] = n_hash
    d["qk_rope_head_dim"] = int(config.qk_rope_head_dim)
    main, compress = config.rope_parameters["main"], config.rope_parameters["compress"]
    d["rope_theta"] = main["rope_theta"]
    d["compress_rope_theta"] = compress["rope_theta"]
    if compress.get("rope_type") == "yarn":
        d["rope_scaling"] = {
            "type": "yarn", "factor": compress["factor"],
            "original_max_position_embeddings": compress["original_max_position_embeddings"],
            "beta_fast": compress.get("beta_fast", 32), "beta_slow": compress.get("beta_slow", 1),
        }
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                "partial_rotary_factor"):
        d.pop(key, None)
    return d


# --- running ----------------------------------------------------------------------------------
def _ids(token_ids) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    assert ids.dim() == 1, "one sequence, 1-D"
    return ids


@torch.no_grad()
def hf_logits(model: "DeepseekV4ForCausalLM", token_ids) -> torch.Tensor:
    """fp32 logits [T, vocab] of one full prefill without a cache."""
    ids = _ids(token_ids)
    out = model(input_ids=ids[None], use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_decode_logits(model: "DeepseekV4ForCausalLM", token_ids, prompt_len: int) -> torch.Tensor:
    """transformers' incremental decode with its DynamicCache: prefill `token_ids[:prompt_len]`,
    then one token per forward. Returns fp32 logits [T, vocab] for every position."""
    ids = _ids(token_ids)
    cache = DynamicCache(config=model.config)
    rows = []
    out = model(input_ids=ids[None, :prompt_len], cache=cache, use_cache=True)
    rows.append(out.logits[0].float())
    for t in range(prompt_len, len(ids)):
        out = model(input_ids=ids[None, t:t + 1], cache=cache, use_cache=True,
                    position_ids=torch.tensor([[t]]))
        rows.append(out.logits[0].float())
    return torch.cat(rows)


def random_tokens(n: int, vocab_size: int, seed: int) -> torch.Tensor:
    """n random token ids from a seeded generator; never all the same token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n,), generator=gen)
    if n > 1 and (ids == ids[0]).all():  # astronomically unlikely; keep the promise anyway
        ids[1] = (ids[0] + 1) % vocab_size
    return ids


def row_errors(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Per row: max |ours - theirs| / max |theirs|."""
    ours, theirs = ours.double(), theirs.double()
    return (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1).clamp_min(1e-30)


# --- selection margins ------------------------------------------------------------------------
@torch.no_grad()
def selection_margins(model: "DeepseekV4ForCausalLM", token_ids) -> dict[str, float]:
    """For every top-k selection the model makes on `token_ids` (the lightning indexer's top
    `index_topk` compressed entries in CSA layers; the bias-routed MoE's top `num_experts_per_tok`
    experts), the smallest gap between the k-th and the (k+1)-th candidate, relative to the
    row's largest |score|. Keyed by module name.

    An fp32 reimplementation differs from transformers by ~1e-6 relative, so a selection whose
    gap is below ~1e-5 may legitimately flip, and a tie (gap 0: e.g. indexer scores that are
    exactly 0 because every head's ReLU is 0, common with few indexer heads) is broken by
    torch.topk's internal order, which differs between a prefill and a one-row decode even
    inside transformers. The oracle tests only use inputs whose margins are clear."""
    config = model.config
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls == "DeepseekV4IndexerScorer":
            hooks.append(module.register_forward_hook(
                lambda m, i, o, name=name: captured.__setitem__(name, o.detach()[0].double())))
        elif cls == "DeepseekV4TopKRouter":
            def hook(m, i, o, name=name):
                scores = m.score_fn(o[0].detach().double()) + m.e_score_correction_bias.double()
                captured[name] = scores
            hooks.append(module.register_forward_hook(hook))
    try:
        hf_logits(model, token_ids)
    finally:
        for h in hooks:
            h.remove()
    margins: dict[str, float] = {}
    ratio = config.compress_rates["compressed_sparse_attention"]
    for name, scores in captured.items():
        if name.endswith("scorer"):
            k = config.index_topk
            seq_len, n_entries = scores.shape
            causal = (torch.arange(seq_len)[:, None] + 1) // ratio  # entries visible per query
            scores = scores.masked_fill(torch.arange(n_entries)[None, :] >= causal, float("-inf"))
            rows = (causal[:, 0] > k).nonzero().flatten()  # queries where top-k really selects
        else:
            k = config.num_experts_per_tok
            rows = torch.arange(scores.shape[0])
        if len(rows) == 0 or scores.shape[-1] <= k:
            continue
        s = scores[rows]
        top = s.topk(k + 1, dim=-1).values
        scale = s.masked_fill(~torch.isfinite(s), 0).abs().amax(-1).clamp_min(1e-30)
        margins[name] = ((top[:, k - 1] - top[:, k]) / scale).min().item()
    return margins


def clear_token_ids(model: "DeepseekV4ForCausalLM", n: int, seed: int, min_margin: float = 1e-5,
                    tries: int = 50) -> torch.Tensor:
    """`random_tokens(n, vocab, seed')` for the first seed' >= seed whose selection margins all
    exceed `min_margin` (see `selection_margins`)."""
    for s in range(seed, seed + tries):
        ids = random_tokens(n, model.config.vocab_size, s)
        margins = selection_margins(model, ids)
        if all(m >= min_margin for m in margins.values()):
            return ids
    raise AssertionError(f"no tie-free token sequence among seeds {seed}..{seed + tries - 1}; "
                         f"last margins {margins}")
