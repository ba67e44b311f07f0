"""How fast the expert stage's loads alone can stream MXFP4 codes on a GPU: the K loop without the decode.

`python tests/expert_load_probe.py [--per-sm 1,2,3,4] [--steps] [--out DIR]` (CUDA only). A copy of the
fragment-order K loop of `experts._fragment_matvec` (tiles of 128 rows x 256 columns, 8 warps,
the next K step loaded into registers while the current one is used) that only XORs the loaded
codes into registers, run over 1 GiB of codes (4096-column rows, the gate/up shape), with P
persistent programs a SM, so that the bytes in flight are those of the real kernel. Address
patterns:
- `rows`: the codes as stacked (rows of K / 2 bytes, the fragment order inside each 128
  columns); one load instruction of a warp reads 64 bytes of each of 8 rows (`_load_fragments`).
- `tiled`: each 16 rows x 128 columns stored as one 1 KB block in the order the lanes read it;
  one load instruction of a warp reads 512 contiguous bytes.
Scales: `none`; `rows` (as stacked: each lane reads its 2 rows' 8 bytes a K step, a quarter of
a 32-byte sector); `tiled` (a 128-column group's 4 scales of a row, rows contiguous: a warp's
instruction reads one whole sector). Prints TB/s of the bytes read against the copy bandwidth.

`--steps` instead: the loads of one decode step's gate/up tiles (tiled codes, no scales), a
program a tile of a few experts (4096 rows each: w1 over w3), 12 steps of fresh random experts
in one CUDA graph as `experts_bench` times them: 6 experts (1 row of top-6) as the stage runs
them, with K in 2 or 4 slices, two K steps ahead, 64-row tiles of 4 warps, the blocks stored
K-step-major (each 4 bands' 8 blocks of a 256-column step in 8 contiguous KB, instead of each
band's blocks along K), and 12 and 34 experts (2 and 6 rows): what HBM gives that access pattern
when the kernel does nothing else.
"""

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from monodecode.bench.timing import copy_bandwidth, graphed, timed

K, BN, BK, WARPS = 4096, 128, 256, 8
ROWS_TOTAL = 1 << 19  # 1 GiB of codes


@triton.jit
def _codes(codes, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr):
    G: tl.constexpr = BK // 128
    W: tl.constexpr = BN // 16
    g = tl.arange(0, G)[:, None, None]
    a = tl.arange(0, 2)[None, :, None]
    f = tl.arange(0, W * 256)[None, None, :]
    if TILED:  # block (row0 / 16 + w, group): 512 halves, a then (row i, chunk, 8 halves)
        block = (row0 // 16 + f // 256) * (K // 128) + k0 // 128 + g
        return tl.load(codes + tl.multiple_of(block * 512 + a * 256, [1, 1, 8]) + f % 256)
    rows = row0 + 16 * (f // 256) + 8 * a + f // 32 % 8
    return tl.load(codes + tl.multiple_of(rows * (K // 4) + k0 // 4 + 32 * g, [1, 1, 8]) + f % 32)


@triton.jit
def _scales_rows(scales, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """As `_load_fragments`: [2, W * 32 * S], a row's S scales for each of its 4 lanes."""
    S: tl.constexpr = BK // 32
    W: tl.constexpr = BN // 16
    f = tl.arange(0, W * 32 * S)[None, :]
    rows = row0 + 16 * (f // (32 * S)) + 8 * tl.arange(0, 2)[:, None] + f // (4 * S) % 8
    return tl.load(scales + tl.multiple_of(rows * (K // 32) + k0 // 32, [1, S]) + f % S).to(tl.int32)


@triton.jit
def _scales_tiled(scales, row0, k0, R, BN: tl.constexpr, BK: tl.constexpr):
    """[K / 128, R, 4] as [G, 2, W * 128]: (w, row i, lane t, 4 scales)."""
    W: tl.constexpr = BN // 16
    G: tl.constexpr = BK // 128
    g = tl.arange(0, G)[:, None, None]
    a = tl.arange(0, 2)[None, :, None]
    f = tl.arange(0, W * 128)[None, None, :]
    rows = row0 + 16 * (f // 128) + 8 * a + f // 16 % 8
    return tl.load(scales + tl.multiple_of(((k0 // 128 + g) * R + rows) * 4, [1, 1, 4]) + f % 4).to(tl.int32)


@triton.jit
def _probe(codes, scales, out, tasks, K, R, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr,
           SCALES: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((BK // 128, 2, BN // 16 * 256), tl.int16)
    sacc = 0
    for t in range(pid, tasks, grid):
        row0 = t * BN
        tile = _codes(codes, row0, 0, K, BN, BK, TILED)
        if SCALES == 1:
            sc = _scales_rows(scales, row0, 0, K, BN, BK)
        if SCALES == 2:
            sc = _scales_tiled(scales, row0, 0, R, BN, BK)
        for k0 in tl.range(0, K, BK, num_stages=1):
            ahead = tl.minimum(k0 + BK, K - BK)
            next_tile = _codes(codes, row0, ahead, K, BN, BK, TILED)
            acc ^= tile
            tile = next_tile
            if SCALES == 1:
                next_sc = _scales_rows(scales, row0, ahead, K, BN, BK)
                sacc += tl.sum(sc)
                sc = next_sc
            if SCALES == 2:
                next_sc = _scales_tiled(scales, row0, ahead, R, BN, BK)
                sacc += tl.sum(sc)
                sc = next_sc
    tl.store(out + pid, tl.sum(acc.to(tl.int32)) + sacc)


@triton.jit
def _step_codes(codes, row0, k0, K, BN: tl.constexpr, BK: tl.constexpr, STEP_MAJOR: tl.constexpr):
    """`_codes` (tiled), or (STEP_MAJOR) with the blocks of each 4 bands' 256-column step contiguous."""
    if STEP_MAJOR:
        G: tl.constexpr = BK // 128
        g = tl.arange(0, G)[:, None, None]
        a = tl.arange(0, 2)[None, :, None]
        f = tl.arange(0, BN // 16 * 256)[None, None, :]
        band = row0 // 16 + f // 256
        block = (band // 4) * (K // 256) * 8 + (band % 4) * 2 + g % 2 + (g // 2) * 8 + (k0 // 256) * 8
        tile = tl.load(codes + tl.multiple_of(block * 512 + a * 256, [1, 1, 8]) + f % 256)
    else:
        tile = _codes(codes, row0, k0, K, BN, BK, True)
    return tile


@triton.jit
def _step_tiles(codes, experts, out, K, ROWS, SPLIT: tl.constexpr, AHEAD: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, STEP_MAJOR: tl.constexpr):
    """Program (t, part): tile t (BN rows of expert experts[t // (ROWS / BN)]), slice `part` of
    SPLIT of K, AHEAD K steps loaded ahead (2: unrolled by 3, so the tiles need no moves)."""
    t, part = tl.program_id(0), tl.program_id(1)
    per_expert = ROWS // BN
    row0 = tl.load(experts + t // per_expert).to(tl.int64) * ROWS + (t % per_expert) * BN
    lo = part * (K // SPLIT)
    hi = lo + K // SPLIT
    acc = tl.zeros((BK // 128, 2, BN // 16 * 256), tl.int16)
    tile = _step_codes(codes, row0, lo, K, BN, BK, STEP_MAJOR)
    if AHEAD == 2:
        tile1 = _step_codes(codes, row0, tl.minimum(lo + BK, hi - BK), K, BN, BK, STEP_MAJOR)
        for k0 in tl.range(lo, hi, BK, num_stages=1, loop_unroll_factor=3):
            tile2 = _step_codes(codes, row0, tl.minimum(k0 + 2 * BK, hi - BK), K, BN, BK, STEP_MAJOR)
            acc ^= tile
            tile, tile1 = tile1, tile2
    else:
        for k0 in tl.range(lo, hi, BK, num_stages=1):
            next_tile = _step_codes(codes, row0, tl.minimum(k0 + BK, hi - BK), K, BN, BK, STEP_MAJOR)
            acc ^= tile
            tile = next_tile
    tl.store(out + t * SPLIT + part, tl.sum(acc.to(tl.int32)))


def steps(out_dir: str) -> None:
    """`--steps` (module docstring)."""
    experts_total, rows, steps_a_graph = 256, 4096, 12
    codes = torch.randint(-32768, 32767, (experts_total * rows, K // 4), dtype=torch.int16, device="cuda")
    out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth("cuda")
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_TBps": copy / 1e12,
              "runs": []}
    print(f"copy {copy / 1e12:.3f} TB/s on {result['device']}", flush=True)
    for experts, split, ahead, warps, step_major in ((6, 1, 1, 8, 0), (6, 2, 1, 8, 0), (6, 4, 1, 8, 0),
                                                     (6, 1, 2, 8, 0), (6, 1, 1, 4, 0), (6, 1, 1, 8, 1),
                                                     (12, 1, 1, 8, 0), (34, 1, 1, 8, 0), (34, 1, 1, 8, 1)):
        picks = [torch.randperm(experts_total, device="cuda", generator=g)[:experts].int()
                 for _ in range(steps_a_graph)]
        bn = 128 if warps == 8 else 64
        tiles = experts * rows // bn
        run = lambda: [_step_tiles[(tiles, split)](codes, p, out, K, rows, SPLIT=split, AHEAD=ahead,  # noqa: E731
                                                   BN=bn, BK=BK, STEP_MAJOR=step_major, num_warps=warps,
                                                   maxnreg=128) for p in picks]
        us = timed(graphed(run, "cuda"), "cuda", reps=5) * 1e6 / steps_a_graph  # median of 5 replays
        entry = {"experts": experts, "split": split, "ahead": ahead, "tile_rows": bn, "warps": warps,
                 "blocks": ("as stored", "step-major")[step_major], "programs": tiles * split, "us": us,
                 "TBps": experts * rows * K / 2 / us / 1e6}
        result["runs"].append(entry)
        print(f"{experts:3d} experts, K in {split}, {ahead} step(s) ahead, {bn}-row tiles of {warps} warps, "
              f"blocks {entry['blocks']}: "
              f"{entry['programs']:5d} programs {us:6.1f} us {entry['TBps']:.2f} TB/s", flush=True)
    with open(os.path.join(out_dir, "expert_load_probe_steps.json"), "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-sm", default="1,2,3,4", help="persistent programs a SM")
    parser.add_argument("--steps", action="store_true", help="a decode step's gate/up tiles (module docstring)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.steps:
        steps(args.out)
        return 0
    codes = torch.randint(-32768, 32767, (ROWS_TOTAL, K // 4), dtype=torch.int16, device="cuda")
    scales = torch.randint(0, 255, (ROWS_TOTAL * K // 32,), dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth("cuda")
    tasks = ROWS_TOTAL // BN
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_TBps": copy / 1e12,
              "runs": []}
    print(f"copy {copy / 1e12:.3f} TB/s on {result['device']}", flush=True)
    for per_sm, tiled, scale_pattern in itertools.product([int(p) for p in args.per_sm.split(",")], (0, 1),
                                                          (0, 1, 2)):
        out = torch.empty(per_sm * sms, dtype=torch.int32, device="cuda")
        run = lambda: _probe[(per_sm * sms,)](codes, scales, out, tasks, K, ROWS_TOTAL, BN=BN, BK=BK,  # noqa: E731
                                              TILED=tiled, SCALES=scale_pattern, num_warps=WARPS)
        run()
        seconds = timed(run, "cuda", reps=7)
        read = codes.numel() * 2 + (scales.numel() if scale_pattern else 0)
        entry = {"per_sm": per_sm, "codes": ("rows", "tiled")[tiled],
                 "scales": ("none", "rows", "tiled")[scale_pattern], "TBps": read / seconds / 1e12,
                 "of_copy": read / seconds / copy}
        result["runs"].append(entry)
        print(f"{per_sm} a SM, codes {entry['codes']:<5}, scales {entry['scales']:<5}: {entry['TBps']:.2f} TB/s "
              f"({entry['of_copy']:.0%} of copy)", flush=True)
    with open(os.path.join(args.out, "expert_load_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
