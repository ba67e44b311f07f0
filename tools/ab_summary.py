"""Summarise an A/B of `monodecode bench layer` runs: `python tools/ab_summary.py DIR`.

`bash scripts/h200.sh ab` times the baseline tree (`baseline/`, a `git archive` of main) and this
tree in the order base, new, new, base (more trees with TREES: in order, then back), each run's
`bench_layer.json` in DIR/<tree><round>; every tree's fastest run is set against base's. Two
trees timed one after the other in one device call can differ by more than a change is worth
for reasons that are not the change: the first run on a machine just started was up to 10 %
slower on code neither tree changed (docs/notes/2026-12-03-seams-one-round.md). So each run
also reports the per-op graph layer, which no kernel change touches, as a control, and the
verdict takes each tree's fastest run (a run is only ever slowed by such effects).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def runs(folder: Path) -> dict[str, list[tuple[int, dict]]]:
    """tree -> [(round, {(kind, width, shape): (mono_s, per_op_graph_s)})] from folder/<tree><round>/."""
    found: dict[str, list[tuple[int, dict]]] = {}
    for path in sorted(folder.glob("*/bench_layer.json")):
        name = re.fullmatch(r"([a-z_]+)(\d+)", path.parent.name)
        if not name:
            continue
        rows = {(r["kind"], r["width"], r.get("shape", "default")): (r["mono_s"], r["per_op_graph_s"])
                for r in json.loads(path.read_text())["layers"] if r.get("mono_s")}
        found.setdefault(name[1], []).append((int(name[2]), rows))
    return found


def summary(found: dict[str, list[tuple[int, dict]]]) -> str:
    trees = sorted(found)
    keys = sorted({key for runs_ in found.values() for _, rows in runs_ for key in rows},
                  key=lambda k: (k[0], k[1], k[2] != "default", k[2]))
    lines = []
    for key in keys:
        kind, width, shape = key
        named = "" if shape == "default" else f", shape {shape}"
        lines.append(f"{kind} layer, {width} rows{named}: mono us (per-op graph us, the control) by run")
        best = {}
        for tree in trees:
            times = [(rnd, rows[key]) for rnd, rows in sorted(found[tree]) if key in rows]
            cells = ", ".join(f"run {rnd}: {m * 1e6:.1f} ({p * 1e6:.1f})" for rnd, (m, p) in times)
            best[tree] = min(m for _, (m, _) in times) if times else None
            lines.append(f"  {tree:<8} {cells}")
        base = best.get("base")
        for tree in trees:
            if tree != "base" and base and best[tree]:
                lines.append(f"  fastest: base {base * 1e6:.1f}, {tree} {best[tree] * 1e6:.1f} us "
                             f"({(best[tree] - base) * 1e6:+.1f} us, {(best[tree] / base - 1) * 100:+.1f} %)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    found = runs(Path(argv[0]))
    if not found:
        print(f"no <tree><round>/bench_layer.json under {argv[0]}", file=sys.stderr)
        return 1
    print(summary(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
