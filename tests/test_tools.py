"""tools/sharded_pytest.py: the GPU runs' parallel pytest (scripts/h200.sh tests-all); tools/ab_summary.py:
the verdict of an A/B of bench layer runs (scripts/h200.sh ab); tools/stall_profile.py: an ncu source
page summed by stage (scripts/h200.sh profile)."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sharded_pytest.py"
AB_SUMMARY = Path(__file__).resolve().parents[1] / "tools" / "ab_summary.py"
STALL_PROFILE = Path(__file__).resolve().parents[1] / "tools" / "stall_profile.py"


def _run(tmp_path, body: str, *args: str):
    (tmp_path / "test_some.py").write_text(body)
    return subprocess.run([sys.executable, str(TOOL), "--shards", "2", "--logs", str(tmp_path / "logs"), *args,
                           "--", "test_some.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_every_test_runs_once_over_the_shards_and_a_failure_fails_the_run(tmp_path):
    passing = "".join(f"def test_{i}():\n    assert True\n" for i in range(5))
    done = _run(tmp_path, passing)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 tests from 1 files in 2 shards" in done.stdout
    assert "3 passed" in done.stdout and "2 passed" in done.stdout
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["shard_0.txt", "shard_1.txt"]

    failing = _run(tmp_path, passing + "def test_broken():\n    assert False\n")
    assert failing.returncode == 1 and "1 failed" in failing.stdout


def test_a_list_of_ids_runs_just_those(tmp_path):
    (tmp_path / "ids.txt").write_text("test_some.py::test_1\ntest_some.py::test_3\n")
    done = _run(tmp_path, "".join(f"def test_{i}():\n    assert True\n" for i in range(5)), "--ids", "ids.txt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 tests from the list ids.txt in 2 shards" in done.stdout
    assert done.stdout.count("1 passed") == 2


def test_ab_summary_takes_each_trees_fastest_run_and_shows_the_control(tmp_path):
    # (mono us, per-op graph us) of each run; base1 ran slow on a cold machine, control and all
    runs = {"base1": (480.0, 1770.0), "mid1": (470.0, 1700.0), "new1": (450.0, 1600.0), "new2": (455.0, 1610.0),
            "mid2": (462.0, 1600.0), "base2": (465.0, 1605.0)}
    for name, (mono, per_op) in runs.items():
        (tmp_path / name).mkdir()
        rows = [{"kind": "window", "width": 6, "mono_s": mono * 1e-6, "per_op_graph_s": per_op * 1e-6},
                {"kind": "window", "width": 1, "mono_s": None, "per_op_graph_s": 1e-3},  # refused: not summed
                {"kind": "window", "width": 6, "shape": "dense_stages=8", "mono_s": mono * 0.9e-6,
                 "per_op_graph_s": per_op * 1e-6}]
        (tmp_path / name / "bench_layer.json").write_text(json.dumps({"layers": rows}))
    done = subprocess.run([sys.executable, str(AB_SUMMARY), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "base     run 1: 480.0 (1770.0), run 2: 465.0 (1605.0)" in done.stdout
    assert "fastest: base 465.0, new 450.0 us (-15.0 us, -3.2 %)" in done.stdout
    assert "fastest: base 465.0, mid 462.0 us (-3.0 us, -0.6 %)" in done.stdout
    assert "1 rows" not in done.stdout
    assert "window layer, 6 rows, shape dense_stages=8: mono us" in done.stdout  # each shape on its own
    assert "fastest: base 418.5, new 405.0 us" in done.stdout
    empty = subprocess.run([sys.executable, str(AB_SUMMARY), str(tmp_path / "none")], capture_output=True, text=True,
                           timeout=60)
    assert empty.returncode == 1 and "no <tree><round>/bench_layer.json" in empty.stderr


def test_stall_profile_sums_each_kernels_samples_by_the_stages_between_barrier_signals(tmp_path):
    """Samples by stage (a stage ends at a release increment: one after a MEMBAR; a relaxed one
    ends nothing), the wait at the grid barrier before a stage apart, and the stall reasons of
    the rest."""
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
              '"stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"')
    red = "REDG.E.ADD.STRONG.GPU desc[UR4][R2.64], R5"
    fence, signal = "MEMBAR.ALL.GPU", "ERRBAR"  # a release increment: MEMBAR, ERRBAR, then `red`
    poll = "LDG.E.STRONG.SYS R4, desc[UR4][R2.64]"
    cta, deferred = "BAR.SYNC.DEFER_BLOCKING 0x0", "IMAD R4, R5, R6, RZ"
    # K1: 4 barrier signals, 5 stages; stage 2 (settle) spends 30 of 100 samples, 20 of them in the
    # wait (10 polling, 4 at the CTA barrier that ends it, 6 where the other warps' blocking at it
    # shows), 10 its own; the stages after it have no CTA barrier, so all of theirs are the wait
    released = [(fence, 0), (signal, 0), (red, 0)]
    k1 = [("FFMA R1, R2, R3, R1", 12), (red, 0), ("FFMA R1, R2, R3, R1", 8), *released, (poll, 10), (cta, 4),
          (deferred, 6), ("MUFU.EX2 R1, R2", 10), *released,
          ("HMMA.16816.F32.BF16 R4, R8, R12, R4", 40), *released, ("STG.E [R2.64], R4", 5), *released,
          ("LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", 5)]
    # a kernel of 2 stages has no family: its stages are numbered
    other = [("IMAD R1, R2, R3, RZ", 3), *released, ("EXIT", 1)]
    lines = []
    for table in (k1, other):
        lines.append(header)
        # the wait's samples stall at a barrier, the others 3 to 1 on a load (the not-issued column ignored)
        lines += [f'"{16 * i:#06x}","{source}","{samples}","0",' + (f'"0","{samples}","7"' if source in (poll, cta, deferred)
                                                                    else f'"{samples * 3 / 4}","{samples / 4}","7"')
                  for i, (source, samples) in enumerate(table)]
    (tmp_path / "source.csv").write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, str(STALL_PROFILE), "summary", str(tmp_path / "source.csv")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "kernel 1: 5 stages, 100 samples" in out and "kernel 2: 2 stages, 4 samples" in out
    assert "k1 fold                           20.0 %   wait   0.0 %   sync   0.0 %   (the rest: long_sb 75 %, barrier 25 %)" in out
    assert "k1 settle                         30.0 %   wait  20.0 %   sync  10.0 %   (the rest: long_sb 75 %, barrier 25 %)" in out
    assert "k1 wq_a|wkv                       40.0 %   wait  40.0 %" in out and "HMMA.16816" in out
    assert "stage 0                           75.0 %   wait   0.0 %" in out
    (tmp_path / "other.csv").write_text("Kernel,Time\nk,1\n")
    bad = subprocess.run([sys.executable, str(STALL_PROFILE), "summary", str(tmp_path / "other.csv")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no table with an Address and a Source column" in bad.stderr


def test_stall_profile_names_each_kernels_stages_by_its_place_in_the_launch_order():
    """Names come from the family of the kernel's place in the launch order (K1, K2, K3), a CSA
    layer's K1 told from a window / HCA layer's by its stage count; a count its place's families
    do not have (K2's 7 at K1's place) is numbered."""
    import importlib.util

    from monodecode.mono import k1, k2

    spec = importlib.util.spec_from_file_location("stall_profile", STALL_PROFILE)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    indexed = k1.stage_names("k1c")
    assert tool.stage_names(0, len(indexed)) == indexed and tool.stage_names(0, 5) == k1.stage_names("k1")
    assert tool.stage_names(1, 7) == k2.stage_names("k2") and tool.stage_names(5, 4) == k2.stage_names("k3")
    assert tool.stage_names(3, 7) == [f"stage {i}" for i in range(7)]
    assert tool.stage_names(1, 3) == ["stage 0", "stage 1", "stage 2"]
