"""The window attention of a DeepSeek-V4 layer between and after its GEMVs: two stages of tasks
for K1 / K2 (the GEMVs wq_a|wkv, wq_b and wo_a / wo_b are other stages' tasks).

Contract (rows r < R; H heads of D = head_dim channels; the rope dims are the LAST RD channels of
a head (or of the kv row), rotated in interleaved pairs (2i, 2i+1) by angle position * freqs[i],
freqs fp32 [RD / 2] (`layer_frequencies(config, compressed=False)`); positions and slots int64
[R], slot -1 marks a pad row; norm weights, sinks and freqs fp32; activations bf16):
- `norm_rope_kv_task`, tasks (row, which): `norm_rope_kv_tasks(R)` = 2 R, t = 2 row + which.
  which 0: qr[r] = rms_norm(qr_raw[r], q_norm), qr_raw [R, Q_LORA] (row stride given), qr
  [R, Q_LORA] contiguous; pad rows are computed like any row.
  which 1: kv = rope(rms_norm(kv_raw[r], kv_norm)) at the row's position, kv_raw [R, D] (row
  stride given), written to the window ring of the row's slot s at index p % ring_size, with
  ring_pos[s, p % ring_size] = p. A pad row writes nothing. The rows of one slot must have
  distinct positions mod ring_size (true while a slot has at most ring_size rows in a step),
  or two tasks of the stage write one entry.
- `attend_task`, tasks (row, head block): `attend_tasks(R, H, HB)` = R ceil(H / HB),
  t = row ceil(H / HB) + block; heads block HB .. block HB + HB - 1 (masked at H).
  The queries: q[r, h] = rope(rms_norm(q_raw[r, h])) (no norm weight) at the row's position,
  from q_raw [R, H, D] (the wq_b GEMV's output), computed by the task as it loads them: first
  the heads' sums of squares (every chunk load issued at once), then each chunk normalised,
  rounded, rotated and rounded again as the logits pass reads it; the per-op path's rounding
  points, its sum of squares in another fp32 order.
  For row r of slot s at position p, the keys (= values: one shared K=V head) are the ring
  entries of positions p - W + 1 .. p that exist: position >= 0 and ring_pos[s, index] equal to
  it (an empty entry, -1, or a stale one of another position is skipped). All keys come from the
  ring: the step's own rows were written by `norm_rope_kv_task`, an earlier stage.
  logits = q . k * scale (scale = D^-0.5) in fp32; one softmax over the valid keys and the head's
  sink logit (attn_sink fp32 [H], probability mass with no value); out = probs @ keys in fp32,
  rounded to bf16; o[r, h] = inverse rope of out at p (angle negated), bf16, o [R, H, D]
  contiguous. A pad row gets o[r] = 0 (what the per-op path leaves there).
  A draft block (BLOCK = B > 0, the DSpark draft's stages: model/draft.py): the step's rows are
  blocks of B consecutive rows of one request each (row r in block r // B), and every row of a
  block sees the whole block, so its window ends at the block's last position instead of its
  own: positions e - W + 1 .. e with e = p - r % B + B - 1 (W = the context window + B). The
  block's own keys come from the ring like any others, so its ring holds >= W entries a slot: the
  block's entries lie past the context and are overwritten when those positions are committed.
  The output's inverse rope is at the row's own position p.
  The whole window goes at once (KW = `window_keys(W)` >= W key slots, their ring entries
  gathered once) in two passes over D in chunks of BD (D % BD == 0): the logits, then probs @
  keys chunk by chunk (each chunk rounded, de-rotated and stored). So a pass's chunk loads do not
  wait on each other, no online softmax is needed, and the registers hold [HB, KW] logits and a
  [KW, BD] key chunk rather than [HB, D] accumulators. The keys are read twice (from L2 the
  second time). A row with no valid key gets out = 0 (the sink takes all the mass).
  The chunks wholly before the rope channels (the first (D - RD) // BD) run a copy of each
  pass's loop body without the rotation: a task's time follows its instructions more than its
  loads, and the rotation's sines and cosines were a large part of them.
  The ring's kv is addressed with int32 offsets: S * ring_size * D < 2^31.
  A compressed layer (RATIO > 0): the row also attends its slot's compressed entries
  (entries [S, E, D] bf16, already rotated): TOPK 0 (HCA) the first (p + 1) // RATIO, else (CSA)
  the TOPK ids of the row's selection list (-1: none). Their scaled logits go block by block (KE
  entries) into the task's park (fp32, HB x the entries rounded up to KE, at t * park_stride),
  so that one softmax covers the window, the entries and the sink, as the reference's single
  softmax over [window; entries]; each output chunk adds probs @ entries before dividing by the
  mass. A window layer (RATIO 0) compiles none of it. A CSA row's selection list holds its live
  ids first (the top-k stage's contract), so it attends the first min(TOPK, (p + 1) // RATIO).
  Entry splits (SPLITS > 0): a pair's compressed entries spread over SPLITS more tasks, each
  split's channels over SPLIT_PARTS tasks, whose partial softmaxes the window's tasks wait for
  and combine (`attend_entries.py`).
  Output parts (PARTS > 1): a pair's D / BD output chunks spread over PARTS window tasks,
  t = pair (S + PARTS) + S + p (S = SPLITS SPLIT_PARTS), part p writing chunks p C / PARTS .. (p + 1) C / PARTS - 1
  of the C; each computes the pair's whole softmax (on a compressed layer each waits for the
  pair's entry splits, or parks all its entries' logits itself), so each chunk is what one task
  would write, bit for bit. A task's chunks run one after another, each a chain of loads and
  dots, so the parts shorten the stage more than the logits they compute again lengthen it.
- Ring layout (`PositionRing`): kv [S, ring_size, D] bf16 and pos [S, ring_size] int64, both
  contiguous. Stage order: norm_rope_kv, then the wq_b GEMV that reads qr, then attend; attend
  reads what both wrote, so grid barriers (or the end of a launch) must separate them.
- Rounding points are the reference's (`model/attention.py`, `model/norm.py`, `model/rope.py`):
  rms_norm in fp32 (x * rsqrt(mean(x^2) + eps), then * weight), rounded to bf16; the rotation in
  fp32 from those bf16 values, rounded to bf16; attention in fp32, rounded to bf16 before the
  inverse rotation, rounded again after it; each by `rounding.bf16` (not a cast: why,
  there).

Dots (constexpr FAST): attend's q . k ([HB, BD] x [BD, KW]) and probs @ keys ([HB, KW] x
[KW, BD]) are `tl.dot`s, so HB, KW and BD >= 16 (powers of two). FAST: bf16 operands with fp32
accumulation; q and keys are exact in bf16, and probs are split into a bf16 high part and a bf16
low part (two dots), so the products keep ~16 bits of each probability, as the reference's fp32
einsum does. Portable (interpreter, AMD): fp32 operands in IEEE precision (the interpreter's bf16
dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attend_entries import (KE, MAX_SPLITS, attended_entries, await_splits, entries_out, entry_split,
                             entry_splits, park_entry_logits, parked_mass, release_splits, split_partials,
                             split_stats, splits_out)
from .attention_math import (HB, head_pairs, heads_inverse_rms, key_chunk, pair_offsets, power_of_two_at_most,
                             rms_norm, rope, scaled_logits)
from .plan import fast_dots, interpreted, task_grid
from .rounding import bf16
from .sync import DEFAULT_MAX_POLLS, SyncState


BD = 64  # channels of an attend chunk: the K side of q . k, the N side of probs @ keys
TASK_HEADS = (16, 32, 64)  # the heads a task may take (LaunchShape.attend_heads)
CHUNKS = (64, 128)  # the channels a chunk may take (LaunchShape.attend_chunk)
WIDE_CHUNK_ROWS = 16  # a CSA layer's attend takes chunks of 128 from this many rows of a step


def attend_tile(rows: int, heads: int, head_dim: int, programs: int, selecting: bool, compressed: bool,
                task_heads: int = 0, chunk: int = 0) -> tuple[int, int]:
    """(HB, BD) of a K2 step of `rows` rows: the heads an attend task takes and the channels of its
    chunks, `task_heads` and `chunk` (LaunchShape.attend_heads / attend_chunk) or, at 0, HB and BD,
    except that tasks take 32 heads once the pairs of 16 would not fit one round of the `programs`
    (each task reads its row's keys once for twice the heads) on a window layer and on a layer
    whose rows attend a selection (`selecting`: CSA, `index_topk` entries each), and the latter
    takes chunks of 128 from WIDE_CHUNK_ROWS rows on. An HCA layer (`compressed`, not selecting:
    every entry a row can see, besides the window) keeps 16 heads: its K2 spills with 32. A chunk
    is no longer than a head."""
    if selecting:
        chunk = chunk or (CHUNKS[1] if rows >= WIDE_CHUNK_ROWS else BD)
    if selecting or not compressed:
        task_heads = task_heads or (TASK_HEADS[1] if head_pairs(rows, heads, HB) > programs else HB)
    return task_heads or HB, min(chunk or BD, head_dim)


def norm_rope_kv_tasks(R: int) -> int:
    return 2 * R


def attend_tasks(R: int, H: int, HB: int = HB, splits: int = 0, parts: int = 1, split_parts: int = 1) -> int:
    return head_pairs(R, H, HB) * (splits * split_parts + parts)


def output_parts(R: int, H: int, D: int, programs: int, HB: int = HB, BD: int = BD) -> int:
    """Output parts a (row, head block) pair of a window layer's attend (its D / BD output chunks
    spread over that many tasks) for a launch of `programs` programs: as many as leave every
    pair's tasks one round of the programs, a power of two, at most D / BD (1: one task a pair)."""
    fit = min(D // BD, programs // head_pairs(R, H, HB))
    return 1 if fit < 1 else power_of_two_at_most(fit)


def compressed_layout(R: int, H: int, D: int, entries: int, programs: int, parts: int = 0,
                      HB: int = HB, BD: int = BD) -> tuple[int, int, int]:
    """(entry splits, output parts, split parts) a pair of a compressed layer's attend (`entries`:
    the most a row attends): the output parts `parts` or (0) as many as fill up to half of the
    programs (`output_parts`), the entry splits what is left of one round
    (`attend_entries.entry_splits`), and each split's channels over as many tasks (a power of two,
    at most D / BD) as still leave the pairs' tasks one round."""
    parts = parts or output_parts(R, H, D, programs // 2, HB, BD)
    splits = entry_splits(R, H, entries, programs, parts, HB)
    fit = 0 if splits == 0 else min(D // BD, (programs // head_pairs(R, H, HB) - parts) // splits)
    return splits, parts, 1 if fit < 1 else power_of_two_at_most(fit)


# --- stage 1: q_norm, kv_norm + rope + ring write ---------------------------------------------------
@triton.jit
def norm_rope_kv_task(t, qr_raw_ptr, qr_raw_stride, q_norm_ptr, qr_ptr, kv_raw_ptr, kv_raw_stride, kv_norm_ptr,
                      positions_ptr, slots_ptr, freqs_ptr, ring_kv_ptr, ring_pos_ptr, ring_size,
                      Q_LORA, D, RD, eps, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Task (row t // 2, which t % 2): which 0 writes qr[row]; which 1 writes the row's kv and
    position into its slot's ring (nothing for a pad row)."""
    row = t // 2
    if t % 2 == 0:
        c, _ = pair_offsets(BLOCK_Q)
        mask = c < Q_LORA
        x = tl.load(qr_raw_ptr + row * qr_raw_stride + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(q_norm_ptr + c, mask=mask, other=0.0)
        tl.store(qr_ptr + row * Q_LORA + c, rms_norm(x, Q_LORA, eps, w).to(tl.bfloat16), mask=mask)
    else:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:
            position = tl.load(positions_ptr + row)
            c, pair = pair_offsets(BLOCK_D)
            mask = c < D
            x = tl.load(kv_raw_ptr + row * kv_raw_stride + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(kv_norm_ptr + c, mask=mask, other=0.0)
            kv = rope(rms_norm(x, D, eps, w), pair, position, freqs_ptr, (D - RD) // 2, RD // 2,
                      False)
            entry = slot * ring_size + position % ring_size
            tl.store(ring_kv_ptr + entry * D + c, kv.to(tl.bfloat16), mask=mask)
            tl.store(ring_pos_ptr + entry, position)


# --- stage 2: the heads' norm and rope, the window attention, the inverse rope ---------------------
@triton.jit
def _window(end, slot, ring_pos_ptr, ring_size, W, D, KW: tl.constexpr):
    """The window's keys (positions end - W + 1 + k, k < KW): (offset of each key's row in the
    ring's kv, int32 [KW]; valid [KW])."""
    k = tl.arange(0, KW)
    key_pos = end - (W - 1) + k
    live = (k < W) & (key_pos >= 0)
    entry = (slot * ring_size + tl.where(live, key_pos % ring_size, 0)).to(tl.int32)
    return entry * D, live & (tl.load(ring_pos_ptr + entry, mask=live, other=-1) == key_pos)


@triton.jit
def _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                  park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales,
                  D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr, ROPE: tl.constexpr,
                  RATIO: tl.constexpr, KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr):
    """o[:, d0 .. d0 + BD] = (inverse rope of, ROPE) bf16(probs @ keys[:, d0 .. d0 + BD] / mass),
    the keys the window's and (RATIO) the visible compressed entries: the task's own (SPLITS 0)
    or the entry splits' partial outputs, each weighted by its scale."""
    d = d0 + tl.arange(0, BD)
    keys = key_chunk(ring_kv_ptr, key_rows, valid, d)
    if FAST:
        out = tl.dot(lo, keys, tl.dot(hi, keys))
    else:
        out = tl.dot(p, keys.to(tl.float32), input_precision="ieee")
    if RATIO > 0:
        if SPLITS > 0:
            out += splits_out(split_outs, split_scales, d, D, HB, BD, SPLITS)
        else:
            out = entries_out(out, park, visible, m, 0, 1, d, entries_ptr, slot, n_entries, sel, D, HB, BD, KE,
                              FAST, TOPK)
    o = bf16(out / mass[:, None])
    if ROPE:
        pair = (d0 // 2 + tl.arange(0, BD // 2))[None, :]
        o = tl.reshape(rope(tl.reshape(o, (HB, BD // 2, 2)), pair, position, freqs_ptr, (D - RD) // 2, RD // 2, True),
                       (HB, BD))
    tl.store(o_ptr + rows + d[None, :], o.to(tl.bfloat16), mask=hmask[:, None])


@triton.jit
def attend_task(t, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
                freqs_ptr, H, D: tl.constexpr, RD, W, scale, eps, entries_ptr, n_entries, park_ptr, park_stride,
                selected_ptr, n_rows, partials_ptr, tickets_ptr, sync_ptr, max_polls, HB: tl.constexpr,
                KW: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, RATIO: tl.constexpr,
                KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr, PARTS: tl.constexpr,
                SPLIT_PARTS: tl.constexpr, STAGE: tl.constexpr):
    """Task t of (row, head block) pairs, S + PARTS a pair: S = SPLITS x SPLIT_PARTS split tasks
    (`attend_entries.entry_split`), then the window's tasks, PARTS of them, each of which writes its
    share of o[row, block heads] (output chunks (part - S) C / PARTS .., of the C = D / BD) from the
    raw heads (normalised and rotated as they are loaded), the whole window in two passes over
    D (module docstring); RATIO > 0: and the row's compressed entries (every visible one, TOPK 0,
    or the TOPK its indexer selected), its own (SPLITS 0) or the entry splits' (waited for at the
    pair's ticket)."""
    n_blocks = tl.cdiv(H, HB)
    S: tl.constexpr = SPLITS * SPLIT_PARTS
    pair = t // (S + PARTS)
    part = t - pair * (S + PARTS)
    first = (part - S) * (D // PARTS)  # the window task's output channels: first .. first + D / PARTS
    last = first + D // PARTS
    row = pair // n_blocks
    heads = (pair % n_blocks) * HB + tl.arange(0, HB)
    hmask = heads < H
    rows = (row * H + heads)[:, None] * D
    slot = tl.load(slots_ptr + row)
    park = park_ptr + t * park_stride
    sel = selected_ptr + row * TOPK
    if part < S:
        if slot >= 0:
            inv = heads_inverse_rms(q_ptr, rows, hmask, eps, D, HB, BD)
            position = tl.load(positions_ptr + row)
            visible = attended_entries(row, positions_ptr, slots_ptr, RATIO, TOPK)
            entry_split(part, pair, n_rows * n_blocks, q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr,
                        slot, n_entries, visible, sel, scale, park, partials_ptr, tickets_ptr, D, RD, HB, BD, KE,
                        FAST, TOPK, SPLITS, SPLIT_PARTS)
    elif slot < 0:
        for d0 in range(first, last, BD):
            d = d0 + tl.arange(0, BD)
            tl.store(o_ptr + rows + d[None, :], tl.zeros((HB, BD), dtype=tl.bfloat16), mask=hmask[:, None])
    else:
        inv = heads_inverse_rms(q_ptr, rows, hmask, eps, D, HB, BD)
        position = tl.load(positions_ptr + row)
        end = position if BLOCK == 0 else position - row % BLOCK + BLOCK - 1  # the window's last key
        key_rows, valid = _window(end, slot, ring_pos_ptr, ring_size, W, D, KW)
        logits = scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, ring_kv_ptr, key_rows, valid, scale, D,
                               RD, HB, BD, KW, FAST)
        # one softmax over the valid keys, the compressed entries and the sink (a key with no value)
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        m = tl.maximum(tl.max(logits, axis=1), sink)
        visible = 0
        split_outs = partials_ptr  # the entry splits' outputs and scales [SPLITS, HB] (SPLITS > 0)
        split_scales = m
        if RATIO > 0:
            visible = attended_entries(row, positions_ptr, slots_ptr, RATIO, TOPK)
            if SPLITS > 0:
                await_splits(pair, tickets_ptr, sync_ptr, max_polls, STAGE, S, FAST)
                split_outs, stats = split_stats(partials_ptr, pair, n_rows * n_blocks, D, HB, SPLITS)
                at = stats + tl.arange(0, SPLITS)[:, None] * 2 * HB + tl.arange(0, HB)[None, :]
                split_m = tl.load(at)
                split_mass = tl.load(at + HB)
                m = tl.maximum(m, tl.max(split_m, axis=0))
                split_scales = tl.exp(split_m - m[None, :])  # 0 for a split with no entries (-inf)
            else:
                m = tl.maximum(m, park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot,
                                                    n_entries, visible, sel, scale, park, 0, 1, D, RD, HB, BD, KE,
                                                    FAST, TOPK))
        p = tl.exp(logits - m[:, None])
        mass = tl.sum(p, axis=1) + tl.exp(sink - m)
        if RATIO > 0:
            if SPLITS > 0:
                mass += tl.sum(split_mass * split_scales, axis=0)
            else:
                mass += parked_mass(park, visible, m, 0, 1, HB, KE)
        hi = p  # the output chunks' operands: p itself without FAST
        lo = p
        if FAST:  # p = hi + lo, both bf16: ~16 bits of each probability through bf16 tensor cores
            hi = p.to(tl.bfloat16)
            lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
        plain = (D - RD) // BD * BD  # the chunks before any rope channel: no inverse rotation to compute
        for d0 in range(first, tl.minimum(plain, last), BD):
            _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                          park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales, D, RD, HB,
                          BD, FAST, False, RATIO, KE, TOPK, SPLITS)
        for d0 in range(tl.maximum(plain, first), last, BD):
            _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                          park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales, D, RD, HB,
                          BD, FAST, True, RATIO, KE, TOPK, SPLITS)
        if RATIO > 0 and SPLITS > 0:
            release_splits(pair, n_rows * n_blocks, tickets_ptr, S, PARTS)


# --- standalone launches --------------------------------------------------------------------------
@triton.jit
def _norm_rope_kv(n_tasks, qr_raw_ptr, qr_raw_stride, q_norm_ptr, qr_ptr, kv_raw_ptr, kv_raw_stride, kv_norm_ptr,
                  positions_ptr, slots_ptr, freqs_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, Q_LORA, D, RD, eps,
                  BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        norm_rope_kv_task(t, qr_raw_ptr, qr_raw_stride, q_norm_ptr, qr_ptr, kv_raw_ptr, kv_raw_stride, kv_norm_ptr,
                          positions_ptr, slots_ptr, freqs_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, Q_LORA, D, RD,
                          eps, BLOCK_Q, BLOCK_D)


@triton.jit
def _attend(n_tasks, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
            freqs_ptr, H, D: tl.constexpr, RD, W, scale, eps, entries_ptr, n_entries, park_ptr, park_stride,
            selected_ptr, n_rows, partials_ptr, tickets_ptr, sync_ptr, max_polls, HB: tl.constexpr,
            KW: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, RATIO: tl.constexpr,
            KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr, PARTS: tl.constexpr,
            SPLIT_PARTS: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        attend_task(t, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
                    freqs_ptr, H, D, RD, W, scale, eps, entries_ptr, n_entries, park_ptr, park_stride, selected_ptr,
                    n_rows, partials_ptr, tickets_ptr, sync_ptr, max_polls, HB, KW, BD, BLOCK, FAST, RATIO, KE, TOPK,
                    SPLITS, PARTS, SPLIT_PARTS, 0)


def _empty(shape, like: torch.Tensor, poison: bool) -> torch.Tensor:
    if poison:
        return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=like.device)
    return torch.empty(shape, dtype=torch.bfloat16, device=like.device)


def _check_rope(D: int, freqs: torch.Tensor) -> int:
    rd = 2 * freqs.numel()
    assert freqs.dtype == torch.float32 and freqs.is_contiguous() and D % 2 == 0 and rd <= D
    return rd


def _check_ring(ring, D: int):
    kv, pos = ring.data["kv"], ring.pos
    assert kv.dtype == torch.bfloat16 and kv.is_contiguous() and kv.shape[1:] == (ring.size, D)
    assert pos.dtype == torch.int64 and pos.is_contiguous() and pos.shape == kv.shape[:2]
    return kv, pos


def norm_rope_kv(qr_raw: torch.Tensor, kv_raw: torch.Tensor, q_norm: torch.Tensor, kv_norm: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, freqs: torch.Tensor, ring, eps: float, *,
                 poison: bool = False) -> torch.Tensor:
    """qr_raw [R, q_lora] and kv_raw [R, D] bf16 (row-strided views allowed), q_norm / kv_norm fp32,
    positions / slots int64 [R], freqs fp32 [RD / 2], ring the layer's window `PositionRing` ->
    qr [R, q_lora] bf16; the rows' kv are written into the ring. `poison` fills qr with NaN first."""
    R, q_lora = qr_raw.shape
    D = kv_raw.shape[1]
    assert qr_raw.dtype == kv_raw.dtype == torch.bfloat16 and qr_raw.stride(1) == kv_raw.stride(1) == 1
    assert q_norm.shape == (q_lora,) and kv_norm.shape == (D,) and positions.shape == slots.shape == (R,)
    assert positions.dtype == slots.dtype == torch.int64 and q_lora % 2 == 0
    ring_kv, ring_pos = _check_ring(ring, D)
    qr = _empty((R, q_lora), qr_raw, poison)
    n_tasks = norm_rope_kv_tasks(R)
    _norm_rope_kv[task_grid(n_tasks)](n_tasks, qr_raw, qr_raw.stride(0), q_norm.float().contiguous(), qr, kv_raw,
                                      kv_raw.stride(0), kv_norm.float().contiguous(), positions.contiguous(),
                                      slots.contiguous(), freqs, ring_kv, ring_pos, ring.size, q_lora, D,
                                      _check_rope(D, freqs), float(eps), BLOCK_Q=triton.next_power_of_2(q_lora),
                                      BLOCK_D=triton.next_power_of_2(D))
    return qr


def window_keys(window: int) -> int:
    """KW: the window padded to a power of two, at least 16 (the N side of q . k)."""
    return max(16, triton.next_power_of_2(window))


def attend(q_raw: torch.Tensor, ring, positions: torch.Tensor, slots: torch.Tensor, sink: torch.Tensor,
           freqs: torch.Tensor, window: int, eps: float, *, block: int = 0, heads_per_task: int = HB,
           d_chunk: int = BD, num_warps: int = 4, num_stages: int = 3, poison: bool = False,
           entries: torch.Tensor | None = None, ratio: int = 0, entry_block: int = KE,
           selected: torch.Tensor | None = None, splits: int = 0, parts: int = 1, split_parts: int = 1,
           tickets: torch.Tensor | None = None,
           max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """q_raw [R, H, D] bf16 (the wq_b GEMV's heads, before their norm and rope), ring the layer's
    window `PositionRing` (the step's rows already written), positions / slots int64 [R], sink fp32
    [H], freqs fp32 [RD / 2], eps the heads' rms_norm epsilon -> o [R, H, D] bf16 (the module
    docstring's contract; pad rows 0); `block` > 0: the rows are draft blocks of that many rows,
    `window` counting the block. `poison` fills o with NaN first. num_stages 3 pipelines the chunk
    loads (faster than 2 on the H200). A compressed layer (`ratio`) can spread its entries over
    `splits` tasks a pair (a power of two): its window tasks then wait on them, so the launch is
    cooperative, at most a program a SM, through `tickets` (int32 [2, pairs], 0 between launches;
    made here if None) and a wait of `max_polls` polls, which raises MonoSyncError if it expires.
    A pair's output chunks can spread over `parts` tasks and each entry split's over `split_parts`
    (powers of two dividing D / d_chunk; `output_parts`, `compressed_layout`)."""
    q = q_raw
    R, H, D = q.shape
    assert block >= 0 and (block == 0 or (R % block == 0 and window > block)), \
        f"draft blocks of {block} rows: the step's {R} rows are whole blocks, the window {window} counts one"
    assert q.dtype == torch.bfloat16 and q.is_contiguous() and sink.shape == (H,)
    assert positions.shape == slots.shape == (R,) and positions.dtype == slots.dtype == torch.int64
    chunk = min(d_chunk, D)
    assert heads_per_task >= 16 and chunk >= 16, "tl.dot needs M, N, K >= 16"
    assert D % chunk == 0 and chunk & (chunk - 1) == 0, "D must be a multiple of a power-of-two chunk"
    assert splits == 0 or (ratio and splits & (splits - 1) == 0 and splits <= MAX_SPLITS), \
        f"entry splits ({splits}): a power of two up to {MAX_SPLITS}, on a compressed layer"
    assert parts & (parts - 1) == 0 and 1 <= parts <= D // chunk, \
        f"output parts ({parts}): a power of two up to D / d_chunk = {D // chunk}"
    assert split_parts & (split_parts - 1) == 0 and 1 <= split_parts <= D // chunk, \
        f"split parts ({split_parts}): a power of two up to D / d_chunk = {D // chunk}"
    ring_kv, ring_pos = _check_ring(ring, D)
    assert ring_kv.numel() < 2**31, "the ring is addressed with int32 offsets"
    o = _empty((R, H, D), q, poison)
    n_tasks = attend_tasks(R, H, heads_per_task, splits, parts, split_parts)
    if ratio:  # a compressed layer: the visible entries too (a task's logits parked in `park`)
        assert entries is not None and entries.dtype == torch.bfloat16 and entries.is_contiguous()
        assert entries.shape[0] == ring_kv.shape[0] and entries.shape[2] == D and block == 0
        keys = entries.shape[1] if selected is None else selected.shape[1]
        park_stride = heads_per_task * triton.cdiv(keys, entry_block) * entry_block
        park = torch.empty(n_tasks * park_stride, dtype=torch.float32, device=q.device)
    else:
        entries, park, park_stride = ring_kv, ring_kv, 0  # unread
    if selected is not None:  # CSA: each row's selected entries [R, topk] (-1: none), the live ones first
        assert ratio and selected.shape[0] == R and selected.dtype == torch.int64 and selected.is_contiguous()
    pairs = attend_tasks(R, H, heads_per_task)
    if tickets is None:
        tickets = torch.zeros(2 * pairs, dtype=torch.int32, device=q.device)
    assert tickets.dtype == torch.int32 and tickets.numel() >= 2 * pairs
    partials = torch.empty(max(split_partials(R, H, D, splits, heads_per_task), 1), dtype=torch.float32,
                           device=q.device)
    sync = SyncState(q.device, ["attend"])
    topk = 0 if selected is None else selected.shape[1]
    grid, options = task_grid(n_tasks), {}
    if splits and not interpreted():  # window tasks wait on other tasks: all programs resident
        grid = (min(n_tasks, torch.cuda.get_device_properties(q.device).multi_processor_count),)
        options = {"launch_cooperative_grid": True}
    _attend[grid](n_tasks, q, o, positions.contiguous(), slots.contiguous(), ring_kv, ring_pos, ring.size,
                  sink.float().contiguous(), freqs, H, D, _check_rope(D, freqs), int(window),
                  float(D ** -0.5), float(eps), entries, entries.shape[1] if ratio else 0, park, park_stride,
                  positions if selected is None else selected, R, partials, tickets, sync.words, int(max_polls),
                  HB=heads_per_task, KW=window_keys(window), BD=chunk, BLOCK=block,
                  FAST=fast_dots(q), RATIO=ratio, KE=entry_block, TOPK=topk, SPLITS=splits, PARTS=parts,
                  SPLIT_PARTS=split_parts, num_warps=num_warps, num_stages=num_stages, **options)
    sync.check()
    return o
