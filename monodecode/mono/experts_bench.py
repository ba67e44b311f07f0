"""Benchmark of the routed-expert stage on a GPU: expert bytes per second against the copy floor.

`python -m monodecode.mono.experts_bench [--rows 1,6,16,48] [--steps 20] [--quick]
[--programs-per-sm 0,1,2] [--layouts interleave,fragments,tma,fragments+tma]
[--configs BN,BK,WARPS,STAGES[,REGISTERS[,PDL[,PAIRED[,DOWN_SPLIT[,OVERLAP[,DIAGONAL[,UP_SPLIT]]]]]]];...]
[--no-portable] [--out DIR]`

For each row count, `--steps` fresh random routings (top-6 of 256 experts a row, distinct within a
row) are captured in one CUDA graph, so that consecutive steps mostly read other experts and the
weights come from HBM; the graph is replayed 5 times and the median per step kept. Bytes: the
distinct experts each step touches times one expert's MXFP4 bytes (codes + scales of w1, w2, w3).
The gate/up and the down kernel are also timed alone, each over its own bytes (w1 + w3; w2).
The copy bandwidth (a 2 GiB device-to-device copy, bytes read + written, eager) is measured in
the same run. Layouts: the codes in the checkpoint's order, decoded halves interleaved for the
dot (`interleave`), or in the fragment order (`fragments`, `ExpertWeights.fragments`, how the
mono runner stacks them); `tma`, `+tma`: the codes tiles loaded through tensor descriptors
(`LaunchConfig.tma`). STAGES is Triton's pipelining of the K loop, which the fragment order
without tma does not use (it prefetches by itself); REGISTERS caps the registers a thread
(`LaunchConfig.max_registers`, name ending in `rN`); PDL 1 launches the SwiGLU and down kernels
as programmatic dependents of gate/up (`LaunchConfig.pdl`, `pdl`); PAIRED 1 takes gate and up of
a block in one tile with the SwiGLU in its epilogue (`LaunchConfig.paired`, `paired`: gate/up
alone is then that kernel); DOWN_SPLIT S runs down in S slices of the intermediate
(`LaunchConfig.down_split`, `dsS`); OVERLAP 1 has down's tasks wait for their own group's
gate/up tasks instead of the whole kernel (`LaunchConfig.overlap`, `overlap`; down alone then
does not wait); DIAGONAL 1 scales the fp32 partial sums of tasks of one or two rows
(`LaunchConfig.diagonal`, `diagonal`); UP_SPLIT U runs the paired gate/up in U slices of the
hidden, the last to finish summing them (`LaunchConfig.up_split`, `usU`). Every variant is first
checked against the float64 reference at 6 rows; its line ends with what its gate/up and down
kernels hold: registers a thread, spilled registers, and `async` where Triton staged the codes
through shared memory (its software pipelining).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from ..bench.timing import copy_bandwidth
from . import experts as X

E, D, I, TOPK = 256, 4096, 2048, 6  # v4-flash


def random_bank(g: torch.Generator) -> X.ExpertWeights:
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


def check(bank, config, g) -> float:
    ids = routings(6, 1, g)[0]
    x = torch.randn(6, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(6, TOPK, device="cuda", generator=g)
    y = X.routed_experts(x, ids, w, bank, 10.0, config, poison=True).double()
    ref = X.reference(x, ids, w, bank, 10.0)
    return ((y - ref).norm() / ref.norm()).item()


def resources(bank, config, g) -> dict:
    """Registers a thread, spilled registers, and whether Triton staged the codes through shared
    memory (cp.async in the PTX: its software pipelining) of the gate/up and down kernels."""
    ids = routings(6, 1, g)[0]
    x = torch.randn(6, D, device="cuda", generator=g).to(torch.bfloat16)
    kernels = X.launch_stages(x, X.group_picks(ids), torch.rand(6 * TOPK, device="cuda", generator=g), bank, 10.0,
                              config, X.StageBuffers(6 * TOPK, bank, "cuda", splits=config.down_split,
                                                              up_splits=config.up_split))
    return {name: {"registers": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                   "cp_async": k.asm.get("ptx", "").count("cp.async.")}
            for name, k in kernels.items() if k is not None}


def time_steps(bank, config, rows, steps, g, kernels=("up", "swiglu", "down")) -> tuple[float, float]:
    """(median microseconds per step, mean distinct experts per step) of `kernels` (all three:
    the stage, kernels only; "up" or "down" alone: that kernel)."""
    plans = []
    for ids in routings(rows, steps, g):
        x = torch.randn(rows, D, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.rand(rows * TOPK, device="cuda", generator=g)
        buffers = X.StageBuffers(rows * TOPK, bank, "cuda", splits=config.down_split, up_splits=config.up_split)
        plans.append((x, X.group_picks(ids), w, buffers, ids.unique().numel()))
    run = lambda: [X.launch_stages(x, grp, w, bank, 10.0, config, buffers, kernels)  # noqa: E731
                   for x, grp, w, buffers, _ in plans]
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / steps)
    return sorted(times)[2], sum(p[-1] for p in plans) / steps


LAYOUTS = ("interleave", "fragments", "tma", "fragments+tma")


def variants(quick: bool, programs_per_sm: list[int], layouts: list[str], configs: list[tuple] | None = None,
             portable: bool = True):
    """(name, layout, LaunchConfig): the portable decode (if `portable`), then a grid of fast ones
    (or the (block_n, block_k, warps, stages[, max registers[, pdl[, paired[, down split]]]]) in
    `configs`), each with a program a task (pps 0) or pps persistent programs a SM running K2's
    task loops. The K loop: s1, s2, s3 (Triton's num_stages); the layout as in the module
    docstring."""
    if portable:
        yield "portable", "interleave", X.LaunchConfig(fast=False, block_n=64, block_k=128, num_warps=4, num_stages=2)
    grid = configs or (itertools.product((64, 128), (256, 512), (4, 8), (1, 2)) if quick else
                       itertools.product((32, 64, 128), (128, 256, 512), (4, 8), (1, 2, 3)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (bn, bk, nw, stages, *extra), layout, pps in itertools.product(grid, layouts, programs_per_sm):
        registers, pdl, paired, split, overlap, diagonal, up_split = list(extra) + [0, 0, 0, 1, 0, 0, 1][len(extra):]
        name = (f"fast bn{bn} bk{bk} w{nw} s{stages} {layout}" + (f" pps{pps}" if pps else "")
                + (f" r{registers}" if registers else "") + (" pdl" if pdl else "") + (" paired" if paired else "")
                + (f" ds{split}" if split > 1 else "") + (" overlap" if overlap else "")
                + (" diagonal" if diagonal else "") + (f" us{up_split}" if up_split > 1 else ""))
        yield name, layout, X.LaunchConfig(True, bn, bk, nw, stages, programs=pps * sms, tma=layout.endswith("tma"),
                                           max_registers=registers, pdl=bool(pdl), paired=bool(paired),
                                           down_split=split, overlap=bool(overlap), diagonal=bool(diagonal),
                                           up_split=up_split)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6,16,48")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a small grid of launch configs")
    parser.add_argument("--programs-per-sm", default="0",
                        help="comma-separated: 0 = a program a task; n = n persistent programs a SM running K2's "
                             "task loops (the stage as it runs inside K2)")
    parser.add_argument("--layouts", default="interleave,fragments",
                        help=f"comma-separated, of {', '.join(LAYOUTS)} (module docstring)")
    parser.add_argument("--configs", default="",
                        help="semicolon-separated block_n,block_k,warps,stages[,max registers[,pdl 0/1[,paired 0/1"
                             "[,down split[,overlap 0/1[,diagonal 0/1[,up split]]]]]]] (e.g. 128,256,8,1,128,1;"
                             "64,256,4,3) instead of the grid (0 registers: uncapped)")
    parser.add_argument("--no-portable", action="store_true",
                        help="leave out the portable decode (e.g. to profile one variant alone)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c.strip()]
    except ValueError:
        configs = [()]
    if any(len(c) not in range(4, 12) for c in configs):
        parser.error(f"--configs {args.configs!r}: want block_n,block_k,warps,stages[,max registers[,pdl 0/1"
                     "[,paired 0/1[,down split[,overlap 0/1[,diagonal 0/1[,up split]]]]]]] separated by ';'")
    rows_list = [int(r) for r in args.rows.split(",")]
    layouts = args.layouts.split(",")
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(sorted(unknown))}; known: {', '.join(LAYOUTS)}")
    g = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth("cuda")
    checkpoint_order = random_bank(g)
    banks = {False: checkpoint_order}
    if any(layout.startswith("fragments") for layout in layouts):  # the same experts, a second copy
        banks[True] = X.in_fragment_order(checkpoint_order)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d"),
              "copy_TBps": copy / 1e12, "expert_MB": expert_bytes() / 1e6, "variants": {}}
    print(f"copy {copy / 1e12:.3f} TB/s on {result['device']}", flush=True)
    for name, layout, config in variants(args.quick, [int(p) for p in args.programs_per_sm.split(",")], layouts,
                                             configs, not args.no_portable):
        bank = banks[layout.startswith("fragments")]
        try:
            err = check(bank, config, g)
        except Exception as e:  # a config the compiler refuses (e.g. out of shared memory)
            print(f"{name}: failed: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        entry = {"config": config.__dict__, "rel_err": err, "kernels": resources(bank, config, g), "rows": {}}
        for rows in rows_list:
            us, distinct = time_steps(bank, config, rows, args.steps, g)
            tbps = distinct * expert_bytes() / (us * 1e-6) / 1e12
            entry["rows"][rows] = {"us": us, "distinct_experts": distinct, "TBps": tbps, "of_copy": tbps * 1e12 / copy}
            for kernel, share in (("up", 2 / 3), ("down", 1 / 3)):  # w1 + w3, and w2: each kernel's own bytes
                us, distinct = time_steps(bank, config, rows, args.steps, g, (kernel,))
                entry["rows"][rows][f"{kernel}_TBps"] = share * distinct * expert_bytes() / (us * 1e-6) / 1e12
        result["variants"][name] = entry
        cells = "  ".join(f"{r}:{v['TBps']:.2f} ({v['up_TBps']:.2f}/{v['down_TBps']:.2f})"
                          for r, v in entry["rows"].items())
        regs = " ".join(f"{k}:{v['registers']}r/{v['spills']}s{'/async' if v['cp_async'] else ''}"
                        for k, v in entry["kernels"].items())
        print(f"{name:<32} err {err:.1e}  TB/s by rows (gate/up / down alone) {cells}  ({regs})", flush=True)
    best = {}
    for rows in rows_list:
        name, entry = max(((n, e) for n, e in result["variants"].items() if n != "portable"),
                          key=lambda item: item[1]["rows"][rows]["TBps"])
        best[rows] = (name, entry["rows"][rows])
    result["best"] = {r: {"variant": n, **v} for r, (n, v) in best.items()}
    with open(os.path.join(args.out, "experts_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ncopy {copy / 1e12:.3f} TB/s; expert stage, kernels only, {args.steps} fresh routings a row count")
    print(f"{'rows':>5} {'experts':>8} {'best variant':<32} {'us':>8} {'TB/s':>6} {'of copy':>8} {'up alone':>9} "
          f"{'down alone':>11} {'portable TB/s':>14}")
    for rows, (name, v) in best.items():
        portable = result["variants"].get("portable", {}).get("rows", {}).get(rows, {}).get("TBps", float("nan"))
        print(f"{rows:>5} {v['distinct_experts']:>8.1f} {name:<32} {v['us']:>8.1f} {v['TBps']:>6.2f} "
              f"{v['of_copy']:>8.0%} {v['up_TBps']:>9.2f} {v['down_TBps']:>11.2f} {portable:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
