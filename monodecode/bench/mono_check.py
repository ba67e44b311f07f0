"""The mono path checked on a GPU at real dims: `python -m monodecode.bench.mono_check [--layers N]
[--shape FIELD=VALUE,...] [--skip CHECKS] [--out FILE]`.

A v4-flash-sized model (synthetic weights, the first N layers: window, window, CSA, HCA, ...),
bf16 on the GPU; every layer runs `whole` (K1 + K2 + K3), and the runner captures each width's
step in a CUDA graph, so the agreement check runs through them.
Four checks, results printed and written as JSON (`--skip` leaves some out):
1. agreement: per layer (the mean of the hc streams after it, live rows) and on the logits, mono
   against per-op on copies of the same prefilled caches, at widths 1, 6, 16 and 48 (with pad
   rows at 48); cosine and relative L2, and each layer's worst row; the ring rows each path wrote,
   compared, a compressed layer's source rings and entries (a CSA layer's indexer's too), and
   the last CSA layer's index selection (entries compared, and how many differ: near-ties). Rows whose last-layer (bias-routed) picks differ between the paths are counted with
   the reference's routing margin there (a near-tie flips on bf16 noise) and left out of the last
   layer's and the logits' agreement (`logits_all_rows` keeps them);
2. graph: whole steps (every layer: K1 + K2 + K3; the head) for widths 1, 6, 16, 48, 6, 1 captured in one CUDA graph, replayed 300 times; every
   replay's outputs (logits, y, streams) bit-for-bit equal to the first's;
3. error path: a K1 barrier made unreachable (the device epoch moved on behind the kernel's back)
   with a short poll bound, for K1's family and (with a CSA layer) the CSA K1's: the launch ends,
   the host raises MonoSyncError naming the stage, the next step runs;
4. timeline: per-stage times of each kernel family's last launch (K1 / K1c / K2 / K3), one eager
   step a width (where the time goes; not a benchmark; last, as the least needed).
No error word may be set anywhere else.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time

import torch
import triton

from ..checkpoint import SyntheticCheckpoint
from ..config import CSA_RATIO, preset
from ..decode import Decoder
from ..model import Model
from ..mono.shape import LaunchShape
from ..mono.sync import EPOCH, MonoSyncError
from ..mono.timeline import format_times, stage_times
from .routing import recorded_routes, routing_flips

RATIOS = (0, 0, 4, 128)
# tokens already in each slot's cache: slot 3's rows complete an HCA entry (position 127) in the
# 16- and 48-row steps, slot 6 sees two entries
PROMPTS = [150, 7, 40, 126, 1, 90, 260, 12]
WIDTHS = {1: ([(0, 1)], 0), 6: ([(s, 1) for s in range(6)], 0), 16: ([(s, 2) for s in range(8)], 0),
          48: ([(s, 5) for s in range(8)], 8)}


def build(layers: int, seed: int = 0) -> Decoder:
    # no DSpark draft: nothing here runs it, and its three layers of experts would nearly double the build
    config = preset("v4-flash", num_hidden_layers=layers, compress_ratios=RATIOS[:layers],
                    num_hash_layers=min(layers, 3), dspark_target_layer_ids=tuple(range(layers)),
                    num_nextn_predict_layers=0)
    return Decoder(Model.from_checkpoint(SyntheticCheckpoint(config, seed), "cuda", torch.bfloat16), "on")


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().flatten(), b.double().flatten()
    return {"cos": float(torch.dot(a, b) / (a.norm() * b.norm())), "rel_l2": float((a - b).norm() / b.norm())}


def row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 of each row [N]."""
    a, b = a.double(), b.double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def prefilled_cache(decoder: Decoder, context: int = 512):
    g = torch.Generator().manual_seed(1)
    cache = decoder.make_cache(len(PROMPTS), context, 8)
    for slot, n in enumerate(PROMPTS):
        prompt = torch.randint(0, decoder.config.vocab_size, (n,), generator=g)
        decoder.model.step(cache, prompt, torch.arange(n), torch.full((n,), slot))
    return cache


def step_rows(width: int, g: torch.Generator, vocab: int):
    groups, pads = WIDTHS[width]
    tokens, positions, slots = [], [], []
    for slot, n in groups:
        tokens += torch.randint(0, vocab, (n,), generator=g).tolist()
        positions += list(range(PROMPTS[slot], PROMPTS[slot] + n))
        slots += [slot] * n
    return tokens + [0] * pads, positions + [0] * pads, slots + [-1] * pads


def per_op_last_routing(decoder: Decoder, *step_args) -> tuple[torch.Tensor, torch.Tensor, tuple, dict]:
    """A per-op step that records its last layer's routing and its last CSA layer's index
    selection: (logits, hidden, (picks [N, k] sorted, margins [N], `MoE.margin`), {row: the
    entries its indexer kept})."""
    moe = decoder.model.blocks[-1].moe
    csa = last_csa_layer(decoder)
    attention = decoder.model.blocks[csa].attention if csa is not None else None
    index = {}

    def recording_keys(g, side, cache):
        entries, mask = type(attention)._compressed_keys(attention, g, side, cache)
        for row, kept in zip(g.index.tolist(), mask.cpu()):
            index[row] = set(kept.nonzero().flatten().tolist())
        return entries, mask

    if attention is not None:
        attention._compressed_keys = recording_keys
    try:
        with recorded_routes(moe) as routes:
            logits, hidden = decoder.model.step(*step_args, return_hidden=True)
    finally:
        if attention is not None:
            del attention._compressed_keys
    return logits, hidden, routes[-1], index


def last_csa_layer(decoder: Decoder) -> int | None:
    """The last CSA layer (ratio 4): its K1 leaves its selection in the scratch after a step."""
    return max((i for i, ratio in enumerate(decoder.config.compress_ratios) if ratio == CSA_RATIO), default=None)


def index_agreement(decoder: Decoder, width: int, reference: dict, live: torch.Tensor) -> dict:
    """The last CSA layer's index selection on each path, live rows: entries the per-op path kept,
    how many of them the kernels did not keep, and in how many rows (a near-tie of the scores
    flips on bf16 noise, as a routing pick does)."""
    selected = decoder.mono.scratch[width].selected.cpu().tolist()
    compared = differing = rows = 0
    for r in torch.nonzero(live).flatten().tolist():
        ref, ours = reference.get(r, set()), {e for e in selected[r] if e >= 0}
        compared += len(ref)
        differing += len(ref - ours) + max(len(ours) - len(ref), 0)
        rows += ref != ours
    return {"entries_compared": compared, "entries_differing": differing, "rows_differing": rows}


def check_agreement(decoder: Decoder, base_cache, widths=tuple(WIDTHS)) -> dict:
    g = torch.Generator().manual_seed(2)
    results = {}
    for width in widths:
        tokens, positions, slots = step_rows(width, g, decoder.config.vocab_size)
        ref_cache, mono_cache = copy.deepcopy(base_cache), copy.deepcopy(base_cache)
        ref_logits, ref_hidden, routing, index = per_op_last_routing(decoder, ref_cache, tokens, positions, slots)
        logits, hidden = decoder.step(mono_cache, tokens, positions, slots, return_hidden=True)
        assert decoder.last_path == "mono"
        live = torch.tensor(slots, device=logits.device) >= 0
        # a near-tie flips on bf16 noise, and such a row then differs by a whole expert: reported
        # and left out of the last layer's agreement and the logits' (mono's picks: the last K2's)
        flipped, flips = routing_flips(decoder.mono.scratch[width].ids, *routing, live)
        d, last = decoder.config.hidden_size, len(decoder.model.blocks) - 1
        layers, worst_row = [], []
        for i in range(len(decoder.model.blocks)):
            a, b = hidden[:, i * d:(i + 1) * d], ref_hidden[:, i * d:(i + 1) * d]
            rows = live & ~flipped if i == last else live  # a flipped row differs from the last layer on
            layers.append(agreement(a[rows], b[rows]))
            worst_row.append(float(row_rel(a[live], b[live]).max()))
        rings = [agreement(a.window.data["kv"].float(), b.window.data["kv"].float())
                 for a, b in zip(mono_cache.layers, ref_cache.layers)]
        same_positions = all(torch.equal(a.window.pos, b.window.pos) for a, b in zip(mono_cache.layers, ref_cache.layers))
        compressed = {i: compressed_agreement(a, b) for i, (a, b) in enumerate(zip(mono_cache.layers, ref_cache.layers))
                      if b.source is not None}
        kept = live & ~flipped
        results[width] = {"layers": layers, "logits": agreement(logits[kept], ref_logits[kept]),
                          "worst_row_rel_l2": worst_row, "last_layer_routing_flips": flips,
                          "logits_all_rows": agreement(logits[live], ref_logits[live]), "rings": rings,
                          "ring_positions_equal": same_positions, "compressed": compressed,
                          "index_selection": (index_agreement(decoder, width, index, live)
                                              if last_csa_layer(decoder) is not None else None),
                          **greedy_agreement(logits[live], ref_logits[live])}
    return results


def compressed_agreement(a, b) -> dict:
    """A compressed layer's caches after a step on each path: the source ring (positions equal,
    projections' agreement) and the entries (the same rows emitted, their agreement); on a CSA
    layer its indexer's too, under `index`."""
    report = _compressor_agreement(a.source, b.source, a.entries, b.entries)
    if b.index_source is not None:
        report["index"] = _compressor_agreement(a.index_source, b.index_source, a.index_entries, b.index_entries)
    return report


def _compressor_agreement(source_a, source_b, entries_a, entries_b) -> dict:
    emitted = [entries.float().abs().sum(-1) > 0 for entries in (entries_a, entries_b)]
    return {"source_positions_equal": torch.equal(source_a.pos, source_b.pos),
            "source_kv": agreement(source_a.data["kv"].float(), source_b.data["kv"].float()),
            "source_gate": agreement(source_a.data["gate"].float(), source_b.data["gate"].float()),
            "entries_emitted_equal": torch.equal(*emitted), "entries_emitted": int(emitted[1].sum()),
            "entries": agreement(entries_a.float(), entries_b.float())}


def greedy_agreement(logits: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """The share of rows whose greedy token matches the per-op path's, and for each row that does
    not, the per-op logits' gap between their top two tokens (a near-tie shows as a gap far below
    the logits' typical differences between the paths)."""
    differs = logits.argmax(-1) != ref_logits.argmax(-1)
    top2 = ref_logits[differs].float().topk(2, dim=-1).values
    return {"greedy_equal": float((~differs).float().mean()),
            "greedy_differs_top2_gaps": [float(gap) for gap in top2[:, 0] - top2[:, 1]]}


def check_graph(decoder: Decoder, base_cache, replays: int = 300) -> dict:
    runner, cache = decoder.mono, copy.deepcopy(base_cache)
    g = torch.Generator().manual_seed(3)
    order = [1, 6, 16, 48, 6, 1]

    def step(width):  # embed, every layer (K1 + K2 + K3), head
        return runner.run_rows(runner._scratch(width), cache, return_hidden=False)

    for width in WIDTHS:  # inputs of each width, fixed for the graph's life
        s = runner._scratch(width)
        for buffer, values in zip((s.tokens, s.positions, s.slots), step_rows(width, g, decoder.config.vocab_size)):
            buffer.copy_(torch.tensor(values))
        step(width)  # compile, warm up
    torch.cuda.synchronize()
    runner.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = [step(width) for width in order]
    outputs = lambda: [t.clone() for t in logits] + [  # noqa: E731
        t.clone() for w in WIDTHS for t in (runner.scratch[w].y, *runner.scratch[w].streams)]
    graph.replay()
    torch.cuda.synchronize()
    first = outputs()
    mismatches = 0
    start = time.perf_counter()
    for _ in range(replays - 1):
        graph.replay()
        mismatches += sum(not torch.equal(a, b) for a, b in zip(outputs(), first))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    runner.check()
    return {"replays": replays, "widths_per_replay": order, "mismatched_outputs": mismatches,
            "outputs_compared_per_replay": len(first),
            "finite": all(bool(torch.isfinite(t).all()) for t in first), "seconds": seconds,
            "epochs": {name: state.epoch for name, state in runner.sync.items()}}


def check_timeline(decoder: Decoder, base_cache) -> dict:
    """Per-stage times (timeline.py) of each kernel family's last launch, one eager step a
    width. Not a benchmark (one step, stamps on); it says where a launch's time goes."""
    runner, g = decoder.mono, torch.Generator().manual_seed(5)
    graphs, runner.graphs_enabled, runner.timeline = runner.graphs_enabled, False, True
    out = {}
    for width in WIDTHS:
        cache = copy.deepcopy(base_cache)
        tokens, positions, slots = step_rows(width, g, decoder.config.vocab_size)
        decoder.step(cache, tokens, positions, slots)  # warm
        decoder.step(cache, tokens, positions, slots)
        torch.cuda.synchronize()
        out[width] = {kind: stage_times(stamps, runner.sync[kind].stage_names) for kind, stamps in
                      runner.timelines.items()}
        for kind, times in out[width].items():
            print(f"width {width}, {kind} (its last launch):\n{format_times(times)}")
    runner.graphs_enabled, runner.timeline = graphs, False
    return out


def check_error_path(decoder: Decoder, base_cache) -> dict:
    """For K1's family and, with a CSA layer, the CSA layer's K1 family (`k1c`): a step whose K1
    barriers wait for launches that never ran (the family's device epoch moved on behind the
    kernels' back) with a short poll bound raises MonoSyncError naming the stage, and the next
    step runs again."""
    families = ["k1"] + (["k1c"] if last_csa_layer(decoder) is not None else [])
    return {family: _expired_wait(decoder, base_cache, family) for family in families}


def _expired_wait(decoder: Decoder, base_cache, family: str) -> dict:
    runner, cache = decoder.mono, copy.deepcopy(base_cache)
    tokens, positions, slots = step_rows(6, torch.Generator().manual_seed(4), decoder.config.vocab_size)
    saved = runner.max_polls, runner.graphs_enabled
    runner.max_polls, runner.graphs_enabled = 20000, False
    runner.sync[family].words[EPOCH] += 5  # barriers now wait for arrivals of launches that never ran
    start = time.perf_counter()
    try:
        decoder.step(cache, tokens, positions, slots)
        raised = None
    except MonoSyncError as e:
        raised = str(e)
    seconds = time.perf_counter() - start
    try:
        logits = decoder.step(cache, tokens, positions, slots)  # the counters started over: it runs again
    finally:
        runner.max_polls, runner.graphs_enabled = saved
    return {"raised": raised, "seconds": seconds, "recovered_finite": bool(torch.isfinite(logits).all())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="first N layers of v4-flash (2..4)")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--shape", default="default", help="the kernels' launch shape: `default` or field=value,... "
                                                           "of monodecode.mono.shape.LaunchShape")
    parser.add_argument("--skip", default="", help="comma-separated checks to skip: agreement, graph, timeline, "
                                                   "error_path")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    decoder = build(args.layers)
    shape = LaunchShape.parse(args.shape)
    if shape != decoder.mono.shape:
        decoder.mono.configure(shape)  # checks co-residency again
    base = prefilled_cache(decoder)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "layers": args.layers,
        "ratios": decoder.mono.ratios, "grids": decoder.mono.grids, "shape": decoder.mono.shape.spec(),
        "build_seconds": time.perf_counter() - started,
        "runner_graphs": decoder.mono.graphs_enabled,  # agreement runs through the runner's graphs
    }
    checks = (("agreement", check_agreement), ("graph", check_graph), ("error_path", check_error_path),
              ("timeline", check_timeline))
    print(f"kernels: {json.dumps(decoder.mono.kernel_resources())}", flush=True)  # the residency check's builds
    for name, check in checks:  # each result is printed and saved as it comes (a run may be cut short)
        if name not in args.skip.split(","):
            report[name] = check(decoder, base)
            report["seconds"] = time.perf_counter() - started
            report["kernels"] = decoder.mono.kernel_resources()  # registers and spills of what ran
            print(f"{name}: {json.dumps(report[name])}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
