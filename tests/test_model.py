"""The per-op model on its own: decode equals prefill, rewinds, pad rows, formats, errors; for
DeepSeek-V4 (the tiny preset) and DeepSeek-V4.1 (tiny-v4.1: its ratio-2 and ratio-1 layers, KV and
index sources, candidate filter and Engram)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from monodecode import formats
from monodecode.checkpoint import Checkpoint, write_synthetic_checkpoint
from monodecode.config import preset
from monodecode.generate import generate
from monodecode.model import load_model


@pytest.fixture(scope="module", params=["tiny", "tiny-v4.1"])
def model(request, device):
    return load_model(request.param, seed=11, device=device)


def rel_err(a, b):
    """Per row: max |a - b| / max |b| (on the CPU, whatever the device)."""
    a, b = a.cpu(), b.cpu()
    return ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()


def random_ids(generator, n, vocab=512):
    ids = torch.randint(0, vocab, (n,), generator=generator)
    assert ids.unique().numel() > 1
    return ids


def test_score_is_sane(model):
    ids = random_ids(torch.Generator().manual_seed(0), 40)
    logits = model.score(ids)
    assert logits.shape == (40, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100
    # causal: changing the last token leaves earlier rows alone, changing the first does not
    other = ids.clone()
    other[-1] = (other[-1] + 1) % 512
    assert rel_err(model.score(other)[:-1], logits[:-1]) < 1e-5
    other = ids.clone()
    other[0] = (other[0] + 1) % 512
    assert not torch.allclose(model.score(other)[-1], logits[-1])


def test_decode_equals_prefill_with_interleaved_requests(model):
    """Three requests of 70 tokens decoded together: steps mix single rows and runs of several
    rows per request (like speculative verify steps), crossing the 16-token window, CSA windows
    of 4 and HCA windows of 16 (V4.1: groups of 2, candidate blocks of 4, Engram's n-grams). Each
    row must match the prefill of its own sequence."""
    g = torch.Generator().manual_seed(1)
    seqs = [random_ids(g, 70) for _ in range(3)]
    slots = [2, 0, 3]  # not 0..n-1, to catch slot mix-ups
    expected = [model.score(s) for s in seqs]
    cache = model.make_cache(num_slots=4, max_context=80)
    done = [0, 0, 0]
    got = [torch.empty(70, 512) for _ in seqs]
    step = 0
    while min(done) < 70:
        tokens, positions, row_slots, owners = [], [], [], []
        for r, seq in enumerate(seqs):
            take = min([1, 3, 6, 1, 2][(step + r) % 5], 70 - done[r])
            for p in range(done[r], done[r] + take):
                tokens.append(seq[p]); positions.append(p); row_slots.append(slots[r]); owners.append((r, p))
            done[r] += take
        logits = model.step(cache, torch.stack(tokens), positions, row_slots)
        for row, (r, p) in enumerate(owners):
            got[r][p] = logits[row]
        step += 1
    for r in range(3):
        assert rel_err(got[r], expected[r]) < 1e-4, f"request {r}"


def test_rewound_verify_step_matches_prefill(model):
    """A verify step writes 6 positions, 4 are rejected and replaced by other tokens: the result
    equals the prefill of the committed sequence (the cache keeps what the rewind needs)."""
    g = torch.Generator().manual_seed(2)
    prefix, drafts, accepted = random_ids(g, 30), random_ids(g, 6), random_ids(g, 12)
    cache = model.make_cache(num_slots=1, max_context=64, max_step_rows=8)
    model.step(cache, prefix, range(30), [0] * 30)
    model.step(cache, drafts, range(30, 36), [0] * 6)  # rows 32..35 get rejected
    committed = torch.cat([prefix, drafts[:2], accepted])
    logits = model.step(cache, accepted, range(32, 44), [0] * 12)
    assert rel_err(logits, model.score(committed)[32:]) < 1e-4


def test_pad_rows_do_not_touch_other_requests_or_the_cache(model):
    g = torch.Generator().manual_seed(3)
    seq = random_ids(g, 20)
    cache = model.make_cache(num_slots=2, max_context=32)
    model.step(cache, seq[:19], range(19), [1] * 19)
    before = [layer.window.pos.clone() for layer in cache.layers]
    logits = model.step(cache, torch.tensor([7, seq[19], 9]), [5, 19, 0], [-1, 1, -1])
    assert rel_err(logits[1:2], model.score(seq)[19:]) < 1e-4
    after = [layer.window.pos for layer in cache.layers]
    for b, a in zip(before, after):
        assert torch.equal(a[0], b[0])  # slot 0 untouched
    assert torch.isfinite(logits).all()


def test_reused_slot_forgets_the_previous_request(model):
    g = torch.Generator().manual_seed(4)
    first, second = random_ids(g, 40), random_ids(g, 24)
    cache = model.make_cache(num_slots=1, max_context=48)
    model.step(cache, first, range(40), [0] * 40)
    cache.clear(0)
    out = [model.step(cache, second[:10], range(10), [0] * 10)]
    out += [model.step(cache, second[p:p + 1], [p], [0]) for p in range(10, 24)]
    assert rel_err(torch.cat(out), model.score(second)) < 1e-4


def test_bf16_is_close_to_fp32(device):
    """bf16 rounding may flip a near-tied expert choice for a token, which changes that row a
    lot (seen on the H200: one row of 24), so the bound is on the typical row, not the worst."""
    ids = random_ids(torch.Generator().manual_seed(5), 24)
    ref = load_model("tiny", seed=11, device=device).score(ids).cpu()
    bf16 = load_model("tiny", seed=11, dtype=torch.bfloat16, device=device).score(ids).cpu()
    assert bf16.dtype == torch.float32
    row_err = (bf16 - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert row_err.median() < 0.03
    assert (bf16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def dequantized_copy(src, dst):
    """The same weights with every FP8 / MXFP4 tensor dequantized to bf16, unquantized config."""
    ckpt = Checkpoint(src)
    tensors = {}
    for spec in ckpt.specs:
        if spec.fmt == "fp8":
            w = formats.dequantize_fp8_block(ckpt.tensor(f"{spec.name}.weight"),
                                             ckpt.tensor(f"{spec.name}.scale"), spec.fp8_block)
        elif spec.fmt == "mxfp4":
            w = formats.dequantize_mxfp4(ckpt.tensor(f"{spec.name}.weight"), ckpt.tensor(f"{spec.name}.scale"))
        else:
            tensors[spec.name] = ckpt.tensor(spec.name)
            continue
        tensors[f"{spec.name}.weight"] = w
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))


def test_the_lm_head_is_the_fp32_product_of_the_bf16_operands(device):
    """On a GPU the head multiplies the bf16 weight into fp32 without an fp32 copy of it
    (`has_fp32_output_gemm`): the same exact products as the fp32 GEMM of the upcast operands, so
    the same logits up to fp32 summation order; elsewhere it is that fp32 GEMM."""
    import torch.nn.functional as F

    from monodecode.model.norm import rms_norm

    m = load_model("tiny", seed=11, dtype=torch.bfloat16, device=device)
    assert m._fp32_output_gemm == (device == "cuda")
    x = torch.randn(2, 3, m.config.hidden_size, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    logits = m.lm_head(x.to(device))
    normed = rms_norm(x.to(device), m.w["norm"], m.config.rms_norm_eps)
    ref = F.linear(normed.double(), m.w["head"].double()).float()  # exact products, float64 sums
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, m.config.vocab_size)
    assert rel_err(logits, ref) < 1e-5


@pytest.mark.parametrize("name", ["tiny", "tiny-v4.1"])
def test_quantized_checkpoint_scores_like_its_bf16_dequantization(tmp_path, device, name):
    src = write_synthetic_checkpoint(preset(name), tmp_path / "q", seed=3, progress=False)
    dequantized_copy(src, tmp_path / "bf16")
    ids = random_ids(torch.Generator().manual_seed(6), 48)
    quantized = load_model(src, device=device).score(ids)
    plain = load_model(tmp_path / "bf16", device=device).score(ids)
    # FP8 and MXFP4 values are exact in bf16, so the two models compute the same thing
    assert rel_err(quantized, plain) < 1e-6
    assert torch.isfinite(quantized).all()


def test_preset_is_deterministic_by_seed(device):
    ids = torch.arange(10)
    a = load_model("tiny", seed=1, device=device).score(ids)
    assert torch.equal(a, load_model("tiny", seed=1, device=device).score(ids))
    assert not torch.allclose(a, load_model("tiny", seed=2, device=device).score(ids))


def test_preset_equals_its_written_checkpoint(tmp_path, device):
    path = write_synthetic_checkpoint(preset("tiny"), tmp_path / "t", seed=11, progress=False)
    ids = torch.arange(30) * 7
    written = load_model(path, device=device).score(ids)
    assert torch.equal(written, load_model("tiny", seed=11, device=device).score(ids))


@pytest.mark.parametrize(
    "tokens, positions, slots, message",
    [
        ([1, 600], [0, 1], [0, 0], "row 1: token id 600 is outside [0, 512)"),
        ([1, 2], [0, 1], [0, 5], "row 1: slot 5 is outside [-1, 2)"),
        ([1, 2], [0, 99], [1, 1], "row 1: position 99 is outside [0, 16)"),
        ([1, 2], [3, 5], [1, 1], "rows of slot 1 have positions [3, 5]"),
        ([1, 2], [0], [0, 0], "must be 1-D and of the same non-zero length"),
    ],
)
def test_step_rejects_bad_rows(model, tokens, positions, slots, message):
    cache = model.make_cache(num_slots=2, max_context=16)
    with pytest.raises(ValueError) as e:
        model.step(cache, tokens, positions, slots)
    assert message in str(e.value)


def test_generate_greedy_matches_score(model):
    prompt = [5, 9, 200, 31]
    out = generate(model, prompt, 12)
    logits = model.score(prompt + out[:-1])
    assert out == logits[len(prompt) - 1:].argmax(-1).tolist()


def test_generate_sampling_is_seeded(model):
    a = generate(model, [1, 2], 10, temperature=1.0, top_p=0.9, seed=4)
    assert a == generate(model, [1, 2], 10, temperature=1.0, top_p=0.9, seed=4)
    assert a != generate(model, [1, 2], 10, temperature=1.0, top_p=0.9, seed=5)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, [1], 2, temperature=1.0, top_p=0)
    with pytest.raises(ValueError, match="prompt token id 512 at index 1"):
        generate(model, [1, 512], 2)


def test_weights_that_cannot_fit_are_refused_before_reading(monkeypatch, capsys):
    import monodecode.model.transformer as transformer
    from monodecode.cli import main

    monkeypatch.setattr(transformer, "free_memory", lambda device: 1000)
    with pytest.raises(MemoryError, match=r"the weights need [0-9.]+ MiB on cpu as loaded \(float32\), 0\.0 MiB is free"):
        load_model("tiny")
    assert main(["generate", "--max-tokens", "2"]) == 2
    assert "Use fewer layers" in capsys.readouterr().err


def test_config_overrides_apply_to_presets_only(tmp_path):
    """`load_model(..., overrides=...)` changes a preset's config (`bench decode --layers N` builds
    its model so, over ranks too); a checkpoint's config is its own."""
    assert load_model("tiny", overrides={"num_hidden_layers": 1}).config.num_hidden_layers == 1
    src = write_synthetic_checkpoint(preset("tiny"), tmp_path / "ckpt", seed=3, progress=False)
    with pytest.raises(ValueError, match=r"config overrides \(num_hidden_layers\) apply to presets only"):
        load_model(src, overrides={"num_hidden_layers": 1})
