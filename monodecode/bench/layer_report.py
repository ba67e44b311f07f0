"""The report of `monodecode bench layer` (bench/layer.py): the table on the terminal, the whole
model projected from the measured kinds, and the plot (time and fraction of the floor against
width), from a run's `bench_layer.json` (a saved one too: `--replot`)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

from ..config import preset

KINDS = {0: "window", 4: "CSA", 128: "HCA"}  # the layer kinds by compression ratio


def show(report: dict, out: Path) -> int:
    """The table on the terminal and the PNG in `out` (when matplotlib is installed)."""
    print(table(report))
    if not report.get("complete", True):
        print("note: this run was cut short; the table has the rows it measured")
    if importlib.util.find_spec("matplotlib") is None:
        print("note: matplotlib is not installed, so no bench_layer.png (pip install 'monodecode[bench]')")
    else:
        write_plot(report, out / "bench_layer.png")
        print(f"wrote {out / 'bench_layer.png'}")
    return 0


PATHS = {"per_op_eager_s": ("per-op eager", "tab:blue"), "per_op_graph_s": ("per-op graph", "tab:orange"),
         "per_op_compiled_s": ("per-op compiled", "tab:purple"), "mono_s": ("mono", None)}
MONO_COLORS = ("tab:green", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")  # a launch shape each


def write_plot(report: dict, path: Path) -> None:
    """Time and % of floor against width, a column of panels a layer kind, a line a path."""
    from matplotlib.figure import Figure  # the object API: no GUI backend, no global state

    kinds = list(dict.fromkeys(r["kind"] for r in report["layers"]))
    figure = Figure(figsize=(4 * len(kinds), 7), layout="constrained")
    axes = figure.subplots(2, len(kinds), squeeze=False)
    layers = _with_runs(report["layers"])
    runs = mono_runs(layers)
    for col, kind in enumerate(kinds):
        series_of = {run: sorted((r for r in layers if r["kind"] == kind and r["shape_run"] == run),
                                 key=lambda r: r["width"]) for run in runs}
        rows = series_of[next(iter(runs))]
        widths = [r["width"] for r in rows]
        lines = [(key, label, color, rows) for key, (label, color) in PATHS.items() if key != "mono_s"]
        lines += [("mono_s", "mono" if len(runs) == 1 else f"mono ({label})", MONO_COLORS[i % len(MONO_COLORS)],
                   series_of[run]) for i, (run, label) in enumerate(runs.items())]
        for key, label, color, series in lines:
            if all(r[key] is None for r in series):
                continue
            times = [r[key] * 1e6 if r[key] is not None else float("nan") for r in series]
            fractions = [r["floor_s"] * 1e6 / t for r, t in zip(series, times)]
            axes[0, col].plot(widths, times, marker="o", label=label, color=color)
            axes[1, col].plot(widths, fractions, marker="o", label=label, color=color)
        axes[0, col].plot(widths, [r["floor_s"] * 1e6 for r in rows], linestyle="--", color="gray", label="floor")
        axes[0, col].set(title=f"{kind} layer", ylabel="us a step", yscale="log")
        axes[1, col].set(xlabel="rows a step", ylabel="fraction of the floor", ylim=(0, 1))
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    figure.suptitle(f"{report['device']}, {report['preset']}: one decoder layer a step")
    figure.savefig(path, dpi=120)


def _with_runs(rows: list[dict]) -> list[dict]:
    """Rows with their place in --shapes (`shape_run`); a report saved before that field gets it
    from the order of the rows of each (kind, width), which is --shapes order."""
    seen: dict[tuple, int] = {}
    out = []
    for row in rows:
        run = seen.setdefault((row["kind"], row["width"]), 0)
        seen[(row["kind"], row["width"])] += 1
        out.append({"shape_run": run, **row})
    return out


def mono_runs(rows: list[dict]) -> dict:
    """The mono lines of a report, in --shapes order: run -> label (the shape, and its place in
    --shapes when it came more than once, as a control for run order)."""
    shapes = {}
    for row in _with_runs(rows):
        shapes.setdefault(row["shape_run"], row["shape"])
    twice = {shape for shape in shapes.values() if list(shapes.values()).count(shape) > 1}
    return {run: f"{shape}, #{run + 1}" if shape in twice else shape for run, shape in shapes.items()}


def table(report: dict) -> str:
    head = (f"{report['device']}, torch {report['torch']}, Triton {report['triton']}, {report['date']}; "
            f"copy {report['copy_bytes_per_s'] / 1e12:.2f} TB/s; {report['preset']}, context {report['context']}")
    if report.get("tensor_parallel_size", 1) > 1:
        head += (f"; over {report['tensor_parallel_size']} ranks: rank 0's times and experts, the floor of the rank "
                 "that reads the most")
    cols = (f"{'kind':<7}{'rows':>5}{'experts':>8}{'floor us':>10}{'per-op us':>12}{'graph us':>12}"
            f"{'compiled':>12}{'of floor':>9}{'mono us':>12}{'K1':>9}{'K2':>9}{'of floor':>9}"
            f"{'speedup':>9}{'cosine':>10}{'flips':>6}"
            f"{'launches':>14}  shape")
    lines = [head, cols]
    for r in report["layers"]:
        versus = f"{r['mono_of_floor']:>9.1%}{r['speedup']:>8.2f}x" if r["mono_s"] else f"{'refused':>18}"
        lines.append(f"{r['kind']:<7}{r['width']:>5}{r['distinct_experts']:>8}{r['floor_s'] * 1e6:>10.1f}"
                     f"{r['per_op_eager_s'] * 1e6:>12.1f}{us_text(r['per_op_graph_s']):>12}"
                     f"{us_text(r['per_op_compiled_s']):>12}"
                     f"{r['per_op_of_floor']:>9.1%}{us_text(r['mono_s']):>12}"
                     f"{us_text(r.get('mono_k1_s')):>9}{us_text(r.get('mono_k2_s')):>9}{versus}"
                     f"{_agreement(r)}{_launches(r['kernels_launched']):>14}  {r['shape']}")
    lines.append("per-op us: the eager reference (experts looped, dequantized each call); graph us: the batched "
                 "per-op layer in a CUDA graph, compiled: the same under torch.compile; of floor "
                 "and speedup use the fastest per-op; "
                 "mono: the layer's kernels in a CUDA graph, K1 (timed alone) and K2 (the rest: mono - K1, K3 "
                 "with it); cosine: mono's layer output against the per-op block's on the same step, over the "
                 "rows whose expert picks agree; flips: the rows whose picks differ (near-ties; the printout "
                 "above gives their margins); shape: the "
                 "kernels' launch shape (mono/shape.py LaunchShape); launches: GPU kernels one eager step launches "
                 "(torch profiler), per-op eager / per-op graph [/ per-op compiled] / mono")
    lines += whole_model(report)
    resources = {(r["shape"], k["kernel"], k["registers"], k["spills"]) for r in report["layers"]
                 for k in r.get("kernel_resources") or () if k["row_block"] in (None, _widest(r))}  # K3: None
    if resources:
        lines.append("registers a thread (spilled) at the widest row block: " + "; ".join(
            f"{shape} {kernel} {regs} ({spills})" for shape, kernel, regs, spills in sorted(resources)))
    return "\n".join(lines)


def _agreement(row: dict) -> str:
    """The cosine and flips columns of a row ('-' where not checked: a refused shape, or a report
    from before the check)."""
    if row.get("cosine") is None:
        return f"{'-':>10}{'-':>6}"
    flips = row.get("routing_flips")
    return f"{row['cosine']:>10.6f}{flips['rows'] if flips else '-':>6}"


def whole_model(report: dict) -> list[str]:
    """The preset's whole stack of layers projected from the measured kinds: at each width and
    launch shape where every kind the preset has was timed, the sum over its layers of mono's,
    the per-op graph's and the floor's times (a line each; none if a kind is missing)."""
    # ratio 4 is CSA (the one with an indexer), any other ratio HCA (the tiny preset's is 16)
    counts = Counter(KINDS.get(ratio, KINDS[128]) for ratio in preset(report["preset"]).compress_ratios)
    measured = {(r["kind"], r["width"], r["shape_run"]): r for r in _with_runs(report["layers"])}
    lines = []
    for width, run in sorted({(w, run) for _, w, run in measured}):
        rows = {kind: measured.get((kind, width, run)) for kind in counts}
        if any(r is None or r["mono_s"] is None for r in rows.values()):
            continue
        total = {key: None if any(r[key] is None for r in rows.values()) else
                 sum(counts[kind] * r[key] for kind, r in rows.items())
                 for key in ("mono_s", "per_op_graph_s", "floor_s")}  # per-op graph: none over ranks
        per_op = "-" if total["per_op_graph_s"] is None else f"{total['per_op_graph_s'] * 1e3:.2f}"
        lines.append(f"whole model ({', '.join(f'{n} {kind}' for kind, n in counts.items())} layers; no head, "
                     f"no draft), {width} rows, {next(iter(rows.values()))['shape']}: mono "
                     f"{total['mono_s'] * 1e3:.2f} ms, {total['floor_s'] / total['mono_s']:.1%} of its floor "
                     f"{total['floor_s'] * 1e3:.2f} ms; per-op graph {per_op} ms")
    return lines


def _widest(row: dict) -> int:
    """The widest row block a layer row's kernels were built for (K3's one build has none)."""
    return max(k["row_block"] for k in row["kernel_resources"] if k["row_block"] is not None)


def _launches(counts: dict) -> str:
    """GPU kernels a step launches: per-op eager / per-op graph / mono, and per-op compiled before
    mono where it was timed ("-" on a CPU)."""
    keys = ("per_op_eager", "per_op_graph") + ("per_op_compiled",) * ("per_op_compiled" in counts) + ("mono",)
    return "/".join("-" if counts.get(k) is None else str(counts[k]) for k in keys)


def us_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"
