"""Attention of a DeepSeek-V4.1 layer, whose compressed entries and their selection come from
source layers (sources.py).

The core is V4's (attention.py) without the per-head query norm: the window of raw KV, the sink,
the grouped output. A compressed layer (ratio 2 or 1) also attends entries of its KV source (the
latest `kv_source_layer_ids` at or below it): a KV source compresses its rows into its own cache
first, so a layer reads the entries of the step's own rows too. Which entries: an index source
(the latest `index_source_layer_ids` at or below the layer) scores its KV source's index keys and
selects its top-k, and publishes the selection to the layers above it that run no indexer, for
the same step; the candidate layer publishes its candidate mask the same way. `StepShare` holds
what a step's layers publish, by request group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import Attention, RequestRows
from .cache import LayerCache
from .parallel import SINGLE, TensorParallel
from .sources import LatentCompressor, SourceIndexer, candidate_mask


@dataclass
class StepShare:
    """One step's cross-layer state: every layer's cache (a layer reads its KV source's), and per
    request group (its index in the step's groups) the latest index source's selection [n, E]
    and the candidate layer's mask [n, E]."""

    caches: list[LayerCache]
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)


class SharedAttention(Attention):
    def __init__(self, config, w: dict[str, torch.Tensor], prefix: str, layer: int, tp: TensorParallel = SINGLE):
        self.layer = layer
        super().__init__(config, w, prefix, config.compress_ratios[layer], tp)

    def build_compression(self) -> None:
        """The compressor on a KV source, the indexer on an index source; nothing else."""
        c, layer = self.c, self.layer
        if self.ratio == 0:
            return
        self.kv_source = c.kv_source_of(layer)
        if self.kv_source == layer:
            self.compressor = LatentCompressor(self.w, "", self.ratio, c, self.freqs)
        if c.index_source_of(layer) == layer:
            self.indexer = SourceIndexer(self.w, "", self.ratio, c, self.freqs)
        self.publishes_candidates = layer == c.candidate_source_layer_id
        self.uses_candidates = c.uses_candidates(layer)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, groups: list[RequestRows],
                 cache: LayerCache, share: StepShare) -> torch.Tensor:
        qr, q, kv = self.project(x, positions)
        sources = self.compressor.project(x) if self.compressor else None
        index_q = self.indexer.queries(x, qr, positions) if self.indexer else None
        out = torch.zeros_like(q)
        for i, g in enumerate(groups):
            keys, mask = self._window_keys(g, kv[g.index], cache)
            if self.ratio:
                if self.compressor:
                    self._compress(g, {k: v[g.index] for k, v in sources.items()}, cache, x.dtype)
                entries, selected = self._selected_entries(i, g, index_q, share)
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, selected], dim=1)
            cache.window.write(g.slot, g.positions, {"kv": kv[g.index]})
            out[g.index] = self.attend(q[g.index], keys, mask)
        return self.output(out, positions)

    def _compress(self, g: RequestRows, new: dict[str, torch.Tensor], cache: LayerCache, dtype) -> None:
        """Write the entries and index keys of the groups the rows complete; at ratio 2 remember
        the rows' projections for the groups they open."""
        r = self.ratio
        p0, p_last = int(g.positions[0]), int(g.positions[-1])
        first, last = (p0 + r) // r - 1, (p_last + 1) // r - 1
        if r == 1:
            latent = new["latent"]
        else:
            if last >= first:
                latent = self._pooled(g, new, cache, first, last, dtype)
            cache.source.write(g.slot, g.positions, new)
        if last >= first:
            windows = torch.arange(first, last + 1, device=g.positions.device)
            entries, keys = self.compressor.entries_and_keys(latent, windows)
            cache.entries[g.slot, first:last + 1] = entries.to(cache.entries.dtype)
            cache.index_entries[g.slot, first:last + 1] = keys.to(cache.index_entries.dtype)

    def _pooled(self, g: RequestRows, new: dict[str, torch.Tensor], cache: LayerCache, first: int, last: int,
                dtype) -> torch.Tensor:
        """Latents of groups first..last from the rows before the step (the ring) and the step's."""
        r, p0 = self.ratio, int(g.positions[0])
        start = first * r
        old, old_valid = cache.source.read(g.slot, torch.arange(start, p0, device=g.positions.device))
        present = torch.cat([old_valid, torch.ones_like(g.positions, dtype=torch.bool)])
        kv, gate = (torch.cat([old[k], new[k]]) for k in ("kv", "gate"))
        rows = (torch.arange(first, last + 1, device=kv.device)[:, None] * r
                + torch.arange(r, device=kv.device)) - start  # [groups, r]
        return self.compressor.latents(kv[rows], gate[rows], present[rows], dtype)

    def _selected_entries(self, i: int, g: RequestRows, index_q, share: StepShare):
        """The KV source's entries the group's rows can see, and the mask [n, E] of those each
        row attends (its index source's selection)."""
        source = share.caches[self.kv_source]
        count = (int(g.positions[-1]) + 1) // self.ratio
        entries = source.entries[g.slot, :count]
        if self.indexer is None:
            return entries, share.selections[i]
        q, weights = (t[g.index] for t in index_q)
        candidates = share.candidates[i] if self.uses_candidates else None
        scores = self.indexer.scores(q, weights, source.index_entries[g.slot, :count], g.positions, candidates)
        if self.publishes_candidates:
            c = self.c
            share.candidates[i] = candidate_mask(scores, g.positions, self.ratio, c.candidate_topk_blocks,
                                                 c.candidate_block_size)
        share.selections[i] = self.indexer.select(scores)
        return entries, share.selections[i]
