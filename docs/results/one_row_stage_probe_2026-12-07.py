"""Probe (not project code) for docs/notes/2026-12-07-scale-values-lost-and-one-row-profile.md:
what a one-row dense GEMV stage spends its time on, and whether 128 x 128 tiles with one scale a
tile (K split to balance the programs) stream faster than today's 32 x 512 tiles whose x is
scaled a column.

Run from a checkout's root on a GPU: `python docs/results/one_row_stage_probe_2026-12-07.py`
($OUT for the JSON). Each stage alone as the kernels run it: a persistent grid of SMs x programs a
SM (8 warps), weights rotating past L2, 20 launches a CUDA graph, the median of 7 replays less
an empty launch's time. Every variant is checked against torch first (bf16 output; the bound
variants `noscale` / `weights` give wrong numbers on purpose and are not checked).
- main: `gemv._gemv_stage` at one row as K1 / K2 run it (`single_row_blocks`: BN 32 / 16 / 8,
  BK 16 K elements / BN, x scaled a column by its E8M0 code, loaded each step);
- main-noscale: the same without the scale codes (the bound of what they cost);
- main-weights: the weights alone (no x, no scale): the loop's stream;
- tile: 128 x 128 tiles (16 KB, one scale block), the step's partial sum scaled once by the
  tile's code, K split into `balanced_split` slices summed in order by the last (tickets);
- tile-noscale: the same without the code;
- tile-ahead: each step's code loaded one step before (a register carried), not in its step;
- wide: the tiles' products summed element-wise in a [128, 128] fp32 accumulator, reduced along K
  once a task instead of every step (x scaled by the tile's code); wide-ahead: with the codes ahead;
- @2: two programs a SM; :S: a pipeline S deep (default 4).
"""
import argparse
import importlib
import json
import os
import sys
import tempfile

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from monodecode.mono import gemv as base  # noqa: E402
from monodecode.mono import gemv_tiles as tiles  # noqa: E402
from monodecode.mono.fp8 import e4m3_value, e8m0_value  # noqa: E402
from monodecode.mono.sync import arrive  # noqa: E402

SCALE_LINE = "            x = x * e8m0_value(tl.load(scale_row + (k0 + rk) // SB).to(tl.int32))\n"
PRODUCT_LINE = "        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)\n"
REWRITES = {"noscale": [(SCALE_LINE, "")],
            "weights": [(SCALE_LINE, ""), (PRODUCT_LINE, "        acc += tl.sum(w.to(tl.float32), axis=1)\n")]}


def rewritten(name):
    """gemv.py with REWRITES[name] applied, imported as a module of its own."""
    folder = tempfile.mkdtemp()
    source = open(base.__file__).read().replace("from .", "from monodecode.mono.")
    for old, new in REWRITES[name]:
        assert old in source, (name, old)
        source = source.replace(old, new)
    with open(os.path.join(folder, f"gemv_{name}.py"), "w") as f:
        f.write(source)
    sys.path.insert(0, folder)
    return importlib.import_module(f"gemv_{name}")


@triton.jit
def _code(s_ptr, i, steps, n_tasks, pid, grid, K, SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          SPLIT: tl.constexpr):
    """The E8M0 code of the program's K step i (`one_row_tiles`' task order; 127 past its tasks)."""
    t = pid + i // steps * grid
    nb = t // SPLIT
    k0 = ((t - nb * SPLIT) * steps + i % steps) * BK
    return tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + k0 // SB, mask=t < n_tasks, other=127)


@triton.jit
def one_row_tiles(x_ptr, w_ptr, s_ptr, y_ptr, sums_ptr, tickets_ptr, N, K, group_rows, SB: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                  SCALE: tl.constexpr, WIDE: tl.constexpr, AHEAD: tl.constexpr, FAST: tl.constexpr = True):
    """y = x @ W.T for one row on BN x BK tiles inside one scale block (BN, BK <= SB): a step's
    fp32 partial sum times the tile's power of two; task t is slice t % SPLIT of block t // SPLIT,
    the block's last slice to arrive sums the slices in order. WIDE: the products summed
    element-wise in a [BN, BK] fp32 accumulator (x scaled by the tile's code first), reduced along K
    once a task (no reduction across threads in the K loop), else reduced every step. AHEAD: each
    step's code loaded a step before (carried in a register: the load's latency under a step's
    work), else loaded in the step that uses it. FAST: the codes bitcast to e4m3 (a
    GPU), else decoded from their bits (the interpreter, for a check on a CPU)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    K = K // BK * BK
    steps = K // BK // SPLIT
    n_tasks = tl.cdiv(N, BN) * SPLIT
    mine = tl.cdiv(tl.maximum(n_tasks - pid, 0), grid)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN,), dtype=tl.float32)
    wide = tl.zeros((BN, BK), dtype=tl.float32)
    code = _code(s_ptr, 0, steps, n_tasks, pid, grid, K, SB, BN, BK, SPLIT)
    for i in tl.range(0, mine * steps, num_stages=STAGES):
        j = i // steps
        step = i - j * steps
        t = pid + j * grid
        nb = t // SPLIT
        k0 = ((t - nb * SPLIT) * steps + step) * BK
        n = nb * BN + tl.arange(0, BN)
        xoff = 0
        if group_rows > 0:
            xoff = (nb * BN) // group_rows * K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
        x = tl.load(x_ptr + xoff + k0 + rk).to(tl.float32)
        if FAST:
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = e4m3_value(w.to(tl.int32))
        if SCALE:
            if AHEAD:  # this step's code came with the last step; the next step's is loaded now
                scale = e8m0_value(code.to(tl.int32))
                code = _code(s_ptr, i + 1, steps, n_tasks, pid, grid, K, SB, BN, BK, SPLIT)
            else:
                scale = e8m0_value(_code(s_ptr, i, steps, n_tasks, pid, grid, K, SB, BN, BK, SPLIT).to(tl.int32))
            if WIDE:
                x = x * scale
        if WIDE:
            wide += w * x[None, :]
        else:
            part = tl.sum(w * x[None, :], axis=1)
            if SCALE:
                part = part * scale
            acc += part
        if step == steps - 1:
            if WIDE:
                acc = tl.sum(wide, axis=1)
                wide = tl.zeros((BN, BK), dtype=tl.float32)
            if SPLIT == 1:
                tl.store(y_ptr + n, acc.to(tl.bfloat16), mask=n < N)
            else:
                tl.store(sums_ptr + t * BN + tl.arange(0, BN), acc)
            acc = tl.zeros((BN,), dtype=tl.float32)
    if SPLIT > 1:
        for j in range(mine):
            nb = (pid + j * grid) // SPLIT
            if arrive(tickets_ptr + nb) == SPLIT - 1:
                block = sums_ptr + nb * SPLIT * BN + tl.arange(0, BN)
                total = tl.load(block, cache_modifier=".cg")
                for k in tl.range(1, SPLIT, loop_unroll_factor=1):
                    total += tl.load(block + k * BN, cache_modifier=".cg")
                tl.atomic_xchg(tickets_ptr + nb, 0, sem="relaxed", scope="gpu")
                n = nb * BN + tl.arange(0, BN)
                tl.store(y_ptr + n, total.to(tl.bfloat16), mask=n < N)


@triton.jit
def _empty(y_ptr):
    pass


DEV = "cuda"
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1
# (name, N, K, group_rows): the window layer's dense matrices at v4-flash sizes (w2's SwiGLU left out)
SHAPES = [("wq_a|wkv", 1536, 4096, 0), ("wq_b", 32768, 1024, 0), ("wo_a", 8192, 4096, 1024),
          ("wo_b", 4096, 8192, 0), ("w1|w3", 4096, 4096, 0), ("w2", 4096, 2048, 0)]
MODULES = {"main": base, **{name: rewritten(name) for name in REWRITES}}


def timed(fn, reps=20, rounds=7):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def launcher(variant, N, K, group_rows, x, ws, s, y, programs, stages):
    """A function launching `variant`'s stage on the next weight copy."""
    copies, turn = len(ws), iter(range(10 ** 9))
    kind, _, bound = variant.partition("-")
    if kind == "main":
        module = MODULES[bound or "main"]
        bn, bk = tiles.single_row_blocks(N, K, 128, programs)
        dummy = torch.zeros(1, device=DEV)
        tickets = torch.zeros(1, dtype=torch.int32, device=DEV)
        return lambda: module._gemv_stage[(programs,)](
            x, x.shape[1], 1, ws[next(turn) % copies], s, y, N, N, K, group_rows, dummy, tickets, x, 0.0, WFMT=0,
            SB=128, BN=bn, BK=bk, SPLIT=1, BR=1, OUT_BF16=True, FAST=True, STAGES=stages, SWIGLU=False,
            num_warps=8), f"{bn}x{bk}"
    split = tiles.balanced_split(triton.cdiv(N, 128), K, 128, programs)
    sums = torch.full((triton.cdiv(N, 128) * split * 128,), float("nan"), device=DEV)
    tickets = torch.zeros(triton.cdiv(N, 128), dtype=torch.int32, device=DEV)
    return lambda: one_row_tiles[(programs,)](
        x, ws[next(turn) % copies], s, y, sums, tickets, N, K, group_rows, SB=128, BN=128, BK=128, SPLIT=split,
        STAGES=stages, SCALE=bound != "noscale", WIDE=kind == "wide", AHEAD=bound == "ahead", num_warps=8), \
        f"128x128/{split}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--matrices", default=",".join(name for name, *_ in SHAPES), help="of " + ", ".join(
        name for name, *_ in SHAPES))
    parser.add_argument("--variants", default="main,main-noscale,main-weights,tile,tile-ahead,tile-noscale,wide,"
                        "wide-ahead")
    parser.add_argument("--quick", action="store_true", help="one program a SM, 4 deep only")
    args = parser.parse_args()
    a = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    copy = 2 * a.numel() / timed(lambda: b.copy_(a), reps=5) / 1e6
    empty = timed(lambda: _empty[(SMS,)](a))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"copy {copy:.2f} TB/s; an empty launch {empty:.1f} us (subtracted)", flush=True)
    variants = args.variants.split(",")
    shapes = [shape for shape in SHAPES if shape[0] in args.matrices.split(",")]
    results = []
    for name, N, K, group_rows in shapes:
        width = (N // group_rows) * K if group_rows else K
        copies = max(2, (256 << 20) // (N * K))
        ws = [torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, device=DEV)
              | (torch.randint(0, 2, (N, K), dtype=torch.uint8, device=DEV) << 7) for _ in range(copies)]
        s = torch.randint(118, 126, (N // 128, K // 128), dtype=torch.uint8, device=DEV)
        x = torch.randn(1, width, device=DEV).to(torch.bfloat16)
        dense = ws[0].view(torch.float8_e4m3fn).float() * torch.repeat_interleave(
            torch.repeat_interleave(torch.exp2(s.float() - 127), 128, 0), 128, 1)
        rows = group_rows or N
        wanted = torch.cat([x[:, g * K:(g + 1) * K].float() @ dense[g * rows:(g + 1) * rows].T
                            for g in range(N // rows)], dim=1)
        line = [f"{name} [{N} x {K}] {N * K / copy / 1e6:.1f} us at copy speed:"]
        for variant in variants:
            for pps, stages in ((1, 4), (2, 4), (1, 3), (1, 6)):
                if (pps == 2 and variant.endswith(("noscale", "weights")) or stages != 4 and variant != "wide-ahead"
                        or args.quick and (pps, stages) != (1, 4)):
                    continue
                label = variant + (f"@{pps}" if pps > 1 else "") + (f":{stages}" if stages != 4 else "")
                y = torch.full((1, N), float("nan"), dtype=torch.bfloat16, device=DEV)
                try:
                    fn, tiles = launcher(variant, N, K, group_rows, x, ws[:1], s, y, SMS * pps, stages)
                    fn()
                    torch.cuda.synchronize()
                    if not variant.endswith(("noscale", "weights")):
                        err = ((y.float() - wanted).norm() / wanted.norm()).item()
                        assert err < 1e-2, f"{label}: relative error {err:.2e}"
                    fn, tiles = launcher(variant, N, K, group_rows, x, ws, s, y, SMS * pps, stages)
                    t = timed(fn) - empty
                    line.append(f"{label} ({tiles}) {t:.1f}")
                    results.append({"matrix": name, "variant": label, "tiles": tiles, "us": t,
                                    "tb_s": N * K / t / 1e6})
                except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                    line.append(f"{label} failed: {str(e).splitlines()[0][:100]}")
        print(" | ".join(line), flush=True)
    sums = {}
    for r in results:
        sums[r["variant"]] = sums.get(r["variant"], 0.0) + r["us"]
    print("sum over the six:", ", ".join(f"{v} {t:.1f}" for v, t in sums.items()))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "one_row_stage_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_tb_s": copy, "empty_us": empty,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
