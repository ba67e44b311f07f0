"""Probe (issue 28): do K2's FFN-seam stages wait on instruction fetch?

The Nsight profile of a window layer at 6 rows (2026-12-06) shows K2's fold, gate|w1|w3 and
route|w2 with 37-39 % of their samples stalled on no instruction, where wo_a and wo_b (earlier
in the same 165 KB kernel) show none and K1's fold (the same code in a 67 KB kernel) waits on
shared memory instead. If fetching the code is what they wait on, a K2 launched right after
another K2 (its code just run, what fits still in the SMs' instruction caches) runs those
stages faster. This times each K2 stage (the timeline) in a graph of K1, K2, K3 as the layer
runs, and in one of K1, K2, K2, K3 (the second K2 stamps the timeline; K2 is idempotent on its
inputs: the same attention, fold, settle, routing), per width.

Run from the repository root on a GPU:
    python docs/results/k2_twice_probe_2026-12-06.py --widths 1,6,16 --kind window
"""

import argparse

import torch

from monodecode.bench.layer import KINDS, LayerBench, build, fill_cache
from monodecode.bench.timing import graphed
from monodecode.mono.timeline import format_times, stage_times


def k2_stages(bench: LayerBench, kernels, twice: bool) -> str:
    runner = bench.runner
    launch = runner.launch

    def launch_k2_twice(kernel, name, family, *args, **kwargs):
        if name == "K2":
            launch(kernel, name, family, *args, **kwargs)
        return launch(kernel, name, family, *args, **kwargs)

    runner.timeline = True
    if twice:
        runner.launch = launch_k2_twice
    try:
        replay = graphed(kernels, bench.device)
        for _ in range(bench.reps):
            replay()
        torch.cuda.synchronize(bench.device)
        runner.check()
        return format_times(stage_times(runner.timelines["k2"], runner.sync["k2"].stage_names))
    finally:
        runner.launch = launch
        runner.timeline = False
        runner.timelines.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1,6,16")
    parser.add_argument("--kind", default="window", choices=list(KINDS.values()))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    cli = parser.parse_args()
    device = torch.device("cuda")
    decoder = build("v4-flash", device, kinds=(cli.kind,))
    bench = LayerBench(decoder, fill_cache(decoder.model, cli.context), cli.context, cli.reps)
    print(torch.cuda.get_device_name(device), "torch", torch.__version__, "triton", __import__("triton").__version__)
    g = torch.Generator().manual_seed(2)
    for width in map(int, cli.widths.split(",")):
        step = bench.step(0, width, g)
        for twice in (False, True, False, True):
            label = "K1, K2, K2, K3 (the second K2's stages)" if twice else "K1, K2, K3"
            print(f"\n{cli.kind} layer, {width} rows, {label}:\n{k2_stages(bench, step.kernels, twice)}")


if __name__ == "__main__":
    main()
