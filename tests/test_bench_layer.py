"""`monodecode bench layer` end to end at tiny sizes (on the CPU the kernels are interpreted): the
code paths and the report, not the times."""

import json
import os

if os.environ.get("MONODECODE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

from monodecode.cli import main


def test_bench_layer_reports_every_kind_and_width(device, tmp_path, capsys):
    assert main(["bench", "layer", "--preset", "tiny", "--device", device, "--widths", "1,3",
                 "--context", "20", "--reps", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_layer.json").read_text())
    rows = report["layers"]
    assert [(r["kind"], r["plan"], r["width"]) for r in rows] == [
        ("window", "whole", 1), ("window", "whole", 3), ("CSA", "ffn", 1), ("CSA", "ffn", 3),
        ("HCA", "ffn", 1), ("HCA", "ffn", 3)]
    for r in rows:
        assert 1 <= r["distinct_experts"] <= 2 * r["width"]  # tiny: top-2 of 8
        assert r["floor_bytes"] > 0 and r["per_op_eager_s"] > 0 and r["mono_s"] >= r["mono_kernels_s"] > 0
    wider = {r["kind"]: r["floor_bytes"] for r in rows if r["width"] == 3}
    narrow = {r["kind"]: r["floor_bytes"] for r in rows if r["width"] == 1}
    assert all(wider[k] > narrow[k] for k in wider)  # more rows read more KV (and experts)
    assert "of floor" in capsys.readouterr().out
