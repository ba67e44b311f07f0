"""The routed-expert stage alone on a GPU, as K3 runs it: expert bytes a second against the copy floor.

`python -m monodecode.bench.experts [--rows 1,6,16,48] [--steps 12] [--shapes SPEC;SPEC] [--out DIR]`

The stage's three launches (`mono.expert_stage`: K3's expert task loops, tiles and grid, a launch
boundary where K3 has a grid barrier) at v4-flash sizes (256 experts, d 4096, I 2048, top-6),
random MXFP4 weights. For each row count, `--steps` fresh random routings (top-6 of 256 a row,
distinct within a row) are captured in one CUDA graph, so that consecutive steps mostly read
other experts and the weights come from HBM; the graph is replayed 5 times and the median per
step kept. Bytes: the distinct experts each step touches times one expert's MXFP4 bytes (codes
and scales of w1, w2, w3). Each shape (`mono.shape.LaunchShape`, its expert fields and warps) is
first checked against the float64 reference at 6 rows. The copy bandwidth (a 2 GiB
device-to-device copy, read + written, eager) is measured in the same run. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ..mono import experts as X
from ..mono.expert_reference import reference
from ..mono.expert_stage import StageBuffers, launch_stages, routed_experts
from ..mono.shape import LaunchShape
from .timing import copy_bandwidth, graphed, timed

E, D, I, TOPK = 256, 4096, 2048, 6  # v4-flash
LIMIT = 10.0


def random_experts(g: torch.Generator) -> X.ExpertWeights:
    """Random codes already in the fragment order (any byte is a valid pair of codes) and scale
    codes that keep the weights small."""
    def matrix(n, k):
        codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        scales = torch.randint(118, 127, (E, n, k // 32), dtype=torch.uint8, device="cuda", generator=g)
        return codes, scales

    return X.ExpertWeights(matrix(I, D), matrix(D, I), matrix(I, D))


def expert_bytes() -> int:
    return 3 * (D * I // 2 + D * I // 32)


def routings(rows: int, steps: int, g: torch.Generator) -> list[torch.Tensor]:
    scores = torch.rand(steps, rows, E, device="cuda", generator=g)
    return [s.topk(TOPK, dim=-1).indices for s in scores]


def relative_error(experts, shape, g) -> float:
    ids = routings(6, 1, g)[0]
    x = torch.randn(6, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(6, TOPK, device="cuda", generator=g)
    y = routed_experts(x, ids, w, experts, LIMIT, shape=shape, poison=True).double()
    ref = reference(x, ids, w, experts, LIMIT)
    return ((y - ref).norm() / ref.norm()).item()


def time_steps(experts, shape, rows, steps, g) -> tuple[float, float]:
    """(median seconds a step, mean distinct experts a step) of the stage's launches."""
    plans = []
    for ids in routings(rows, steps, g):
        x = torch.randn(rows, D, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.rand(rows * TOPK, device="cuda", generator=g)
        plans.append((x, X.group_picks(ids), w, StageBuffers(rows * TOPK, experts, "cuda"), ids.unique().numel()))
    replay = graphed(lambda: [launch_stages(x, groups, w, experts, LIMIT, buffers, shape=shape, fast=True)
                              for x, groups, w, buffers, _ in plans], "cuda")
    return timed(replay, "cuda", reps=5) / steps, sum(p[-1] for p in plans) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6,16,48")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shapes", default="default",
                        help="';'-separated launch shapes, each `default` or field=value,... of LaunchShape")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    shapes = [LaunchShape.parse(text) for text in args.shapes.split(";")]
    g = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth("cuda")
    experts = random_experts(g)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d"),
              "copy_TBps": copy / 1e12, "expert_MB": expert_bytes() / 1e6, "shapes": {}}
    print(f"copy {copy / 1e12:.3f} TB/s on {result['device']}", flush=True)
    for shape in shapes:
        entry = {"rel_err": relative_error(experts, shape, g), "rows": {}}
        for rows in [int(r) for r in args.rows.split(",")]:
            seconds, distinct = time_steps(experts, shape, rows, args.steps, g)
            tbps = distinct * expert_bytes() / seconds / 1e12
            entry["rows"][rows] = {"us": seconds * 1e6, "distinct_experts": distinct, "TBps": tbps,
                                   "of_copy": tbps * 1e12 / copy}
        result["shapes"][shape.spec()] = entry
        cells = "  ".join(f"{r} rows {v['us']:.1f} us {v['TBps']:.2f} TB/s" for r, v in entry["rows"].items())
        print(f"{shape.spec():<28} err {entry['rel_err']:.1e}  {cells}", flush=True)
    with open(os.path.join(args.out, "experts_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
