"""The mono path (K1 + K2 per layer) against the per-op path on the same model and inputs.

On the CPU the kernels run under Triton's interpreter with grid (1,); with
MONODECODE_TEST_DEVICE=cuda they run compiled, one program per SM. The model: tiny dims, three
layers, one of each kind, all `whole` (K1 + K2 + K3): window-only (hash-routed), CSA
(hash-routed; its indexer in K1) and HCA (ratio 16, bias-routed); bf16, as the kernels run. The
runner's build, launch shapes and errors on the same decoder: `test_mono_runner_build.py`.
"""

import pytest
import torch

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.model import Model
from monodecode.decode import Decoder

SLOTS, CONTEXT, STEP_ROWS = 8, 96, 8
# Where a top-k choice nearly ties, a last-bit difference in its input
# picks another element, and the row then legitimately differs. Two such choices differ between the
# paths here: the routed experts of the last layer (bias-routed; the earlier layers are hash-routed,
# the token picks) and the entries the CSA layer's indexer keeps (on inputs that differ in the
# last bits). The tests set aside the rows whose choice actually differs, and
# require each to have been a near-tie in the reference (a gap below these) and at most a quarter
# of the rows to flip: a wrong kernel would flip rows with wide gaps.
ROUTING_NEAR_TIE = 2e-2  # absolute gap of the biased router scores
# Gap between the k-th and (k+1)-th index scores over the row's largest |score| (in the greedy test,
# one row of step 27 keeps 8 of its 9 entries at a gap of 0.0065).
INDEX_NEAR_TIE = 5e-2
CSA, LAST = 1, 2  # the CSA layer; the last layer, the only bias-routed one

def tiny(**overrides):
    return preset("tiny", **{"num_hidden_layers": 3, "compress_ratios": (0, 4, 16), "dspark_target_layer_ids": (0, 1, 2),
                             **overrides})


@pytest.fixture(scope="module")
def decoder(device):
    d = Decoder(Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), device, torch.bfloat16), "on")
    assert d.mono is not None and d.mono.ratios == (0, 4, 16)
    d.mono.poison = True  # every width's scratch starts as NaN: an unwritten element would show
    return d


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(cosine, relative L2) of two tensors, as float64."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm())), float((a - b).norm() / b.norm())


def prefilled(decoder, lengths, seed):
    """Two caches holding the same prefills (per-op), one prompt a slot; the next positions."""
    g = torch.Generator().manual_seed(seed)
    caches = [decoder.make_cache(SLOTS, CONTEXT, STEP_ROWS) for _ in range(2)]
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, decoder.config.vocab_size, (n,), generator=g)
        for cache in caches:
            decoder.model.step(cache, prompt, torch.arange(n), torch.full((n,), slot))
    return caches, list(lengths)


def step_rows(g, vocab, next_pos, groups, pads):
    """A step: per (slot, rows) group that many consecutive positions, then `pads` pad rows."""
    tokens, positions, slots = [], [], []
    for slot, n in groups:
        tokens += torch.randint(0, vocab, (n,), generator=g).tolist()
        positions += list(range(next_pos[slot], next_pos[slot] + n))
        slots += [slot] * n
    tokens += [0] * pads
    positions += [0] * pads
    slots += [-1] * pads
    return tokens, positions, slots


class Choices:
    """The top-k choices of each step that may flip (ROUTING_NEAR_TIE above): the last layer's
    picks (per-op steps through its `MoE.route`, with the gap between the k-th and (k+1)-th
    biased scores; mono steps from the kernels' scratch: the picks of the step's last K2 launch,
    which is the last layer's) and the CSA indexer's kept entries per row (per-op steps through
    `Attention._compressed_keys`, with their gap; mono steps from the selection list that K1 of
    the only CSA layer leaves in the scratch). The mono steps run eagerly while recording (the runner's graphs
    are off): Python hooks see nothing inside a replayed graph, and a capture cannot copy to the
    host; that replays equal eager runs is tested on its own
    (test_cuda_graphs_of_alternating_widths_replay_the_eager_results).
    """

    def __init__(self, decoder):
        self.decoder, self.moe, self.attention = decoder, decoder.model.blocks[LAST].moe, decoder.model.blocks[CSA].attention
        assert LAST == len(decoder.model.blocks) - 1 and self.moe.bias is not None and self.attention.indexer is not None
        assert all(b.moe.tid2eid is not None for b in decoder.model.blocks[:LAST])  # earlier layers: the token picks
        self.routed, self.index = None, {}
        self.graphs_were_enabled = decoder.mono.graphs_enabled

    def __enter__(self):
        self.decoder.mono.graphs_enabled = False
        moe, attention = self.moe, self.attention
        route, compressed_keys = moe.route, attention._compressed_keys

        def recording_route(x, tokens):
            ids, weights = route(x, tokens)
            self.routed = (ids.sort(dim=-1).values.cpu(), moe.margin(x).cpu())
            return ids, weights

        indexer = attention.indexer

        def record(rows, q, weights, keys, positions, kept):
            """kept [n, E] bool: the entries each of `rows` attends."""
            scores = indexer.scores(q, weights, keys, positions)
            k, gaps = indexer.topk, torch.full((len(positions),), float("inf"))
            if keys.shape[-2] > k:  # else every visible entry is kept
                best = scores.topk(k + 1, dim=-1).values
                scale = scores.masked_fill(scores == float("-inf"), 0).abs().amax(dim=-1)
                visible = (scores > float("-inf")).sum(dim=-1)
                gaps = torch.where(visible > k, (best[:, k - 1] - best[:, k]) / scale, float("inf"))
            for row, entries, gap in zip(rows, kept.cpu(), gaps.cpu()):
                self.index[row] = (tuple(entries.nonzero().flatten().tolist()), float(gap))

        def recording_keys(g, side, cache):  # the per-op path: a request's rows at a time
            entries, mask = compressed_keys(g, side, cache)
            count = mask.shape[1]
            if count:
                record(g.index.tolist(), side["index_q"], side["index_w"], cache.index_entries[g.slot, :count],
                       g.positions, mask)
            return entries, mask

        moe.route, attention._compressed_keys = recording_route, recording_keys
        return self

    def __exit__(self, *exc):
        self.decoder.mono.graphs_enabled = self.graphs_were_enabled
        self.moe.__dict__.pop("route", None)
        self.attention.__dict__.pop("_compressed_keys", None)

    def take(self, rows: int) -> dict:
        """The choices of the step that just ran: picks [N, k] sorted, their gaps [N] (None on a
        mono step), and {row: (kept entries, gap)} of the indexer."""
        if self.routed is None:  # a mono step: MoE.route did not run
            picks, gaps = self.decoder.mono.scratch[rows].ids.sort(dim=-1).values.cpu(), None
            selected = self.decoder.mono.scratch[rows].selected.cpu()
            self.index = {r: (tuple(sorted(e for e in ids if e >= 0)), None) for r, ids in enumerate(selected.tolist())}
        else:
            (picks, gaps), self.routed = self.routed, None
        index, self.index = self.index, {}
        return {"picks": picks, "route_gaps": gaps, "index": index}


def flips(out: dict, ref: dict, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index flips, routing flips): live rows whose indexer entries / last-layer picks differ from
    the reference's. Each must have been a near-tie there (`assert_few_flips` bounds their count)."""
    rows = range(len(live))
    kept = lambda choices, r: choices["index"].get(r, ((),))[0]  # noqa: E731  (no entry visible yet: none)
    index = torch.tensor([kept(out, r) != kept(ref, r) for r in rows]) & live
    routing = (out["picks"] != ref["picks"]).any(dim=-1) & live
    index_gaps = torch.tensor([ref["index"].get(r, (None, float("inf")))[1] for r in rows])
    assert (index_gaps[index] < INDEX_NEAR_TIE).all(), ("an index flip at a wide gap", index_gaps[index])
    assert (ref["route_gaps"][routing] < ROUTING_NEAR_TIE).all(), ("a routing flip at a wide gap",
                                                                   ref["route_gaps"][routing])
    return index, routing


def assert_few_flips(flipped: torch.Tensor, live: torch.Tensor):
    """At most a quarter of the live rows flip, over a step or over a whole decode (a two-row step
    with one near-tie flip is half its rows, and still bf16 noise)."""
    assert flipped.sum() <= 0.25 * live.sum(), ("too many flips", int(flipped.sum()), int(live.sum()))


def assert_rows_agree(out, ref, rows: torch.Tensor, what):
    """Cosine >= 0.9999 and relative L2 <= 1 % over `rows`, and 3 % relative L2 for each row."""
    cos, rel = agreement(out[rows], ref[rows])
    assert cos >= 0.9999 and rel <= 1e-2, (what, cos, rel)
    row_rel = (out[rows].double() - ref[rows].double()).norm(dim=-1) / ref[rows].double().norm(dim=-1)
    assert (row_rel <= 3e-2).all(), (what, row_rel.max())


STEPS = {  # width: (groups of (slot, rows), pad rows)
    1: ([(0, 1)], 0),
    5: ([(1, 4)], 1),
    6: ([(s, 1) for s in range(6)], 0),
    48: ([(s, 5) for s in range(8)], 8),
}


@pytest.mark.parametrize("width", sorted(STEPS))
def test_a_step_matches_the_per_op_path(decoder, width):
    # Seeds whose rows hold no near-tie choice at 1 row (seen: seed 1 ties on the tiny preset of
    # hidden 128): a step whose only row flips leaves no row to compare.
    seed = width + 100
    g = torch.Generator().manual_seed(seed)
    # slots 1 and 6 far enough on that the CSA layer's indexer keeps 8 of 17-21 visible entries
    (ref_cache, mono_cache), next_pos = prefilled(decoder, [3, 70, 9, 30, 1, 12, 81, 5], seed=seed)
    groups, pads = STEPS[width]
    tokens, positions, slots = step_rows(g, decoder.config.vocab_size, next_pos, groups, pads)
    assert len(tokens) == width
    compare_step(decoder, ref_cache, mono_cache, tokens, positions, slots)


def compare_step(decoder, ref_cache, mono_cache, tokens, positions, slots) -> dict:
    """One step on each path (per-op on ref_cache, the kernels on mono_cache, equal before it) and
    everything that must agree after it: few flips and each a near-tie, each layer's residual and
    the logits over the rows no flip reaches, the rings and compressed caches. Returns the per-op
    step's choices."""
    with Choices(decoder) as choices:
        ref, ref_hidden = decoder.model.step(ref_cache, tokens, positions, slots, return_hidden=True)
        ref_choices = choices.take(len(slots))
        out, hidden = decoder.step(mono_cache, tokens, positions, slots, return_hidden=True)
        out_choices = choices.take(len(slots))
    assert decoder.last_path == "mono"
    live = torch.tensor(slots) >= 0
    index_flips, routing_flips = flips(out_choices, ref_choices, live)
    assert_few_flips(index_flips | routing_flips, live)
    d = decoder.config.hidden_size
    for layer in range(3):  # each layer's residual (mean over the hc streams): window, CSA, HCA
        cols = slice(layer * d, (layer + 1) * d)
        rows = live & ~(index_flips & (layer >= CSA)) & ~(routing_flips & (layer >= LAST))
        assert_rows_agree(hidden[:, cols].cpu(), ref_hidden[:, cols].cpu(), rows, f"layer {layer}")
    assert_rows_agree(out.cpu(), ref.cpu(), live & ~index_flips & ~routing_flips, "logits")
    for layer, (a, b) in enumerate(zip(mono_cache.layers, ref_cache.layers)):
        assert torch.equal(a.window.pos, b.window.pos), f"layer {layer}: ring positions differ"
        cos, rel = agreement(a.window.data["kv"].float().cpu(), b.window.data["kv"].float().cpu())
        assert cos >= 0.9999 and rel <= 1e-2, (layer, cos, rel)
        assert_compressed_caches_agree(a, b, layer)
    return ref_choices


def assert_compressed_caches_agree(a, b, layer):
    """A compressed layer's source rings (positions equal, projections close) and entries (close;
    an entry one path emitted and the other did not would be a zero row against a full one): its
    compressor's and, on a CSA layer, its indexer's."""
    for ring, entries in (("source", "entries"), ("index_source", "index_entries")):
        if getattr(b, ring) is None:
            continue
        source_a, source_b = getattr(a, ring), getattr(b, ring)
        assert torch.equal(source_a.pos, source_b.pos), f"layer {layer}: {ring} ring positions differ"
        for part in ("kv", "gate"):
            cos, rel = agreement(source_a.data[part].float().cpu(), source_b.data[part].float().cpu())
            assert cos >= 0.9999 and rel <= 1e-2, (layer, ring, part, cos, rel)
        entries_a, entries_b = getattr(a, entries).float().cpu(), getattr(b, entries).float().cpu()
        emitted = entries_b.abs().sum(-1) > 0
        assert torch.equal(entries_a.abs().sum(-1) > 0, emitted), f"layer {layer}: {entries} emitted differ"
        cos, rel = agreement(entries_a, entries_b)
        assert cos >= 0.9999 and rel <= 1e-2, (layer, entries, cos, rel)


def greedy(decoder, step, cache, prompts, steps, forced=None):
    """Greedy decoding of one request a slot, one row a request a step: (tokens, logits, Choices)
    per step. With `forced` (another run's tokens), those are fed instead of its own."""
    for slot, prompt in enumerate(prompts):
        decoder.model.step(cache, prompt, list(range(len(prompt))), [slot] * len(prompt))
    last = [p[-1] for p in prompts]
    pos = [len(p) - 1 for p in prompts]
    tokens, logits, taken = [], [], []
    with Choices(decoder) as choices:
        for i in range(steps):
            out = step(cache, last, pos, list(range(len(prompts))))
            taken.append(choices.take(len(prompts)))
            tokens.append(out.argmax(dim=-1).tolist())
            logits.append(out.float().cpu())
            last = forced[i] if forced is not None else tokens[-1]
            pos = [p + 1 for p in pos]
    return tokens, logits, taken


@pytest.mark.parametrize("steps", [pytest.param(32, marks=pytest.mark.slow), 8], ids=lambda n: f"{n}_steps")
def test_greedy_decoding_matches(decoder, steps):
    """Both paths are fed the per-op path's greedy tokens, so that one flip cannot derail the rest;
    their greedy picks agree at every step whose top-2 margin the logit differences cannot bridge.
    (Free-running, the seed below agrees for 26 steps, then a margin of 3e-4 flips: bf16 noise,
    since the per-op path in bf16 and in fp32 differ by as much as mono and per-op do, ~0.6 %
    relative L2. On the H200, step 27's CSA indexer keeps another entry for row 1 on each path, a
    gap of 0.4-0.6 % of its score range: a near-tie flip, set aside by `flips`.) 32 steps are
    `slow` (about 7 s a mono step under the interpreter); the first 8 of them run by default."""
    g = torch.Generator().manual_seed(32)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 11)]
    ref = greedy(decoder, decoder.model.step, decoder.make_cache(2, CONTEXT, STEP_ROWS), prompts, steps)
    out = greedy(decoder, decoder.step, decoder.make_cache(2, CONTEXT, STEP_ROWS), prompts, steps, forced=ref[0])
    assert_follows(out, ref)


def assert_follows(out, ref):
    """Per step, over the rows whose top-k choices did not flip (`flips`): logits close, and greedy
    picks equal wherever the reference's top-2 margin is more than twice the row's largest logit
    difference (a flip needs the gap bridged)."""
    (tokens, logits, choices), (ref_tokens, ref_logits, ref_choices) = out, ref
    live = torch.ones(len(tokens[0]), dtype=torch.bool)
    flipped = torch.stack([torch.stack(flips(a, b, live)).any(dim=0) for a, b in zip(choices, ref_choices)])
    assert_few_flips(flipped, live.expand_as(flipped))
    ref, out = torch.stack(ref_logits), torch.stack(logits)
    top2 = ref.topk(2, dim=-1).values
    decided = ((top2[..., 0] - top2[..., 1]) > 2 * (out - ref).abs().amax(dim=-1)) & ~flipped
    assert decided.float().mean() > 0.6  # the check is not vacuous
    assert torch.equal(torch.tensor(tokens)[decided], torch.tensor(ref_tokens)[decided])
    for step in range(len(logits)):
        assert_rows_agree(out[step], ref[step], ~flipped[step], f"step {step}")


@pytest.mark.parametrize("steps", [pytest.param(12, marks=pytest.mark.slow), 4], ids=lambda n: f"{n}_steps")
def test_paths_interleave_step_by_step_on_the_same_cache(decoder, steps):
    """Mono and per-op steps alternate on one cache (each reads what the other wrote): the greedy
    run follows the per-op one. 12 steps are `slow`; the first 4 run by default."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 9, 6)]
    ref = greedy(decoder, decoder.model.step, decoder.make_cache(3, CONTEXT, STEP_ROWS), prompts, steps)
    paths = iter([decoder.step, decoder.model.step] * (steps // 2))
    out = greedy(decoder, lambda *a: next(paths)(*a), decoder.make_cache(3, CONTEXT, STEP_ROWS), prompts, steps,
                 forced=ref[0])
    assert_follows(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("ratios", [(0, 0, 0), (0, 4, 16)])
def test_cuda_graphs_of_alternating_widths_replay_the_eager_results(device, ratios):
    """Window layers only, or one of each kind (a CSA layer's indexer in K1): each width's step is
    captured once and replayed; replays equal eager runs."""
    m = Decoder(Model.from_checkpoint(SyntheticCheckpoint(tiny(compress_ratios=ratios), seed=9), device,
                                      torch.bfloat16), "on")
    assert m.mono.graphs_enabled
    g = torch.Generator().manual_seed(11)
    (graph_cache, eager_cache), next_pos = prefilled(m, [3, 17, 9, 30, 1, 12, 20, 5], seed=11)
    for width in [1, 6, 48, 6, 1, 48, 5]:
        tokens, positions, slots = step_rows(g, m.config.vocab_size, next_pos, *STEPS[width])
        out = m.step(graph_cache, tokens, positions, slots)
        m.mono.graphs_enabled = False
        ref = m.step(eager_cache, tokens, positions, slots)
        m.mono.graphs_enabled = True
        assert torch.equal(out, ref), width
    assert len(m.mono.graphs) == 4
