"""DSpark speculative decoding on the per-op path: lossless greedy, cache consistency, errors."""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from monodecode.checkpoint import CheckpointError, write_synthetic_checkpoint
from monodecode.cli import main
from monodecode.config import preset
from monodecode.generate import generate, generate_speculative
from monodecode.model import load_model
from monodecode.model.draft import _drawn as drawn
from monodecode.model.norm import rms_norm
from monodecode.sampling import RowSettings
from monodecode.spec.config import SpeculativeConfig
from monodecode.spec.decoder import SpeculativeDecoder


@pytest.fixture(scope="module")
def model(device):
    return load_model("tiny", seed=21, device=device)


def spec(method, **extra):
    return SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                        "rejection_sample_method": method, **extra})


@pytest.mark.parametrize("method", ["greedy", "standard", "block"])
@pytest.mark.parametrize("prompt_seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_greedy_speculation_is_lossless(model, method, prompt_seed):
    """64 tokens of one prompt, each verification method; two more prompts are `slow`."""
    g = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(0, 512, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
    plain = generate(model, prompt, 64)
    fast, stats = generate_speculative(model, prompt, 64, spec(method), seed=prompt_seed)
    assert fast == plain
    assert stats.steps >= 1 and 1 <= stats.mean_acceptance_length <= 6


@pytest.mark.parametrize("method", ["standard", "block"])
def test_top_k_reaches_draft_and_verification(model, method):
    """top_k = 1 at temperature 1 is greedy, but only if both the draft's and the target's
    distributions are cut to their top token: the output must then equal plain greedy."""
    decoder = SpeculativeDecoder(model, spec(method))
    caches = decoder.make_caches(num_slots=1, max_context=64)
    prompt = [7, 70, 300, 12]
    request = decoder.prefill(caches, 0, prompt, 1.0, 1.0, torch.Generator(model.device).manual_seed(0), top_k=1)
    out = [request.anchor]
    while len(out) < 30:
        out += decoder.step(caches, [request])[0]
    assert out[:30] == generate(model, prompt, 30)


def test_batched_requests_commit_consistent_caches(model):
    """Three requests decoded together at temperature 1 (standard verification): afterwards the
    target's logits for each committed sequence equal its prefill, and each draft ring holds
    exactly the context keys a prefill of the committed sequence gives (a step commits every
    request's rows to the draft's rings in one call, each row into its request's slot)."""
    decoder = SpeculativeDecoder(model, spec("standard"))
    caches = decoder.make_caches(num_slots=4, max_context=96)
    prompts = [[5, 9, 14], list(range(40, 61)), [300] * 2 + [7]]
    gens = [torch.Generator(model.device).manual_seed(i) for i in range(3)]
    requests = [decoder.prefill(caches, slot, p, 1.0, 1.0, g)
                for slot, p, g in zip((3, 0, 2), prompts, gens)]
    sequences = [p + [r.anchor] for p, r in zip(prompts, requests)]
    for _ in range(6):
        for seq, tokens in zip(sequences, decoder.step(caches, requests)):
            seq += tokens
    assert decoder.stats.steps == 18
    for seq, r in zip(sequences, requests):
        assert r.position == len(seq) - 1 and r.anchor == seq[-1]
        committed = seq[:-1]
        # the target continues exactly like a prefill of the committed tokens
        logits = model.step(caches.target, [seq[-1]], [r.position], [r.slot])
        expected = model.score(seq)[-1:]
        assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-4
        # the draft's rings hold the committed positions' keys, as a fresh prefill makes them
        fresh = decoder.make_caches(num_slots=1, max_context=96)
        decoder.prefill(fresh, 0, committed)
        window = torch.arange(max(len(committed) - 16, 0), len(committed), device=model.device)
        for ring, fresh_ring in zip(caches.draft.rings, fresh.draft.rings):
            got, valid = ring.read(r.slot, window)
            want, fresh_valid = fresh_ring.read(0, window)
            assert valid.all() and fresh_valid.all()
            assert torch.allclose(got["kv"], want["kv"], rtol=1e-4, atol=1e-5)


def per_stage_commit(draft, cache, slot, positions, hidden):
    """`Draft.commit` one stage at a time: each stage's keys from its own attention's `keys`."""
    main_x = rms_norm(F.linear(hidden.to(draft.model.dtype), draft.w["mtp.0.main_proj"]),
                      draft.w["mtp.0.main_norm"], draft.c.rms_norm_eps)
    for stage, ring in zip(draft.stages, cache.rings):
        ring.write(slot, positions, {"kv": stage.attention.keys(main_x, positions)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draft_commits_every_stage_at_once_as_one_stage_at_a_time(device, dtype):
    """`Draft.commit` makes all stages' context keys in one pass (stacked wkv, one norm, one
    rotation): the rings hold bit for bit what each stage's own keys give, for the FP8 weights
    of the synthetic checkpoint dequantized to fp32 or bf16; a prompt shorter than the ring, one
    longer (only its last rows kept), and a verify step's rows of several slots, each with fresh
    random features."""
    model = load_model("tiny", seed=21, device=device, dtype=dtype)
    draft, c = model.draft(), model.config
    g = torch.Generator().manual_seed(3)
    size = c.sliding_window + c.dspark_block_size
    cases = [(1, torch.arange(5)), (2, torch.arange(3, 3 + size + 7)),
             ([0, 0, 3, 3, 3], torch.tensor([7, 8, 40, 41, 42]))]
    caches = [draft.make_cache(4) for _ in range(2)]
    for slot, positions in cases:
        hidden = torch.randn(len(positions), len(c.dspark_target_layer_ids) * c.hidden_size, generator=g)
        positions, hidden = positions.to(device), hidden.to(device)
        draft.commit(caches[0], slot, positions, hidden)
        per_stage_commit(draft, caches[1], slot, positions, hidden)
        for ring, ref in zip(*(cache.rings for cache in caches)):
            assert torch.equal(ring.pos, ref.pos)
            assert torch.equal(ring.data["kv"], ref.data["kv"])


def test_proposal_is_well_formed_and_leaves_the_rings_alone(model):
    decoder = SpeculativeDecoder(model, spec("standard"))
    caches = decoder.make_caches(num_slots=2, max_context=64)
    request = decoder.prefill(caches, 1, [3, 1, 4, 1, 5, 9, 2, 6])
    before = [ring.pos.clone() for ring in caches.draft.rings]
    uniforms = torch.rand(1, 5, generator=torch.Generator().manual_seed(0)).to(model.device)
    proposal = decoder.draft.propose(caches.draft, torch.tensor([request.anchor]),
                                     torch.tensor([request.position]), [1], RowSettings.of([(0.7, 0.9, 0)], model.device),
                                     uniforms)
    assert proposal.tokens.shape == (1, 5) and proposal.probs.shape == (1, 5, 512)
    assert torch.allclose(proposal.probs.sum(-1).cpu(), torch.ones(1, 5))
    drawn = proposal.probs.gather(-1, proposal.tokens.unsqueeze(-1))
    assert (drawn > 0).all()  # each draft token came from its distribution
    assert ((proposal.confidence > 0) & (proposal.confidence < 1)).all()
    for b, ring in zip(before, caches.draft.rings):
        assert torch.equal(b, ring.pos)  # block keys never enter the ring


def test_an_all_greedy_proposal_is_the_sampled_one_at_temperature_zero(model):
    """With every request at temperature 0 the draft's head takes its batched greedy path (a CUDA
    graph a request count on a GPU, replayed here a second time): the tokens, one-hot
    distributions and confidences of the sampling path at temperature 0, whatever its uniforms;
    a whole step's greedy and sampled heads its tokens and distributions."""
    decoder = SpeculativeDecoder(model, spec("greedy"))
    caches = decoder.make_caches(num_slots=3, max_context=64)
    requests = [decoder.prefill(caches, s, [s + 3, 1, 4, 1, 5][:s + 3]) for s in range(3)]
    draft, r = decoder.draft, len(requests)
    anchors = torch.tensor([q.anchor for q in requests])
    args = (caches.draft, anchors, torch.tensor([q.position for q in requests]), [q.slot for q in requests])
    uniforms = torch.rand(r, 5, generator=torch.Generator().manual_seed(4)).to(model.device)
    greedy_settings = RowSettings.of([(0.0, 0.9, 5)] * r, model.device)
    for _ in range(2):
        greedy = draft.propose(*args, greedy_settings, None)
    streams = draft.model.embed(torch.full((r * draft.block_size,), 7, device=model.device))
    hb, base = draft._head(streams, None, r)
    sampled_at_zero = partial(drawn, settings=RowSettings.of([(0.0, 1.0, 0), (1e-6, 1.0, 0), (0.0, 1.0, 0)], model.device),
                              uniforms=uniforms)
    assert torch.equal(draft._greedy_markov(streams, None, anchors.to(model.device)).tokens[[0, 2]],
                       draft._markov_sample(base, hb, anchors.to(model.device), sampled_at_zero).tokens[[0, 2]])
    # a whole step's greedy head (`greedy_tokens`: no distributions, no confidences) picks the same tokens
    noisy = streams + torch.randn(streams.shape, generator=torch.Generator().manual_seed(5)).to(streams)
    assert torch.equal(draft.greedy_tokens(noisy, anchors.to(model.device)),
                       draft._greedy_markov(noisy, None, anchors.to(model.device)).tokens)
    # its sampled head (`sampled_tokens`: no confidences) draws the same tokens from the same
    # distributions; the confidences are the head's formula
    on_device = anchors.to(model.device)
    settings = RowSettings.of([(0.0, 1.0, 0)] * (r - 1) + [(0.8, 0.9, 3)], model.device)
    head = draft.sampled_head(noisy, None, on_device, settings, uniforms)
    tokens, probs = draft.sampled_tokens(noisy, on_device, settings, uniforms)
    assert torch.equal(tokens, head.tokens) and torch.equal(probs, head.probs)
    prev = torch.cat([on_device[:, None], head.tokens[:, :-1]], dim=1)
    features = torch.cat([draft._head(noisy, None, r)[0].float(), draft.w[draft.markov_w1][prev].float()], dim=-1)
    weight = draft.w[f"{draft.last}confidence_head.proj"].float()
    assert torch.allclose(head.confidence, torch.sigmoid(features @ weight.t()).squeeze(-1), atol=1e-6)
    # the whole proposal against the sampling path, which a request above temperature 0 forces
    mixed = draft.propose(*args, RowSettings.of([(0.0, 1.0, 0)] * (r - 1) + [(1e-6, 1.0, 0)], model.device), uniforms)
    assert torch.equal(mixed.tokens[:r - 1], greedy.tokens[:r - 1])
    assert torch.equal(mixed.probs[:r - 1], greedy.probs[:r - 1])
    assert torch.equal(mixed.confidence, greedy.confidence)
    assert torch.equal(greedy.probs.argmax(-1), greedy.tokens) and torch.equal(greedy.probs.sum(-1), torch.ones(r, 5).to(greedy.probs))


def test_requests_of_any_settings_sample_together_as_they_would_alone():
    """The draft's draws: the distributions of requests with different settings computed in one
    batch, each request's token picked by its own uniform, equal (distributions and tokens) to
    one request at a time through `probabilities` and `pick`, a greedy request among them."""
    from monodecode.sampling import pick, probabilities

    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(7, 50, generator=g)
    uniforms = torch.rand(7, 5, generator=g)
    settings = [(0.8, 0.9, 0), (0.8, 0.9, 0), (1.0, 1.0, 5), (0.0, 1.0, 0), (0.8, 0.9, 0), (1.3, 0.5, 0),
                (1.0, 0.7, 5)]
    for case in (settings, [settings[0]] * 7):  # mixed, and all alike
        tokens, probs = drawn(logits, 2, settings=RowSettings.of(case), uniforms=uniforms)
        for i, s in enumerate(case):
            expected = probabilities(logits[i], *s)
            assert torch.equal(probs[i], expected)
            assert tokens[i] == pick(expected, uniforms[i, 2])


def test_synthetic_mode_hits_its_acceptance_length(model):
    """The verify-level test checks 2% over 20k draws; here the whole loop, with 8 requests a
    step, checks that the decoder counts what the synthetic verifier does."""
    decoder = SpeculativeDecoder(model, spec("synthetic", synthetic_acceptance_length=3.51))
    caches = decoder.make_caches(num_slots=8, max_context=1024)
    requests = [decoder.prefill(caches, s, [s + 1, 2, 3], 1.0, 1.0, torch.Generator(model.device).manual_seed(s))
                for s in range(8)]
    for _ in range(30):
        decoder.step(caches, requests)
    assert decoder.stats.steps == 240
    # the seeds are fixed; 240 verdicts of sd ~1.5 about 3.51: 8 % is ~2.9 of the mean's sd
    assert abs(decoder.stats.mean_acceptance_length - 3.51) / 3.51 < 0.08


def test_block_size_mismatch_is_refused(model):
    config = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 7})
    with pytest.raises(ValueError, match="must equal the DSpark draft's block size"):
        SpeculativeDecoder(model, config)


def test_missing_draft_fails_only_when_speculation_is_asked(tmp_path, device):
    path = write_synthetic_checkpoint(preset("tiny"), tmp_path / "t", seed=2, progress=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for name, file in list(index["weight_map"].items()):
        if name.startswith("mtp."):
            (path / file).unlink(missing_ok=True)
            del index["weight_map"][name]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(path, device=device)
    assert len(generate(model, [1, 2, 3], 4)) == 4
    with pytest.raises(CheckpointError, match="DSpark draft tensor mtp.0.main_proj.weight is missing"):
        generate_speculative(model, [1, 2, 3], 4, spec("greedy"))


def test_cli_prints_acceptance(capsys):
    config = '{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}'
    assert main(["generate", "--max-tokens", "20", "--speculative-config", config]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # text: the default model has the byte-level fallback, as for serve
    assert "mean acceptance length" in captured.err and "per-position acceptance rates" in captured.err
    plain = main(["generate", "--max-tokens", "20"]) == 0 and capsys.readouterr().out
    assert plain == captured.out  # greedy: the same tokens
    synthetic = '{"method": "dspark", "num_speculative_tokens": 5, "synthetic_acceptance_length": 3.5, ' \
                '"rejection_sample_method": "synthetic"}'
    assert main(["generate", "--max-tokens", "8", "--speculative-config", synthetic]) == 0
    assert "for benchmarks only" in capsys.readouterr().err
    assert main(["generate", "--speculative-config", "{not json"]) == 2
    assert "argument --speculative-config: speculative config is not valid JSON" in capsys.readouterr().err

