"""The MoE's small stages around the routed experts: route, group, combine.

Each stage is a table of independent tasks (device functions that K2, and for combine K3, call
from their task loops); `_route`, `_group` and `_combine` are standalone launches of the same
tasks, one program looping over tasks t = pid, pid + grid, ... (grid (1,) under the interpreter).
Rows: a step has R <= 48 rows; k = top-k, E = routed experts, P = R * k picks.

Stages
- route (`route_task`, `route_tasks(R) = R`, one task a row): reads logits [R, E] fp32 (the
  gate GEMV x.float() @ gate.float().T, done elsewhere; row stride given) and slots int64 [R].
  scores = sqrt(softplus(logits)) in fp32, torch's softplus (x > 20 -> x, else log1p(exp(x))).
  ids: HASH, the row's token's row of tid2eid (int64 [vocab, k], tokens int64 [R]); else the
  top-k of scores + bias (bias fp32 [E]), descending, ties to the lowest expert index.
  weights = scores[ids] / sum(scores[ids]) * route_scale in fp32. Writes ids [R, k] int32 and
  weights [R, k] fp32; a pad row (slot < 0) gets ids -1 and weights 0, which the later stages
  skip. The ids are local to the experts held (`first`, `held`: a tensor-parallel rank's range;
  0 and E at one rank): a pick of another rank's expert is -1 too (weight kept, unread), so a
  live row may hold -1 picks among its own; group sorts each -1 pick with the pads and combine
  skips it, pick by pick. (MoE.route; expert ids must be < 2^16.)
- group (`group_task`, `group_tasks() = 1`, ONE task, one program; in the kernels the route task
  that arrives last runs it, `group_when_routed`): from the flat ids [P]
  int32 writes exactly what `experts.group_picks(ids)` returns, order, experts, counts int32
  [P]: the picks stably sorted by expert, pads last; counts[j] > 0 only where a task of the
  expert stage starts (an expert's first sorted pick and every ROWS picks after it), then it is
  that task's number of picks (<= ROWS); experts[j] is the expert there, else 0. Built by one
  sort of unique keys (expert * BP + pick: stable by construction) and two scans that find each
  sorted pick's run of equal experts; no P x P matrix.
- combine (`combine_task`, `combine_tasks(R, d, BLOCK)`, a task per (row, block of d)):
  y[r] = (sum over slots s = 0 .. k-1, in order, of bf16(per_pick[r * k + s])) + shared[r] in
  fp32, rounded to bf16 -> y [R, d] bf16. per_pick fp32 [P, d] (the expert stage's output; rows
  of picks with id < 0 are skipped, never read: they hold garbage); shared bf16 [R, d] when
  HAS_SHARED. (MoE.__call__ likewise adds each routed expert's output rounded to bf16 by its w2
  F.linear, in fp32, the shared expert's output last, then casts to bf16; it sums in ascending
  expert order, this in top-k order: the same up to fp32 summation order.)

Rounding points: route is fp32 throughout; combine rounds each pick's output (`rounding.bf16`)
and the sum. Constexpr FAST (NVIDIA, compiled): a store's bf16 cast rounds (to nearest even) and
libdevice's log1p / exp; portable (interpreter, AMD): the store's value rounded by `rounding.bf16`
first (the interpreter's cast truncates) and log1p from tl.log with Goldberg's correction.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .experts import ROWS
from .plan import fast_dots, task_grid
from .rounding import bf16
from .sync import arrive

_PAD: tl.constexpr = tl.constexpr(1 << 16)  # the sort class of pad picks: after every expert id
MAX_PICKS_BLOCK = 1 << 14  # keys class * BP + pick must stay below 2^31


# --- route ----------------------------------------------------------------------------------------
@triton.jit
def _sqrt_softplus(x, FAST: tl.constexpr):
    """sqrt(softplus(x)) in fp32, torch's softplus: x above the threshold 20 passes through."""
    if FAST:
        soft = libdevice.log1p(libdevice.exp(tl.minimum(x, 20.0)))
    else:
        # log(1 + y) loses y below 2^-24; scaling by y / ((1 + y) - 1) restores it (Goldberg)
        y = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + y
        soft = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, soft))


@triton.jit
def route_task(t, logits_ptr, logits_stride, slots_ptr, bias_ptr, tokens_ptr, tid2eid_ptr,
               ids_ptr, weights_ptr, E, K, route_scale, first, held,
               BE: tl.constexpr, BK: tl.constexpr, HASH: tl.constexpr, FAST: tl.constexpr):
    """Row t: its k expert ids (int32) and routing weights (fp32), -1 and 0 on a pad row. The
    ids are local to the experts held, first .. first + held - 1 (a tensor-parallel rank's; all
    E at one rank): a pick of an expert not held is -1 with its weight kept, which the later
    stages skip like a pad's.
    BE >= E and BK >= K are powers of two; bias_ptr is unused when HASH, tokens_ptr and
    tid2eid_ptr when not. Reads stay inside the row's logits and, for a live row, its tid2eid
    row: a pad row's token (and any row's NaN logits) may be garbage."""
    row = logits_ptr + t * logits_stride
    slot = tl.arange(0, BK)
    live = tl.load(slots_ptr + t) >= 0
    picked = slot < tl.where(live, K, 0)
    if HASH:
        token = tl.load(tokens_ptr + t)
        ids = tl.load(tid2eid_ptr + token * K + slot, mask=picked, other=0).to(tl.int32)
    else:
        e = tl.arange(0, BE)
        biased = _sqrt_softplus(tl.load(row + e, mask=e < E, other=0.0), FAST) + tl.load(bias_ptr + e, mask=e < E)
        biased = tl.where(e < E, biased, -float("inf"))
        ids = tl.zeros([BK], dtype=tl.int32)
        for s in range(K):  # k rounds of argmax: descending, the lowest index among equals
            pick = tl.min(tl.where(biased == tl.max(biased, 0), e, BE), 0)
            ids = tl.where(slot == s, pick, ids)
            biased = tl.where(e == pick, -float("inf"), biased)
    # the chosen scores, recomputed from their logits: the same bits as above, no gather needed
    picked = picked & (ids < E)  # always, but for NaN logits (then no lane is the max)
    scores = tl.where(picked, _sqrt_softplus(tl.load(row + ids, mask=picked, other=0.0), FAST), 0.0)
    total = tl.sum(scores, 0)
    weights = scores / tl.where(total > 0.0, total, 1.0) * route_scale  # a pad row: 0, not 0 / 0
    mine = picked & (ids >= first) & (ids < first + held)
    tl.store(ids_ptr + t * K + slot, tl.where(mine, ids - first, -1), mask=slot < K)
    tl.store(weights_ptr + t * K + slot, tl.where(picked, weights, 0.0), mask=slot < K)


def route_tasks(rows: int) -> int:
    return rows


# --- group ----------------------------------------------------------------------------------------
@triton.jit
def _ordered(a0, a1, a2, b0, b1, b2):
    """Two scan summaries (first class, last class, position) as (left, right). Of two adjacent
    ranges, the left one's position field is always the smaller (a start lies in its range, an
    end one past a position of it), so the combines do not depend on the order in which Triton
    passes their arguments, which a reverse scan does not document."""
    swap = b2 < a2
    return (tl.where(swap, b0, a0), tl.where(swap, b1, a1), tl.where(swap, b2, a2),
            tl.where(swap, a0, b0), tl.where(swap, a1, b1), tl.where(swap, a2, b2))


@triton.jit
def _run_start(a0, a1, a2, b0, b1, b2):
    """Summary of a range of sorted picks: (first class, last class, first position of the last
    class). A right range whose ends are equal is one class (sorted), so it extends the left
    range's last run if it has that class."""
    lf, ll, ls, rf, rl, rs = _ordered(a0, a1, a2, b0, b1, b2)
    return lf, rl, tl.where((rf == rl) & (rf == ll), ls, rs)


@triton.jit
def _run_end(a0, a1, a2, b0, b1, b2):
    """Mirror of `_run_start` for a reverse scan: (first class, last class, one past the last
    position of the first class)."""
    lf, ll, le, rf, rl, re = _ordered(a0, a1, a2, b0, b1, b2)
    return lf, rl, tl.where((lf == ll) & (ll == rf), re, le)


@triton.jit
def group_task(ids_ptr, order_ptr, experts_ptr, counts_ptr, P, BP: tl.constexpr, ROWS_: tl.constexpr):
    """`experts.group_picks` of the flat ids [P] (-1: pad) with ROWS_ rows a task: order, experts,
    counts int32 [P]. One task; BP >= P a power of two."""
    tl.static_assert(BP <= 16384)  # MAX_PICKS_BLOCK: keys below 2^31
    j = tl.arange(0, BP)
    e = tl.load(ids_ptr + j, mask=j < P, other=-1, cache_modifier=".cg")  # other SMs' ids: from L2
    # unique keys: the bitonic sort is not stable, the pick index in the key makes it so;
    # pads and the block's tail (j >= P, never stored) sort last, in pick order
    key = tl.sort(tl.where(e < 0, _PAD, e) * BP + j)
    cls = key // BP
    _, _, start = tl.associative_scan((cls, cls, j), 0, _run_start)
    _, _, end = tl.associative_scan((cls, cls, j + 1), 0, _run_end, reverse=True)
    counts = tl.where(((j - start) % ROWS_ == 0) & (cls != _PAD), tl.minimum(end - j, ROWS_), 0)
    tl.store(order_ptr + j, key % BP, mask=j < P)
    tl.store(experts_ptr + j, tl.where(counts > 0, cls, 0), mask=j < P)
    tl.store(counts_ptr + j, counts, mask=j < P)


def group_tasks() -> int:
    return 1


@triton.jit
def group_when_routed(ticket_ptr, R, ids_ptr, order_ptr, experts_ptr, counts_ptr, P, BP: tl.constexpr,
                      ROWS_: tl.constexpr):
    """After a route task of the kernels: count it in at the ticket (0 before the stage); the task
    that arrives R-th has seen every row's ids published (`sync.arrive`), groups the picks
    (`group_task`) and sets the ticket back to 0 for the next launch. So no stage waits for the
    grouping but the ones after the next grid barrier."""
    if arrive(ticket_ptr) == R - 1:
        group_task(ids_ptr, order_ptr, experts_ptr, counts_ptr, P, BP, ROWS_)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


# --- combine --------------------------------------------------------------------------------------
@triton.jit
def combine_task(t, per_pick_ptr, ids_ptr, shared_ptr, y_ptr, D, K,
                 BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, FAST: tl.constexpr):
    """y[row, block] = (sum of the row's live picks in top-k order + shared) in fp32, to bf16.
    Each pick's output is rounded to bf16 first: the reference's expert returns bf16."""
    blocks = tl.cdiv(D, BLOCK)
    row = t // blocks
    c = (t % blocks) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(K):
        p = row * K + s
        # a pad pick's row was never written (NaN is possible): not read at all, not scaled by 0
        width = tl.where(tl.load(ids_ptr + p) >= 0, D, 0)
        acc += bf16(tl.load(per_pick_ptr + p * D + c, mask=c < width, other=0.0))
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * D + c, mask=c < D, other=0.0).to(tl.float32)
    if not FAST:
        acc = bf16(acc)
    tl.store(y_ptr + row * D + c, acc.to(tl.bfloat16), mask=c < D)


def combine_tasks(rows: int, hidden: int, block: int) -> int:
    return rows * triton.cdiv(hidden, block)


# --- standalone launches --------------------------------------------------------------------------
@triton.jit
def _route(n, logits_ptr, logits_stride, slots_ptr, bias_ptr, tokens_ptr, tid2eid_ptr, ids_ptr, weights_ptr,
           E, K, route_scale, first, held, BE: tl.constexpr, BK: tl.constexpr, HASH: tl.constexpr,
           FAST: tl.constexpr):
    for t in range(tl.program_id(0), n, tl.num_programs(0)):
        route_task(t, logits_ptr, logits_stride, slots_ptr, bias_ptr, tokens_ptr, tid2eid_ptr, ids_ptr,
                   weights_ptr, E, K, route_scale, first, held, BE, BK, HASH, FAST)


@triton.jit
def _group(ids_ptr, order_ptr, experts_ptr, counts_ptr, P, BP: tl.constexpr, ROWS_: tl.constexpr):
    group_task(ids_ptr, order_ptr, experts_ptr, counts_ptr, P, BP, ROWS_)


@triton.jit
def _combine(n, per_pick_ptr, ids_ptr, shared_ptr, y_ptr, D, K,
             BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, FAST: tl.constexpr):
    for t in range(tl.program_id(0), n, tl.num_programs(0)):
        combine_task(t, per_pick_ptr, ids_ptr, shared_ptr, y_ptr, D, K, BLOCK, HAS_SHARED, FAST)


def _empty(shape, dtype, device, poison: bool) -> torch.Tensor:
    """An output buffer; poisoned (NaN, or int32 min) so that tests see any element no task wrote."""
    if not poison:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


def route(logits: torch.Tensor, slots: torch.Tensor, topk: int, route_scale: float, *,
          bias: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, held: range | None = None,
          poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, k] int32, weights [R, k] fp32) of logits [R, E] fp32: hash routing when
    `tid2eid` is given (with `tokens`), else top-k of scores + `bias`; with `held` (a rank's
    experts) the ids local to it, -1 for the others (`route_task`)."""
    rows, num_experts = logits.shape
    held = held or range(num_experts)
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    hash_routed = tid2eid is not None
    if hash_routed:
        assert tokens is not None and tid2eid.shape[1] == topk and tid2eid.is_contiguous()
    else:
        assert bias is not None and bias.dtype == torch.float32
    ids = _empty((rows, topk), torch.int32, logits.device, poison)
    weights = _empty((rows, topk), torch.float32, logits.device, poison)
    n = route_tasks(rows)
    _route[task_grid(n)](n, logits, logits.stride(0), slots, logits if hash_routed else bias,
                         tokens if hash_routed else slots, tid2eid if hash_routed else slots, ids, weights,
                         num_experts, topk, float(route_scale), held.start, len(held),
                         BE=triton.next_power_of_2(num_experts), BK=triton.next_power_of_2(topk), HASH=hash_routed,
                         FAST=fast_dots(logits))
    return ids, weights


def group(ids: torch.Tensor, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts.group_picks(ids)` on the device, in one program: (order, experts, counts) int32 [P]."""
    flat = ids.flatten().to(torch.int32).contiguous()
    picks = flat.numel()
    block = max(16, triton.next_power_of_2(picks))
    assert block <= MAX_PICKS_BLOCK
    order, experts, counts = (_empty((picks,), torch.int32, ids.device, poison) for _ in range(3))
    _group[(group_tasks(),)](flat, order, experts, counts, picks, BP=block, ROWS_=ROWS)
    return order, experts, counts


def combine(per_pick: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None, block: int = 1024,
            poison: bool = False) -> torch.Tensor:
    """y [R, d] bf16: per_pick fp32 [R * k, d] summed per row in top-k order over picks with
    ids [R, k] >= 0, plus `shared` bf16 [R, d] when given."""
    rows, topk = ids.shape
    hidden = per_pick.shape[1]
    assert per_pick.dtype == torch.float32 and per_pick.is_contiguous() and per_pick.shape[0] == rows * topk
    assert shared is None or (shared.dtype == torch.bfloat16 and shared.is_contiguous())
    flat_ids = ids.to(torch.int32).contiguous()
    y = _empty((rows, hidden), torch.bfloat16, per_pick.device, poison)
    n = combine_tasks(rows, hidden, block)
    _combine[task_grid(n)](n, per_pick, flat_ids, per_pick if shared is None else shared, y, hidden, topk,
                           BLOCK=block, HAS_SHARED=shared is not None, FAST=fast_dots(per_pick))
    return y
