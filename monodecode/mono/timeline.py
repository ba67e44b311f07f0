"""Where a persistent launch spends its time: per-program stamps turned into per-stage times.

With `MonoRunner.timeline` on (GPU only: the stamps read the PTX global timer), every program of
a launch records (sync.stamp) its start, its arrival at and release from each grid barrier, and
its end, in a [grid, TIMELINE_SLOTS] int64 buffer of ns. Stage k of a launch runs on program p
from its previous release (or start) to its arrival at barrier k (or its end); the stage's time
is from the earliest program starting it to the last one finishing it, and the barrier's wait is
from that last arrival to the last release. The slowest program sets both, so a stage whose time
is far above its bytes' worth is the one to rebalance (with per-task flags where the timeline
shows waiting). Beside them, a program's median time in the stage (from its own start to its own
end) and which program ended it last: a stage far above its median waits on one program's work
(one task, say, or a chain of them), not on all of them. `launch_gaps`: between the launches of one
step, the time from one launch's last program ending to the next one's first program starting.
"""

from __future__ import annotations

import torch


def stage_times(stamps: torch.Tensor, stage_names: list[str]) -> list[dict]:
    """stamps [grid, slots] int64 ns of one launch with len(stage_names) stages ->
    [{"stage", "us", "barrier_us", "median_program_us", "last_program"}] (barrier_us 0 for the
    last stage; the median the lower of the middle two of an even grid), in stage order."""
    stamps = stamps.to(torch.int64).cpu()
    barriers = len(stage_names) - 1
    starts = [stamps[:, 0]] + [stamps[:, 2 * k + 2] for k in range(barriers)]
    ends = [stamps[:, 2 * k + 1] for k in range(barriers)] + [stamps[:, 2 * barriers + 1]]
    out = []
    for k, name in enumerate(stage_names):
        us = float(ends[k].max() - starts[k].min()) / 1e3
        wait = float(stamps[:, 2 * k + 2].max() - ends[k].max()) / 1e3 if k < barriers else 0.0
        own = (ends[k] - starts[k]).double() / 1e3
        out.append({"stage": name, "us": us, "barrier_us": wait, "median_program_us": float(own.median()),
                    "last_program": int(ends[k].argmax())})
    return out


def launch_span(stamps: torch.Tensor, stages: int) -> tuple[int, int]:
    """(first program's start, last program's end) in ns of one launch of `stages` stages."""
    stamps = stamps.to(torch.int64).cpu()
    return int(stamps[:, 0].min()), int(stamps[:, 2 * (stages - 1) + 1].max())


def launch_gaps(spans: list[tuple[str, tuple[int, int]]]) -> dict:
    """The launches of one step in order, (name, launch_span) each -> {"gaps_us": {name: us from
    the previous launch's last end to this one's first start}, "span_us": first start to last end}."""
    gaps = {name: (start - previous[1]) / 1e3 for (_, previous), (name, (start, _)) in zip(spans, spans[1:])}
    return {"gaps_us": gaps, "span_us": (spans[-1][1][1] - spans[0][1][0]) / 1e3}


def format_times(times: list[dict]) -> str:
    total = sum(t["us"] + t["barrier_us"] for t in times)
    lines = [f"{t['stage']:<32} {t['us']:8.1f} us  barrier {t['barrier_us']:6.1f} us  (a program's median "
             f"{t['median_program_us']:5.1f} us; last: program {t['last_program']})" for t in times]
    return "\n".join(lines + [f"{'total':<32} {total:8.1f} us"])
