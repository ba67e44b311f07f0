"""The compressed entries of a CSA / HCA layer's attend tasks (`attention.py`'s contract): the
entry blocks a row attends, their logits parked for one softmax with the window's, and the entry
splits that spread them over more tasks.

Entry splits (SPLITS > 0, a power of two; `attention.attend_tasks(R, H, HB, SPLITS, PARTS,
SPLIT_PARTS)` tasks): a pair (row, head block) has S = SPLITS x SPLIT_PARTS split tasks and PARTS
window tasks, t = pair (S + PARTS) + part. Split s < SPLITS (its SPLIT_PARTS tasks, parts s
SPLIT_PARTS ..) takes the entry blocks s, s + SPLITS, ... (each task parking their logits in its
own park), stores the heads' max logit m_s, their mass sum exp(logit - m_s) and partial output
probs @ entries (fp32 [HB, D], undivided; each task its share of the channels, as the window's
tasks share theirs) into `partials` (`split_partials` values: every pair's outputs, then every
pair's [SPLITS, 2, HB] stats), then each task signals the pair's ticket (a split with no block
stores m_s = -inf, mass 0 and no output). Parts S .. S + PARTS - 1, the window's tasks (each its
share of the output chunks), wait until the ticket reaches S (bounded:
`max_polls`, an expired wait records STAGE + 1 in the error word of `sync_ptr` and the task goes
on) and scale each split's mass and output by exp(m_s - m) for the common max m of the window,
the splits and the sink. Tickets (int32 [2, pairs], 0 between launches): a pair's splits' signals,
then its window tasks' arrivals after their output; the last of the PARTS to arrive takes both
back down (`release_splits`), so no window task finds its ticket lowered while it waits. Waits
go only to lower-numbered tasks, which never wait: no cycle, and under the interpreter (tasks in
order) every wait is already met. Fp32 summation order differs from the unsplit task's only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_math import HB, head_pairs, key_chunk, power_of_two_at_most, scaled_logits, visible_entries
from .sync import _ERROR, leader_wait, signal, wait_at_least


KE = 64  # compressed entries of a block: the N side of q . k


MAX_SPLITS = 8  # entry splits a (row, head block) pair: the window task holds [SPLITS, HB, BD] of their outputs


def entry_splits(R: int, H: int, entries: int, programs: int, parts: int = 1, HB: int = HB, KE: int = KE) -> int:
    """Entry splits a pair of a compressed layer's attend (`entries`: the most a row attends, its
    blocks of KE the work to spread; `parts` window tasks a pair) for a launch of `programs`
    programs: as many as leave every pair's tasks one round of the programs, a power of two, at
    most MAX_SPLITS and no more than the blocks; 0 (the window's tasks take the entries
    themselves) when the pairs' window tasks fill the programs."""
    fit = min(MAX_SPLITS, triton.cdiv(entries, KE), programs // head_pairs(R, H, HB) - parts)
    return 0 if fit < 1 else power_of_two_at_most(fit)


def split_partials(R: int, H: int, D: int, splits: int, HB: int = HB) -> int:
    """fp32 values the entry splits of R rows keep for their window tasks: outputs and stats."""
    return head_pairs(R, H, HB) * splits * HB * (D + 2)


@triton.jit
def _entry_block(entries_ptr, slot, n_entries, e0, visible, sel, D: tl.constexpr, KE: tl.constexpr,
                 TOPK: tl.constexpr):
    """Keys e0 .. e0 + KE of the row's compressed ones: (each entry's row offset in the slot's
    compressed cache [KE], live [KE]). TOPK 0: the entries themselves, the first `visible` live;
    else the row's selected entries, sel[j] (-1: none), the first TOPK of the list."""
    j = e0 + tl.arange(0, KE)
    if TOPK > 0:
        e = tl.load(sel + j, mask=j < TOPK, other=-1)
        live = e >= 0
    else:
        e = j
        live = j < visible
    return (slot * n_entries + tl.where(live, e, 0)) * D, live


@triton.jit
def park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries, visible, sel,
                      scale, park, first, stride, D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr,
                      KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """The scaled logits of the visible compressed entries in blocks first, first + stride, ...,
    block by block, parked at `park` ([HB, EP] fp32, -inf past the visible ones); returns their
    max a head [HB] (-inf without a block)."""
    top = tl.full((HB,), float("-inf"), tl.float32)
    for e0 in range(first * KE, visible, stride * KE):
        key_rows, live = _entry_block(entries_ptr, slot, n_entries, e0, visible, sel, D, KE, TOPK)
        logits = scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, key_rows, live, scale, D,
                               RD, HB, BD, KE, FAST)
        tl.store(park + _parked(visible, e0, HB, KE), logits)
        top = tl.maximum(top, tl.max(logits, axis=1))
    return top


@triton.jit
def _parked(visible, e0, HB: tl.constexpr, KE: tl.constexpr):
    """Offsets [HB, KE] of entries e0 .. e0 + KE's logits in a task's park (a head's row: the
    visible entries rounded up to KE)."""
    return tl.arange(0, HB)[:, None] * (tl.cdiv(visible, KE) * KE) + (e0 + tl.arange(0, KE))[None, :]


@triton.jit
def parked_mass(park, visible, m, first, stride, HB: tl.constexpr, KE: tl.constexpr):
    """sum of exp(parked logit - m) a head [HB] over blocks first, first + stride, ..."""
    mass = tl.zeros((HB,), tl.float32)
    for e0 in range(first * KE, visible, stride * KE):
        mass += tl.sum(tl.exp(tl.load(park + _parked(visible, e0, HB, KE)) - m[:, None]), axis=1)
    return mass


@triton.jit
def entries_out(out, park, visible, m, first, stride, d, entries_ptr, slot, n_entries, sel, D: tl.constexpr,
                HB: tl.constexpr, BD: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """out + probs @ entries[:, d] over the visible entries of blocks first, first + stride, ...
    ([HB, BD] fp32, not yet divided by the mass): accumulated into `out`, so that a window task
    holds one [HB, BD] tile of the chunk, not its window's and its entries' apart."""
    for e0 in range(first * KE, visible, stride * KE):
        key_rows, live = _entry_block(entries_ptr, slot, n_entries, e0, visible, sel, D, KE, TOPK)
        p = tl.exp(tl.load(park + _parked(visible, e0, HB, KE)) - m[:, None])
        keys = key_chunk(entries_ptr, key_rows, live, d)
        if FAST:
            hi = p.to(tl.bfloat16)
            out = tl.dot((p - hi.to(tl.float32)).to(tl.bfloat16), keys, tl.dot(hi, keys, out))
        else:
            out = tl.dot(p, keys.to(tl.float32), out, input_precision="ieee")
    return out


@triton.jit
def split_stats(partials_ptr, pair, n_pairs, D: tl.constexpr, HB: tl.constexpr, SPLITS: tl.constexpr):
    """Where the entry splits of `pair` keep their outputs ([SPLITS, HB, D] fp32) and their stats
    ([SPLITS, 2, HB] fp32: each head's max logit, then its mass under that max)."""
    outs = partials_ptr + pair * (SPLITS * HB * D)
    stats = partials_ptr + n_pairs * (SPLITS * HB * D) + pair * (SPLITS * 2 * HB)
    return outs, stats


@triton.jit
def entry_split(task, pair, n_pairs, q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries,
                visible, sel, scale, park, partials_ptr, tickets_ptr, D: tl.constexpr, RD, HB: tl.constexpr,
                BD: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr,
                SPLITS: tl.constexpr, SPLIT_PARTS: tl.constexpr):
    """Split task `task` of a pair: entry split part = task // SPLIT_PARTS, over its entry blocks
    (part, part + SPLITS, ...) the heads' max logit m, their mass sum exp(logit - m) and their
    partial output probs @ entries (fp32, not divided) in its share of the channels (task %
    SPLIT_PARTS of SPLIT_PARTS), stored for the pair's window tasks; then a signal at the pair's
    ticket. Each of a split's tasks stores the same m and mass. With no block: m = -inf, mass 0,
    no output stored."""
    if SPLITS > 0:
        part = task // SPLIT_PARTS
        first = (task % SPLIT_PARTS) * (D // SPLIT_PARTS)
        outs, stats = split_stats(partials_ptr, pair, n_pairs, D, HB, SPLITS)
        m = park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries, visible,
                              sel, scale, park, part, SPLITS, D, RD, HB, BD, KE, FAST, TOPK)
        if part * KE < visible:
            for d0 in range(first, first + D // SPLIT_PARTS, BD):
                d = d0 + tl.arange(0, BD)
                out = entries_out(tl.zeros((HB, BD), tl.float32), park, visible, m, part, SPLITS, d, entries_ptr,
                                  slot, n_entries, sel, D, HB, BD, KE, FAST, TOPK)
                tl.store(outs + (part * HB + tl.arange(0, HB))[:, None] * D + d[None, :], out)
            mass = parked_mass(park, visible, m, part, SPLITS, HB, KE)
        else:
            mass = tl.zeros((HB,), tl.float32)
        head = tl.arange(0, HB)
        tl.store(stats + part * 2 * HB + head, m)
        tl.store(stats + part * 2 * HB + HB + head, mass)
        signal(tickets_ptr + pair)


@triton.jit
def await_splits(pair, tickets_ptr, sync_ptr, max_polls, STAGE: tl.constexpr, SIGNALS: tl.constexpr,
                 LEADER: tl.constexpr):
    """A window task's wait for its pair's SIGNALS split tasks (bounded: an expired wait records
    STAGE in the error word and the task goes on with what is there)."""
    if LEADER:
        leader_wait(tickets_ptr + pair, SIGNALS, sync_ptr + _ERROR, STAGE, max_polls)
    else:
        wait_at_least(tickets_ptr + pair, SIGNALS, sync_ptr + _ERROR, STAGE, max_polls)


@triton.jit
def release_splits(pair, n_pairs, tickets_ptr, SIGNALS: tl.constexpr, PARTS: tl.constexpr):
    """A window task's arrival once its output is written: the last of the pair's PARTS takes the
    ticket back down by SIGNALS (its split tasks') and the arrivals by PARTS, so both are 0
    between launches even after a wait gave up (every signal and arrival comes)."""
    ticket = tickets_ptr + pair
    if PARTS == 1:
        tl.atomic_add(ticket, -SIGNALS, sem="relaxed", scope="gpu")
    else:
        arrivals = tickets_ptr + n_pairs + pair
        if tl.atomic_add(arrivals, 1, sem="relaxed", scope="gpu") == PARTS - 1:
            tl.atomic_add(arrivals, -PARTS, sem="relaxed", scope="gpu")
            tl.atomic_add(ticket, -SIGNALS, sem="relaxed", scope="gpu")


@triton.jit
def splits_out(split_outs, split_scales, d, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr,
               SPLITS: tl.constexpr):
    """sum over the entry splits of scale * their partial output[:, d] ([HB, BD] fp32); a split
    with no entries (scale 0) is not read."""
    s = tl.arange(0, SPLITS)[:, None, None]
    live = split_scales[:, :, None] > 0
    outs = tl.load(split_outs + (s * HB + tl.arange(0, HB)[None, :, None]) * D + d[None, None, :], mask=live,
                   other=0.0)
    return tl.sum(outs * split_scales[:, :, None], axis=0)


@triton.jit
def attended_entries(row, positions_ptr, slots_ptr, RATIO: tl.constexpr, TOPK: tl.constexpr):
    """The compressed entries row `row` attends: every visible one (TOPK 0), else its selection
    list's live ids, which come first: min(TOPK, visible)."""
    visible = visible_entries(row, positions_ptr, slots_ptr, RATIO)
    if TOPK > 0:
        visible = tl.minimum(visible, TOPK)
    return visible
