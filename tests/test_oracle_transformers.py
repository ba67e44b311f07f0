"""Our model against Hugging Face transformers' `DeepseekV4ForCausalLM` (the oracle).

Each tiny config in `hf_oracle.CONFIGS` is built in transformers with every weight random and
non-degenerate (see hf_oracle), saved with `save_pretrained`, loaded with `monodecode.load`, and
run on random tokens: per row, max |ours - theirs| / max |theirs| must stay <= 1e-4.

The `test_hf_*` and `test_saved_checkpoint_*` tests check the harness itself and run without our
model.

What transformers (5.24, `models/deepseek_v4/modeling_deepseek_v4.py`) does where it could
differ from DeepSeek's official `inference/model.py`, and what we do:

- FP8 QAT of the kv nope dims (the official reference quantises kv[..., :nope] to FP8 e4m3 with
  block-64 UE8M0 scales and back, in the attention and both compressors): transformers skips it
  (`kv = kv_norm(kv_proj(x))`, then RoPE, nothing else). We skip it too: no difference.
- The lightning indexer's Hadamard rotation and FP4 (e2m1, block 32) QAT of q and compressed k:
  transformers skips both (`DeepseekV4Indexer`: q_b_proj -> RoPE; compressor -> kv_norm -> RoPE).
  We skip them too: no difference (Hadamard is orthogonal and applied to both sides, so without
  FP4 it would not change the scores anyway).
- Routed expert weight: transformers multiplies it after w2
  (`F.linear(h, down_proj[e]) * weight`), the official code before w2 (`w2(weight * h)`).
  Linear, so identical in fp32 up to rounding; the 1e-4 tolerance covers it.
- Router: transformers picks `topk(sqrtsoftplus(logits) + e_score_correction_bias)`, weights
  with the unbiased scores, always renormalises (`norm_topk_prob` is not read), times
  `routed_scaling_factor`. Hash layers take the experts from `tid2eid[input_id]` and weight them
  the same way. Same as the official code.
- SwiGLU clamp (`gate.clamp(max=limit)`, `up.clamp(-limit, limit)`) in the routed AND the shared
  experts. The config `window` sets swiglu_limit 0.75 so the clamps bite.
- RoPE: interleaved pairs on the LAST `qk_rope_head_dim` dims (indexer: the last
  `qk_rope_head_dim` of `index_head_dim`); sliding-only layers use `rope_theta` without scaling,
  CSA/HCA layers (attention, compressor and indexer alike) use `compress_rope_theta` with YaRN,
  and transformers forces `attention_factor = 1.0` (no YaRN mscale), like the official code.
  Compressed entry w gets RoPE at position w * ratio. The attention output's rope slice is
  de-rotated at the query position.
- Visibility: query t sees raw positions t-window+1 .. t (window entries including itself) and
  compressed entry w iff w < (t+1) // ratio (pinned by `test_hf_visibility_rules`); CSA queries
  only the indexer's top `index_topk` among those. An incomplete trailing window emits nothing.
- Ties in top-k selections are not part of the model: the lightning indexer's score
  `sum_h w_h * relu(q_h . k)` is exactly 0 when every head's dot product is negative, which
  happens often with few indexer heads, and torch.topk then picks among equal scores by
  implementation detail. With 2-4 indexer heads transformers' own cached decode disagrees with
  its own prefill by up to 0.44 relative for that reason (found while writing this). The configs
  use 16 indexer heads (no exact zeros) and `hf_oracle.clear_token_ids` picks token sequences
  whose every selection (indexer and bias router) has a gap >= 1e-5 between the k-th and the
  (k+1)-th candidate, so that fp32 rounding cannot flip one.

No intended difference is known at the fp32 level; if one is introduced, pin it here.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from safetensors import safe_open

from hf_oracle import (
    CONFIGS,
    check_non_degenerate,
    clear_token_ids,
    hf_decode_logits,
    hf_logits,
    make_hf_model,
    random_tokens,
    require_transformers,
    row_errors,
    save_hf_model,
    selection_margins,
)

TOLERANCE = 1e-4
MODEL_SEED = 20240
CONFIG_IDS = list(CONFIGS)


@pytest.fixture(autouse=True)
def _transformers_available():
    require_transformers()


def _token_seed(name: str) -> int:
    return 1000 + 97 * CONFIG_IDS.index(name)


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    ours = ours.cpu()
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    assert ours.dtype == torch.float32, f"{what}: logits dtype {ours.dtype}, expected float32"
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits at rows " \
        f"{(~torch.isfinite(ours)).any(-1).nonzero().flatten().tolist()[:10]}"
    err = row_errors(ours, theirs)
    worst = int(err.argmax())
    bad = (err > TOLERANCE).nonzero().flatten().tolist()
    assert not bad, (
        f"{what}: worst row {worst} has max|ours-theirs|/max|theirs| = {err[worst]:.3e} "
        f"(tolerance {TOLERANCE:g}); {len(bad)}/{len(err)} rows over, first {bad[0]}, "
        f"rows over: {bad[:20]}; median row error {err.median():.1e}"
    )


# --- the harness ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIG_IDS)
def test_hf_model_is_random_deterministic_and_non_degenerate(name):
    c = CONFIGS[name]
    a = make_hf_model(MODEL_SEED, **c.kwargs)
    b = make_hf_model(MODEL_SEED, **c.kwargs)
    other = make_hf_model(MODEL_SEED + 1, **c.kwargs)
    check_non_degenerate(a)
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    for key, t in sa.items():
        assert torch.equal(t, sb[key]), f"{key}: same seed, different values"
        if not key.endswith("inv_freq"):
            assert not torch.equal(t, so[key]), f"{key}: does not depend on the seed"
    # the tensors transformers' init leaves trivial
    for key, t in sa.items():
        if key.endswith(("sinks", ".base", "hc_base", "position_bias", "e_score_correction_bias")):
            assert t.abs().mean() > 0.01, f"{key} is nearly zero"
        if key.endswith("scale"):  # attn_hc.scale, ffn_hc.scale, hc_head.hc_scale
            assert (t - 1).abs().max() > 1e-3, f"{key} is (nearly) all ones"
    # the layer kinds the config claims
    kinds = {"window": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca8": "heavily_compressed_attention", "hca16": "heavily_compressed_attention"}
    for cover in c.covers:
        if cover in kinds:
            assert kinds[cover] in a.config.layer_types, (name, cover)
        if cover.startswith("hca"):
            assert a.config.compress_rates["heavily_compressed_attention"] == int(cover[3:])
    if "hash" in c.covers:
        assert "hash_moe" in a.config.mlp_layer_types
    if "bias" in c.covers:
        assert "moe" in a.config.mlp_layer_types
    yarn = a.config.rope_parameters["compress"]
    if "yarn" in c.covers:
        assert yarn["rope_type"] == "yarn" and yarn["original_max_position_embeddings"] < c.seq_len
    if "yarn-ramp" in c.covers:  # the ramp starts past dim 0, so beta_fast matters
        dim, base = a.config.qk_rope_head_dim, yarn["rope_theta"]
        low = dim * math.log(yarn["original_max_position_embeddings"] / (yarn["beta_fast"] * 2 * math.pi)) \
            / (2 * math.log(base))
        assert yarn["rope_type"] == "yarn" and math.floor(low) >= 1
    assert c.seq_len > a.config.sliding_window
    if "compressed_sparse_attention" in a.config.layer_types:  # the indexer really selects
        assert c.seq_len // 4 > a.config.index_topk


@pytest.mark.parametrize("name", CONFIG_IDS)
def test_hf_harness_sanity(name):
    """transformers' logits: finite, varying, deterministic, causal."""
    c = CONFIGS[name]
    model = make_hf_model(MODEL_SEED, **c.kwargs)
    ids = random_tokens(c.seq_len, model.config.vocab_size, _token_seed(name))
    assert len(ids.unique()) > 1
    logits = hf_logits(model, ids)
    assert logits.shape == (c.seq_len, model.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, hf_logits(model, ids)), "not deterministic"
    assert logits.std(-1).min() > 1e-3, "a row of constant logits"
    assert (logits[1:] - logits[:-1]).abs().amax(-1).min() > 1e-3, "two consecutive rows equal"
    assert len(logits.argmax(-1).unique()) > 1, "every position predicts the same token"

    first = ids.clone()
    first[0] = (ids[0] + 1) % model.config.vocab_size
    changed = hf_logits(model, first)
    assert (changed[5] - logits[5]).abs().max() > 1e-4, "position 0 does not reach position 5"
    assert (changed[0] - logits[0]).abs().max() > 1e-4

    last = ids.clone()
    last[-1] = (ids[-1] + 1) % model.config.vocab_size
    changed = hf_logits(model, last)
    # not bit-exact: which rows share an expert's matmul changes, and with it the fp32 rounding
    leak = row_errors(changed[:-1], logits[:-1]).max()
    assert leak < 1e-5, f"the last token leaks into earlier rows ({leak:.1e})"
    assert (changed[-1] - logits[-1]).abs().max() > 1e-4


def _influence(model, ids, position: int) -> torch.Tensor:
    """Which rows' logits change (beyond fp32 rounding) when the token at `position` changes."""
    base = hf_logits(model, ids)
    other = ids.clone()
    other[position] = (ids[position] + 7) % model.config.vocab_size
    return row_errors(hf_logits(model, other), base) > 1e-4


def test_hf_visibility_rules():
    """Pin transformers' (and the official) visibility on one-layer models, where a token can
    only reach a query through attention: the raw window holds `sliding_window` positions
    including the query's own, and a compressed entry is visible from the query at the last
    position of its window onwards (w < (t+1) // ratio)."""
    base = dict(CONFIGS["hca"].kwargs, num_hidden_layers=1, mlp_layer_types=["moe"])
    window = make_hf_model(MODEL_SEED, **dict(base, layer_types=["sliding_attention"],
                                              sliding_window=4))
    ids = random_tokens(24, window.config.vocab_size, 7)
    reach = _influence(window, ids, 3)
    assert reach.nonzero().flatten().tolist() == [3, 4, 5, 6]  # t - 3 <= 3 <= t

    hca = make_hf_model(MODEL_SEED, **dict(base, layer_types=["heavily_compressed_attention"],
                                           sliding_window=4))  # ratio 8
    reach = _influence(hca, ids, 1)
    # raw window: queries 1..4; entry 0 (positions 0..7): queries 7 onwards
    assert reach.nonzero().flatten().tolist() == [1, 2, 3, 4] + list(range(7, 24))
    reach = _influence(hca, ids, 20)  # in entry 2 (16..23): visible from query 23
    assert reach.nonzero().flatten().tolist() == [20, 21, 22, 23]


@pytest.mark.skipif(
    tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 24),
    reason="transformers < 5.24 (5.17 on the H200 image) decodes inconsistently with its own prefill")
def test_hf_cached_decode_matches_hf_prefill():
    """transformers' incremental decode (DynamicCache) agrees with its own prefill once the
    top-k selections are tie-free (see the module docstring), so it can serve as a decode
    oracle."""
    c = CONFIGS["mixed"]
    model = make_hf_model(MODEL_SEED, **c.kwargs)
    ids = clear_token_ids(model, c.seq_len, _token_seed("mixed"))
    full = hf_logits(model, ids)
    decoded = hf_decode_logits(model, ids, prompt_len=37)
    assert row_errors(decoded, full).max() < 1e-5


@pytest.mark.parametrize("name", CONFIG_IDS)
def test_saved_checkpoint_layout(name, tmp_path):
    """What save_pretrained writes, tensor by tensor, against the module it came from; and that
    our checkpoint reader accepts it and parses the same config."""
    import monodecode

    c = CONFIGS[name]
    model = make_hf_model(MODEL_SEED, **c.kwargs)
    save_hf_model(model, tmp_path, spelling=c.spelling)
    saved = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            saved.update({k: f.get_tensor(k) for k in f.keys()})
    expected = _expected_saved(model)
    assert sorted(saved) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key

    ckpt = monodecode.Checkpoint(tmp_path)
    ckpt.validate()
    hf, ours = model.config, ckpt.config
    rates = {"sliding_attention": 0, **hf.compress_rates}
    assert ours.compress_ratios == tuple(rates[t] for t in hf.layer_types)
    assert ours.num_hash_layers == hf.mlp_layer_types.count("hash_moe")
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    assert ours.rope_theta == hf.rope_parameters["main"]["rope_theta"]
    assert ours.compress_rope_theta == hf.rope_parameters["compress"]["rope_theta"]
    yarn = hf.rope_parameters["compress"]
    if yarn["rope_type"] == "yarn":
        assert (ours.rope_scaling.factor, ours.rope_scaling.original_max_position_embeddings,
                ours.rope_scaling.beta_fast, ours.rope_scaling.beta_slow) == (
            yarn["factor"], yarn["original_max_position_embeddings"], yarn["beta_fast"],
            yarn["beta_slow"])
    else:
        assert ours.rope_scaling is None
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                  "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
                  "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps"):
        assert getattr(ours, field) == getattr(hf, field), field


_ATTN = {"q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight",
         "q_b_proj.weight": "wq_b.weight", "kv_proj.weight": "wkv.weight",
         "kv_norm.weight": "norm.weight", "o_a_proj.weight": "wo_a.weight",
         "o_b_proj.weight": "wo_b.weight", "sinks": "attn_sink",
         "compressor.kv_proj.weight": "compressor.wkv.weight",
         "compressor.gate_proj.weight": "compressor.wgate.weight",
         "compressor.position_bias": "compressor.ape",
         "compressor.kv_norm.weight": "compressor.norm.weight",
         "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
         "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
         "compressor.indexer.position_bias": "indexer.compressor.ape",
         "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
         "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
         "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
          "mlp.gate.tid2eid": "ffn.gate.tid2eid",
          "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
          "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
          "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
          **{f"{site}_hc.{p}": f"hc_{site}_{p}" for site in ("attn", "ffn")
             for p in ("fn", "base", "scale")}}


def _expected_saved(model) -> dict[str, torch.Tensor]:
    """The checkpoint save_pretrained should write, derived independently from the modules: the
    official names under `model.`, `head.weight` for lm_head, gate_up_proj[e] split as
    w1 = gate (first half of the rows), w3 = up (second half)."""
    out: dict[str, torch.Tensor] = {}
    inter = model.config.moe_intermediate_size
    for key, value in model.state_dict().items():
        if key.endswith("inv_freq"):
            continue
        if key == "lm_head.weight":
            out["head.weight"] = value
            continue
        if not key.startswith("model.layers."):
            out[key] = value  # embed_tokens, norm, hc_head.*
            continue
        layer, rest = key.removeprefix("model.layers.").split(".", 1)
        p = f"model.layers.{layer}."
        if rest.startswith("self_attn."):
            out[p + "attn." + _ATTN[rest.removeprefix("self_attn.")]] = value
        elif rest == "mlp.experts.gate_up_proj":
            for e in range(value.shape[0]):
                out[p + f"ffn.experts.{e}.w1.weight"] = value[e, :inter]
                out[p + f"ffn.experts.{e}.w3.weight"] = value[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[p + f"ffn.experts.{e}.w2.weight"] = value[e]
        else:
            out[p + _LAYER[rest]] = value
    return out


# --- our model against transformers -----------------------------------------------------------
def _load_ours(path, device):
    import monodecode

    return monodecode.load(path, device=device, dtype=torch.float32)


@pytest.mark.parametrize("name", CONFIG_IDS)
def test_prefill_matches_transformers(name, tmp_path, device):
    c = CONFIGS[name]
    hf = make_hf_model(MODEL_SEED, **c.kwargs)
    save_hf_model(hf, tmp_path, spelling=c.spelling)
    ids = clear_token_ids(hf, c.seq_len, _token_seed(name))
    theirs = hf_logits(hf, ids)
    ours = _load_ours(tmp_path, device)
    assert ours.config.compress_ratios == tuple(
        {"sliding_attention": 0, **hf.config.compress_rates}[t] for t in hf.config.layer_types)
    with torch.no_grad():
        got = ours.score(ids)
    _assert_close(got, theirs, f"prefill, config {name} ({', '.join(c.covers)})")
    # short prompts: one token; fewer tokens than a compressor window; a plain list of ints
    for n in (1, 3, 21):
        prefix = ids[:n].tolist() if n == 21 else ids[:n]
        with torch.no_grad():
            _assert_close(ours.score(prefix), hf_logits(hf, ids[:n]), f"prefill of {n} tokens, {name}")


def test_step_decode_matches_transformers_decode(tmp_path, device):
    """Our step() against transformers' own cached decode, token by token, on `mixed`: a
    prompt of 37 tokens in one step, then one token per step, in slot 1 of 2."""
    c = CONFIGS["mixed"]
    hf = make_hf_model(MODEL_SEED, **c.kwargs)
    save_hf_model(hf, tmp_path, spelling=c.spelling)
    ids = clear_token_ids(hf, c.seq_len, _token_seed("mixed"))
    prompt = 37
    theirs = hf_decode_logits(hf, ids, prompt_len=prompt)
    if row_errors(theirs, hf_logits(hf, ids)).max() > 1e-5:
        pytest.skip("transformers' cached decode disagrees with its own prefill on this input")
    ours = _load_ours(tmp_path, device)
    cache = ours.make_cache(num_slots=2, max_context=c.seq_len)
    rows = []
    with torch.no_grad():
        positions = torch.arange(prompt)
        rows.append(ours.step(cache, ids[:prompt], positions, torch.ones(prompt, dtype=torch.long)))
        for t in range(prompt, c.seq_len):
            one = torch.tensor([t])
            rows.append(ours.step(cache, ids[t:t + 1], one, torch.ones(1, dtype=torch.long)))
    _assert_close(torch.cat(rows), theirs, "step decode vs transformers' cached decode, mixed")


def test_selection_margins_cover_every_selection():
    """The margin check sees every indexer and every bias router of `mixed`."""
    c = CONFIGS["mixed"]
    model = make_hf_model(MODEL_SEED, **c.kwargs)
    margins = selection_margins(model, random_tokens(c.seq_len, model.config.vocab_size, 1))
    csa = [i for i, t in enumerate(model.config.layer_types) if t == "compressed_sparse_attention"]
    moe = [i for i, t in enumerate(model.config.mlp_layer_types) if t == "moe"]
    assert sorted(margins) == sorted(
        [f"model.layers.{i}.self_attn.compressor.indexer.scorer" for i in csa]
        + [f"model.layers.{i}.mlp.gate" for i in moe])
