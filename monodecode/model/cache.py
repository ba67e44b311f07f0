"""Decode state: preallocated tensors indexed by request slot, read and written in place.

Per layer:
- the sliding window: a position ring of `sliding_window + max_step_rows` KV rows a slot; row
  of position p lives at p % size, with its position stored beside it (-1: empty);
- compressed layers: a position ring of the compressor's per-token projections (kv, gate) over
  the window span it needs (2 x ratio for CSA's overlapping windows, ratio for HCA) plus
  `max_step_rows`, and the compressed entries [slots, max_context // ratio, head_dim], entry w
  summarising positions [w * ratio, (w + 1) * ratio);
- CSA layers also: the indexer compressor's projection ring and its keys.

DeepSeek-V4.1: only a KV-source layer holds compressed state (its entries, their index keys, and
at ratio 2 a ring of its fp32 projections, `ratio + max_step_rows` rows); the other layers read
their source's (shared_attention.py). A model with Engram layers also keeps each request's last
token ids (`tokens`, `engram_max_ngram_size - 1 + max_step_rows` a slot), the n-grams' history.

The extra `max_step_rows` rows make a step rewindable: a verify step may write up to that many
positions of one request that are later rejected; the rows the next step needs are still there,
and a rejected position is overwritten when it is decoded again. Readers check the stored
position, so stale or foreign rows are never used.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


class PositionRing:
    """Per-slot rows keyed by absolute position: position p at index p % size."""

    def __init__(self, num_slots: int, size: int, widths: dict[str, int], device, dtype):
        self.size = size
        self.pos = torch.full((num_slots, size), -1, dtype=torch.long, device=device)
        self.data = {k: torch.zeros(num_slots, size, w, dtype=dtype, device=device) for k, w in widths.items()}

    def read(self, slot: int, positions: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        index = positions % self.size
        valid = (positions >= 0) & (self.pos[slot, index] == positions)
        return {k: v[slot, index] for k, v in self.data.items()}, valid

    def write(self, slot: int | list[int] | torch.Tensor, positions: torch.Tensor,
              values: dict[str, torch.Tensor]) -> None:
        """Rows of `positions` [n] and `values` ([n, width] each) into one slot (of a long prompt
        only the last `size` rows are kept), or with `slot` a list or tensor, row i into slot[i]
        (the rows of one slot then fit the ring: a verify step's rows)."""
        keep = slice(max(positions.shape[0] - self.size, 0), None)  # later rows win
        if not isinstance(slot, int):
            slot, keep = torch.as_tensor(slot, device=self.pos.device), slice(None)
        index = positions[keep] % self.size
        self.pos[slot, index] = positions[keep]
        for k, v in values.items():
            self.data[k][slot, index] = v[keep].to(self.data[k].dtype)

    def clear(self, slot: int) -> None:
        self.pos[slot] = -1


class LayerCache:
    def __init__(self, config: ModelConfig, ratio: int, num_slots: int, max_context: int,
                 max_step_rows: int, device, dtype, compresses: bool = True):
        """`compresses`: whether the layer makes its own compressed entries (V4.1: its KV sources
        only; the other layers keep their window alone)."""
        d = config.head_dim
        self.window = PositionRing(num_slots, config.sliding_window + max_step_rows, {"kv": d}, device, dtype)
        self.source = self.entries = self.index_source = self.index_entries = None
        if ratio == 0 or not compresses:
            return
        num_entries = max_context // ratio
        if config.is_v41:
            self.entries = torch.zeros(num_slots, num_entries, d, dtype=dtype, device=device)
            self.index_entries = torch.zeros(num_slots, num_entries, config.index_head_dim, dtype=dtype, device=device)
            if ratio > 1:
                self.source = PositionRing(num_slots, ratio + max_step_rows, {"kv": d, "gate": d}, device, torch.float32)
            return
        overlap = 2 if ratio == 4 else 1
        span = overlap * ratio + max_step_rows
        self.source = PositionRing(num_slots, span, {"kv": overlap * d, "gate": overlap * d}, device, dtype)
        self.entries = torch.zeros(num_slots, num_entries, d, dtype=dtype, device=device)
        if ratio == 4:
            di = config.index_head_dim
            self.index_source = PositionRing(num_slots, span, {"kv": 2 * di, "gate": 2 * di}, device, dtype)
            self.index_entries = torch.zeros(num_slots, num_entries, di, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        for ring in (self.window, self.source, self.index_source):
            if ring is not None:
                ring.clear(slot)


class DecodeCache:
    """All layers' decode state for `num_slots` requests of up to `max_context` positions."""

    def __init__(self, config: ModelConfig, ratios: list[int], num_slots: int, max_context: int,
                 max_step_rows: int = 8, device="cpu", dtype=torch.float32):
        if num_slots < 1 or max_context < 1 or max_step_rows < 1:
            raise ValueError(f"num_slots ({num_slots}), max_context ({max_context}) and "
                             f"max_step_rows ({max_step_rows}) must be positive")
        self.num_slots, self.max_context, self.max_step_rows = num_slots, max_context, max_step_rows
        self.layers = [LayerCache(config, r, num_slots, max_context, max_step_rows, device, dtype,
                                  compresses=not config.is_v41 or config.kv_source_of(i) == i)
                       for i, r in enumerate(ratios)]
        self.tokens = None
        if config.engram_layer_ids:
            size = config.engram_max_ngram_size - 1 + max_step_rows
            self.tokens = PositionRing(num_slots, size, {"id": 1}, device, torch.long)

    def clear(self, slot: int) -> None:
        """Forget a slot's request (its rows become invalid), e.g. before reusing the slot."""
        for layer in self.layers:
            layer.clear(slot)
        if self.tokens is not None:
            self.tokens.clear(slot)
