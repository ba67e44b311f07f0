"""CSA's lightning indexer inside the kernels: the scores of each row's visible index entries, as
tasks (`model/compressor.py`'s `Indexer.scores` is the reference), and the top-k selection over
them (`select_task`, a radix select a row; below).

Contract (HI index heads of DI channels, the last RD rotated; rows r < R at positions p, slots s,
slot -1 a pad row; the layer's index cache holds E entries a slot):
- `score_tasks(R, E, KE)` = R ceil(E / KE): task t (row t // blocks, entries block (t % blocks) KE
  .. + KE) writes scores[row, block] (fp32 [R, E]): -inf for an entry the row cannot see
  (w >= (p + 1) // ratio, and every entry of a pad row); else the sum over heads h of
  weights[row, h] * relu(q[row, h] . k[s, w]) * DI^-0.5, where q = rope(q_raw[row, h]) at p (the
  RoPE in fp32, rounded to bf16: the reference's bf16 `apply_rope`), k the index entries bf16
  [S, E, DI], weights[row, h] = weights_raw[row, h] (bf16 [R, HI], the `weights_proj` GEMV's
  output) in fp32 times HI^-0.5 (`Indexer.queries`' order), the dot in fp32 (FAST: bf16
  operands, which q and k are, fp32 accumulation).
- A block wholly past the row's visible entries writes -inf and reads nothing else.
- TOPK > 0 (K1's): a row that keeps every visible entry (visible <= TOPK, below 4 TOPK cached
  tokens) has no scores written at all: its selection does not depend on them (`select_task`).
- Up to fp32 summation order (the dot's and the sum over heads').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_math import pair_offsets, rope, visible_entries
from .plan import fast_dots, task_grid

KE = 64  # entries of a score task
SELECT_BLOCK = 256  # entries a selection pass loads at once (K1's: LaunchShape.select_block)
MAX_SELECT_BLOCK = 4096  # scores a pass holds at once: 16 a thread of K1's 8 warps, with their keys


def score_tasks(R: int, E: int, KE: int = KE) -> int:
    return R * triton.cdiv(E, KE)


@triton.jit
def score_tasks_of(R, E, KE: tl.constexpr):
    """`score_tasks` inside a kernel."""
    return R * tl.cdiv(E, KE)


@triton.jit
def needs_scores(visible, TOPK: tl.constexpr):
    """Whether a row with `visible` entries needs its scores to select TOPK of them (TOPK 0: always)."""
    if TOPK == 0:
        return visible >= 0
    else:
        return visible > TOPK


@triton.jit
def score_task(t, q_raw_ptr, weights_ptr, positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries, scores_ptr, HI,
               RD, scale, weights_scale, RATIO: tl.constexpr, BH: tl.constexpr, DI: tl.constexpr, KE: tl.constexpr,
               FAST: tl.constexpr, TOPK: tl.constexpr):
    """Scores of task t's row and block of entries (the module docstring)."""
    blocks = tl.cdiv(n_entries, KE)
    row = t // blocks
    visible = visible_entries(row, positions_ptr, slots_ptr, RATIO)
    if needs_scores(visible, TOPK):
        _score_block(row, (t % blocks) * KE, visible, q_raw_ptr, weights_ptr, positions_ptr, slots_ptr, freqs_ptr,
                     keys_ptr, n_entries, scores_ptr, HI, RD, scale, weights_scale, BH, DI, KE, FAST)


@triton.jit
def _score_block(row, e0, visible, q_raw_ptr, weights_ptr, positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries,
                 scores_ptr, HI, RD, scale, weights_scale, BH: tl.constexpr, DI: tl.constexpr, KE: tl.constexpr,
                 FAST: tl.constexpr):
    """scores[row, e0 .. e0 + KE] (the module docstring)."""
    e = e0 + tl.arange(0, KE)
    slot = tl.load(slots_ptr + row)
    position = tl.load(positions_ptr + row)
    live = e < visible
    scores = tl.full((KE,), float("-inf"), tl.float32)
    if e0 < visible:
        h = tl.arange(0, BH)
        hmask = h < HI
        c, pair = pair_offsets(DI)
        q = tl.load(q_raw_ptr + (row * HI + h)[:, None, None] * DI + c[None, :, :], mask=hmask[:, None, None],
                    other=0.0).to(tl.float32)
        q = tl.reshape(rope(q, pair[None, :], position, freqs_ptr, (DI - RD) // 2, RD // 2, False), (BH, DI))
        keys = tl.load(keys_ptr + ((slot * n_entries + tl.where(live, e, 0)) * DI)[:, None] + tl.arange(0, DI)[None, :],
                       mask=live[:, None], other=0.0)
        if FAST:
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(keys))
        else:
            dots = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        weights = tl.load(weights_ptr + row * HI + h, mask=hmask, other=0.0).to(tl.float32) * weights_scale
        summed = tl.sum(tl.maximum(dots, 0.0) * scale * weights[:, None], axis=0)
        scores = tl.where(live, summed, float("-inf"))
    tl.store(scores_ptr + row * n_entries + e, scores, mask=e < n_entries)


@triton.jit
def _scores(n_tasks, q_raw_ptr, weights_ptr, positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries, scores_ptr,
            HI, RD, scale, weights_scale, RATIO: tl.constexpr, BH: tl.constexpr, DI: tl.constexpr, KE: tl.constexpr,
            FAST: tl.constexpr, TOPK: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        score_task(t, q_raw_ptr, weights_ptr, positions_ptr, slots_ptr, freqs_ptr, keys_ptr, n_entries, scores_ptr,
                   HI, RD, scale, weights_scale, RATIO, BH, DI, KE, FAST, TOPK)


def scores(q_raw: torch.Tensor, weights_raw: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
           freqs: torch.Tensor, keys: torch.Tensor, ratio: int = 4, entry_block: int = KE,
           topk: int = 0) -> torch.Tensor:
    """The standalone launch: q_raw [R, HI, DI] bf16 (the indexer's wq_b output, before its RoPE),
    weights_raw bf16 [R, HI] (the `weights_proj` GEMV's output), positions / slots int64 [R], freqs
    fp32 [RD / 2], keys the index entries bf16 [S, E, DI] -> scores fp32 [R, E]; with `topk`, the
    rows with at most that many visible entries are left as they were (NaN here)."""
    R, HI, DI = q_raw.shape
    S, E, _ = keys.shape
    if keys.shape[2] != DI or weights_raw.shape != (R, HI) or positions.shape != (R,) or slots.shape != (R,):
        raise ValueError(f"q_raw {tuple(q_raw.shape)}, weights_raw {tuple(weights_raw.shape)}, keys {tuple(keys.shape)}, "
                         f"positions {tuple(positions.shape)}, slots {tuple(slots.shape)} do not fit")
    assert q_raw.dtype == keys.dtype == weights_raw.dtype == torch.bfloat16
    assert q_raw.is_contiguous() and keys.is_contiguous() and weights_raw.is_contiguous()
    assert DI & (DI - 1) == 0 and DI >= 16 and entry_block >= 16 and 2 * freqs.numel() <= DI
    out = torch.full((R, E), float("nan"), dtype=torch.float32, device=q_raw.device)
    n_tasks = score_tasks(R, E, entry_block)
    _scores[task_grid(n_tasks)](n_tasks, q_raw, weights_raw, positions.contiguous(), slots.contiguous(),
                                freqs.float().contiguous(), keys, E, out, HI, 2 * freqs.numel(), float(DI ** -0.5),
                                float(HI ** -0.5),
                                RATIO=ratio, BH=max(16, triton.next_power_of_2(HI)), DI=DI, KE=entry_block,
                                FAST=fast_dots(q_raw), TOPK=topk)
    return out


# --- the top-k selection -----------------------------------------------------------------------------
# A radix select a row: the scores' fp32 bits mapped to unsigned keys in the same order, then four
# passes of 8-bit digits from the top, each a histogram of the digit among the keys that match the
# digits fixed so far, find the k-th largest key; a last pass writes the entries above it and, in
# entry order, as many equal to it as the k still need.


@triton.jit
def _ordered(scores):
    """fp32 -> uint32 keys in the same order (negatives flipped, positives' sign bit set)."""
    bits = scores.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def select_task(row, scores_ptr, n_entries, selected_ptr, visible, K: tl.constexpr, BE: tl.constexpr):
    """selected[row, :K]: the row's top-min(K, visible) entry ids by score (ties at the k-th
    largest score broken by entry order), then -1. `visible`: the row's visible entries."""
    if needs_scores(visible, K):
        _radix_select(row, scores_ptr, n_entries, selected_ptr, visible, K, BE)
    else:  # every visible entry is kept, in entry order, whatever its score (none read)
        ids = tl.arange(0, K)
        tl.store(selected_ptr + row * K + ids, tl.where(ids < visible, ids, -1).to(tl.int64))


@triton.jit
def _radix_select(row, scores_ptr, n_entries, selected_ptr, visible, K: tl.constexpr, BE: tl.constexpr):
    """`select_task` of a row with more than K visible entries (the comment above)."""
    need = tl.minimum(visible, K)
    prefix = tl.zeros((), tl.uint32)  # the digits fixed so far, in place
    for shift in tl.static_range(24, -8, -8):
        high_mask = ((0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF) if shift < 24 else 0
        hist = tl.zeros((256,), tl.int32)
        for e0 in range(0, visible, BE):
            e = e0 + tl.arange(0, BE)
            keys = _ordered(tl.load(scores_ptr + row * n_entries + e, mask=e < visible, other=0.0))
            match = (e < visible) & ((keys & high_mask) == (prefix & high_mask))
            hist += tl.histogram(tl.where(match, (keys >> shift) & 255, 0).to(tl.int32), 256,
                                 mask=match)
        above = tl.cumsum(tl.flip(hist, 0), 0)  # keys matching, with this digit >= 255 - i
        digit = 255 - tl.argmax((above >= need).to(tl.int32), 0)
        need -= tl.sum(tl.where(tl.arange(0, 256) > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
    # the k-th largest key is `prefix`; `need` of the keys equal to it are taken, in entry order
    taken = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for e0 in range(0, visible, BE):
        e = e0 + tl.arange(0, BE)
        live = e < visible
        keys = _ordered(tl.load(scores_ptr + row * n_entries + e, mask=live, other=0.0))
        tie = live & (keys == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = live & ((keys > prefix) | (tie & (tie_rank < need)))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(selected_ptr + row * K + slot, e.to(tl.int64), mask=take & (slot < K))
        taken += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    rest = taken + tl.arange(0, K)
    tl.store(selected_ptr + row * K + rest, tl.full((K,), -1, tl.int64), mask=rest < K)


@triton.jit
def select_row(row, scores_ptr, n_entries, selected_ptr, positions_ptr, slots_ptr, RATIO: tl.constexpr,
               K: tl.constexpr, BE: tl.constexpr):
    """`select_task` of a row, its visible entries from its position (none for a pad row)."""
    visible = tl.minimum(visible_entries(row, positions_ptr, slots_ptr, RATIO), n_entries)
    select_task(row, scores_ptr, n_entries, selected_ptr, visible, K, BE)


@triton.jit
def _select(R, scores_ptr, n_entries, selected_ptr, positions_ptr, slots_ptr, RATIO: tl.constexpr,
            K: tl.constexpr, BE: tl.constexpr):
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        select_row(row, scores_ptr, n_entries, selected_ptr, positions_ptr, slots_ptr, RATIO, K, BE)


def select(scores: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k: int, ratio: int = 4,
           block: int = SELECT_BLOCK) -> torch.Tensor:
    """The standalone launch: scores fp32 [R, E] (from `scores`) -> selected int64 [R, k], each
    row's top-min(k, visible) entry ids, then -1 (a pad row: all -1)."""
    R, E = scores.shape
    assert k & (k - 1) == 0 and block & (block - 1) == 0 and scores.is_contiguous()
    out = torch.full((R, k), -7, dtype=torch.int64, device=scores.device)  # poison: every slot is written
    _select[task_grid(R)](R, scores, E, out, positions.contiguous(), slots.contiguous(), RATIO=ratio, K=k, BE=block)
    return out
