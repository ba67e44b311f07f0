"""The kernels' step at positions past 65,536 (V4-Flash's YaRN original context) against the per-op
path on the same cache. The runner tests' tiny model (its compressed layers' rope already YaRN-
scaled at every position), each cache filled as a prefill of CONTEXT tokens would leave it (every
ring's positions, each compressed layer's entries; random values: `bench.layer.fill_cache`), then
one step of two requests: rows that complete a compressed block of both compressed layers
(CSA: 4 positions, HCA: 16) and rows that do not, and a pad row. At this context the CSA indexer
scores ~16.5 K entries a row and keeps 8, and the HCA layer attends ~4 K entries a row."""

import torch

from monodecode.bench.layer import fill_cache
# tests/ is on the path (rootdir conftest); `decoder` is the runner tests' fixture, used here too
from test_mono_runner import compare_step, decoder  # noqa: F401

CONTEXT = 66_015  # the next position, 66,015, completes a block of 4 and of 16 positions
STEP = [(0, 2), (5, 1)]  # (slot, rows): positions CONTEXT, CONTEXT + 1, ... a slot


def test_a_step_past_65536_positions_matches_the_per_op_path(decoder):
    assert all((CONTEXT + 1) % ratio == 0 for ratio in decoder.mono.ratios if ratio)
    g = torch.Generator().manual_seed(11)
    ref_cache, mono_cache = fill_cache(decoder.model, CONTEXT), fill_cache(decoder.model, CONTEXT)
    positions = [CONTEXT + i for _, n in STEP for i in range(n)] + [0]
    slots = [slot for slot, n in STEP for _ in range(n)] + [-1]
    tokens = torch.randint(0, decoder.config.vocab_size, (len(slots),), generator=g).tolist()
    ref_choices = compare_step(decoder, ref_cache, mono_cache, tokens, positions, slots)
    kept = [len(ref_choices["index"][r][0]) for r in range(len(slots)) if slots[r] >= 0]
    assert kept == [decoder.config.index_topk] * len(kept), kept  # the top-k really selects
    stepped = torch.zeros(len(mono_cache.layers[0].window.pos), dtype=torch.bool)
    stepped[[slot for slot, _ in STEP]] = True
    for ratio, layer in zip(decoder.mono.ratios, mono_cache.layers):
        if ratio:  # the entry the step's first row of each request completed, and no other
            emitted = layer.entries[:, (CONTEXT + 1) // ratio - 1].abs().sum(-1).cpu() > 0
            assert torch.equal(emitted, stepped), (ratio, emitted)
