"""The DSpark draft's stages on the kernels (mono/draft_runner.py) against the per-op draft, on
the same model, context and block rows. On the CPU the kernels run under Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.model import Model
from monodecode.model.attention import RequestRows
from monodecode.mono.draft_runner import DraftRunner
from monodecode.sampling import RowSettings

SLOTS = 8
# A row whose routed experts sit at a near-tie in some stage (the k-th and (k+1)-th biased scores
# closer than this) may pick another expert from bf16 noise and then legitimately differ; as in
# tests/test_mono_runner.py, such rows are set aside, at most a quarter of them.
ROUTING_NEAR_TIE = 2e-2


@pytest.fixture(scope="module")
def model(device):
    return Model.from_checkpoint(SyntheticCheckpoint(preset("tiny"), seed=9), device, torch.bfloat16)


@pytest.fixture(scope="module")
def runner(model):
    return DraftRunner(model, model.draft(), poison=True)  # poison: an unwritten scratch element shows


def context(model, draft, g, lengths, device):
    """Two draft caches holding the same committed context, a request a slot; the slots."""
    c = model.config
    caches = [draft.make_cache(SLOTS) for _ in range(2)]
    slots = torch.randperm(SLOTS, generator=g)[:len(lengths)].tolist()
    for slot, n in zip(slots, lengths):
        hidden = torch.randn(n, len(c.dspark_target_layer_ids) * c.hidden_size, generator=g).to(device)
        for cache in caches:
            draft.commit(cache, slot, torch.arange(n, device=device), hidden)
    return caches, slots


def per_op_stages(draft, cache, tokens, positions, slots, margins):
    """The draft's stages per-op (as Draft.propose runs them), recording each row's smallest
    routing margin over the stages in `margins`."""
    b = draft.block_size
    groups = [RequestRows(s, torch.arange(i * b, (i + 1) * b, device=tokens.device), positions[i * b:(i + 1) * b])
              for i, s in enumerate(slots)]
    streams = draft.model.embed(tokens)
    for stage, ring in zip(draft.stages, cache.rings):
        route = stage.moe.route

        def recording(x, row_tokens, moe=stage.moe, route=route):
            margins.append(moe.margin(x).cpu())
            return route(x, row_tokens)

        stage.moe.route = recording
        try:
            streams = stage(streams, tokens, positions, groups, ring)
        finally:
            del stage.moe.route  # the instance attribute: back to the class's method
    return streams


# Requests whose context is shorter than the window, fills it, and runs past it (the ring of
# window + block keys wraps); 2 and 8 requests are `slow` (the GPU runs them)
@pytest.mark.parametrize("lengths", [[3], [3, 16, 25, 9], pytest.param([30, 5], marks=pytest.mark.slow),
                                     pytest.param([3, 16, 25, 9, 1, 40, 7, 12], marks=pytest.mark.slow)],
                         ids=["1_request", "4_requests", "2_requests", "8_requests"])
def test_the_draft_stages_on_the_kernels_match_the_per_op_stages(model, runner, device, lengths):
    """The streams after the last stage, row by row, and the context each block reads left as it
    was (the kernels write only the blocks' own keys, past it)."""
    c, draft = model.config, runner.draft
    g = torch.Generator().manual_seed(len(lengths))
    caches, slots = context(model, draft, g, lengths, device)
    before = [ring.pos.clone() for ring in caches[1].rings]
    b = draft.block_size
    tokens = torch.full((len(lengths), b), c.dspark_noise_token_id)
    tokens[:, 0] = torch.randint(0, c.vocab_size, (len(lengths),), generator=g)
    positions = (torch.tensor(lengths)[:, None] + torch.arange(b)).flatten().to(device)
    tokens, row_slots = tokens.flatten().to(device), torch.tensor(slots).repeat_interleave(b)
    margins = []
    ref = per_op_stages(draft, caches[0], tokens, positions, slots, margins)
    out = runner.stages(caches[1])(tokens, positions, row_slots)
    cos = F.cosine_similarity(out.double().flatten(1), ref.double().flatten(1), dim=1).cpu()
    near_tie = torch.stack(margins).min(dim=0).values < ROUTING_NEAR_TIE
    off = cos < 0.9999
    assert not (off & ~near_tie).any(), (cos, torch.stack(margins).min(dim=0).values)
    assert off.sum() <= len(cos) // 4, cos
    for ring, pos in zip(caches[1].rings, before):
        for slot, n in zip(slots, lengths):
            read = (pos[slot] >= max(0, n - c.sliding_window)) & (pos[slot] < n)
            assert read.sum() == min(n, c.sliding_window)
            assert torch.equal(ring.pos[slot][read], pos[slot][read])


def test_a_proposal_on_the_kernels(model, runner, device):
    """`Draft.propose` with the runner's stages: a block of draft tokens a request, its
    distributions and confidences, as the per-op draft gives them (up to a token chosen at a
    near-tie)."""
    draft, c = runner.draft, model.config
    g = torch.Generator().manual_seed(7)
    lengths = [20, 4]
    caches, slots = context(model, draft, g, lengths, device)
    anchors = torch.randint(0, c.vocab_size, (len(lengths),), generator=g)
    greedy = RowSettings.of([(0.0, 1.0, 0)] * len(lengths), device)
    ref = draft.propose(caches[0], anchors, torch.tensor(lengths), slots, greedy, None)
    out = draft.propose(caches[1], anchors, torch.tensor(lengths), slots, greedy, None, stages=runner.stages(caches[1]))
    assert out.tokens.shape == ref.tokens.shape == (len(lengths), draft.block_size)
    assert (out.tokens[:, 0] == ref.tokens[:, 0]).all()  # the first token, from the anchor's row
    assert torch.isfinite(out.confidence).all() and ((0 < out.confidence) & (out.confidence < 1)).all()


def test_the_draft_runner_takes_whole_blocks_only(model, runner):
    cache = runner.draft.make_cache(SLOTS)
    assert runner.refusal(cache, [1] * 7, list(range(7)), [0] * 7) == "7 rows are not whole draft blocks of 5"
    with pytest.raises(ValueError, match="not whole draft blocks"):
        runner.step(cache, [1] * 7, list(range(7)), [0] * 7)


@pytest.fixture(scope="module")
def kernel_decoder(device):
    """A decoder with the kernels on (so its draft's stages run on them too), shared by the
    speculative tests below: the kernels are built and their widths warmed once."""
    from monodecode.decode import Decoder

    return Decoder(Model.from_checkpoint(SyntheticCheckpoint(preset("tiny"), seed=21), device, torch.bfloat16), "on")


def speculative(decoder, method="standard", paths=None, **extra):
    from monodecode.spec.config import SpeculativeConfig
    from monodecode.spec.decoder import SpeculativeDecoder

    config = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                          "rejection_sample_method": method, **extra})
    return SpeculativeDecoder(decoder, config, count_path=None if paths is None else paths.append)


@pytest.mark.parametrize("tokens", [pytest.param(16, marks=pytest.mark.slow), 6])
def test_greedy_speculation_with_the_draft_on_the_kernels_is_lossless(kernel_decoder, tokens):
    """A decoder with the kernels on runs the draft's stages on them (`Decoder.draft`), and every
    greedy step runs whole (spec/step_graph.py): greedy speculation still gives plain greedy
    decoding's tokens (16 tokens are `slow`: the whole model runs interpreted; 6 take ~85 s,
    as 3 do: the first launches at each width cost most); the decoder builds that draft once and
    gives it to every caller."""
    from monodecode.decode import KernelDraft
    from monodecode.generate import generate

    paths = []
    spec = speculative(kernel_decoder, paths=paths)
    assert isinstance(spec.draft, KernelDraft) and kernel_decoder.draft() is spec.draft
    caches = spec.make_caches(num_slots=1, max_context=64)
    prompt = [7, 70, 300, 12]
    request = spec.prefill(caches, 0, prompt, 0.0, 1.0, None)
    out = [request.anchor]
    while len(out) < tokens:
        out += spec.step(caches, [request])[0]
    assert spec.draft.runner.sync["k1"].epoch > 0  # the draft ran on the kernels
    assert paths == ["whole"] * spec.stats.steps
    assert out[:tokens] == generate(kernel_decoder, prompt, tokens)


def test_which_steps_run_whole(kernel_decoder):
    """Any verification method and any sampling settings run whole; more rows than the kernels
    take run stepwise."""
    spec = speculative(kernel_decoder)
    caches = spec.make_caches(num_slots=2, max_context=64)
    greedy = spec.prefill(caches, 0, [7, 70, 300])
    sampled = spec.prefill(caches, 1, [5, 9], 1.0, 0.9, torch.Generator(kernel_decoder.device).manual_seed(0), top_k=7)
    assert spec.takes_whole([greedy]) and spec.takes_whole([greedy, sampled])
    for method, extra in (("greedy", {}), ("block", {}), ("synthetic", {"synthetic_acceptance_length": 3.0})):
        assert speculative(kernel_decoder, method, **extra).takes_whole([sampled, greedy])
    assert not spec.takes_whole([greedy] * 9)  # 54 verify rows
    assert spec.whole_step.refusal(9) == "more than 48 rows"


# (method, each request's (temperature, top_p, top_k), steps). By default one sampled request
# (the lossless test's widths) for one step; the rest `slow` (~30 s a step interpreted).
WHOLE_AS_STEPWISE = [
    pytest.param("block", [(0.8, 0.9, 20)], 1, id="block_1_sampled_request_1_step"),
    pytest.param("standard", [(0.7, 1.0, 0), (0.0, 1.0, 0)], 3, id="standard_sampled_and_greedy_3_steps",
                 marks=pytest.mark.slow),
    pytest.param("synthetic", [(0.0, 1.0, 0), (0.0, 1.0, 0)], 3, id="synthetic_2_greedy_3_steps", marks=pytest.mark.slow),
    pytest.param("synthetic", [(1.0, 0.5, 0)], 2, id="synthetic_1_sampled_2_steps", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("method,settings,steps", WHOLE_AS_STEPWISE)
def test_whole_steps_commit_what_stepwise_ones_do(kernel_decoder, method, settings, steps):
    """A whole step draws each request's uniforms before its device work, as the stepwise path
    draws them (spec/draws.py): with the same seeds and context, each step commits the tokens the
    stepwise path commits, and the generators end in the same state."""
    from dataclasses import replace

    paths = []
    extra = {"synthetic_acceptance_length": 3.0} if method == "synthetic" else {}
    spec = speculative(kernel_decoder, method, paths=paths, **extra)
    whole = spec.whole_step
    prompts = [[7, 70, 300, 12], [5, 9, 41]][:len(settings)]
    caches, requests = [], []
    for _ in range(2):  # [0]: whole steps, [1]: stepwise
        caches.append(spec.make_caches(num_slots=2, max_context=64))
        requests.append([replace(spec.prefill(caches[-1], slot, prompt), temperature=t, top_p=p, top_k=k,
                                 generator=torch.Generator(kernel_decoder.device).manual_seed(40 + slot))
                         for slot, (prompt, (t, p, k)) in enumerate(zip(prompts, settings))])
    for _ in range(steps):
        committed = spec.step(caches[0], requests[0])
        spec.whole_step = None
        assert spec.step(caches[1], requests[1]) == committed
        spec.whole_step = whole
    assert paths == ["whole", "stepwise"] * steps
    for a, b in zip(*requests):
        assert (a.position, a.anchor) == (b.position, b.anchor)
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_a_kernel_error_in_a_whole_step_is_raised_after_it(kernel_decoder):
    """A wait that gave up in the draft's kernels during a whole step (its error word set): the
    step raises after it, naming the draft and the stage; the requests stay where they were, and
    the error word starts over."""
    from monodecode.mono.sync import ERROR, MonoSyncError

    paths = []
    spec = speculative(kernel_decoder, paths=paths)
    caches = spec.make_caches(num_slots=1, max_context=64)
    request = spec.prefill(caches, 0, [7, 70, 300, 12])
    before = (request.position, request.anchor)
    words = spec.draft.runner.sync["k1"].words
    words[ERROR] = 1  # as a wait of the first stage that gave up
    with pytest.raises(MonoSyncError, match="whole speculative step.*the draft's kernels: a persistent "
                                            "kernel gave up waiting in stage 'k1 fold'"):
        spec.step(caches, [request])
    assert (request.position, request.anchor) == before and spec.stats.steps == 0 and paths == []
    assert int(words[ERROR]) == 0


def test_a_whole_step_refuses_bad_requests_before_it_runs(kernel_decoder):
    """The whole step makes its rows from the requests and checks them as requests: a bad one
    is named before anything runs, and no request moves."""
    from dataclasses import replace

    paths = []
    spec = speculative(kernel_decoder, paths=paths)
    caches = spec.make_caches(num_slots=2, max_context=64)
    good = spec.prefill(caches, 0, [7, 70, 300])
    for change, message in [
        ({"slot": 2}, r"request 1 \(slot 2\): the slot is outside \[0, 2\)"),
        ({"slot": 0}, r"request 1 \(slot 0\): an earlier request of the step has this slot"),
        ({"position": 59}, r"request 1 \(slot 1\): position 59 is outside \[0, 59\): its verify rows reach "
                           r"position \+ 5, and the cache holds 64 positions"),
        ({"anchor": -1}, r"request 1 \(slot 1\): token id -1 is outside"),
    ]:
        bad = replace(good, **{"slot": 1, **change})  # checked before it runs: no prefill of its own needed
        before = [(q.position, q.anchor) for q in (good, bad)]
        with pytest.raises(ValueError, match=message):
            spec.step(caches, [good, bad])
        assert [(q.position, q.anchor) for q in (good, bad)] == before
    assert spec.stats.steps == 0 and paths == []


@pytest.mark.gpu
def test_whole_steps_replay_bit_exact(kernel_decoder):
    """300 whole steps (standard verification), 1 / 8 / 2 requests in turn, every other request
    sampled (temperature 0.7, top-p 0.9, its own seeded generator), on caches where each key's
    step is a CUDA graph (1 request: all greedy; 8 and 2: sampled and filtering): each step's
    committed tokens, logits and the requests' new anchors and positions are bit-equal to the same
    step run eagerly (graphs off) on a second set of caches and requests with the same context
    and seeds."""
    from dataclasses import replace

    paths = []
    spec = speculative(kernel_decoder, "standard", paths=paths)
    whole = spec.whole_step
    assert whole.graphs_enabled
    prompts = [[3 + s, 14, 15, 92, 65][:2 + s % 4] for s in range(8)]
    caches, requests = [], []
    for _ in range(2):  # [0]: graphs, [1]: eager
        caches.append(spec.make_caches(num_slots=8, max_context=2048))  # request 0: <= 6 positions a step
        requests.append([replace(spec.prefill(caches[-1], slot, prompt), temperature=0.7 * (slot % 2), top_p=0.9,
                                 generator=torch.Generator(kernel_decoder.device).manual_seed(slot))
                         for slot, prompt in enumerate(prompts)])
    for i in range(300):
        n = (1, 8, 2)[i % 3]
        committed, logits = spec.step(caches[0], requests[0][:n], return_logits=True)
        whole.graphs_enabled = False
        ref_committed, ref_logits = spec.step(caches[1], requests[1][:n], return_logits=True)
        whole.graphs_enabled = True
        assert committed == ref_committed, i
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), i
        assert [(r.position, r.anchor) for r in requests[0]] == [(r.position, r.anchor) for r in requests[1]], i
    assert paths == ["whole"] * 600
    assert sorted(key[:3] for key in whole.graphs) == [(1, True, False), (2, False, True), (8, False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["standard", "block"])
def test_whole_sampled_steps_are_lossless(kernel_decoder, method):
    """Lossless with the draft on the kernels: 3,000 whole steps (a CUDA graph) from one request
    state at temperature 1, top-k 20: the first committed token (a kept draft or the rule's
    correction) is distributed as the target's own distribution there (chi-square p > 1e-3, as
    tests/test_spec_verify.py asks of the rules). Every step starts from the same state: a step
    writes only positions from its anchor on, which the next step writes again (the target's
    row at the anchor is the same in every step, up to the rounding that the other rows' drafts
    can change where they share its experts)."""
    from dataclasses import replace

    from monodecode.sampling import probabilities
    from test_spec_verify import LOSSLESS_P, chi_square_pvalue

    spec = speculative(kernel_decoder, method)
    caches = spec.make_caches(num_slots=1, max_context=64)
    start = spec.prefill(caches, 0, [7, 70, 300, 12], 1.0, 1.0, None, top_k=20)
    generator = torch.Generator(kernel_decoder.device).manual_seed(90)
    counts, first_row = torch.zeros(kernel_decoder.config.vocab_size, dtype=torch.long), None
    for i in range(3000):  # the i-th drawing step of the request's seed: fresh uniforms (spec/draws.py)
        committed, logits = spec.step(caches, [replace(start, generator=generator, draws=i)], return_logits=True)
        counts[committed[0][0]] += 1
        if first_row is None:
            first_row = logits[0][0].clone()
        assert F.cosine_similarity(logits[0][0].double(), first_row.double(), dim=0) > 0.9999
    assert spec.stats.steps == 3000 and spec.whole_step.graphs
    pvalue = chi_square_pvalue(counts, probabilities(first_row, 1.0, 1.0, 20).cpu())
    print(f"{method}: p-value of the first committed token over 3,000 whole steps: {pvalue:.3g}")
    assert pvalue > LOSSLESS_P


def test_the_speculation_check_compares_with_plain_greedy_decoding(device, tmp_path, capsys):
    """`python -m monodecode.bench.spec_check` (run on the GPU at v4-flash sizes), one tiny layer
    with the kernels on, one request, blocks from the plain path cut at random places: every step
    whole, drafts accepted, the sequences equal and their logits agreeing, the JSON written."""
    import json

    from monodecode.bench import spec_check

    out = tmp_path / "spec_check.json"
    assert spec_check.main(["--preset", "tiny", "--layers", "1", "--requests", "1", "--tokens", "6", "--drafts",
                            "oracle", "--device", device, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    oracle = report["counts"]["1"]["oracle"]
    assert oracle["all_equal"] and oracle["logits_agree"] and oracle["paths"] == {"whole": oracle["steps"]}
    assert oracle["tokens_a_step"] > 1  # the plain path's tokens were proposed and kept
    [row] = oracle["requests"]
    assert row["prompt_length"] == spec_check.PROMPTS[0] and row["first_difference"] is None
    assert json.dumps(report["counts"]["1"]) in capsys.readouterr().out


def test_the_speculation_check_reports_where_the_sequences_part(monkeypatch):
    """Where a request's speculative tokens part from its plain ones: the index, the plain path's
    top-two gap and its margin over the speculative token there, the tokens after it not
    compared; the two paths' logits on the rows of one prefix (not the first, the prefill's):
    their lowest cosine and largest difference, and a request whose logits disagree (a fault,
    not rounding) failing the agreement."""
    from types import SimpleNamespace

    from monodecode.bench import spec_check

    def logits_of(tokens, gaps, runners_up):  # each row: its token at its gap over the runner-up, the rest lower
        rows = torch.full((len(tokens), 10), -4.0)
        for row, token, gap, runner_up in zip(rows, tokens, gaps, runners_up):
            row[runner_up], row[token] = 0.0, gap
        return rows

    plain = [[5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4]]
    plain_logits = [logits_of(plain[0], [0.5, 0.25, 0.125, 2.0], [0, 0, 9, 0]),
                    logits_of(plain[1], [1.0, 0.75, 3.0, 0.5], [0, 0, 0, 0]),
                    logits_of(plain[2], [1.0, 0.75, 3.0, 0.5], [0, 0, 0, 0])]
    speculative = [[5, 6, 9, 9], [1, 2, 3, 4], [1, 2, 3, 4]]
    spec_logits = [rows[1:].clone() for rows in plain_logits]
    spec_logits[0][1, 9] += 0.25  # token 2: 9 over 7 by 0.125
    spec_logits[0][2] = torch.randn(10)  # after the parting: not compared
    spec_logits[2][0] = torch.randn(10)  # the same tokens from logits that are not the plain path's
    monkeypatch.setattr(spec_check, "plain_greedy", lambda decoder, prompt_ids, tokens: (plain, plain_logits))
    monkeypatch.setattr(spec_check, "speculative_greedy",
                        lambda decoder, prompt_ids, tokens, oracle, seed: (speculative, spec_logits, {"steps": 2}))
    decoder = SimpleNamespace(config=SimpleNamespace(vocab_size=10))
    report = spec_check.check(decoder, 3, 4, seed=0, drafts=("draft",))["draft"]
    assert not report["all_equal"] and not report["logits_agree"] and report["steps"] == 2
    parted, same, faulty = report["requests"]
    assert (parted["equal"], parted["first_difference"], parted["top2_gap_there"]) == (False, 2, 0.125)
    assert (parted["plain"], parted["speculative"]) == (plain[0], speculative[0])
    assert parted["margin_there"] == 0.125 and parted["smallest_top2_gap"] == 0.125  # up to the parting token
    want = torch.nn.functional.cosine_similarity(plain_logits[0][2].double(), spec_logits[0][1].double(), dim=0)
    assert parted["lowest_logit_cosine"] == pytest.approx(want.item()) and parted["largest_logit_difference"] == 0.25
    assert (same["equal"], same["first_difference"], same["smallest_top2_gap"]) == (True, None, 0.5)
    assert (same["margin_there"], same["largest_logit_difference"]) == (None, 0.0)
    assert same["lowest_logit_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert faulty["equal"] and faulty["lowest_logit_cosine"] < spec_check.AGREEMENT
