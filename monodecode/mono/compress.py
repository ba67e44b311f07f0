"""A compressed layer's entries inside the kernels: the compressor's source rows and its emission
(CSA: ratio 4, windows that overlap; HCA: ratio 128), as tasks for K1 (`model/compressor.py` is
the reference).

Contract (M = ratio, D = the entry's channels, RD of them rotated; C = 2 halves with overlap, else 1):
- `source_write_task(r)`, R tasks: row r's projections `wkv(x)`, `wgate(x)` ([R, C D] bf16, the
  GEMV's outputs, rows a given stride apart) and its position into its slot's source ring (pad
  rows: nothing), a stage before the emission.
- `emit_tasks(R)` = R: task r emits the entry w = (p + 1) // M - 1 of its row's slot s when the row
  (position p, slot s >= 0) completes that window, (p + 1) % M == 0, and w < the cache's entries a
  slot; any other row (and a pad row, s = -1) does nothing.
- Source: the slot's rows of the layer's source ring (`PositionRing`: kv, gate [S, span, C D] bf16,
  pos [S, span] int64), written by an earlier stage. Half h of the entry (h < C) takes window
  w - (C - 1) + h's positions (w - C + 1 + h) M + j, j < M: values kv[.., h D + ch] and scores
  gate[.., h D + ch] + ape[j, h D + ch] (ape fp32 [M, C D]). A slot whose position is negative or
  not the one the ring holds there is absent: score -inf, value 0.
- Per channel ch < D: softmax of the C M scores in fp32 (max, then the sum of exps, then each
  probability), each probability rounded to bf16, times its value, rounded to bf16, summed in fp32
  and rounded to bf16: pooled [D], as the reference's bf16 `(values * probs).sum()`. Then
  rms_norm(pooled) with the compressor's norm weight (fp32), rounded to bf16, and the rope of the
  last RD channels at position w M (the compressed layer's freqs), rounded to bf16:
  entries[s, w] (bf16 [S, E, D]).
- Three passes over the slots in blocks of SB (the max, the sum of exps, the products), so that a
  task holds [SB, D] tiles and pooled [D] rather than every slot at once: an HCA entry reads its
  128 rows' gates three times and their values once (from L2 after the first pass).
- Rounding points are the reference's, each by `rounding.bf16`; up to fp32 summation order
  (a probability or a sum may then round to the other bf16 neighbour, rarely).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_math import pair_offsets, rms_norm, rope
from .plan import task_grid
from .rounding import bf16

SB = 16  # slots of a block


def emit_tasks(R: int) -> int:
    return R


@triton.jit
def source_write_task(r, positions_ptr, slots_ptr, kv_ptr, gate_ptr, stride, src_kv_ptr, src_gate_ptr, src_pos_ptr,
                      span, CW, BLOCK: tl.constexpr):
    """Row r's compressor projections (kv, gate [R, CW] bf16, CW = C D, rows `stride` apart) into
    its slot's source ring at its position (`PositionRing`: row position % span), and the position
    beside them; nothing for a pad row (slot < 0). The emission of a later stage reads them there."""
    slot = tl.load(slots_ptr + r)
    if slot >= 0:
        position = tl.load(positions_ptr + r)
        row = slot * span + position % span
        c = tl.arange(0, BLOCK)
        for c0 in range(0, CW, BLOCK):
            mask = c0 + c < CW
            tl.store(src_kv_ptr + row * CW + c0 + c, tl.load(kv_ptr + r * stride + c0 + c, mask=mask), mask=mask)
            tl.store(src_gate_ptr + row * CW + c0 + c, tl.load(gate_ptr + r * stride + c0 + c, mask=mask), mask=mask)
        tl.store(src_pos_ptr + row, position)


@triton.jit
def _slot_block(src_gate_ptr, src_pos_ptr, ape_ptr, slot, span, window, j0, ch0, c, cmask, D,
                M: tl.constexpr, C: tl.constexpr, SB: tl.constexpr):
    """Slots j0 .. j0 + SB of `window` on the channels ch0 + c (c [P, 2] pair offsets): the ring
    rows' offsets [SB], whether each slot is present [SB], and its scores [SB, P, 2] fp32
    (-inf where absent)."""
    j = j0 + tl.arange(0, SB)
    position = window * M + j
    live = (j < M) & (position >= 0)
    row = slot * span + tl.where(live, position % span, 0)
    present = live & (tl.load(src_pos_ptr + row, mask=live, other=-1) == position)
    offsets = row[:, None, None] * (C * D) + ch0 + c[None, :, :]
    mask = present[:, None, None] & cmask[None, :, :]
    gate = tl.load(src_gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    ape = tl.load(ape_ptr + j[:, None, None] * (C * D) + ch0 + c[None, :, :], mask=(j < M)[:, None, None]
                  & cmask[None, :, :], other=0.0)
    return offsets, mask, tl.where(mask, gate + ape, float("-inf"))


@triton.jit
def emit_task(r, positions_ptr, slots_ptr, src_kv_ptr, src_gate_ptr, src_pos_ptr, span, ape_ptr, norm_w_ptr,
              freqs_ptr, entries_ptr, n_entries, D, RD, eps,
              M: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r's entry, if the row completes a window (the module docstring)."""
    slot = tl.load(slots_ptr + r)
    position = tl.load(positions_ptr + r)
    w = (position + 1) // M - 1
    if (slot >= 0) & ((position + 1) % M == 0) & (w < n_entries):
        c, pair = pair_offsets(BLOCK_D)
        cmask = c < D
        top = tl.full((BLOCK_D // 2, 2), float("-inf"), tl.float32)
        for h in tl.static_range(C):
            for j0 in range(0, M, SB):
                _, _, score = _slot_block(src_gate_ptr, src_pos_ptr, ape_ptr, slot, span, w - (C - 1) + h, j0,
                                          h * D, c, cmask, D, M, C, SB)
                top = tl.maximum(top, tl.max(score, axis=0))
        top = tl.where(top == float("-inf"), 0.0, top)  # channels past D: nothing present
        total = tl.zeros((BLOCK_D // 2, 2), tl.float32)
        for h in tl.static_range(C):
            for j0 in range(0, M, SB):
                _, _, score = _slot_block(src_gate_ptr, src_pos_ptr, ape_ptr, slot, span, w - (C - 1) + h, j0,
                                          h * D, c, cmask, D, M, C, SB)
                total += tl.sum(tl.exp(score - top[None, :, :]), axis=0)
        total = tl.where(total == 0.0, 1.0, total)
        pooled = tl.zeros((BLOCK_D // 2, 2), tl.float32)
        for h in tl.static_range(C):
            for j0 in range(0, M, SB):
                offsets, mask, score = _slot_block(src_gate_ptr, src_pos_ptr, ape_ptr, slot, span,
                                                   w - (C - 1) + h, j0, h * D, c, cmask, D, M, C, SB)
                value = tl.load(src_kv_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                prob = bf16(tl.exp(score - top[None, :, :]) / total[None, :, :])
                pooled += tl.sum(bf16(prob * value), axis=0)
        weight = tl.load(norm_w_ptr + c, mask=cmask, other=0.0)
        entry = rope(rms_norm(bf16(pooled), D, eps, weight), pair, w * M, freqs_ptr, (D - RD) // 2, RD // 2,
                     False)
        tl.store(entries_ptr + (slot * n_entries + w) * D + c, entry.to(tl.bfloat16), mask=cmask)


@triton.jit
def _emit(n_tasks, positions_ptr, slots_ptr, src_kv_ptr, src_gate_ptr, src_pos_ptr, span, ape_ptr, norm_w_ptr,
          freqs_ptr, entries_ptr, n_entries, D, RD, eps,
          M: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        emit_task(t, positions_ptr, slots_ptr, src_kv_ptr, src_gate_ptr, src_pos_ptr, span, ape_ptr, norm_w_ptr,
                  freqs_ptr, entries_ptr, n_entries, D, RD, eps, M, C, SB, BLOCK_D)


def emit(ring, entries: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, freqs: torch.Tensor,
         positions: torch.Tensor, slots: torch.Tensor, ratio: int, overlap: bool, eps: float) -> None:
    """The standalone launch: ring the layer's source `PositionRing` (kv, gate [S, span, C D] bf16),
    entries [S, E, D] bf16 (written in place where a row completes a window), ape fp32 [ratio, C D],
    norm_weight fp32 [D], freqs fp32 [RD / 2], positions / slots int64 [R] (slot -1: a pad row)."""
    halves = 2 if overlap else 1
    kv, gate, pos = ring.data["kv"], ring.data["gate"], ring.pos
    S, E, D = entries.shape
    if kv.shape != (S, ring.size, halves * D) or gate.shape != kv.shape or pos.shape != (S, ring.size):
        raise ValueError(f"source ring kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, pos {tuple(pos.shape)} "
                         f"do not fit entries {tuple(entries.shape)} with {halves} half(s)")
    if ape.shape != (ratio, halves * D) or norm_weight.shape != (D,) or 2 * freqs.numel() > D:
        raise ValueError(f"ape {tuple(ape.shape)}, norm {tuple(norm_weight.shape)}, freqs {tuple(freqs.shape)} "
                         f"do not fit ratio {ratio}, {halves} half(s) of {D} channels")
    assert kv.dtype == gate.dtype == entries.dtype == torch.bfloat16 and kv.is_contiguous() and gate.is_contiguous()
    assert entries.is_contiguous() and positions.dtype == slots.dtype == torch.int64
    n_tasks = emit_tasks(positions.numel())
    _emit[task_grid(n_tasks)](n_tasks, positions.contiguous(), slots.contiguous(), kv, gate, pos, ring.size,
                              ape.float().contiguous(), norm_weight.float().contiguous(), freqs.float().contiguous(),
                              entries, E, D, 2 * freqs.numel(), float(eps), M=ratio, C=halves, SB=min(SB, ratio),
                              BLOCK_D=triton.next_power_of_2(D))
