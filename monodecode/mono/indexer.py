"""CSA's lightning indexer inside the kernels: the scores of each row's visible index entries, as
tasks (`model/compressor.py`'s `Indexer.scores` is the reference), and the top-k selection over
them (a radix select in six stages of tasks, each a row's block of entries; below).

Contract (HI index heads of DI channels, the last RD rotated; rows r < R at positions p, slots s,
slot -1 a pad row; the layer's index cache holds E entries a slot):
- `score_stage` over the first `span` entries of every row (K1: the step's most visible,
  `visible_span`; the standalone launch: all E), in tasks of a row's run of consecutive blocks of
  KE entries (`score_layout`: as many blocks a task as leave every row's tasks one round of the
  programs), writes scores[row, e] (fp32 [R, E]) for the entries of the span's blocks (e < E):
  -inf for an entry the row cannot see (w >= (p + 1) // ratio, and every entry of a pad row);
  else the sum over heads h of weights[row, h] * relu(q[row, h] . k[s, w]) * DI^-0.5, where q =
  rope(q_raw[row, h]) at p (the RoPE in fp32, rounded to bf16: the reference's bf16
  `apply_rope`; once a task), k the index entries bf16 [S, E, DI], weights[row, h] =
  weights_raw[row, h] (bf16 [R, HI], the `weights_proj` GEMV's output) in fp32 times HI^-0.5
  (`Indexer.queries`' order), the dot in fp32 (FAST: bf16 operands, which q and k are, fp32
  accumulation). A task's blocks are one loop, which the launch's software pipelining
  (num_stages) turns into async copies of the next blocks' keys while one block is scored.
- A block wholly past the row's visible entries writes -inf and reads nothing else; entries
  past the span's blocks are not written (the selection reads a row's visible ones only).
- TOPK > 0 (K1's): a row that keeps every visible entry (visible <= TOPK, below 4 TOPK cached
  tokens) has no scores written at all: its selection does not depend on them
  (`select_write_task`).
- The selection (`select_stage` 0 .. 5, a grid barrier or a launch between stages; tasks (row,
  block of BE entries) over the step's most visible entries): selected[row, :TOPK] (int64) holds
  a selecting row's TOPK entries of largest score (ties at the k-th largest broken by entry
  order), in entry order; a row that keeps every visible entry has them in order, then -1 (a pad
  row: all -1). Scratch: int32 [R, 5, 256], a row's four digit histograms (0 before stage 0:
  `clear_select_hist`) and the k-th key's digits as each stage fixes them, and the block counts
  (`select_counts`).
- Up to fp32 summation order (the dot's and the sum over heads').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_math import pair_offsets, rope, visible_entries
from .plan import fast_dots, task_grid

KE = 64  # entries of a score block: the N side of its dot
SELECT_BLOCK = 256  # entries a selection task takes (K1's: `select_block`)
WIDE_SELECT_BLOCK = 1024  # K1's from WIDE_SELECT_ROWS rows of a step on
WIDE_SELECT_ROWS = 32
MIN_SELECT_BLOCK = 16
MAX_SELECT_BLOCK = 4096  # scores a pass holds at once: 16 a thread of K1's 8 warps, with their keys


def select_block(block: int, rows: int) -> int:
    """Entries a selection task of a K1 step of `rows` rows takes: `block` (LaunchShape.select_block),
    or if 0, SELECT_BLOCK below WIDE_SELECT_ROWS rows and WIDE_SELECT_BLOCK from there. A wide step
    at long context makes many short tasks a stage (16 K cached tokens, 48 rows: 768 of 256
    entries, six rounds of the programs), whose fixed work (the row's visible entries, the
    histogram's atomics) outweighs what longer tasks leave idle; a narrow step's few tasks want
    the opposite."""
    if block:
        return block
    return WIDE_SELECT_BLOCK if rows >= WIDE_SELECT_ROWS else SELECT_BLOCK


@triton.jit
def needs_scores(visible, TOPK: tl.constexpr):
    """Whether a row with `visible` entries needs its scores to select TOPK of them (TOPK 0: always)."""
    if TOPK == 0:
        return visible >= 0
    else:
        return visible > TOPK


@triton.jit
def score_layout(R, span, programs, KE: tl.constexpr):
    """(entry blocks of KE a score task takes, tasks a row) over the first `span` entries of R rows:
    a row's blocks spread over as many tasks as leave every row's tasks one round of `programs`
    (at least one task a row)."""
    blocks = tl.cdiv(span, KE)
    per_task = tl.maximum(tl.cdiv(blocks, tl.maximum(programs // R, 1)), 1)
    return per_task, tl.cdiv(blocks, per_task)


@triton.jit
def score_stage(pid, grid, programs, R, span, q_raw_ptr, weights_ptr, weights_stride, positions_ptr, slots_ptr,
                freqs_ptr, keys_ptr, n_entries, scores_ptr, HI, RD, scale, weights_scale, RATIO: tl.constexpr,
                BH: tl.constexpr, DI: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """Program pid's (of `grid`) score tasks over the first `span` entries, laid out for `programs`
    programs (`score_layout`)."""
    per_task, tasks_a_row = score_layout(R, span, programs, KE)
    for t in range(pid, R * tasks_a_row, grid):
        score_task(t // tasks_a_row, (t % tasks_a_row) * per_task, per_task, q_raw_ptr, weights_ptr, weights_stride,
                   positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries, scores_ptr, HI, RD, scale, weights_scale,
                   RATIO, BH, DI, KE, FAST, TOPK)


@triton.jit
def score_task(row, first, count, q_raw_ptr, weights_ptr, weights_stride, positions_ptr, slots_ptr, freqs_ptr,
               keys_ptr, n_entries, scores_ptr, HI, RD, scale, weights_scale, RATIO: tl.constexpr, BH: tl.constexpr,
               DI: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """scores[row] over its entry blocks first .. first + count - 1 (the module docstring): the
    row's queries rotated once, then block by block."""
    visible = visible_entries(row, positions_ptr, slots_ptr, RATIO)
    if needs_scores(visible, TOPK):
        end = tl.minimum(first + count, tl.cdiv(n_entries, KE)) * KE  # past the task's last block
        seen = tl.minimum(visible, end)
        if first * KE < seen:
            slot = tl.load(slots_ptr + row)
            h = tl.arange(0, BH)
            c, pair = pair_offsets(DI)
            q = tl.load(q_raw_ptr + (row * HI + h)[:, None, None] * DI + c[None, :, :], mask=(h < HI)[:, None, None],
                        other=0.0).to(tl.float32)
            q = tl.reshape(rope(q, pair[None, :], tl.load(positions_ptr + row), freqs_ptr, (DI - RD) // 2, RD // 2,
                                False), (BH, DI))
            if FAST:  # the dots' operand, once
                q = q.to(tl.bfloat16)
            weights = tl.load(weights_ptr + row * weights_stride + h, mask=h < HI, other=0.0).to(tl.float32)
            weights *= weights_scale
            for e0 in range(first * KE, seen, KE):
                e = e0 + tl.arange(0, KE)
                scored = _block_scores(q, _block_keys(keys_ptr, slot, n_entries, e0, seen, DI, KE), weights, scale, FAST)
                tl.store(scores_ptr + row * n_entries + e, tl.where(e < seen, scored, float("-inf")),
                         mask=e < n_entries)
        for e0 in range(tl.maximum(tl.cdiv(seen, KE), first) * KE, end, KE):  # wholly past the visible ones
            e = e0 + tl.arange(0, KE)
            tl.store(scores_ptr + row * n_entries + e, tl.full((KE,), float("-inf"), tl.float32), mask=e < n_entries)


@triton.jit
def _block_keys(keys_ptr, slot, n_entries, e0, seen, DI: tl.constexpr, KE: tl.constexpr):
    """The slot's index entries e0 .. e0 + KE: bf16 [KE, DI], zero from `seen` on (nothing read there)."""
    e = e0 + tl.arange(0, KE)
    live = e < seen
    return tl.load(keys_ptr + ((slot * n_entries + tl.where(live, e, 0)) * DI)[:, None] + tl.arange(0, DI)[None, :],
                   mask=live[:, None], other=0.0)


@triton.jit
def _block_scores(q, keys, weights, scale, FAST: tl.constexpr):
    """The heads' weighted sum of relu(q . k) * scale for each key of the block: fp32 [KE]."""
    if FAST:
        dots = tl.dot(q, tl.trans(keys))
    else:
        dots = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
    return tl.sum(tl.maximum(dots, 0.0) * scale * weights[:, None], axis=0)


@triton.jit
def _scores(R, programs, q_raw_ptr, weights_ptr, weights_stride, positions_ptr, slots_ptr, freqs_ptr, keys_ptr,
            n_entries, scores_ptr, HI, RD, scale, weights_scale, RATIO: tl.constexpr, BH: tl.constexpr,
            DI: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    score_stage(tl.program_id(0), tl.num_programs(0), programs, R, n_entries, q_raw_ptr, weights_ptr, weights_stride,
                positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries, scores_ptr, HI, RD, scale, weights_scale,
                RATIO, BH, DI, KE, FAST, TOPK)


def scores(q_raw: torch.Tensor, weights_raw: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
           freqs: torch.Tensor, keys: torch.Tensor, ratio: int = 4, entry_block: int = KE,
           topk: int = 0, programs: int | None = None) -> torch.Tensor:
    """The standalone launch: q_raw [R, HI, DI] bf16 (the indexer's wq_b output, before its RoPE),
    weights_raw bf16 [R, HI] (the `weights_proj` GEMV's output; its rows may be strided, as K1's
    columns of the stacked projections' outputs are), positions / slots int64 [R], freqs
    fp32 [RD / 2], keys the index entries bf16 [S, E, DI] -> scores fp32 [R, E]; with `topk`, the
    rows with at most that many visible entries are left as they were (NaN here). The tasks are
    laid out for `programs` programs (`score_layout`; default: a program a block of a row)."""
    R, HI, DI = q_raw.shape
    S, E, _ = keys.shape
    if keys.shape[2] != DI or weights_raw.shape != (R, HI) or positions.shape != (R,) or slots.shape != (R,):
        raise ValueError(f"q_raw {tuple(q_raw.shape)}, weights_raw {tuple(weights_raw.shape)}, keys {tuple(keys.shape)}, "
                         f"positions {tuple(positions.shape)}, slots {tuple(slots.shape)} do not fit")
    assert q_raw.dtype == keys.dtype == weights_raw.dtype == torch.bfloat16
    assert q_raw.is_contiguous() and keys.is_contiguous() and weights_raw.stride(1) == 1
    assert DI & (DI - 1) == 0 and DI >= 16 and entry_block >= 16 and 2 * freqs.numel() <= DI
    out = torch.full((R, E), float("nan"), dtype=torch.float32, device=q_raw.device)
    programs = programs or R * triton.cdiv(E, entry_block)
    _scores[task_grid(programs)](R, programs, q_raw, weights_raw, weights_raw.stride(0), positions.contiguous(),
                                 slots.contiguous(), freqs.float().contiguous(), keys, E, out, HI, 2 * freqs.numel(),
                                 float(DI ** -0.5), float(HI ** -0.5), RATIO=ratio,
                                 BH=max(16, triton.next_power_of_2(HI)), DI=DI, KE=entry_block, FAST=fast_dots(q_raw),
                                 TOPK=topk)
    return out


# --- the top-k selection -----------------------------------------------------------------------------
# A radix select spread over the programs: the scores' fp32 bits mapped to unsigned keys in the
# same order; four passes of 8-bit digits from the top, each a stage of tasks (row, block of BE
# entries) that add the histogram of their block's digit, among the keys that match the digits
# fixed so far, into the row's histogram of that digit (int32 atomics: totals that do not depend
# on the order). A pass's tasks fix the digit before theirs from its histogram and the digits the
# pass before kept (`_kth_key`), its row's first task keeping them in turn, so that no task reads
# a chain of histograms. Then every task counts its block's keys above the k-th largest key and
# equal to it (a stage), and writes its ids at the offset its row's earlier blocks' counts give (a
# stage): the entries above the k-th key and, in entry order, as many equal to it as needed, in
# entry order, as a one-program walk would. So a row's selection costs six short stages whatever
# its length, and grid barriers (or launches) between them.
SELECT_LEVELS: tl.constexpr = tl.constexpr(4)  # 8-bit digits of a 32-bit key
SELECT_STAGES: tl.constexpr = tl.constexpr(SELECT_LEVELS + 2)  # the digit passes, the counts, the writes
HIST_ROWS: tl.constexpr = tl.constexpr(SELECT_LEVELS + 1)  # a row's: a histogram a digit, then the kept digits


@triton.jit
def _ordered(scores):
    """fp32 -> uint32 keys in the same order (negatives flipped, positives' sign bit set)."""
    bits = scores.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def visible_span(R, n_entries, positions_ptr, slots_ptr, RATIO: tl.constexpr):
    """The most entries a row of the step sees (at most n_entries): the span the score and selection
    tasks cover. Every program computes the same, so a step in which no row selects (none sees
    more than TOPK) can pass the selection's barriers by."""
    most = tl.zeros((), tl.int64)
    for r0 in range(0, R, 64):
        r = r0 + tl.arange(0, 64)
        slot = tl.load(slots_ptr + r, mask=r < R, other=-1)
        seen = tl.where(slot >= 0, (tl.load(positions_ptr + r, mask=r < R, other=0) + 1) // RATIO, 0)
        most = tl.maximum(most, tl.max(tl.minimum(seen, n_entries), 0))
    return most


@triton.jit
def _row_block(t, blocks, n_entries, positions_ptr, slots_ptr, RATIO: tl.constexpr, BE: tl.constexpr):
    """Task t's (row, entries [BE] of its block, live [BE], the row's visible entries)."""
    row = t // blocks
    visible = tl.minimum(visible_entries(row, positions_ptr, slots_ptr, RATIO), n_entries)
    e = (t % blocks) * BE + tl.arange(0, BE)
    return row, e, e < visible, visible


@triton.jit
def _keys(scores_ptr, row, n_entries, e, live):
    return _ordered(tl.load(scores_ptr + row * n_entries + e, mask=live, other=0.0))


@triton.jit
def _kept_at(hist_ptr, row, LEVELS: tl.constexpr):
    """Where the row's pair for LEVELS fixed digits lies: its histograms' last row, cells 2 LEVELS, +1."""
    return hist_ptr + (row * HIST_ROWS + SELECT_LEVELS) * 256 + 2 * LEVELS


@triton.jit
def _kept_key(hist_ptr, row, LEVELS: tl.constexpr):
    """(the top LEVELS digits of the row's k-th largest key, in place; how many keys that match them
    the k still need), as the stage that fixed them kept them (`_keep_key`; LEVELS >= 1)."""
    kept = _kept_at(hist_ptr, row, LEVELS)
    return tl.load(kept, cache_modifier=".cg").to(tl.uint32, bitcast=True), tl.load(kept + 1, cache_modifier=".cg")


@triton.jit
def _keep_key(hist_ptr, row, prefix, need, LEVELS: tl.constexpr):
    kept = _kept_at(hist_ptr, row, LEVELS)
    tl.store(kept, prefix.to(tl.int32, bitcast=True))
    tl.store(kept + 1, need)


@triton.jit
def _kth_key(hist_ptr, row, K: tl.constexpr, LEVELS: tl.constexpr):
    """`_kept_key` of LEVELS digits from the kept LEVELS - 1 and the histogram of digit LEVELS - 1:
    two loads at once, not a chain of LEVELS histograms."""
    prefix = tl.zeros((), tl.uint32)
    need = tl.zeros((), tl.int32) + K
    if LEVELS > 1:
        prefix, need = _kept_key(hist_ptr, row, LEVELS - 1)
    if LEVELS > 0:
        bins = tl.arange(0, 256)
        hist = tl.load(hist_ptr + (row * HIST_ROWS + LEVELS - 1) * 256 + bins, cache_modifier=".cg")
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys matching, with this digit >= i
        digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1  # the largest digit with enough keys at or above it
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << (32 - 8 * LEVELS))
    return prefix, need


@triton.jit
def select_pass_task(t, blocks, scores_ptr, n_entries, hist_ptr, positions_ptr, slots_ptr, RATIO: tl.constexpr,
                     K: tl.constexpr, BE: tl.constexpr, LEVEL: tl.constexpr):
    """Digit pass LEVEL of task t (row t // blocks, its block t % blocks): the histogram of digit
    LEVEL among the block's keys that match the digits fixed before it, added into hist[row, LEVEL]."""
    row, e, live, visible = _row_block(t, blocks, n_entries, positions_ptr, slots_ptr, RATIO, BE)
    if needs_scores(visible, K) and (t % blocks) * BE < visible:
        prefix, need = _kth_key(hist_ptr, row, K, LEVEL)
        if LEVEL > 0 and t % blocks == 0:
            _keep_key(hist_ptr, row, prefix, need, LEVEL)
        keys = _keys(scores_ptr, row, n_entries, e, live)
        SHIFT: tl.constexpr = 24 - 8 * LEVEL
        match = live
        if LEVEL > 0:
            match = match & ((keys >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist = tl.histogram(tl.where(match, (keys >> SHIFT) & 255, 0).to(tl.int32), 256, mask=match)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (row * HIST_ROWS + LEVEL) * 256 + bins, hist, mask=hist > 0, sem="relaxed",
                      scope="gpu")


@triton.jit
def select_count_task(t, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr, positions_ptr, slots_ptr,
                      RATIO: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
    """counts[row, block] = (its keys above the row's k-th key, its keys equal to it)."""
    row, e, live, visible = _row_block(t, blocks, n_entries, positions_ptr, slots_ptr, RATIO, BE)
    if needs_scores(visible, K) and (t % blocks) * BE < visible:
        kth, need = _kth_key(hist_ptr, row, K, SELECT_LEVELS)
        if t % blocks == 0:
            _keep_key(hist_ptr, row, kth, need, SELECT_LEVELS)
        keys = _keys(scores_ptr, row, n_entries, e, live)
        at = counts_ptr + (row * blocks + t % blocks) * 2
        tl.store(at, tl.sum((live & (keys > kth)).to(tl.int32), 0))
        tl.store(at + 1, tl.sum((live & (keys == kth)).to(tl.int32), 0))


@triton.jit
def select_write_task(t, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr, selected_ptr, positions_ptr, slots_ptr,
                      RATIO: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
    """selected[row, :K] (int64): a selecting row's block writes its ids at the slots after its
    earlier blocks' (the keys above the k-th and, in entry order, the ties the k still need); a
    row that keeps every visible entry writes them in order, then -1 (its first block's task)."""
    row, e, live, visible = _row_block(t, blocks, n_entries, positions_ptr, slots_ptr, RATIO, BE)
    block = t % blocks
    if not needs_scores(visible, K):
        if block == 0:  # every visible entry is kept, in entry order, whatever its score (none read)
            ids = tl.arange(0, K)
            tl.store(selected_ptr + row * K + ids, tl.where(ids < visible, ids, -1).to(tl.int64))
    elif block * BE < visible:
        kth, need = _kept_key(hist_ptr, row, SELECT_LEVELS)
        above, ties = tl.zeros((), tl.int32), tl.zeros((), tl.int32)  # in the row's earlier blocks
        for b0 in range(0, block, BE):
            b = b0 + tl.arange(0, BE)
            at = counts_ptr + (row * blocks + b) * 2
            above += tl.sum(tl.load(at, mask=b < block, other=0, cache_modifier=".cg"), 0)
            ties += tl.sum(tl.load(at + 1, mask=b < block, other=0, cache_modifier=".cg"), 0)
        keys = _keys(scores_ptr, row, n_entries, e, live)
        tie = live & (keys == kth)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = live & ((keys > kth) | (tie & (tie_rank < need)))
        slot = above + tl.minimum(ties, need) + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(selected_ptr + row * K + slot, e.to(tl.int64), mask=take & (slot < K))


@triton.jit
def select_stage(pid, grid, STAGE: tl.constexpr, R, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr,
                 selected_ptr, positions_ptr, slots_ptr, RATIO: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
    """Program pid's tasks of selection stage STAGE (0 .. 3 the digit passes, 4 the counts, 5 the
    writes) over the blocks of BE entries of `visible_span`. The histograms must be 0 before stage 0 (`clear_select_hist`)."""
    blocks = tl.maximum(blocks, 1)  # a step of pad rows still writes its -1s
    for t in range(pid, R * blocks, grid):
        if STAGE < SELECT_LEVELS:
            select_pass_task(t, blocks, scores_ptr, n_entries, hist_ptr, positions_ptr, slots_ptr, RATIO, K, BE,
                             STAGE)
        elif STAGE == SELECT_LEVELS:
            select_count_task(t, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr, positions_ptr, slots_ptr,
                              RATIO, K, BE)
        else:
            select_write_task(t, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr, selected_ptr, positions_ptr,
                              slots_ptr, RATIO, K, BE)


@triton.jit
def clear_select_hist(pid, grid, R, hist_ptr):
    """The step's digit histograms (int32 [R, 5, 256]'s first four of a row) set to 0, a row a task."""
    for row in range(pid, R, grid):
        for level in tl.static_range(SELECT_LEVELS):
            tl.store(hist_ptr + (row * HIST_ROWS + level) * 256 + tl.arange(0, 256), tl.zeros((256,), tl.int32))


@triton.jit
def _select(STAGE: tl.constexpr, R, scores_ptr, n_entries, hist_ptr, counts_ptr, selected_ptr, positions_ptr,
            slots_ptr, RATIO: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
    blocks = tl.cdiv(visible_span(R, n_entries, positions_ptr, slots_ptr, RATIO), BE)
    select_stage(tl.program_id(0), tl.num_programs(0), STAGE, R, blocks, scores_ptr, n_entries, hist_ptr, counts_ptr,
                 selected_ptr, positions_ptr, slots_ptr, RATIO, K, BE)


def select_counts(R: int, n_entries: int, block: int) -> int:
    """int32 values a step's selection keeps for its block counts (two a block of a row)."""
    return 2 * R * max(triton.cdiv(n_entries, block), 1)


def select(scores: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k: int, ratio: int = 4,
           block: int = SELECT_BLOCK) -> torch.Tensor:
    """The standalone launch: scores fp32 [R, E] (from `scores`) -> selected int64 [R, k], each
    row's top-min(k, visible) entry ids, then -1 (a pad row: all -1). One launch a stage (the
    launches' order is the stages' barrier)."""
    R, E = scores.shape
    assert k & (k - 1) == 0 and block & (block - 1) == 0 and scores.is_contiguous()
    out = torch.full((R, k), -7, dtype=torch.int64, device=scores.device)  # poison: every slot is written
    hist = torch.zeros((R, HIST_ROWS, 256), dtype=torch.int32, device=scores.device)
    counts = torch.full((select_counts(R, E, block),), -7, dtype=torch.int32, device=scores.device)
    positions, slots = positions.contiguous(), slots.contiguous()
    for stage in range(SELECT_STAGES):
        _select[task_grid(R * max(triton.cdiv(E, block), 1))](stage, R, scores, E, hist, counts, out, positions,
                                                                slots, RATIO=ratio, K=k, BE=block)
    return out
