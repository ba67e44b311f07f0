"""Where a mono kernel's warps spend their time, stage by stage: Nsight Compute's PC sampling of
K1 / K2 / K3 summed over each stage's code.

The timeline (`bench layer --timeline`) says how long each stage takes; this says why. `bash
scripts/h200.sh profile` (WIDTH rows, default 1) runs

    ncu ... python tools/stall_profile.py step --width W

which builds `bench layer`'s model (v4-flash sizes, synthetic weights, context 512) and launches
one layer's kernels (`--kind`: window, CSA or HCA; h200.sh's KIND) a few times eagerly for ncu to
sample one step of them; then exports
each profiled kernel's SASS with its samples (`ncu --import ... --page source --csv
--print-source sass`), and

    python tools/stall_profile.py summary SOURCE.csv

sums the samples by stage. A stage of a persistent kernel is its code up to a grid barrier's
signal (`sync.signal`'s release increment: a `REDG.E.ADD.STRONG.GPU` right after the release's
`MEMBAR.ALL.GPU`; the relaxed increments of histograms, tickets and passed barriers have no
fence and split nothing), so a kernel with B signals has B + 1 stages, named from its family's
stages (K1 5, a CSA layer's K1 12, K2 7, K3 4; the kernels in launch order). A CSA / HCA layer's
K2 also signals inside attend (its entry splits, at their pair's ticket), so its stages come out
numbered, attend's first two of them.
Per stage: its share of the kernel's samples; of them, the wait at the grid barrier before it
(the code from the previous stage's signal to the first CTA barrier after it, where a program's
warps wait while one of them polls: a stage that few programs work in shows mostly as the next
stage's wait) and those on the synchronisation's strong loads and atomics (barrier polls,
tickets); the leading stall reasons of the rest (`long_sb`: a global load, `no_instruction`:
the instruction fetch, `barrier`: a CTA barrier inside the stage, ...); and the instructions with
the most samples.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

SIGNAL = re.compile(r"\bREDG\.E\.ADD\.STRONG\.GPU\b")
RELEASE = re.compile(r"\bMEMBAR\.ALL\.GPU\b")
FENCED = 4  # instructions after a release's MEMBAR (ERRBAR, CGAERRBAR) within which its increment comes
SYNC = re.compile(r"\.STRONG\.|\bATOMG\b|\bATOM\b")
CTA_BARRIER = re.compile(r"\bBAR\.SYNC\b")
DEFERRED = 16  # instructions after the wait's CTA barrier where its blocking may show
TOP = 3  # instructions listed a stage
REASONS = 4  # stall reasons listed a stage (their share of the stage's samples)
PROFILED = "profiled"  # the NVTX range of the launches to sample


def stage_names(kernel: int, count: int) -> list[str]:
    """The names of the `count` stages of profiled kernel `kernel` (in launch order: K1, K2, K3,
    then again): its family's whose stage count matches (a CSA layer's K1 has seven stages more),
    else numbered."""
    from monodecode.mono import k1, k2
    families = ([k1.stage_names("k1"), k1.stage_names("k1c")], [k2.stage_names("k2")], [k2.stage_names("k3")])
    return next((names for names in families[kernel % 3] if len(names) == count),
                [f"stage {i}" for i in range(count)])


def read_tables(path: Path) -> list[list[dict]]:
    """The source page's CSV: one table a profiled kernel, each opening with a header row that
    names an address column and a source column. Rows: {address, source, samples}."""
    tables, columns, reasons = [], None, {}
    for row in csv.reader(path.read_text().splitlines()):
        address, source = _column(row, "address"), _column(row, "source")
        if address is not None and source is not None:
            columns = {"address": address, "source": source, "samples": _samples_column(row)}
            reasons = _reason_columns(row)
            tables.append([])
        elif columns and len(row) > max(columns.values()):
            text = row[columns["address"]].strip()
            if re.fullmatch(r"(0x)?[0-9a-fA-F]+", text):
                tables[-1].append({"address": int(text, 16), "source": row[columns["source"]].strip(),
                                   "samples": _number(row[columns["samples"]]),
                                   "reasons": {name: _number(row[i]) for name, i in reasons.items() if i < len(row)}})
    if not tables:
        raise SystemExit(f"{path}: no table with an Address and a Source column (an ncu source page in CSV?)")
    return tables


def _column(header: list[str], name: str) -> int | None:
    """The first column whose name is `name` (any case, `#` and spaces around ignored)."""
    for i, cell in enumerate(header):
        if cell.strip(" #").lower() == name:
            return i
    return None


def _reason_columns(header: list[str]) -> dict[str, int]:
    """The per-reason sample columns (`stall_long_sb`, ...: every sample, issued or not) -> their
    index, named without the prefix; none if the export has no such columns."""
    return {name.strip()[len("stall_"):]: i for i, name in enumerate(header)
            if name.strip().startswith("stall_") and "(" not in name}


def _samples_column(header: list[str]) -> int:
    """The column of all PC samples of an instruction."""
    for wanted in ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All", "Sampling"):
        for i, name in enumerate(header):
            if wanted in name:
                return i
    raise SystemExit(f"no PC-sampling column among {header}")


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def _stage(waiting: bool) -> dict:
    # left: instructions of the wait still to come (None: up to the CTA barrier; 0: none)
    return {"samples": 0.0, "sync": 0.0, "wait": 0.0, "rows": [], "reasons": Counter(), "left": None if waiting else 0}


def by_stage(rows: list[dict]) -> list[dict]:
    """Each stage's samples, sync samples, wait samples, the stall reasons of the rest, and its
    instructions, in code order. The wait: from the barrier signal before the stage to the
    first CTA barrier after it (the grid barrier's poll, and what the compiler scheduled beside
    it), and on to the first instruction after that barrier with `barrier` samples, where the
    deferred blocking of the warps that did not poll lands (at most DEFERRED instructions on)."""
    stages = [_stage(waiting=False)]
    fenced = 0  # instructions left in which an increment is a release's
    for row in sorted(rows, key=lambda r: r["address"]):
        stage = stages[-1]
        stage["samples"] += row["samples"]
        stage["sync"] += row["samples"] if SYNC.search(row["source"]) else 0.0
        stage["rows"].append(row)
        if stage["left"] is None:  # before the CTA barrier
            stage["wait"] += row["samples"]
            stage["left"] = DEFERRED if CTA_BARRIER.search(row["source"]) else None
        elif stage["left"] > 0:  # after it, until the deferred blocking shows
            stage["wait"] += row["samples"]
            stage["left"] = 0 if row["reasons"].get("barrier") else stage["left"] - 1
        else:
            stage["reasons"].update(row["reasons"])
        if SIGNAL.search(row["source"]) and fenced:
            stages.append(_stage(waiting=True))
        fenced = FENCED if RELEASE.search(row["source"]) else max(fenced - 1, 0)
    return stages


def summary(path: Path) -> str:
    lines = []
    for k, rows in enumerate(read_tables(path)):
        stages = by_stage(rows)
        total = sum(s["samples"] for s in stages) or 1.0
        labels = stage_names(k, len(stages))
        lines.append(f"kernel {k + 1}: {len(stages)} stages, {total:.0f} samples")
        for label, stage in zip(labels, stages):
            share, sync, wait = (100 * stage[key] / total for key in ("samples", "sync", "wait"))
            reasons = stage["reasons"]
            of_stage = sum(reasons.values()) or 1.0
            why = ", ".join(f"{name} {100 * n / of_stage:.0f} %" for name, n in reasons.most_common(REASONS) if n)
            lines.append(f"  {label:<32} {share:5.1f} %   wait {wait:5.1f} %   sync {sync:5.1f} %"
                         + (f"   (the rest: {why})" if why else ""))
            for row in sorted(stage["rows"], key=lambda r: -r["samples"])[:TOP]:
                if row["samples"]:
                    lines.append(f"      {row['address']:#07x} {100 * row['samples'] / total:5.1f} %  {row['source'][:70]}")
    return "\n".join(lines)


def step(width: int, launches: int, shape: str, kind: str = "window") -> None:
    """Launch the bench model's `kind` layer's kernels (K1, K2, K3) `launches` times on a step of
    `width` rows, inside the NVTX range `PROFILED` (ncu --nvtx-include "profiled/": not the
    build's launches)."""
    import torch

    from monodecode.bench.layer import LayerBench, build, fill_cache
    from monodecode.mono.shape import LaunchShape

    decoder = build("v4-flash", "cuda", kinds=(kind,))
    if shape != "default":
        decoder.mono.configure(LaunchShape.parse(shape))
    context = 512
    bench = LayerBench(decoder, fill_cache(decoder.model, context), context, reps=1)
    inputs = bench.step(0, width, torch.Generator().manual_seed(2))  # the model's one layer
    with torch.no_grad():
        torch.cuda.nvtx.range_push(PROFILED)
        for _ in range(launches):
            inputs.kernels()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    decoder.mono.check()
    print(f"launched the {kind} layer's kernels {launches} times at {width} rows, shape {shape}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("step", help="launch a layer's kernels (under ncu)")
    run.add_argument("--kind", choices=("window", "CSA", "HCA"), default="window")
    run.add_argument("--width", type=int, default=1)
    run.add_argument("--launches", type=int, default=3)
    run.add_argument("--shape", default="default")
    show = sub.add_parser("summary", help="sum an ncu source page (CSV) by stage")
    show.add_argument("csv", type=Path)
    args = parser.parse_args(argv)
    if args.command == "step":
        step(args.width, args.launches, args.shape, args.kind)
    else:
        print(summary(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
