"""The dense GEMV stage's tiles, on the host: how a GEMV of [N, K] weights is cut into tasks of BN
outputs over K steps of BK (and K slices) for a step of R rows, the scratch a split GEMV needs,
and the tilings the stage refuses. `gemv.py` holds the stage itself and its contract.

`gemv_tasks` (a stage's task count), `split_scratch` / `split_needs` (the slice sums and tickets a
split GEMV or a kernel's dense stages need), `row_block` (BR), `default_blocks` (BN, BK) of a
standalone dot task, `single_row_blocks` (BN, BK) of a one-row task, `kernel_blocks` (BN, BK,
SPLIT inside the kernels), `balanced_split` (the K slices that balance the programs),
`check_blocks` (the ValueErrors of the contract: call it at build) and `scale_block` (SB from a
scale tensor's shape).
"""

from __future__ import annotations

import triton


def gemv_tasks(N: int, BN: int, split: int = 1) -> int:
    """Tasks of a GEMV stage with N output columns in blocks of BN, each block's K in `split` slices."""
    return triton.cdiv(N, BN) * split


def split_scratch(N: int, BN: int, split: int, BR: int) -> tuple[int, int]:
    """(fp32 slice sums, tickets) a GEMV split `split` ways needs (`gemv_stage`'s sums_ptr and
    tickets_ptr): a [BN, BR] tile a task and a ticket an output block; none unsplit."""
    return (gemv_tasks(N, BN, split) * BN * BR, triton.cdiv(N, BN)) if split > 1 else (0, 0)


def split_needs(stages, rows: int) -> tuple[int, int]:
    """(fp32 slice sums, tickets) the largest of a kernel's dense `stages` needs at `rows` rows;
    a stage is a list of (N, (BN, BK, SPLIT)), one a GEMV that runs in it."""
    br = row_block(rows)
    needs = [[sum(part) for part in zip(*(split_scratch(N, bn, split, br) for N, (bn, _, split) in stage))]
             for stage in stages]
    return max(n[0] for n in needs), max(n[1] for n in needs)


def row_block(R: int) -> int:
    """BR for R rows: 1 for one row (the CUDA-core task), else R padded up to a power of two,
    at least 16 (the dot's minimum)."""
    return 1 if R == 1 else max(16, triton.next_power_of_2(R))


def default_blocks(N: int, K: int, SB: int | None = None, programs: int | None = None) -> tuple[int, int]:
    """(BN, BK) for an [N, K] weight (FP8 with SB x SB scale blocks, or bf16 with SB None):
    BN = min(64, SB, next_pow2(N)) but >= 16, halved (not below 16) while the stage has fewer
    tasks than half of `programs` (the persistent grid, if given); BK = the largest power of
    two <= min(128, SB) that divides K. Why: a task streams too few bytes at once to cover the
    memory latency, so a small stage wants most programs busy."""
    bn = max(16, min(64 if SB is None else min(64, SB), triton.next_power_of_2(N)))
    while programs and bn > 16 and 2 * gemv_tasks(N, bn) < programs:
        bn //= 2
    bk = min(128 if SB is None else min(128, SB), K & -K)
    return bn, bk


def single_row_blocks(N: int, K: int, SB: int | None = None, programs: int | None = None) -> tuple[int, int]:
    """(BN, BK) of a one-row task: BN one of 32, 16, 8 (at most SB and N padded to a power of two),
    with `programs` (the persistent grid) the one whose tasks leave the busiest program the fewest
    weight rows, ceil(tasks / programs) * BN (the largest of those that tie), else the largest;
    BK = 16384 weight elements / BN, capped at the largest power of two dividing K. Why: one row
    is a stream of weights with almost no arithmetic, so a step's load is as large as the
    registers allow without spilling, and a stage ends when its busiest program does (the router
    gate's 256 rows in tasks of 16 made its programs the busiest of the gate|w1|w3 stage)."""
    sizes = [bn for bn in (32, 16, 8) if bn <= min(SB or 32, max(8, triton.next_power_of_2(N)))]
    bn = sizes[0]
    if programs:
        bn = min(sizes, key=lambda b: (triton.cdiv(gemv_tasks(N, b), programs) * b, -b))
    return bn, min(16384 // bn, K & -K)


def kernel_blocks(block_n: int, block_k: int, chunk: int, N: int, K: int, SB: int | None, programs: int,
                  rows: int, warps: int) -> tuple[int, int, int]:
    """(BN, BK, SPLIT) of a GEMV stage inside the persistent kernels for a step of `rows` rows, in
    programs of `warps` warps. One row: `single_row_blocks`, unsplit. More rows (the launch shape,
    `LaunchShape.block_n / block_k / dense_chunk`): BN = block_n, or with block_n 0 128 in
    programs of 8 warps or more and 64 below (a dot of 64 rows a warp group); at most SB and
    next_pow2(N), at least 16; BK = block_k, at most the largest power of two dividing K, and
    half that for bf16 weights (the same bytes a step); tasks of `chunk` K elements (at least
    BK), so K splits into K / chunk slices when longer (while that divides K evenly); chunk 0:
    the slices that balance the programs (`balanced_split`)."""
    if rows == 1:
        return (*single_row_blocks(N, K, SB, programs), 1)
    bn = block_n or (128 if warps >= 8 else 64)
    bn = max(16, min(bn, SB or bn, triton.next_power_of_2(N)))
    bk = min(block_k, K & -K) if SB is not None else max(16, min(block_k // 2, K & -K))
    if chunk == 0:
        return bn, bk, balanced_split(triton.cdiv(N, bn), K, bk, programs)
    chunk = max(chunk, bk)
    split = K // chunk if K > chunk and K % chunk == 0 else 1
    return bn, bk, split


MAX_BALANCED_SPLIT = 8  # the most slices `balanced_split` cuts K into: the last slice sums them all


def balanced_split(blocks: int, K: int, BK: int, programs: int) -> int:
    """The number of slices (a power of two up to MAX_BALANCED_SPLIT, whole BK steps each) of a
    GEMV of `blocks` output blocks over `programs` programs that leaves its busiest program the
    fewest K elements to stream: ceil(blocks * split / programs) tasks of K / split each. Among
    equals the fewest slices, since each adds a tile to the sums that the last slice reads."""
    splits = [1 << i for i in range(MAX_BALANCED_SPLIT.bit_length()) if K % ((1 << i) * BK) == 0]
    return min(splits, key=lambda s: (triton.cdiv(blocks * s, programs) * (K // s), s))


def check_blocks(N: int, K: int, SB: int | None, BN: int, BK: int, group_rows: int = 0, split: int = 1,
                 rows: int = 2) -> None:
    """Raise ValueError unless (BN, BK, split) is a valid tiling of an [N, K] weight (SB None:
    bf16) for steps of `rows` rows."""
    for name, b, least in (("BN", BN, 8 if rows == 1 else 16), ("BK", BK, 16)):
        if b < least or b & (b - 1):
            raise ValueError(f"gemv: {name}={b} must be a power of two >= {least}")
    if K <= 0 or K % BK:
        raise ValueError(f"gemv: BK={BK} must divide K={K}")
    if split < 1 or K % (split * BK):
        raise ValueError(f"gemv: split={split} slices of whole BK={BK} steps must cover K={K}")
    if split > 1 and rows == 1:
        raise ValueError("gemv: a one-row step's GEMV is not split along K")
    if SB is not None and SB % BN:  # (BK, a power of two as SB, divides SB or is a multiple of it)
        raise ValueError(f"gemv: BN={BN} must divide the scale block SB={SB}, so that a tile spans one block row")
    if group_rows and (group_rows < 0 or group_rows % BN or N % group_rows):
        raise ValueError(f"gemv: group_rows={group_rows} must be a multiple of BN={BN} dividing N={N}")


def scale_block(N: int, K: int, scale_shape) -> int:
    """The power-of-two SB with scale_shape == (ceil(N/SB), ceil(K/SB)). Where several fit, the
    grid is one block in both dims and all of them mean the same: take the smallest."""
    sb = 1
    while sb <= 2 * max(N, K):
        if tuple(scale_shape) == (triton.cdiv(N, sb), triton.cdiv(K, sb)):
            return sb
        sb *= 2
    raise ValueError(f"gemv: scale shape {tuple(scale_shape)} is no power-of-two block grid of a [{N}, {K}] weight")
