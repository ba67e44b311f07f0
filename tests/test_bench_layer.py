"""`monodecode bench layer` end to end at tiny sizes (on the CPU the kernels are interpreted): the
code paths and the report, not the times."""

import gc
import json
import weakref

import pytest
import torch

from monodecode.bench import layer as bench_layer
from monodecode.cli import main
from monodecode.model import Model


@pytest.mark.parametrize("kinds", [pytest.param(["window", "CSA", "HCA"], marks=pytest.mark.slow), ["window", "CSA"]],
                         ids=["every_kind", "window_and_CSA"])
def test_bench_layer_reports_each_kind_and_width(device, tmp_path, capsys, monkeypatch, kinds):
    """Every kind is `slow`; by default a window and a CSA layer. Each layer's batched per-op layer
    (its experts dequantized: ~13 GB at v4-flash) is built once, the one before it let go first."""
    built = []

    class BuiltOnce(bench_layer.BatchedLayer):
        def __init__(self, block):
            gc.collect()
            assert all(ref() is None for ref in built), "an earlier layer's batched layer is still held"
            super().__init__(block)
            built.append(weakref.ref(self))

    monkeypatch.setattr(bench_layer, "BatchedLayer", BuiltOnce)
    assert main(["bench", "layer", "--preset", "tiny", "--device", device, "--widths", "1,3", "--kinds", ",".join(kinds),
                 "--context", "20", "--reps", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_layer.json").read_text())
    rows = report["layers"]
    assert report["complete"]  # False in the file while rows are still coming
    assert len(built) == len(kinds)  # once a layer, whatever its widths
    printed = capsys.readouterr().out
    assert "window layer, 3 rows, default: per-op graph" in printed  # each row shown as it comes
    assert [(r["kind"], r["width"]) for r in rows] == [(kind, width) for kind in kinds for width in (1, 3)]
    for r in rows:
        assert 1 <= r["distinct_experts"] <= 2 * r["width"]  # tiny: top-2 of 8
        assert r["floor_bytes"] > 0 and r["per_op_eager_s"] > 0 and r["mono_s"] > 0
        # K1 timed alone: a part of the layer (K2 and K3, the FFN, the larger part)
        assert 0 < r["mono_k1_s"] < r["mono_s"] and r["mono_k2_s"] > 0
        assert r["cosine"] > 0.9999  # mono's layer output against the per-op block's on the same step
        assert 0 <= r["worst_row"][0] < r["width"] and 0.999 < r["worst_row"][1] <= 1 + 1e-12  # the least-agreeing row
        flips = r["routing_flips"]  # tiny's top-2 of 8 experts: no near-tie in these steps
        assert flips["rows"] == 0 and flips["margins"] == [] and flips["median_margin"] > 0
        assert flips["cosine_all_rows"] == pytest.approx(r["cosine"])
        launches = r["kernels_launched"]
        if device == "cpu":
            assert launches == {"per_op_eager": None, "per_op_graph": None, "mono": None}
        else:
            assert launches["mono"] == 3  # K1 + K2 + K3
            assert launches["per_op_eager"] > launches["mono"] and launches["per_op_graph"] > launches["mono"]
        assert r["per_op_graph_s"] > 0  # the batched per-op layer, every kind
    wider = {r["kind"]: r["floor_bytes"] for r in rows if r["width"] == 3}
    narrow = {r["kind"]: r["floor_bytes"] for r in rows if r["width"] == 1}
    assert all(wider[k] > narrow[k] for k in wider)  # more rows read more KV (and experts)
    assert "of floor" in printed
    table_rows = [line.split() for line in printed.splitlines()
                  if line.startswith(("window ", "CSA ", "HCA ")) and " layer, " not in line]
    assert len(table_rows) == len(rows) and "cosine flips" in printed  # the agreement in the table too
    assert all(float(cells[-4]) > 0.9999 and cells[-3] == "0" for cells in table_rows)
    # the table and PNG again from the JSON alone (a GPU host may have no matplotlib), and of a cut run
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    saved.update(complete=False, layers=saved["layers"][:2])
    (tmp_path / "cut.json").write_text(json.dumps(saved))
    assert main(["bench", "layer", "--replot", str(tmp_path / "cut.json"), "--out", str(tmp_path / "replot")]) == 0
    replotted = capsys.readouterr().out
    assert "of floor" in replotted and "cut short" in replotted and "CSA" not in replotted.split("per-op us:")[0]
    assert (tmp_path / "replot" / "bench_layer.png").stat().st_size > 0
    assert (tmp_path / "bench_layer.png").stat().st_size > 0  # matplotlib is in the test extra


def test_bench_layer_times_each_launch_shape(device, tmp_path):
    assert main(["bench", "layer", "--preset", "tiny", "--device", device, "--widths", "2", "--kinds", "window",
                 "--shapes", "default;block_n=32,expert_block_n=32", "--context", "20", "--reps", "1",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_layer.json").read_text())["layers"]
    assert [(r["kind"], r["width"], r["shape"]) for r in rows] == [
        ("window", 2, "default"), ("window", 2, "block_n=32,expert_block_n=32")]
    assert rows[0]["per_op_eager_s"] == rows[1]["per_op_eager_s"]  # the per-op path is timed once
    assert all(r["mono_s"] > 0 and r["cosine"] > 0.9999 for r in rows)


def test_routing_flips_finds_the_rows_whose_picks_differ():
    """Rows of the kernels' picks (in any order a row) against the per-op path's (sorted): a row
    with another expert is flipped, a pad row never; under tensor parallelism the per-op ids are
    made local to the rank's experts first (another rank's pick: -1, as the kernels write it)."""
    from monodecode.bench.routing import routing_flips

    picks = torch.tensor([[1, 5], [0, 7], [2, 3], [4, 6]])
    margins = torch.tensor([0.5, 1e-4, 0.25, 2e-5])
    mono = torch.tensor([[5, 1], [0, 6], [3, 2], [4, 5]], dtype=torch.int32)
    live = torch.tensor([True, True, True, False])
    flipped, flips = routing_flips(mono, picks, margins, live)
    assert flipped.tolist() == [False, True, False, False]
    assert flips == {"rows": 1, "margins": [pytest.approx(1e-4)], "median_margin": pytest.approx(0.25)}
    # a rank holding experts 4 .. 7: rows 0 and 1 keep one pick each, row 2 none
    local = torch.tensor([[-1, 1], [-1, 3], [-1, -1], [-1, -1]], dtype=torch.int32)
    flipped, flips = routing_flips(local, picks, margins, live, held=range(4, 8))
    assert flipped.tolist() == [False, False, False, False] and flips["rows"] == 0
    flipped, _ = routing_flips(local, picks, margins, live, held=range(0, 4))  # as rank 0 sees them
    assert flipped.tolist() == [False, True, True, False]


def test_the_plot_takes_a_shape_timed_twice_and_widths_in_any_order(tmp_path):
    """`--shapes 'default;X;default'` (the default again: a control for run order) and `--widths
    6,1`: one mono line a place in --shapes, each over the widths in order."""
    from monodecode.bench.layer_report import mono_runs, write_plot

    shapes = ["default", "block_n=32", "default"]
    rows = [{"kind": "window", "width": width, "shape": shape, "shape_run": run, "floor_s": 1e-5 * width,
             "per_op_eager_s": 1e-3, "per_op_graph_s": 5e-4, "per_op_compiled_s": None, "mono_s": 1e-4 * (run + 1)}
            for width in (6, 1) for run, shape in enumerate(shapes)]
    assert mono_runs(rows) == {0: "default, #1", 1: "block_n=32", 2: "default, #3"}
    write_plot({"device": "cpu", "preset": "tiny", "layers": rows}, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_the_whole_model_projection_sums_each_kind_over_the_presets_layers():
    """v4-flash's 2 window, 21 CSA and 20 HCA layers from one timed layer of each kind, at each
    width and shape where all three were timed (not at a width that lacks one)."""
    from monodecode.bench.layer_report import whole_model

    times = {"window": 1e-4, "CSA": 2e-4, "HCA": 3e-4}
    rows = [{"kind": kind, "width": width, "shape": "default", "shape_run": 0, "floor_s": t / 4,
             "per_op_graph_s": 10 * t, "mono_s": t} for kind, t in times.items() for width in (1, 6)
            if (kind, width) != ("HCA", 6)]
    lines = whole_model({"preset": "v4-flash", "layers": rows})
    mono = 2 * 1e-4 + 21 * 2e-4 + 20 * 3e-4
    assert lines == [f"whole model (2 window, 21 CSA, 20 HCA layers; no head, no draft), 1 rows, default: mono "
                     f"{mono * 1e3:.2f} ms, 25.0% of its floor {mono / 4 * 1e3:.2f} ms; per-op graph "
                     f"{10 * mono * 1e3:.2f} ms"]
    over_ranks = [{**r, "per_op_graph_s": None} for r in rows]  # no per-op graph under tensor parallelism
    assert whole_model({"preset": "v4-flash", "layers": over_ranks})[0].endswith("; per-op graph - ms")


def test_the_identity_owed_output_leaves_the_residual_as_it_is(device):
    """What mono's layer folds first in `bench layer`: the per-op hc_post and the kernels' fold
    both return the streams bit for bit (so the layer routes as the per-op block does)."""
    from monodecode.bench.layer import identity_owed
    from monodecode.model.hc import hc_post
    from monodecode.mono import hc as HC

    rows, hc, d = 5, 4, 96
    g = torch.Generator().manual_seed(3)
    streams = (4 * torch.randn(rows, hc, d, generator=g)).to(torch.bfloat16).to(device)
    y, post, comb = identity_owed(rows, hc, d, device)
    assert torch.equal(hc_post(y, streams, post, comb), streams)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g).to(device)
    folded, _ = HC.fold(streams, fn, (y, post, comb), chunk=32, poison=True)
    assert torch.equal(folded, streams)


def test_launch_shapes_parse_and_name_bad_fields():
    from monodecode.mono.shape import LaunchShape

    shape = LaunchShape.parse("k2_warps=4, expert_block_n=64,block_k=256")
    assert (shape.k2_warps, shape.expert_block_n, shape.block_k) == (4, 64, 256)
    assert LaunchShape.parse(shape.spec()) == shape and LaunchShape.parse("default") == LaunchShape()
    with pytest.raises(ValueError, match="warps=8"):
        LaunchShape.parse("warps=8")
    with pytest.raises(ValueError, match="k2_warps must be a whole number"):
        LaunchShape.parse("k2_warps=eight")
    # K3's register cap: its programs a SM fit 64 K registers, in steps of 8, at most 255
    assert LaunchShape().expert_registers() == 128  # 2 programs of 8 warps
    assert LaunchShape(expert_warps=4, expert_programs_per_sm=3).expert_registers() == 168
    assert LaunchShape(expert_warps=4, expert_programs_per_sm=1).expert_registers() == 255


@pytest.mark.parametrize("ratio", [0, 4, 16])
def test_batched_layer_matches_the_per_op_block(device, ratio):
    """The graph-capturable per-op baseline against model.layer.Block on the same rows and caches,
    over several steps (entries completed inside a step, by its last row, not at all; CSA's
    indexer choosing among more entries than its top-k)."""
    import copy

    import torch

    from monodecode.bench.batched import BatchedLayer
    from monodecode.checkpoint import SyntheticCheckpoint
    from monodecode.config import preset

    config = preset("tiny", num_hidden_layers=1, compress_ratios=(ratio,), dspark_target_layer_ids=(0,))
    model = Model.from_checkpoint(SyntheticCheckpoint(config, seed=4), device, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    cache = model.make_cache(4, 96, 8)
    lengths = [30, 3, 12, 1]
    for slot, n in enumerate(lengths):
        model.step(cache, torch.randint(0, 512, (n,), generator=g), torch.arange(n), torch.full((n,), slot))
    block, ref_cache, batched = model.blocks[0], copy.deepcopy(cache), BatchedLayer(model.blocks[0])
    for rows in ([5, 1, 2, 1], [3, 4, 1, 0], [1, 2, 5, 8]):
        slots = torch.tensor([s for s, n in enumerate(rows) for _ in range(n)], device=device)
        positions = torch.tensor([lengths[s] + i for s, n in enumerate(rows) for i in range(n)], device=device)
        lengths = [n + r for n, r in zip(lengths, rows)]
        tokens = torch.randint(0, 512, (len(slots),), generator=g).to(device)
        streams = torch.randn(len(slots), config.hc_mult, config.hidden_size, generator=g).to(torch.bfloat16).to(device)
        ref = block(streams, tokens, positions, model.group_rows(ref_cache, tokens, positions, slots),
                    ref_cache.layers[0])
        out = batched(streams, tokens, positions, slots, cache.layers[0])
        a, b = out.double().flatten().cpu(), ref.double().flatten().cpu()
        cos, rel = float(a @ b / (a.norm() * b.norm())), float((a - b).norm() / b.norm())
        assert cos >= 0.99999 and rel <= 5e-3, (rows, cos, rel)  # seen: bit-equal on the CPU
        for ours, theirs in zip(vars(cache.layers[0]).values(), vars(ref_cache.layers[0]).values()):
            if torch.is_tensor(theirs):  # the compressed entries
                assert torch.equal(ours, theirs), rows
            elif theirs is not None:  # a position ring
                assert torch.equal(ours.pos, theirs.pos), rows
                assert all(torch.equal(ours.data[k], theirs.data[k]) for k in theirs.data), rows


@pytest.mark.parametrize("kinds", [pytest.param(["window", "CSA", "HCA"], marks=pytest.mark.slow), ["window"]],
                         ids=["every_kind", "window"])
def test_bench_layer_times_the_compiled_per_op_layer(device, tmp_path, kinds):
    """Every kind is `slow` (a compile each); by default the window layer, the least code to compile."""
    assert main(["bench", "layer", "--preset", "tiny", "--device", device, "--widths", "2", "--context", "8",
                 "--reps", "1", "--compile", "default", "--kinds", ",".join(kinds), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_layer.json").read_text())["layers"]
    assert [r["kind"] for r in rows] == kinds
    assert all(r["per_op_compiled_s"] > 0 for r in rows)
    for launches in (r["kernels_launched"] for r in rows):  # inductor fuses: fewer than the per-op graph
        compiled = launches["per_op_compiled"]
        assert compiled is None if device == "cpu" else 0 < compiled < launches["per_op_graph"]


@pytest.mark.parametrize("layers,requests,steps,temperature", [pytest.param(2, (1, 2), 2, 0.0, marks=pytest.mark.slow),
                                                            (1, (1,), 1, 0.8)],
                         ids=["2_layers_1_and_2_requests_greedy", "1_layer_1_request_sampled"])
def test_bench_decode_times_every_path_at_each_request_count(device, tmp_path, capsys, layers, requests, steps,
                                                             temperature):
    """Two layers (window and CSA), two request counts of two timed greedy steps are `slow`; by
    default one window layer, one request at temperature 0.8 (top-p 0.9), one timed step (after
    the two warm-up steps). The per-op and mono stepwise steps split into draft, verify and the
    rest, the whole mono step into its device work (itself into its parts, in order) and the
    rest (itself into the host's parts, in order); all three accept alike. With `--host-profile`:
    the host's operations a step (and on a GPU the device's kernels, the whole step's graph's
    among them)."""
    from monodecode.bench.decode import HOST_PARTS
    from monodecode.spec.step_graph import PARTS

    assert main(["bench", "decode", "--preset", "tiny", "--layers", str(layers), "--requests",
                 ",".join(map(str, requests)), "--steps", str(steps), "--context", "12", "--reps", "1",
                 "--temperature", str(temperature), "--top-p", "0.9", "--host-profile", "--device", device,
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    printed = capsys.readouterr().out
    for r in report["rows"]:
        host, kernels = (r["host_profile"][side] for side in ("host", "device"))
        assert 0 < len(host) <= 12 and all(p["self_us_a_step"] > 0 and p["calls_a_step"] > 0 for p in host)
        assert any(p["op"].startswith("aten::") for p in host)  # torch's operations the host ran
        assert f"host   {host[0]['self_us_a_step']:8.1f} us a step in {host[0]['calls_a_step']:5.1f} calls: " in printed
        if device == "cpu":
            assert kernels == []
            continue
        assert 0 < len(kernels) <= 12 and all(p["self_us_a_step"] > 0 for p in kernels)
        if r["path"] == "mono":  # the whole step's graph's kernels, the kernels' own among them
            assert any(p["op"].startswith("_k") for p in kernels)
    assert report["layers"] == layers and report["block"] >= 1 and report["steps"] == steps
    assert (report["temperature"], report["top_p"]) == (temperature, 0.9)
    assert [(r["path"], r["requests"]) for r in report["rows"]] == [
        (path, count) for count in requests for path in ("per-op graph", "mono stepwise", "mono")]
    for r in report["rows"]:
        assert r["rows"] == r["requests"] * (report["block"] + 1)
        assert 1 <= r["tokens_per_step"] <= report["block"] + 1 and r["tokens_per_s_per_user"] > 0
        if r["path"] == "mono":  # one device part: nothing timed apart but the parts of its work
            assert r["step_s"] >= r["device_s"] > 0 and 0 < r["other_s"] < r["step_s"]  # step by step
            assert r["draft_s"] is r["verify_s"] is r["draft_stages_s"] is None
            assert list(r["device_parts_s"]) == list(PARTS)
            assert all(s > 0 for s in r["device_parts_s"].values())
            # each step's parts lie within its device work, and the medians of one or two steps are means
            assert sum(r["device_parts_s"].values()) <= r["device_s"]
            # the rest, the host's, in consecutive spans that make it up
            assert list(r["other_parts_s"]) == list(HOST_PARTS) and all(s >= 0 for s in r["other_parts_s"].values())
            assert r["other_parts_s"]["rows"] > 0 and r["other_parts_s"]["after"] > 0
            assert sum(r["other_parts_s"].values()) == pytest.approx(r["other_s"], rel=1e-6)
            assert f"(rows {r['other_parts_s']['rows'] * 1e3:.2f}, inputs " in printed
            continue
        assert r["device_s"] is r["device_parts_s"] is r["other_parts_s"] is None
        # the head is timed apart, in a graph of its own (one rep here): not compared with the verify
        # step that contains it, whose time a busy machine can make the shorter of the two
        assert r["step_s"] >= r["draft_s"] + r["verify_s"] > 0 and r["verify_s"] > 0 and r["head_s"] > 0
        assert 0 < r["other_s"] < r["step_s"]
        if r["path"] == "mono stepwise":  # the draft's stages ran on the kernels, inside its proposal
            assert 0 < r["draft_stages_s"] < r["draft_s"]
        else:
            assert r["draft_stages_s"] is None
    accepted = [[r["tokens_per_step"] for r in report["rows"][i::3]] for i in range(3)]
    assert accepted[0] == accepted[1] == accepted[2]  # the same synthetic acceptances on every path


def test_bench_decode_times_the_paths_asked_for(device, tmp_path, capsys):
    """`--paths per-op`: the per-op graph's row alone (the test above times all three paths); an
    unknown path is refused."""
    assert main(["bench", "decode", "--preset", "tiny", "--layers", "1", "--requests", "1", "--steps", "1",
                 "--context", "12", "--reps", "1", "--paths", "per-op", "--device", device,
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [r["path"] for r in report["rows"]] == ["per-op graph"]
    assert main(["bench", "decode", "--paths", "per-op,eager", "--device", device]) == 2
    assert "unknown path(s) eager: choose from per-op, stepwise, whole" in capsys.readouterr().err


@pytest.mark.cpu
def test_bench_layer_over_two_ranks(tmp_path):
    """`bench layer --tensor-parallel-size 2` (gloo; both ranks interpreted): mono and the eager
    per-op layer timed, no batched per-op graph, and a floor below one process's (each rank reads
    half of the split weights and of the experts)."""
    common = ["bench", "layer", "--preset", "tiny", "--device", "cpu", "--widths", "3", "--kinds", "window",
              "--context", "12", "--reps", "1"]
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    assert main(common + ["--tensor-parallel-size", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / name / "bench_layer.json").read_text()) for name in ("one", "two"))
    assert two["tensor_parallel_size"] == 2 and two["complete"]
    [row] = two["layers"]
    assert row["mono_s"] > 0 and row["per_op_eager_s"] > 0 and row["per_op_graph_s"] is None
    assert row["cosine"] > 0.9999  # rank 0's output, the ranks' sums included, against the per-op layer's
    assert row["routing_flips"]["rows"] == 0  # rank 0's picks, local to its experts, read as the per-op path's
    assert 0 < row["floor_bytes"] < one["layers"][0]["floor_bytes"]


@pytest.mark.cpu
@pytest.mark.slow
def test_bench_decode_over_two_ranks(tmp_path):
    """`bench decode --tensor-parallel-size 2` (gloo; both ranks interpreted): the mono stepwise
    path alone (the draft's stages on both ranks' kernels), the report saying the size. `slow`."""
    assert main(["bench", "decode", "--preset", "tiny", "--layers", "1", "--requests", "1", "--steps", "1",
                 "--context", "12", "--reps", "1", "--tensor-parallel-size", "2", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    assert report["tensor_parallel_size"] == 2 and [r["path"] for r in report["rows"]] == ["mono stepwise"]
    row = report["rows"][0]
    assert row["head_s"] is None and 0 < row["draft_stages_s"] < row["draft_s"]
    assert row["step_s"] >= row["draft_s"] + row["verify_s"] and 1 <= row["tokens_per_step"] <= report["block"] + 1


def test_a_fitted_model_over_ranks_is_refused(tmp_path, capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--tensor-parallel-size", "2", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2
    assert "--layers fit sizes a model for one GPU: give --layers N" in capsys.readouterr().err


def test_the_per_op_graph_step_is_the_per_op_step(device):
    """bench decode's per-op baseline (every layer in fixed shapes, then the head) against
    Model.step on copies of the same caches: logits and the draft's features."""
    import copy

    import torch

    from monodecode.bench.decode import PerOpGraphStep
    from monodecode.checkpoint import SyntheticCheckpoint
    from monodecode.config import preset

    model = Model.from_checkpoint(SyntheticCheckpoint(preset("tiny"), seed=6), device, torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    cache = model.make_cache(3, 64, 6)
    for slot, n in enumerate([20, 9, 33]):
        model.step(cache, torch.randint(0, 512, (n,), generator=g), torch.arange(n), torch.full((n,), slot))
    tokens = torch.randint(0, 512, (9,), generator=g)
    positions, slots = [20, 21, 22, 9, 33, 34, 35, 36, 37], [0, 0, 0, 1, 2, 2, 2, 2, 2]
    ref_cache = copy.deepcopy(cache)
    ref_logits, ref_hidden = model.step(ref_cache, tokens, positions, slots, return_hidden=True)
    logits, hidden = PerOpGraphStep(model)(cache, tokens, positions, slots, return_hidden=True)
    for out, ref in ((logits, ref_logits), (hidden, ref_hidden)):
        a, b = out.double().flatten().cpu(), ref.double().flatten().cpu()
        assert float((a - b).norm() / b.norm()) <= 5e-3  # seen: bit-equal on the CPU


def test_bench_layer_records_a_refused_shape_and_goes_on(device, tmp_path, monkeypatch, capsys):
    """A launch shape the GPU cannot hold (simulated: the CPU's one program always fits) is a row
    with the reason, and the next shape is timed."""
    from monodecode.mono import MonoRefused
    from monodecode.mono import runner as runner_module

    configure = runner_module.MonoRunner.configure

    def refusing(self, shape, check=True):
        if shape.k2_programs_per_sm == 9:
            raise MonoRefused(["K2: 9 programs a SM cannot all be resident at once"])
        return configure(self, shape, check)

    monkeypatch.setattr(runner_module.MonoRunner, "configure", refusing)
    assert main(["bench", "layer", "--preset", "tiny", "--device", device, "--widths", "2", "--kinds", "window",
                 "--shapes", "k2_programs_per_sm=9;default", "--context", "20", "--reps", "1",
                 "--out", str(tmp_path)]) == 0
    refused, timed = json.loads((tmp_path / "bench_layer.json").read_text())["layers"]
    assert "cannot all be resident" in refused["refused"] and refused["mono_s"] is None
    assert refused["speedup"] is None and refused["distinct_experts"] == timed["distinct_experts"] >= 1
    assert timed["refused"] is None and timed["mono_s"] > 0
    assert "refused" in capsys.readouterr().out



@pytest.mark.cpu
@pytest.mark.parametrize("context", [22, 300])
def test_the_filled_cache_has_the_layout_a_prefill_leaves(context):
    """`bench layer`'s cache (random values, any context at once) holds what a per-op prefill of
    the same tokens leaves in every ring's positions and every compressed layer's entries; the
    values are fresh random ones, not zeros."""
    from monodecode.bench import layer as bench_layer

    model = bench_layer.build("tiny", "cpu").model
    filled = bench_layer.fill_cache(model, context)
    prefilled = model.make_cache(bench_layer.MAX_REQUESTS, context + 64, 8)
    for slot in range(bench_layer.MAX_REQUESTS):
        tokens = torch.randint(0, model.config.vocab_size, (context,))
        model.step(prefilled, tokens, torch.arange(context), torch.full((context,), slot))
    compared = 0
    for ratio, layer_filled, layer_prefilled in zip(model.config.compress_ratios, filled.layers, prefilled.layers):
        for name in ("window", "source", "index_source"):
            ring, reference = getattr(layer_filled, name), getattr(layer_prefilled, name)
            assert (ring is None) == (reference is None), name
            if ring is not None:
                assert torch.equal(ring.pos, reference.pos), name
                for key, data in ring.data.items():
                    held = ring.pos >= 0
                    assert torch.equal(data[~held], reference.data[key][~held])  # zeros where nothing is held
                    assert data[held].abs().min() > 0 and data[held].std() > 0.5, (name, key)
                compared += 1
        for name in ("entries", "index_entries"):
            entries, reference = getattr(layer_filled, name), getattr(layer_prefilled, name)
            assert (entries is None) == (reference is None), name
            if entries is not None:
                written = reference.abs().amax(dim=(0, 2)) > 0  # the entries the prefill emitted
                assert int(written.sum()) == context // ratio
                assert torch.equal(entries.abs().amax(dim=(0, 2)) > 0, written), name
                compared += 1
    assert compared == 9  # rings: the window layer 1, CSA 3, HCA 2; entries: CSA 2, HCA 1
