"""The mono runner's build, launch shapes and errors, on the tiny three-layer decoder and the step
helpers of `test_mono_runner.py` (which holds the agreement tests): the steps and weights it
refuses and why, the memory it reports, the stacks it shares with the per-op path, other launch
shapes giving the same step, expired waits naming their stage, the residency check, the
timeline's stamps and the GPU check's reports.
"""

import logging
from typing import NamedTuple

import pytest
import torch

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.decode import Decoder
from monodecode.model import Model
from monodecode.mono import MonoRefused, build
from monodecode.mono.shape import LaunchShape
from monodecode.mono.weights import projection_names

from test_mono_runner import (CONTEXT, ROUTING_NEAR_TIE, STEP_ROWS, STEPS, agreement, decoder,  # noqa: F401
                              prefilled, step_rows, tiny)


def test_steps_the_kernels_do_not_take_run_per_op_and_are_counted(decoder):
    cache = decoder.make_cache(1, CONTEXT, STEP_ROWS)
    before = sum(decoder.fallbacks.values())
    decoder.step(cache, list(range(20)), list(range(20)), [0] * 20)  # a prefill: 20 rows of one request
    assert decoder.last_path == "per-op"
    assert sum(decoder.fallbacks.values()) == before + 1
    with pytest.raises(ValueError, match="do not take this step: a request with more rows"):
        decoder.mono.step(cache, list(range(20)), list(range(20)), [0] * 20)  # asked directly, it refuses


def test_memory_beyond_the_per_op_path_is_reported(decoder):
    c = decoder.config
    fp8 = decoder.mono.memory()["fp8_weights"]
    dense_fp8 = sum(s.nbytes() for s in decoder.model.checkpoint.specs if s.fmt == "fp8" and s.name.startswith("layers.0.attn."))
    assert fp8 >= dense_fp8 > 0  # layer 0's attention (whole) and every layer's shared expert
    scratch = decoder.mono._scratch(3)  # built now if no step of 3 rows ran yet
    assert decoder.mono.memory()["scratch"] >= scratch.nbytes() >= 2 * 3 * c.hc_mult * c.hidden_size * 2  # streams


def test_weights_are_checked_at_build(decoder):
    from monodecode.mono.weights import WeightCheckError, check_layer, projection_rows, stack_projections

    lw = decoder.mono.layers[0]
    good = lw.wq_b
    lw.wq_b = good._replace(codes=good.codes.t())  # the right bytes, the wrong layout
    try:
        with pytest.raises(WeightCheckError, match=r"layers.0.attn.wq_b.weight: shape .* not contiguous"):
            check_layer(decoder.mono.sizes, "layers.0.", lw)
    finally:
        lw.wq_b = good
    check_layer(decoder.mono.sizes, "layers.0.", lw)
    # a compressed layer's projections are checked one by one before they are stacked (nothing changed)
    c = decoder.config
    w = {f"layers.1.attn.{n}": torch.zeros(r, c.hidden_size, dtype=torch.bfloat16)
         for n, r in zip(projection_names(4), projection_rows(c, 4))}
    w["layers.1.attn.compressor.wgate"] = torch.zeros(projection_rows(c, 4)[1], c.hidden_size + 8,
                                                      dtype=torch.bfloat16)
    kept = dict(w)
    with pytest.raises(WeightCheckError, match=r"layers.1.attn.compressor.wgate: shape"):
        stack_projections(w, c, None, "layers.1.", 4)
    assert all(w[n] is t for n, t in kept.items())


def test_a_cache_the_kernels_cannot_use_is_refused(decoder):
    from monodecode.mono.weights import WeightCheckError

    cache = decoder.make_cache(2, CONTEXT, STEP_ROWS)
    cache.layers[0].window.data["kv"] = cache.layers[0].window.data["kv"].float()
    with pytest.raises(WeightCheckError, match="cache layer 0 window kv: dtype torch.float32, expected torch.bfloat16"):
        decoder.step(cache, [1], [0], [0])


def test_refused_configurations_say_why(device, caplog):
    fp32 = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=1), device, torch.float32)
    with caplog.at_level(logging.WARNING, logger="monodecode.mono"):
        assert build(fp32, "auto") is None
    assert "mono auto: runs per-op: the kernels keep activations and caches in bfloat16" in caplog.text
    with pytest.raises(MonoRefused, match="bfloat16; the model is torch.float32"):
        build(fp32, "on")
    assert build(fp32, "off") is None
    with pytest.raises(ValueError, match="mono must be one of"):
        build(fp32, "sometimes")


@pytest.mark.parametrize("spec,width", [("block_n=16,block_k=512,expert_block_n=32,k1_programs_per_sm=2,k1_warps=4", 6),
                                        ("block_k=32,dense_chunk=32,dense_stages=2,expert_block_n=16,"
                                         "expert_programs_per_sm=1,expert_warps=4,settle_columns=64", 6),
                                        ("attend_splits=2", 1), ("select_block=16", 6),
                                        ("attend_heads=32,attend_chunk=128", 6),
                                        pytest.param("fold_rows=64", 48, marks=pytest.mark.slow)])
def test_another_launch_shape_gives_the_same_step(decoder, spec, width):
    """Tiles, K steps (64 = two scale blocks: weights scaled in registers; 32 within one), K1 at
    two programs a SM and K2 at one, K3 at one of 4 warps (on a GPU: grids of their own, tiles
    chosen for each), dense GEMVs split
    along K (slices of 32: 2 to 4 a block, summed by the last to arrive, in every layer of the
    step, so a ticket left behind would spoil the next) in a shallower pipeline, expert tiles of
    32 and 16 rows (`experts.load_fragments`' 16-row blocks), settle tiles of half a row (two
    passes over it), the compressed layers' attend entries split over two tasks a pair (the
    window's task combining them), attend tasks of 32 heads (the tiny model's 4 of them live; its
    head of 64 channels one chunk: no chunk of 128), the CSA layer's top-k over 16 scores at a time
    (four of its rows see 16-24 entries, top 8: one or two blocks a pass): the same result up to
    fp32 summation order; fold tasks of all 48 rows of a step (`slow`)."""
    g = torch.Generator().manual_seed(21)
    lengths = [70, 81, 9, 95, 1, 66, 20, 5] if spec.startswith("select_block") else [3, 17, 9, 30, 1, 12, 20, 5]
    caches, next_pos = prefilled(decoder, lengths, seed=21)
    tokens, positions, slots = step_rows(g, decoder.config.vocab_size, next_pos, *STEPS[width])
    default = decoder.mono.shape
    out = decoder.step(caches[0], tokens, positions, slots)
    try:
        decoder.mono.configure(LaunchShape.parse(spec))
        other = decoder.step(caches[1], tokens, positions, slots)
    finally:
        decoder.mono.configure(default)
    cos, rel = agreement(other, out)
    assert cos >= 0.99999 and rel <= 2e-3, (cos, rel)


def test_the_experts_are_stacked_once_and_the_per_op_path_reads_the_stack(device):
    """The runner stacks the experts in the fragment order once and hands the stack to the per-op
    path (`Model.replace_experts`: no second copy), which decodes the order back to the same
    weights; a second runner of the same model keeps that stack; a shape whose tiles that order
    cannot serve, without K3 programs or fold tasks of 24 rows, is refused with the reason,
    the old shape kept."""
    m = Model.from_checkpoint(SyntheticCheckpoint(tiny(num_hidden_layers=1, compress_ratios=(0,),
                                                       dspark_target_layer_ids=(0,)), seed=6), device, torch.bfloat16)
    checkpoint_order = [m.blocks[0].moe.experts.expert(e) for e in range(m.config.n_routed_experts)]
    d = Decoder(m, "on")
    experts = d.mono.layers[0].experts
    assert m.blocks[0].moe.experts.stack is experts
    assert all(torch.equal(a, b) for e, ref in enumerate(checkpoint_order)
               for a, b in zip(m.blocks[0].moe.experts.expert(e), ref))
    with pytest.raises(ValueError, match=r"fragment order needs expert K steps of a multiple of 128 "
                                         r"\(here \[64\]\)"):
        d.mono.configure(LaunchShape(expert_block_k=64))
    with pytest.raises(ValueError, match=r"fragment order needs expert tiles of a multiple of 16 rows "
                                         r"\(here \[8\]\)"):
        d.mono.configure(LaunchShape(expert_block_n=8))
    with pytest.raises(ValueError, match=r"K3 \(the routed experts\) needs at least one program a SM"):
        d.mono.configure(LaunchShape(expert_programs_per_sm=0))
    with pytest.raises(ValueError, match=r"fold and settle need fold rows a power of two from 16 to 64 \(here 24\)"):
        d.mono.configure(LaunchShape(fold_rows=24))
    with pytest.raises(ValueError, match=r"settle columns 0 or a power of two from 16 \(here 48\)"):
        d.mono.configure(LaunchShape(settle_columns=48))
    with pytest.raises(ValueError, match=r"attend_splits must be 0 \(automatic\) or a power of two up to 8"):
        d.mono.configure(LaunchShape(attend_splits=3))
    with pytest.raises(ValueError, match=r"attend_parts must be 0 \(automatic\) or a power of two up to head_dim / 64 = 1"):
        d.mono.configure(LaunchShape(attend_parts=2))  # the tiny model's heads: one chunk of 64
    for wrong in (dict(attend_heads=8), dict(attend_chunk=32)):
        with pytest.raises(ValueError, match=r"attend_heads must be 0 \(automatic\) or one of \(16, 32, 64\), "
                                             r"attend_chunk 0 or one of \(64, 128\)"):
            d.mono.configure(LaunchShape(**wrong))
    for block in (8, 48, 8192):
        with pytest.raises(ValueError, match=r"select_block must be 0 \(automatic\) or a power of two from 16 to 4096"):
            d.mono.configure(LaunchShape(select_block=block))
    assert d.mono.shape == LaunchShape()
    again = Decoder(m, "on")
    assert again.mono.layers[0].experts is experts


def test_a_compressed_layers_projections_are_stacked_once_and_the_per_op_path_reads_the_stack(device):
    """K1 runs a compressed layer's bf16 projections of x (its compressor's wkv and wgate; on a CSA
    layer then its indexer compressor's and weights_proj) as one GEMV over their rows stacked in
    that order; the per-op path (its weights by name and the layer's modules) reads those weights
    as views of the same stack from then on, the same values, held once."""
    m = Model.from_checkpoint(SyntheticCheckpoint(tiny(num_hidden_layers=2, compress_ratios=(4, 16),
                                                       dspark_target_layer_ids=(1,)), seed=7), device, torch.bfloat16)

    def per_op_parts(i):
        attn = m.blocks[i].attention
        parts = [attn.compressor.wkv, attn.compressor.wgate]
        if attn.indexer:
            parts += [attn.indexer.compressor.wkv, attn.indexer.compressor.wgate, attn.indexer.weights_proj]
        return parts + [m.w[f"layers.{i}.attn.{name}"] for name in projection_names(m.config.compress_ratios[i])]

    before = [[p.clone() for p in per_op_parts(i)] for i in range(2)]
    d = Decoder(m, "on")
    for i, lw in enumerate(d.mono.layers):
        parts = per_op_parts(i)
        assert all(torch.equal(p, q) for p, q in zip(parts, before[i])), i
        half = len(parts) // 2  # the modules' tensors, then the same by name
        assert torch.equal(torch.cat(parts[:half]), lw.projections), i
        assert all(p.untyped_storage().data_ptr() == lw.projections.untyped_storage().data_ptr() for p in parts), i


def test_an_expired_wait_in_the_csa_layers_k1_names_its_stage(decoder):
    """The CSA layer's K1 is a sync family of its own (seven stages more): an expired wait at its
    barrier 5 (recorded by the kernel as 6) names the index scores, the stage it waited on, and
    one at barrier 10 the top-k's counts."""
    from monodecode.mono.sync import ERROR, MonoSyncError

    for recorded, stage in ((6, "k1 index scores"), (11, "k1 top-k counts")):
        decoder.mono.sync["k1c"].words[ERROR] = recorded
        with pytest.raises(MonoSyncError, match=stage):
            decoder.mono.check()
        assert int(decoder.mono.sync["k1c"].words[ERROR]) == 0  # the counters start over


def test_an_expired_wait_for_attend_splits_raises_and_the_next_step_runs(decoder):
    """K2's window tasks wait at their pair's ticket for the entry splits: with the tickets far
    below zero (signals that can never add up) a step raises naming K2's attend, the tickets end
    where they began (each window task takes back what its splits gave), and at 0 again the next
    step runs."""
    from monodecode.mono.sync import MonoSyncError

    runner, default = decoder.mono, decoder.mono.shape
    g = torch.Generator().manual_seed(31)
    caches, next_pos = prefilled(decoder, [3, 17, 9, 30, 1, 12, 20, 5], seed=31)
    tokens, positions, slots = step_rows(g, decoder.config.vocab_size, next_pos, *STEPS[1])
    saved = runner.max_polls, runner.graphs_enabled
    try:
        runner.configure(LaunchShape(attend_splits=2))
        runner.max_polls, runner.graphs_enabled = 64, False
        decoder.step(caches[0], tokens, positions, slots)  # makes the width's scratch
        tickets = runner.scratch[1].attend_tickets
        assert (tickets == 0).all()
        tickets.fill_(-1000)
        with pytest.raises(MonoSyncError, match="'k2 attend'"):
            decoder.step(caches[0], tokens, positions, slots)
        assert (tickets == -1000).all()
        tickets.zero_()
        assert torch.isfinite(decoder.step(caches[1], tokens, positions, slots)).all()
        assert (tickets == 0).all()
    finally:
        runner.max_polls, runner.graphs_enabled = saved
        runner.configure(default)


def test_an_expired_wait_in_each_k1_family_raises_and_the_next_step_runs(decoder):
    """The GPU check's error path (also run here: under the interpreter a wait for arrivals that
    never come expires too): K1's family and the CSA layer's `k1c` each raise naming the stage,
    and the runner runs the next step."""
    from monodecode.bench import mono_check as check

    reports = check.check_error_path(decoder, check.prefilled_cache(decoder))
    assert set(reports) == {"k1", "k1c"}
    for report in reports.values():
        assert "gave up waiting in stage 'k1 fold'" in report["raised"] and report["recovered_finite"], report


def test_the_residency_check_launches_every_kernel_at_the_widest_build(decoder):
    """On a GPU it runs at build (and at configure); here it is called to run its code."""
    epochs = {name: state.epoch for name, state in decoder.mono.sync.items()}
    held = decoder.mono._scratch(48)  # a step a caller prepared (`bench layer` configures after it)
    held.positions.copy_(torch.arange(100, 148))
    rows = held.rows_in.clone()
    decoder.mono.check_residency()
    advanced = {name: state.epoch - epochs[name] for name, state in decoder.mono.sync.items()}
    assert advanced == {"k1": 2, "k1c": 1, "k2": 3, "k3": 3}  # k1c: the CSA layer's K1
    assert torch.equal(held.rows_in, rows)  # the check ran on a scratch of its own


@pytest.mark.gpu
def test_a_launch_shape_that_cannot_be_resident_is_refused_and_the_old_one_kept(decoder):
    before = decoder.mono.shape
    with pytest.raises(MonoRefused, match="cannot all be resident"):
        decoder.mono.configure(LaunchShape(k2_programs_per_sm=8, k1_warps=8, k2_warps=8))
    assert decoder.mono.shape == before
    cache = decoder.make_cache(1, CONTEXT, STEP_ROWS)
    decoder.model.step(cache, [1, 2, 3], [0, 1, 2], [0, 0, 0])
    decoder.step(cache, [4], [3], [0])
    assert decoder.last_path == "mono"


def test_a_kernel_too_large_for_a_sm_is_refused(decoder, monkeypatch):
    """A build that needs more shared memory than a SM has (Triton's OutOfResources, raised before
    anything runs) is a refusal naming the kernel and the shape, as an over-large grid is: so
    `configure` keeps the old shape and `bench layer --shapes` goes on to the next shape."""
    from triton.runtime.errors import OutOfResources

    from monodecode.mono import runner as runner_module

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(278528, 232448, "shared memory")
            return launch

    class Meta(NamedTuple):
        BR: int

    monkeypatch.setattr(runner_module, "interpreted", lambda: False)
    meta = Meta(16)
    with pytest.raises(MonoRefused, match=r"K2 \(default: \d+ warps\) does not fit a SM: .*shared memory"):
        decoder.mono.launch(TooLarge(), "K2", "k2", meta=meta)


def test_stage_times_from_stamps():
    """Two programs, three stages (two barriers): slots start, (arrive, release) x 2, end."""
    from monodecode.mono.timeline import format_times, stage_times

    stamps = torch.zeros(2, 32, dtype=torch.int64)
    stamps[0, :6] = torch.tensor([0, 4_000, 9_000, 10_000, 12_000, 20_000])
    stamps[1, :6] = torch.tensor([1_000, 8_000, 9_500, 11_000, 12_500, 15_000])
    times = stage_times(stamps, ["a", "b", "c"])
    assert [t["stage"] for t in times] == ["a", "b", "c"]
    assert [t["us"] for t in times] == [8.0, 2.0, 8.0]  # last arrival - first start, per stage
    assert [t["barrier_us"] for t in times] == [1.5, 1.5, 0.0]  # last release - last arrival
    assert [t["median_program_us"] for t in times] == [4.0, 1.0, 2.5]  # the lower of the two own times
    assert [t["last_program"] for t in times] == [1, 1, 0]
    assert "total" in format_times(times) and "last: program 0" in format_times(times)


def test_launch_gaps_from_stamps():
    """Two launches of one step: the first of three stages (end in slot 5), the second of two
    (end in slot 3); the gap runs from the first's last end to the second's first start."""
    from monodecode.mono.timeline import launch_gaps, launch_span

    first = torch.zeros(2, 32, dtype=torch.int64)
    first[:, 0], first[:, 5] = torch.tensor([100, 50]), torch.tensor([900, 1_000])
    second = torch.zeros(2, 32, dtype=torch.int64)
    second[:, 0], second[:, 3] = torch.tensor([4_000, 3_000]), torch.tensor([9_000, 8_000])
    spans = [("k1", launch_span(first, 3)), ("k2", launch_span(second, 2))]
    assert spans == [("k1", (50, 1_000)), ("k2", (3_000, 9_000))]
    assert launch_gaps(spans) == {"gaps_us": {"k2": 2.0}, "span_us": 8.95}


def test_the_gpu_check_reports_agreement_and_routing_flips(decoder):
    """monodecode.bench.mono_check's agreement (run on the H200 at v4-flash sizes) on the tiny decoder: its
    numbers hold here too, and a row whose last-layer picks differ is found, with its margin
    (`routing_flips` alone: tests/test_bench_layer.py)."""
    from monodecode.bench import mono_check as check

    reports = check.check_agreement(decoder, check.prefilled_cache(decoder), widths=(16, 6))
    report = reports[6]
    assert report["greedy_equal"] == 1.0 and max(report["worst_row_rel_l2"]) <= 3e-2
    assert report["last_layer_routing_flips"]["rows"] == 0
    flips = reports[16]["last_layer_routing_flips"]  # seen: one near-tie row (margin 3e-4), left out
    assert all(margin < ROUTING_NEAR_TIE for margin in flips["margins"]) and flips["rows"] <= 4
    for report in reports.values():
        assert all(layer["cos"] >= 0.9999 for layer in report["layers"]) and report["ring_positions_equal"]
        compressors = [*report["compressed"].values(), report["compressed"][1]["index"]]  # CSA's indexer too
        for layer in compressors:  # the CSA layer, the HCA one, the CSA layer's indexer
            assert layer["source_positions_equal"] and layer["entries_emitted_equal"]
            assert min(layer[k]["cos"] for k in ("source_kv", "source_gate", "entries")) >= 0.9999
    assert sorted(reports[16]["compressed"]) == [1, 2]
    for report in reports.values():  # the CSA layer's selection against the per-op path's
        selection = report["index_selection"]
        assert selection["entries_compared"] > 0 and selection["rows_differing"] <= 1, selection
    emitted = {width: reports[width]["compressed"][2]["entries_emitted"] for width in (6, 16)}
    assert emitted[16] == emitted[6] + 1  # slot 3's rows at 126, 127 complete an HCA entry (ratio 16)


def test_the_gpu_check_gives_the_top_two_gap_of_a_row_whose_greedy_token_differs():
    from monodecode.bench.mono_check import greedy_agreement

    ref = torch.randn(4, 50)
    ref[2, 7], ref[2, 9] = 10.0, 9.75  # row 2: a near-tie between tokens 7 and 9
    mono = ref + 1e-3 * torch.randn(4, 50)
    mono[2, 9] = 10.5  # the kernels' path picks the runner-up
    report = greedy_agreement(mono, ref)
    assert report["greedy_equal"] == 0.75
    assert report["greedy_differs_top2_gaps"] == [pytest.approx(0.25)]
    assert greedy_agreement(ref, ref) == {"greedy_equal": 1.0, "greedy_differs_top2_gaps": []}
