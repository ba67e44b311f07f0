"""`BatchedAttention`: a layer's attention (window-only, CSA or HCA) on a decode step in fixed
shapes, with no host syncs, so that it can be captured in a CUDA graph. The mono runner runs the
attention of its `ffn` layers with it, and `bench layer`'s per-op baseline (bench/batched.py).

The step: rows with distinct (slot, position); a request's rows are consecutive positions, at
most the cache's `max_step_rows` of them; pad rows (slot -1) anywhere. The math is `Attention`'s
(same projections, norms, rounding points), with changes of form:
- the step's rows are written to the position rings first (window KV, compressor sources), then
  read back by position, where `Attention` reads older rows from a ring and the step's own rows
  directly: the same rows;
- every row computes the compressed entry of its last window (`Compressor.compress`, on source
  rows read from the ring), and the rows that complete a window (position + 1 a multiple of the
  ratio) write it; the others write back, unchanged, an entry no row of the step completes (the
  one after its request's last window), so that no two writes of a step collide;
- CSA: each row's indexer scores every index key slot of its request (a [rows, max_context / 4,
  index_head_dim] gather: the price of fixed shapes at long contexts), masked to the visible ones,
  and the row attends over its top-k entries (`Indexer.top`), gathered; HCA: over every entry
  slot, masked to the visible ones. Masked keys add exact zeros to the softmax: the result is
  `Attention`'s up to fp32 summation order (bit-equal on the CPU in the tests);
- pad rows write nothing (they write back, unchanged, a row no live row of the step writes) and
  their output is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import Attention
from .cache import LayerCache, PositionRing
from .hc import hc_post
from .layer import site_input


class BatchedAttention:
    def __init__(self, attention: Attention, device):
        self.att, self.c = attention, attention.c
        for owner in (attention, attention.compressor, attention.indexer,
                      attention.indexer and attention.indexer.compressor):
            if owner is not None:  # no host-to-device copy inside a capture
                owner.freqs = owner.freqs.to(device)

    def __call__(self, x, positions, slots, cache: LayerCache) -> torch.Tensor:
        att, window = self.att, self.c.sliding_window
        step = StepRows.of(positions, slots, cache.window.pos.shape[0])
        slots = step.slots
        qr, q, kv = att.project(x, positions)
        write(cache.window, step, {"kv": kv})
        key_pos = positions[:, None] - window + 1 + torch.arange(window, device=x.device)  # [R, W]
        keys, valid = read(cache.window, slots, key_pos)
        keys = keys["kv"]
        if att.ratio:
            visible = emit(att.compressor, cache.source, cache.entries, x, step)
            if att.indexer:
                emit(att.indexer.compressor, cache.index_source, cache.index_entries, x, step)
                index_q, index_w = att.indexer.queries(x, qr, positions)
                top, visible = att.indexer.top(index_q, index_w, cache.index_entries[slots], positions)
                entries = cache.entries[slots[:, None], top]  # [R, k, d]: the chosen entries only
            else:
                entries = cache.entries[slots]  # [R, E, d]: every entry slot, `visible` masks
            keys, valid = torch.cat([keys, entries], dim=1), torch.cat([valid, visible], dim=1)
        y = att.output(att.attend(q, keys, valid), positions)
        return torch.where(step.live[:, None], y, torch.zeros_like(y))


def attention_site(attention: BatchedAttention, streams, fn, base, scale, norm, positions, slots, cache,
                   c) -> torch.Tensor:
    """A layer's attention sub-block in fixed shapes (the first half of `Block`): the site's mHC
    collapse (`fn`, `base`, `scale`: `Block.site_weights`), norm, attention and fold; the new
    streams. The mono runner's `ffn` layers and bench layer's per-op baseline run it."""
    x, post, comb = site_input(streams, fn, base, scale, norm, c)
    return hc_post(attention(x, positions, slots, cache), streams, post, comb)


@dataclass
class StepRows:
    """A step's rows as the writes need them: positions, slots (a pad row's clamped to 0: its
    writes are made no-ops), live (not a pad row) and, per row, the last live position of its
    slot in the step (-1 if it has none)."""

    positions: torch.Tensor
    slots: torch.Tensor
    live: torch.Tensor
    last: torch.Tensor

    @classmethod
    def of(cls, positions, slots, num_slots: int) -> StepRows:
        live, slots = slots >= 0, slots.clamp(min=0)
        last = torch.full((num_slots,), -1, dtype=positions.dtype, device=positions.device)
        last = last.scatter_reduce(0, slots, torch.where(live, positions, -1), "amax")[slots]
        return cls(positions, slots, live, last)


def emit(compressor, ring: PositionRing, entries: torch.Tensor, x, step: StepRows):
    """Write the step's source rows and the entries its rows complete; return which entry slots
    each row sees [R, E]."""
    m, count, positions = compressor.ratio, entries.shape[1], step.positions
    write(ring, step, compressor.project(x))
    visible = torch.arange(count, device=x.device)[None] < ((positions + 1) // m)[:, None]
    if count == 0:  # a context shorter than one window: nothing to emit or see
        return visible
    window = (positions + 1) // m - 1  # the last window a row's position closes or passed
    completes = ((positions + 1) % m == 0) & (window >= 0) & step.live

    def lookup(pos):  # pos [R, m] of row r's window
        rows, present = read(ring, step.slots, pos)
        return rows["kv"], rows["gate"], present

    new = compressor.compress(lookup, window.clamp(min=0)).to(entries.dtype)
    untouched = ((step.last + 1) // m).clamp(max=count - 1)
    target = torch.where(completes, window, untouched)
    slots = step.slots
    entries[slots, target] = torch.where(completes[:, None], new, entries[slots, target])
    return visible


def write(ring: PositionRing, step: StepRows, values: dict[str, torch.Tensor]) -> None:
    """The step's live rows into a position ring. A pad row writes back, unchanged, the row after
    its slot's last live one, which no live row of the step writes (a request's rows in a step
    are fewer than the ring's size)."""
    live, slots = step.live, step.slots
    index = torch.where(live, step.positions, step.last + 1) % ring.size
    for name, value in values.items():
        data = ring.data[name]
        data[slots, index] = torch.where(live[:, None], value.to(data.dtype), data[slots, index])
    ring.pos[slots, index] = torch.where(live, step.positions, ring.pos[slots, index])


def read(ring: PositionRing, slots, positions):
    """Rows of positions [R, n] of each row's slot: ({name: [R, n, width]}, present [R, n])."""
    index = positions % ring.size
    present = (positions >= 0) & (ring.pos[slots[:, None], index] == positions)
    return {name: data[slots[:, None], index] for name, data in ring.data.items()}, present
