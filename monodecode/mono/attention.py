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
  Entry splits (SPLITS > 0, a power of two; `attend_tasks(R, H, HB, SPLITS)` tasks): a pair
  (row, head block) has SPLITS + 1 tasks, t = pair (SPLITS + 1) + part. Part s < SPLITS takes
  the entry blocks s, s + SPLITS, ... (parking their logits in its own park), stores the heads'
  max logit m_s, their mass sum exp(logit - m_s) and partial output probs @ entries (fp32 [HB,
  D], undivided) into `partials` (`split_partials` values: every pair's outputs, then every
  pair's [SPLITS, 2, HB] stats), then signals the pair's ticket (int32, 0 between launches; a
  split with no block stores m_s = -inf, mass 0 and no output). Part SPLITS, the window's task,
  waits until the ticket reaches SPLITS (bounded: `max_polls`, an expired wait records STAGE + 1
  in the error word of `sync_ptr` and the task goes on), subtracts SPLITS, and scales each
  split's mass and output by exp(m_s - m) for the common max m of the window, the splits and
  the sink. Waits go only to lower-numbered tasks, which never wait: no cycle, and under the
  interpreter (tasks in order) every wait is already met. Fp32 summation order differs from the
  unsplit task's only.
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

import os

import torch
import triton
import triton.language as tl

from .plan import interpreted
from .rounding import bf16
from .sync import _ERROR, DEFAULT_MAX_POLLS, SyncState, leader_wait, signal, wait_at_least


HB = 16  # heads of an attend task: the M side of its dots
BD = 64  # channels of an attend chunk: the K side of q . k, the N side of probs @ keys
KE = 64  # compressed entries of a block (a compressed layer's attend): the N side of q . k


def norm_rope_kv_tasks(R: int) -> int:
    return 2 * R


MAX_SPLITS = 8  # entry splits a (row, head block) pair: the window task holds [SPLITS, HB, BD] of their outputs


def attend_tasks(R: int, H: int, HB: int = HB, splits: int = 0) -> int:
    return R * triton.cdiv(H, HB) * (splits + 1)


def entry_splits(R: int, H: int, entries: int, programs: int, HB: int = HB, KE: int = KE) -> int:
    """Entry splits a pair of a compressed layer's attend (`entries`: the most a row attends, its
    blocks of KE the work to spread) for a launch of `programs` programs: as many as leave every
    pair's tasks one round of the programs, a power of two, at most MAX_SPLITS and no more than
    the blocks; 0 (the window's task takes the entries itself) when the pairs fill the programs."""
    pairs = R * triton.cdiv(H, HB)
    fit = min(MAX_SPLITS, triton.cdiv(entries, KE), programs // pairs - 1)
    return 0 if fit < 1 else 1 << (fit.bit_length() - 1)


def split_partials(R: int, H: int, D: int, splits: int, HB: int = HB) -> int:
    """fp32 values the entry splits of R rows keep for their window tasks: outputs and stats."""
    return R * triton.cdiv(H, HB) * splits * HB * (D + 2)


# --- helpers --------------------------------------------------------------------------------------
@triton.jit
def _pair_offsets(BLOCK: tl.constexpr):
    """Channel offsets of a row as [BLOCK / 2, 2] (pair k holds channels 2k, 2k + 1), and the pair
    index of each pair [BLOCK / 2]."""
    pair = tl.arange(0, BLOCK // 2)
    return pair[:, None] * 2 + tl.arange(0, 2)[None, :], pair


@triton.jit
def _rms_norm(x, n, eps, w):
    """rms_norm of one row held in x (fp32, any shape, zeros past the n channels), weight w (fp32,
    x's shape) or None; rounded to bf16 as fp32."""
    y = x * tl.rsqrt(tl.sum(x * x) / n + eps)
    if w is not None:
        y = w * y
    return bf16(y)


@triton.jit
def _rope(x, pair, position, freqs_ptr, first_pair, n_pairs, INVERSE: tl.constexpr):
    """x [..., P, 2] fp32 (bf16 values), channel pairs (2k, 2k + 1) with pair index `pair` (shape of
    x without its last axis): pairs first_pair .. first_pair + n_pairs - 1 are rotated in fp32 by
    position * freqs[k - first_pair] (negated if INVERSE), the rest kept; rounded to bf16 as fp32."""
    j = pair - first_pair
    is_rope = (j >= 0) & (j < n_pairs)
    angle = position.to(tl.float32) * tl.load(freqs_ptr + j, mask=is_rope, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    even, odd = tl.split(x)
    rot_even = tl.where(is_rope, even * cos - odd * sin, even)
    rot_odd = tl.where(is_rope, even * sin + odd * cos, odd)
    return bf16(tl.join(rot_even, rot_odd))


# --- stage 1: q_norm, kv_norm + rope + ring write ---------------------------------------------------
@triton.jit
def norm_rope_kv_task(t, qr_raw_ptr, qr_raw_stride, q_norm_ptr, qr_ptr, kv_raw_ptr, kv_raw_stride, kv_norm_ptr,
                      positions_ptr, slots_ptr, freqs_ptr, ring_kv_ptr, ring_pos_ptr, ring_size,
                      Q_LORA, D, RD, eps, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Task (row t // 2, which t % 2): which 0 writes qr[row]; which 1 writes the row's kv and
    position into its slot's ring (nothing for a pad row)."""
    row = t // 2
    if t % 2 == 0:
        c, _ = _pair_offsets(BLOCK_Q)
        mask = c < Q_LORA
        x = tl.load(qr_raw_ptr + row * qr_raw_stride + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(q_norm_ptr + c, mask=mask, other=0.0)
        tl.store(qr_ptr + row * Q_LORA + c, _rms_norm(x, Q_LORA, eps, w).to(tl.bfloat16), mask=mask)
    else:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:
            position = tl.load(positions_ptr + row)
            c, pair = _pair_offsets(BLOCK_D)
            mask = c < D
            x = tl.load(kv_raw_ptr + row * kv_raw_stride + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(kv_norm_ptr + c, mask=mask, other=0.0)
            kv = _rope(_rms_norm(x, D, eps, w), pair, position, freqs_ptr, (D - RD) // 2, RD // 2,
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
def _key_chunk(ring_kv_ptr, key_rows, valid, d):
    """Channels d of the window's keys: bf16 [KW, BD], zero where invalid."""
    return tl.load(ring_kv_ptr + key_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _heads_inverse_rms(q_ptr, rows, hmask, eps, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr):
    """rsqrt(mean(q^2) + eps) of each of the task's raw heads [HB] (the heads' rms_norm), its D / BD
    chunk loads all issued at once (unrolled)."""
    squares = tl.zeros((HB, BD), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        x = tl.load(q_ptr + rows + (d0 + tl.arange(0, BD))[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=1) / D + eps)


@triton.jit
def _query_chunk(q_ptr, rows, hmask, inv, d0, position, freqs_ptr, D: tl.constexpr, RD, HB: tl.constexpr,
                 BD: tl.constexpr, ROPE: tl.constexpr):
    """Channels d0 .. d0 + BD of the task's queries: rope(rms_norm(raw head)) (no norm weight), bf16
    values as fp32 [HB, BD]; ROPE False: a chunk before the rope channels, normalised only."""
    d = d0 + tl.arange(0, BD)
    x = tl.load(q_ptr + rows + d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    normed = bf16(x * inv[:, None])
    if ROPE:
        pair = (d0 // 2 + tl.arange(0, BD // 2))[None, :]
        normed = tl.reshape(_rope(tl.reshape(normed, (HB, BD // 2, 2)), pair, position, freqs_ptr, (D - RD) // 2,
                                  RD // 2, False), (HB, BD))
    return normed


@triton.jit
def _logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid,
                  D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr, ROPE: tl.constexpr):
    """logits + q[:, d0 .. d0 + BD] . keys[:, d0 .. d0 + BD] ([HB, KW] fp32)."""
    q = _query_chunk(q_ptr, rows, hmask, inv, d0, position, freqs_ptr, D, RD, HB, BD, ROPE)
    keys = _key_chunk(ring_kv_ptr, key_rows, valid, d0 + tl.arange(0, BD))
    if FAST:
        return tl.dot(q.to(tl.bfloat16), tl.trans(keys), logits)
    return tl.dot(q, tl.trans(keys.to(tl.float32)), logits, input_precision="ieee")


@triton.jit
def _scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, keys_ptr, key_rows, live, scale,
                   D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, NK: tl.constexpr, FAST: tl.constexpr):
    """scale * q . keys ([HB, NK] fp32; -inf where a key is not live), over D in chunks of BD: the
    chunks before any rope channel first, with no rotation to compute."""
    logits = tl.zeros((HB, NK), dtype=tl.float32)
    plain = (D - RD) // BD * BD
    for d0 in range(0, plain, BD):
        logits = _logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, keys_ptr, key_rows, live,
                               D, RD, HB, BD, FAST, False)
    for d0 in range(plain, D, BD):
        logits = _logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, keys_ptr, key_rows, live,
                               D, RD, HB, BD, FAST, True)
    return tl.where(live[None, :], logits * scale, float("-inf"))


@triton.jit
def _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                  park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales,
                  D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr, ROPE: tl.constexpr,
                  RATIO: tl.constexpr, KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr):
    """o[:, d0 .. d0 + BD] = (inverse rope of, ROPE) bf16(probs @ keys[:, d0 .. d0 + BD] / mass),
    the keys the window's and (RATIO) the visible compressed entries: the task's own (SPLITS 0)
    or the entry splits' partial outputs, each weighted by its scale."""
    d = d0 + tl.arange(0, BD)
    keys = _key_chunk(ring_kv_ptr, key_rows, valid, d)
    if FAST:
        out = tl.dot(lo, keys, tl.dot(hi, keys))
    else:
        out = tl.dot(p, keys.to(tl.float32), input_precision="ieee")
    if RATIO > 0:
        if SPLITS > 0:
            out += _splits_out(split_outs, split_scales, d, D, HB, BD, SPLITS)
        else:
            out += _entries_out(park, visible, m, 0, 1, d, entries_ptr, slot, n_entries, sel, D, HB, BD, KE, FAST,
                                TOPK)
    o = bf16(out / mass[:, None])
    if ROPE:
        pair = (d0 // 2 + tl.arange(0, BD // 2))[None, :]
        o = tl.reshape(_rope(tl.reshape(o, (HB, BD // 2, 2)), pair, position, freqs_ptr, (D - RD) // 2, RD // 2, True),
                       (HB, BD))
    tl.store(o_ptr + rows + d[None, :], o.to(tl.bfloat16), mask=hmask[:, None])


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
def _park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries, visible, sel,
                       scale, park, first, stride, D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr,
                       KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """The scaled logits of the visible compressed entries in blocks first, first + stride, ...,
    block by block, parked at `park` ([HB, EP] fp32, -inf past the visible ones); returns their
    max a head [HB] (-inf without a block)."""
    top = tl.full((HB,), float("-inf"), tl.float32)
    for e0 in range(first * KE, visible, stride * KE):
        key_rows, live = _entry_block(entries_ptr, slot, n_entries, e0, visible, sel, D, KE, TOPK)
        logits = _scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, key_rows, live, scale, D,
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
def _parked_mass(park, visible, m, first, stride, HB: tl.constexpr, KE: tl.constexpr):
    """sum of exp(parked logit - m) a head [HB] over blocks first, first + stride, ..."""
    mass = tl.zeros((HB,), tl.float32)
    for e0 in range(first * KE, visible, stride * KE):
        mass += tl.sum(tl.exp(tl.load(park + _parked(visible, e0, HB, KE)) - m[:, None]), axis=1)
    return mass


@triton.jit
def _entries_out(park, visible, m, first, stride, d, entries_ptr, slot, n_entries, sel, D: tl.constexpr,
                 HB: tl.constexpr, BD: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr):
    """probs @ entries[:, d] over the visible entries of blocks first, first + stride, ... ([HB, BD]
    fp32, not yet divided by the mass)."""
    out = tl.zeros((HB, BD), tl.float32)
    for e0 in range(first * KE, visible, stride * KE):
        key_rows, live = _entry_block(entries_ptr, slot, n_entries, e0, visible, sel, D, KE, TOPK)
        p = tl.exp(tl.load(park + _parked(visible, e0, HB, KE)) - m[:, None])
        keys = _key_chunk(entries_ptr, key_rows, live, d)
        if FAST:
            hi = p.to(tl.bfloat16)
            out = tl.dot((p - hi.to(tl.float32)).to(tl.bfloat16), keys, tl.dot(hi, keys, out))
        else:
            out = tl.dot(p, keys.to(tl.float32), out, input_precision="ieee")
    return out


@triton.jit
def _visible_entries(position, RATIO: tl.constexpr, TOPK: tl.constexpr):
    """The compressed entries a row at `position` attends: every visible one (TOPK 0), else its
    selection list's live ids, which come first: min(TOPK, visible)."""
    visible = (position + 1) // RATIO
    if TOPK > 0:
        visible = tl.minimum(visible, TOPK)
    return visible


@triton.jit
def _split_stats(partials_ptr, pair, n_pairs, D: tl.constexpr, HB: tl.constexpr, SPLITS: tl.constexpr):
    """Where the entry splits of `pair` keep their outputs ([SPLITS, HB, D] fp32) and their stats
    ([SPLITS, 2, HB] fp32: each head's max logit, then its mass under that max)."""
    outs = partials_ptr + pair * (SPLITS * HB * D)
    stats = partials_ptr + n_pairs * (SPLITS * HB * D) + pair * (SPLITS * 2 * HB)
    return outs, stats


@triton.jit
def _entry_split(part, pair, n_pairs, q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries,
                 visible, sel, scale, park, partials_ptr, tickets_ptr, D: tl.constexpr, RD, HB: tl.constexpr,
                 BD: tl.constexpr, KE: tl.constexpr, FAST: tl.constexpr, TOPK: tl.constexpr,
                 SPLITS: tl.constexpr):
    """Entry split `part` of a pair: over its entry blocks (part, part + SPLITS, ...) the heads'
    max logit m, their mass sum exp(logit - m) and their partial output probs @ entries (fp32,
    not divided), stored for the pair's window task; then a signal at the pair's ticket. With no
    block: m = -inf, mass 0, no output stored."""
    if SPLITS > 0:
        outs, stats = _split_stats(partials_ptr, pair, n_pairs, D, HB, SPLITS)
        m = _park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot, n_entries, visible,
                               sel, scale, park, part, SPLITS, D, RD, HB, BD, KE, FAST, TOPK)
        if part * KE < visible:
            for d0 in range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                out = _entries_out(park, visible, m, part, SPLITS, d, entries_ptr, slot, n_entries, sel, D, HB, BD,
                                   KE, FAST, TOPK)
                tl.store(outs + (part * HB + tl.arange(0, HB))[:, None] * D + d[None, :], out)
            mass = _parked_mass(park, visible, m, part, SPLITS, HB, KE)
        else:
            mass = tl.zeros((HB,), tl.float32)
        head = tl.arange(0, HB)
        tl.store(stats + part * 2 * HB + head, m)
        tl.store(stats + part * 2 * HB + HB + head, mass)
        signal(tickets_ptr + pair)


@triton.jit
def _await_splits(pair, tickets_ptr, sync_ptr, max_polls, STAGE: tl.constexpr, SPLITS: tl.constexpr,
                  LEADER: tl.constexpr):
    """The window task's wait for its pair's SPLITS entry splits (bounded: an expired wait records
    STAGE in the error word and the task goes on with what is there), then the ticket taken back
    down by SPLITS, so it is 0 between launches even after a wait gave up (every signal comes)."""
    ticket = tickets_ptr + pair
    if LEADER:
        leader_wait(ticket, SPLITS, sync_ptr + _ERROR, STAGE, max_polls)
    else:
        wait_at_least(ticket, SPLITS, sync_ptr + _ERROR, STAGE, max_polls)
    tl.atomic_add(ticket, -SPLITS, sem="relaxed", scope="gpu")


@triton.jit
def _splits_out(split_outs, split_scales, d, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr,
                SPLITS: tl.constexpr):
    """sum over the entry splits of scale * their partial output[:, d] ([HB, BD] fp32); a split
    with no entries (scale 0) is not read."""
    s = tl.arange(0, SPLITS)[:, None, None]
    live = split_scales[:, :, None] > 0
    outs = tl.load(split_outs + (s * HB + tl.arange(0, HB)[None, :, None]) * D + d[None, None, :], mask=live,
                   other=0.0)
    return tl.sum(outs * split_scales[:, :, None], axis=0)


@triton.jit
def attend_task(t, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
                freqs_ptr, H, D: tl.constexpr, RD, W, scale, eps, entries_ptr, n_entries, park_ptr, park_stride,
                selected_ptr, n_rows, partials_ptr, tickets_ptr, sync_ptr, max_polls, HB: tl.constexpr,
                KW: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, RATIO: tl.constexpr,
                KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr, STAGE: tl.constexpr):
    """Task t of (row, head block) pairs, SPLITS + 1 a pair: entry splits 0 .. SPLITS - 1, then
    the window's task, which writes o[row, block heads] from the raw heads (normalised and rotated
    as they are loaded), the whole window in two passes over D (module docstring); RATIO > 0: and
    the row's compressed entries (every visible one, TOPK 0, or the TOPK its indexer selected),
    its own (SPLITS 0) or the entry splits' (waited for at the pair's ticket)."""
    n_blocks = tl.cdiv(H, HB)
    pair = t // (SPLITS + 1)
    part = t - pair * (SPLITS + 1)
    row = pair // n_blocks
    heads = (pair % n_blocks) * HB + tl.arange(0, HB)
    hmask = heads < H
    rows = (row * H + heads)[:, None] * D
    slot = tl.load(slots_ptr + row)
    park = park_ptr + t * park_stride
    sel = selected_ptr + row * TOPK
    if part < SPLITS:
        if slot >= 0:
            inv = _heads_inverse_rms(q_ptr, rows, hmask, eps, D, HB, BD)
            position = tl.load(positions_ptr + row)
            _entry_split(part, pair, n_rows * n_blocks, q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr,
                         slot, n_entries, _visible_entries(position, RATIO, TOPK), sel, scale, park, partials_ptr,
                         tickets_ptr, D, RD, HB, BD, KE, FAST, TOPK, SPLITS)
    elif slot < 0:
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            tl.store(o_ptr + rows + d[None, :], tl.zeros((HB, BD), dtype=tl.bfloat16), mask=hmask[:, None])
    else:
        inv = _heads_inverse_rms(q_ptr, rows, hmask, eps, D, HB, BD)
        position = tl.load(positions_ptr + row)
        end = position if BLOCK == 0 else position - row % BLOCK + BLOCK - 1  # the window's last key
        key_rows, valid = _window(end, slot, ring_pos_ptr, ring_size, W, D, KW)
        logits = _scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, ring_kv_ptr, key_rows, valid, scale, D,
                                RD, HB, BD, KW, FAST)
        # one softmax over the valid keys, the compressed entries and the sink (a key with no value)
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        m = tl.maximum(tl.max(logits, axis=1), sink)
        visible = 0
        split_outs = partials_ptr  # the entry splits' outputs and scales [SPLITS, HB] (SPLITS > 0)
        split_scales = m
        if RATIO > 0:
            visible = _visible_entries(position, RATIO, TOPK)
            if SPLITS > 0:
                _await_splits(pair, tickets_ptr, sync_ptr, max_polls, STAGE, SPLITS, FAST)
                split_outs, stats = _split_stats(partials_ptr, pair, n_rows * n_blocks, D, HB, SPLITS)
                at = stats + tl.arange(0, SPLITS)[:, None] * 2 * HB + tl.arange(0, HB)[None, :]
                split_m = tl.load(at)
                split_mass = tl.load(at + HB)
                m = tl.maximum(m, tl.max(split_m, axis=0))
                split_scales = tl.exp(split_m - m[None, :])  # 0 for a split with no entries (-inf)
            else:
                m = tl.maximum(m, _park_entry_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, entries_ptr, slot,
                                                     n_entries, visible, sel, scale, park, 0, 1, D, RD, HB, BD, KE,
                                                     FAST, TOPK))
        p = tl.exp(logits - m[:, None])
        mass = tl.sum(p, axis=1) + tl.exp(sink - m)
        if RATIO > 0:
            if SPLITS > 0:
                mass += tl.sum(split_mass * split_scales, axis=0)
            else:
                mass += _parked_mass(park, visible, m, 0, 1, HB, KE)
        hi = p  # the output chunks' operands: p itself without FAST
        lo = p
        if FAST:  # p = hi + lo, both bf16: ~16 bits of each probability through bf16 tensor cores
            hi = p.to(tl.bfloat16)
            lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
        plain = (D - RD) // BD * BD  # the chunks before any rope channel: no inverse rotation to compute
        for d0 in range(0, plain, BD):
            _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                          park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales, D, RD, HB,
                          BD, FAST, False, RATIO, KE, TOPK, SPLITS)
        for d0 in range(plain, D, BD):
            _output_chunk(p, hi, lo, mass, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid, o_ptr, rows, hmask,
                          park, visible, m, entries_ptr, slot, n_entries, sel, split_outs, split_scales, D, RD, HB,
                          BD, FAST, True, RATIO, KE, TOPK, SPLITS)


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
            KE: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        attend_task(t, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
                    freqs_ptr, H, D, RD, W, scale, eps, entries_ptr, n_entries, park_ptr, park_stride, selected_ptr,
                    n_rows, partials_ptr, tickets_ptr, sync_ptr, max_polls, HB, KW, BD, BLOCK, FAST, RATIO, KE, TOPK,
                    SPLITS, 0)


def _fast(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.version.cuda is not None


def _grid(n_tasks: int) -> tuple[int]:
    # the interpreter runs programs one after another: one program loops over every task
    return (1,) if os.environ.get("TRITON_INTERPRET") == "1" else (n_tasks,)


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
    _norm_rope_kv[_grid(n_tasks)](n_tasks, qr_raw, qr_raw.stride(0), q_norm.float().contiguous(), qr, kv_raw,
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
           selected: torch.Tensor | None = None, splits: int = 0, tickets: torch.Tensor | None = None,
           max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """q_raw [R, H, D] bf16 (the wq_b GEMV's heads, before their norm and rope), ring the layer's
    window `PositionRing` (the step's rows already written), positions / slots int64 [R], sink fp32
    [H], freqs fp32 [RD / 2], eps the heads' rms_norm epsilon -> o [R, H, D] bf16 (the module
    docstring's contract; pad rows 0); `block` > 0: the rows are draft blocks of that many rows,
    `window` counting the block. `poison` fills o with NaN first. num_stages 3 pipelines the chunk
    loads (faster than 2 on the H200). A compressed layer (`ratio`) can spread its entries over
    `splits` tasks a pair (a power of two): its window tasks then wait on them, so the launch is
    cooperative, at most a program a SM, through `tickets` (int32, a pair's each, 0 between launches;
    made here if None) and a wait of `max_polls` polls, which raises MonoSyncError if it expires."""
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
    ring_kv, ring_pos = _check_ring(ring, D)
    assert ring_kv.numel() < 2**31, "the ring is addressed with int32 offsets"
    o = _empty((R, H, D), q, poison)
    n_tasks = attend_tasks(R, H, heads_per_task, splits)
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
        tickets = torch.zeros(pairs, dtype=torch.int32, device=q.device)
    assert tickets.dtype == torch.int32 and tickets.numel() >= pairs
    partials = torch.empty(max(split_partials(R, H, D, splits, heads_per_task), 1), dtype=torch.float32,
                           device=q.device)
    sync = SyncState(q.device, ["attend"])
    topk = 0 if selected is None else selected.shape[1]
    grid, options = _grid(n_tasks), {}
    if splits and not interpreted():  # window tasks wait on other tasks: all programs resident
        grid = (min(n_tasks, torch.cuda.get_device_properties(q.device).multi_processor_count),)
        options = {"launch_cooperative_grid": True}
    _attend[grid](n_tasks, q, o, positions.contiguous(), slots.contiguous(), ring_kv, ring_pos, ring.size,
                  sink.float().contiguous(), freqs, H, D, _check_rope(D, freqs), int(window),
                  float(D ** -0.5), float(eps), entries, entries.shape[1] if ratio else 0, park, park_stride,
                  positions if selected is None else selected, R, partials, tickets, sync.words, int(max_polls),
                  HB=heads_per_task, KW=window_keys(window), BD=chunk, BLOCK=block,
                  FAST=_fast(q), RATIO=ratio, KE=entry_block, TOPK=topk, SPLITS=splits, num_warps=num_warps,
                  num_stages=num_stages, **options)
    sync.check()
    return o
