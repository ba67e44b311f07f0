"""`monodecode bench layer`: one decoder layer's decode-step time against the bandwidth floor.

A model of a layer of each kind in `--kinds` (window-only, CSA, HCA) at `--preset` sizes,
bias-routed so that the routing follows the activations; synthetic weights, bf16; every request's
cache holds `--context` tokens, in the layout a prefill leaves with random values (`fill_cache`).
For each width (rows of the step: up to 8 requests, the rows spread over them as verify rows)
and each layer, with a random residual as the layer's input:
- `per-op eager`: the per-op block (attention + MoE), eagerly, timed with events. It is our
  reference, not a fair baseline yet: it loops over the step's experts in Python and dequantizes
  each expert's MXFP4 on every call;
- `per-op graph`: the same math without host syncs and with the experts batched and prepared
  once (`bench/batched.py`: the fair per-op baseline), in a CUDA graph; with `--compile MODE`,
  also that layer under torch.compile (MODE, e.g. max-autotune-no-cudagraphs; one compile a
  width), in a CUDA graph;
- `mono`: the layer's K1 + K2 + K3 in a CUDA graph (K1 also timed alone in a graph of its own,
  K2 the rest, K3 with it). Mono's layer first folds
  an owed FFN output that leaves the residual unchanged (`identity_owed`), as a model's layers
  after the first fold the one before's: so it pays for one FFN fold, as the per-op block does.
  Each shape's output (the residual with the layer's owed FFN output folded in) is also compared
  with the per-op block's on the same step: `cosine` in the JSON and the printout (and
  `worst_row`, the row that agrees least and its cosine), so that a timed shape is a checked one.
  Rows whose expert picks differ between the paths (a near-tie of the router's scores flips on
  bf16 noise, and the row then differs by a whole expert: `routing.py`) are left out of it and
  reported as `routing_flips` (how many, the per-op path's routing margins at them, the cosine
  over all rows).
Every graph is timed as the median over `--reps` samples of `REPLAYS_IN_A_ROW` replays in a row
(divided): each replay starts as the one before ends, as a layer in a step's graph does, so the
host's launch of the graph, which a step pays once, is not counted in every layer's time.
`--tensor-parallel-size N` runs N processes (one a device, `ranks.rank_device`), each timing its
own part of the layers alike (the kernels' sums over the ranks inside, the per-op block's sums
host collectives; no batched per-op graph, which is one process's), rank 0 reporting; the floor
is then the bytes of the rank that reads the most (its slices of the split weights, its own picked
experts, the whole KV), which the step waits for.
`--shapes` times mono once per launch shape (`mono.shape.LaunchShape`: programs a SM, warps,
tile sizes; a row each), `--kinds` restricts the layer kinds, and `--timeline`
adds the per-stage times of the kernels and the gaps between their launches, as the CUDA graph
replays them (`mono/timeline.py`; GPU only).

Where every kind the preset has was timed at a width, the table ends with the whole stack of the
preset's layers projected from them (`layer_report.whole_model`: each kind's times summed over its layers;
no head, no draft).

The floor: the bytes the layer must read in that step (every dense weight of the layer once, the
distinct experts the step's routing picked, each request's window KV rows and, on CSA, its
visible indexer keys and top-k entries, on HCA its visible entries) over the copy bandwidth
measured in the same run. The same bytes serve every path, so % of floor compares them.
On a CPU (tests) the kernels run under Triton's interpreter and times are wall-clock: the code
paths, not the numbers.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import v41
from ..checkpoint import SyntheticCheckpoint
from ..config import preset
from ..decode import Decoder
from ..model import Model
from ..model.attention import RequestRows
from ..model.hc import hc_post
from ..model.parallel import SINGLE, TensorParallel
from ..mono.plan import MonoRefused
from ..mono.shape import LaunchShape
from ..mono.timeline import format_times, launch_gaps, launch_span, stage_times
from ..ranks import join_ranks
from ..schema import step_bytes, tensor_specs
from .batched import BatchedLayer
from .layer_report import KINDS, show, us_text
from .routing import recorded_routes, routing_flips
from .timing import copy_bandwidth, graphed, kernels_launched, timed

MAX_REQUESTS = 8
REPLAYS_IN_A_ROW = 8  # a timed sample of a graph: this many replays, queued one behind the other


def build(name: str, device, tp: TensorParallel = SINGLE, kinds=tuple(KINDS.values())) -> Decoder:
    """A layer of each of `kinds` at `name`'s sizes on the kernels: the whole, or `tp`'s rank's
    part. Only the kinds asked for: each layer holds ~3.4 GB of experts at v4-flash sizes."""
    # V4's three layer kinds at the preset's sizes: a V4.1 preset has none of them to time
    v41.refuse_to_run(preset(name), "`bench layer` (it times V4's window, CSA and HCA layers)")
    ratios = tuple(ratio for ratio, kind in KINDS.items() if kind in kinds)
    # no DSpark draft: nothing here runs it, and its three layers of experts would double the build
    config = preset(name, num_hidden_layers=len(ratios), compress_ratios=ratios, num_hash_layers=0,
                    dspark_target_layer_ids=tuple(range(len(ratios))), num_nextn_predict_layers=0)
    return Decoder(Model.from_checkpoint(SyntheticCheckpoint(config, seed=0), device, torch.bfloat16, tp=tp), "on")


def fill_cache(model: Model, context: int):
    """A cache of MAX_REQUESTS requests with `context` tokens each, in the layout a prefill of
    them leaves (every ring's positions, each compressed layer's first context // ratio entries),
    its values random (the model's weights are synthetic too): what a step reads, at any context
    in moments (a per-op prefill runs the eager reference's expert loop: far too slow at long
    contexts)."""
    g = torch.Generator().manual_seed(1)
    cache = model.make_cache(MAX_REQUESTS, context + 64, 8)
    for ratio, layer in zip(model.config.compress_ratios, cache.layers):
        for ring in (layer.window, layer.source, layer.index_source):
            if ring is not None:
                positions = torch.arange(max(context - ring.size, 0), context, device=ring.pos.device)
                ring.pos[:, positions % ring.size] = positions
                for data in ring.data.values():
                    shape = (data.shape[0], len(positions), data.shape[2])
                    data[:, positions % ring.size] = torch.randn(shape, generator=g).to(data)
        for entries in (layer.entries, layer.index_entries):
            if entries is not None:
                shape = (entries.shape[0], context // ratio, entries.shape[2])
                entries[:, :context // ratio] = torch.randn(shape, generator=g).to(entries)
    return cache


def step_rows(width: int, context: int):
    """(positions, slots) of a step of `width` rows over min(width, 8) requests, each request's
    rows consecutive positions after its context."""
    requests = min(width, MAX_REQUESTS)
    per = [width // requests + (i < width % requests) for i in range(requests)]
    slots = [s for s, n in enumerate(per) for _ in range(n)]
    positions = [context + i for n in per for i in range(n)]
    return positions, slots


def identity_owed(rows: int, hc: int, d: int, device):
    """An owed FFN output that leaves the residual as it is: y = 0, post = 1, comb = the identity
    (`hc_post` then returns the streams bit for bit). Mono's layer folds it in first, as every
    layer of a model but the first folds the one before's output, so that it pays for that fold
    as the per-op block pays for its own FFN fold, and still routes as the per-op block does."""
    y = torch.zeros(rows, d, dtype=torch.bfloat16, device=device)
    post = torch.ones(rows, hc, dtype=torch.float32, device=device)
    comb = torch.eye(hc, dtype=torch.float32, device=device).expand(rows, hc, hc).contiguous()
    return y, post, comb


class LayerStep(NamedTuple):
    scratch: object  # the runner's Scratch of the step's width
    streams: torch.Tensor  # the layer's input residual [rows, hc, d]
    cache: object  # the layer's cache (a copy of the filled one)
    groups: list  # the step's rows by request (model.group_rows)
    kernels: Callable  # kernels(k2_too=True): launch mono's kernels on the step (K1 alone without K2 and K3)
    # and return the index of the scratch streams that the layer's owed FFN output folds into


class LayerBench:
    def __init__(self, decoder: Decoder, cache, context: int, reps: int, compile_mode: str | None = None):
        model = decoder.model
        self.model, self.runner, self.base_cache, self.tp = model, decoder.mono, cache, model.tp
        self.context, self.reps, self.device = context, reps, model.device
        self.specs = tensor_specs(model.config)
        self.batched: dict[int, BatchedLayer] = {}  # the measured layer's experts, prepared once
        self.compile_mode = compile_mode

    def step(self, layer: int, width: int, g: torch.Generator) -> LayerStep:
        """A step of `width` rows at `layer` (fresh random residual and tokens from `g`, a copy of
        the filled cache) and the launch of mono's kernels on it (`LayerStep.kernels`)."""
        from ..mono import k1, k2  # after the runner's build: on a CPU it turns Triton's interpreter on first

        model, runner, c = self.model, self.runner, self.model.config
        positions, slots = step_rows(width, self.context)
        cache = copy.deepcopy(self.base_cache)
        s = runner._scratch(width)
        s.tokens.copy_(torch.randint(0, c.vocab_size, (width,), generator=g))
        s.positions.copy_(torch.tensor(positions))
        s.slots.copy_(torch.tensor(slots))
        streams = torch.randn(width, c.hc_mult, c.hidden_size, generator=g).to(torch.bfloat16).to(self.device)
        lw, lc = runner.layers[layer], cache.layers[layer]
        owed = identity_owed(width, c.hc_mult, c.hidden_size, self.device)

        def kernels(k2_too: bool = True) -> int:
            s.streams[0].copy_(streams)
            cur = k1.launch(runner, s, lw, lc, 0, owed=owed)
            if k2_too:
                cur = k2.launch(runner, s, lw, lc, cur)
            return cur  # the streams the owed FFN output folds into

        groups = model.group_rows(cache, s.tokens, s.positions, s.slots)
        return LayerStep(scratch=s, streams=streams, cache=lc, groups=groups, kernels=kernels)

    @torch.no_grad()  # as the model's steps run: a compiled region is guarded on the grad mode
    def measure(self, layer: int, width: int, g: torch.Generator, shapes: list[LaunchShape],
                timeline: bool = False) -> list[dict]:
        """One row a launch shape: the per-op times (measured once) and mono's with that shape."""
        runner = self.runner
        inputs = self.step(layer, width, g)
        s, streams, lc, groups = inputs.scratch, inputs.streams, inputs.cache, inputs.groups
        kernels = inputs.kernels
        block = self.model.blocks[layer]
        per_op = timed(lambda: block(streams, s.tokens, s.positions, groups, lc), self.device, self.reps)
        held = self.tp.part(self.model.config.n_routed_experts)
        experts = distinct_experts(block, lambda: block(streams, s.tokens, s.positions, groups, lc), held)
        launches = {"per_op_eager": kernels_launched(lambda: block(streams, s.tokens, s.positions, groups, lc),
                                                     self.device)}
        per_op_graph = per_op_compiled = None
        if self.tp.size == 1:  # the batched layer is one process's (its sums are no collectives)
            if layer not in self.batched:  # one layer's at a time: each holds its experts dequantized
                self.batched.clear()
                self.batched[layer] = BatchedLayer(block)
            batched = self.batched[layer]
            launches["per_op_graph"] = kernels_launched(lambda: batched(streams, s.tokens, s.positions, s.slots, lc),
                                                        self.device)
            per_op_graph = self.replay_time(lambda: batched(streams, s.tokens, s.positions, s.slots, lc))
        if self.compile_mode and self.tp.size == 1:
            # One compiled graph a layer kind and width, all of the same code: past dynamo's
            # recompile limit (8) it would quietly run the layer eagerly; raise it, and fail if hit.
            with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
                compiled = torch.compile(batched.__call__, mode=self.compile_mode, dynamic=False)
                per_op_compiled = self.replay_time(lambda: compiled(streams, s.tokens, s.positions, s.slots, lc))
                launches["per_op_compiled"] = kernels_launched(
                    lambda: compiled(streams, s.tokens, s.positions, s.slots, lc), self.device)
        rows = []
        for shape in shapes:
            row = {"shape": shape.spec(), "per_op_eager_s": per_op, "per_op_graph_s": per_op_graph,
                   "per_op_compiled_s": per_op_compiled, "distinct_experts": experts,
                   "floor_bytes": self.floor_bytes(layer, width, experts, groups), "refused": None,
                   "mono_s": None, "mono_k1_s": None, "mono_k2_s": None, "cosine": None, "worst_row": None,
                   "routing_flips": None, "stages": None, "launches_in_graph": None}
            try:
                runner.configure(shape)
            except MonoRefused as refused:  # the runner keeps its previous shape; the next one is tried
                rows.append({**row, "refused": "; ".join(refused.reasons), "kernels_launched": dict(launches)})
                continue
            row["mono_s"] = self.replay_time(kernels)
            # K1 alone (its own epoch: nothing waits across launches), K2 the rest of the pair
            row["mono_k1_s"] = self.replay_time(lambda: kernels(k2_too=False))
            row["mono_k2_s"] = row["mono_s"] - row["mono_k1_s"]
            row.update(self.agreement(inputs, block))
            runner.check()
            launches["mono"] = kernels_launched(kernels, self.device)
            row["kernels_launched"] = dict(launches)
            row["kernel_resources"] = runner.kernel_resources()  # registers, spills: why a shape is slow
            if timeline:
                row["stages"], row["launches_in_graph"] = self.stage_times(kernels)
            rows.append(row)
        return rows

    def agreement(self, inputs: LayerStep, block) -> dict:
        """Mono's layer output (the residual streams with the owed FFN output folded in) against
        the per-op block's on the same step, so that every timed shape is also checked: the
        cosine similarity over the live rows whose expert picks agree, the row that agrees least
        there ([row, its cosine]: which rows disagree says where to look), and the rows whose
        picks differ (`routing.routing_flips`: near-ties that bf16 noise flips, their margins)
        with the cosine over all rows. Each path writes the step's KV before it reads it: the
        order does not matter."""
        s = inputs.scratch
        with recorded_routes(block.moe) as seen:
            reference = block(inputs.streams, s.tokens, s.positions, inputs.groups, inputs.cache).double()
        cur = inputs.kernels()
        y, post, comb = s.owed()
        mono = hc_post(y, s.streams[cur], post, comb).double()
        live = s.slots >= 0
        [(picks, margins)] = seen
        held = self.tp.part(self.model.config.n_routed_experts) if self.tp.size > 1 else None
        flipped, flips = routing_flips(s.ids, picks, margins, live, held)
        kept = live & ~flipped
        rows = torch.nn.functional.cosine_similarity(mono.flatten(1), reference.flatten(1), dim=1)
        worst = int(torch.where(kept, rows, 2.0).argmin())
        flips["cosine_all_rows"] = cosine(mono[live], reference[live])
        return {"cosine": cosine(mono[kept], reference[kept]), "worst_row": [worst, float(rows[worst])],
                "routing_flips": flips}

    def replay_time(self, fn) -> float:
        """Seconds of one replay of fn captured in a CUDA graph, the graph replayed
        `REPLAYS_IN_A_ROW` times a sample: a layer as a step's graph runs it, after the layer
        before and not after an idle GPU waiting for the host's launch of the graph."""
        return timed(graphed(fn, self.device), self.device, self.reps, back_to_back=REPLAYS_IN_A_ROW)

    def stage_times(self, kernels) -> tuple[dict, dict]:
        """Per-stage times (mono/timeline.py) of the layer's kernels as a CUDA graph replays them
        (the stamps of the last of `reps` replays: what the timed graph runs, the stamps costing a
        little), and the gaps between the launches of that replay (`timeline.launch_gaps`)."""
        runner = self.runner
        runner.timeline = True
        try:
            replay = graphed(kernels, self.device)  # its warm-up run builds the kernels and their stamp buffers
            for _ in range(self.reps):
                replay()
            torch.cuda.synchronize(self.device)
            runner.check()  # an expired wait would leave stamps of a launch that gave up
            kinds = list(runner.timelines)  # the families this layer's launches stamped, in launch order
            names = {kind: runner.sync[kind].stage_names for kind in kinds}
            stages = {kind: stage_times(runner.timelines[kind], names[kind]) for kind in kinds}
            spans = [(kind, launch_span(runner.timelines[kind], len(names[kind]))) for kind in kinds]
            return stages, launch_gaps(spans)
        finally:
            runner.timeline = False
            runner.timelines.clear()

    def floor_bytes(self, layer: int, width: int, experts: int, groups: list[RequestRows]) -> int:
        """The bytes the step reads (`experts`: the distinct ones it picked). Under tensor
        parallelism those of the rank that reads the most (its slices of the split weights, its
        own picked experts, the whole KV: every rank's heads read it): the step waits for it."""
        c, tp = self.model.config, self.tp
        dense, all_picks = step_bytes(c, self.specs, f"layers.{layer}.", rows=width, tp=tp if tp.size > 1 else None)
        per_expert = all_picks // min(width * c.num_experts_per_tok, len(tp.part(c.n_routed_experts))) if all_picks else 0
        mine = dense + experts * per_expert + sum(self.kv_bytes(layer, int(g.positions[-1])) for g in groups)
        return max(tp.every_ranks_value(mine))

    def kv_bytes(self, layer: int, last: int) -> int:
        """Cache bytes (bf16) a request whose last row is at position `last` reads: its window,
        and on CSA every visible indexer key plus the top-k entries, on HCA every visible entry."""
        c = self.model.config
        ratio = c.compress_ratios[layer]
        rows = min(c.sliding_window, last + 1) * c.head_dim
        visible = (last + 1) // ratio if ratio else 0
        if ratio == 4:
            rows += visible * c.index_head_dim + min(c.index_topk, visible) * c.head_dim
        elif ratio:
            rows += visible * c.head_dim
        return 2 * rows


def agreement_text(m: dict) -> str:
    """The printout's words for `LayerBench.agreement`'s result in row `m` ("" if not checked)."""
    if m["cosine"] is None:
        return ""
    row, worst = m["worst_row"]
    text = f", cosine to per-op {m['cosine']:.6f} (row {row} the least: {worst:.6f})"
    flips = m["routing_flips"]
    if flips["rows"]:
        margins = ", ".join(f"{x:.2g}" for x in flips["margins"])
        text += (f"; {flips['rows']} row(s) picked other experts, left out (routing margins {margins}; median "
                 f"{flips['median_margin']:.2g}; cosine over all rows {flips['cosine_all_rows']:.6f})")
    return text


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def distinct_experts(block, run, held: range) -> int:
    """Distinct routed experts of `held` (a rank's; all of them at one rank) the per-op path picks
    in run() (the floor's expert bytes)."""
    with recorded_routes(block.moe) as seen:
        run()
    ids = torch.cat([picks for picks, _ in seen]).unique()
    return int(((ids >= held.start) & (ids < held.stop)).sum())


def run(args) -> int:
    if args.replot:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return show(json.loads(Path(args.replot).read_text()), out)
    device = torch.device(args.device)
    for text in args.shapes.split(";"):
        LaunchShape.parse(text)  # a bad shape is refused before anything is built
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS.values())
    if unknown:
        raise ValueError(f"--kinds: unknown {', '.join(sorted(unknown))} (known: {', '.join(KINDS.values())})")
    if args.timeline and device.type != "cuda":
        raise ValueError("--timeline reads the GPU's global timer: it needs --device cuda")
    size = args.tensor_parallel_size
    if size == 1:
        return measure_all(args, SINGLE)
    if args.compile:
        raise ValueError("--compile times the one-process per-op layer: not with --tensor-parallel-size")
    store = Path(tempfile.mkdtemp(prefix="monodecode-bench-layer-")) / "store"
    mp.start_processes(_rank, args=(size, str(store), args), nprocs=size, start_method="spawn")
    return show(json.loads((Path(args.out) / "bench_layer.json").read_text()), Path(args.out))


def _rank(rank: int, size: int, store: str, args) -> None:
    """Rank `rank` of the ranks `run` starts: every rank measures its part alike (the kernels' sums
    and the per-op layer's collectives meet), rank 0 reports."""
    device = join_ranks(rank, size, store, args.device)
    try:
        measure_all(args, TensorParallel.from_process_group(), device)
    finally:
        dist.destroy_process_group()


def measure_all(args, tp: TensorParallel, device=None) -> int:
    """Measure every layer kind and width of `args` on this process's part (`tp`); the leader
    (rank 0) prints and saves the report (and, at one rank, shows it)."""
    device = torch.device(device or args.device)
    leader = tp.rank == 0
    say = print if leader else (lambda *_, **__: None)
    kinds, widths = args.kinds.split(","), args.widths
    shapes = [LaunchShape.parse(text) for text in args.shapes.split(";")]
    started = time.strftime("%Y-%m-%d %H:%M")
    decoder = build(args.preset, device, tp, kinds)
    model = decoder.model
    bench = LayerBench(decoder, fill_cache(model, args.context), args.context, args.reps, args.compile)
    bandwidth = copy_bandwidth(device)
    g = torch.Generator().manual_seed(2)
    rows = []
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "date": started,
              "preset": args.preset, "context": args.context, "copy_bytes_per_s": bandwidth,
              "tensor_parallel_size": tp.size, "layers": rows, "complete": False}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for layer, ratio in enumerate(model.config.compress_ratios):
        if KINDS[ratio] not in kinds:
            continue
        for width in widths:
            for run_index, m in enumerate(bench.measure(layer, width, g, shapes, args.timeline)):
                floor_s = m["floor_bytes"] / bandwidth
                best_per_op = min(t for t in (m["per_op_eager_s"], m["per_op_graph_s"], m["per_op_compiled_s"])
                                  if t is not None)
                mono = m["mono_s"]
                rows.append({"kind": KINDS[ratio], "width": width, **m,
                             "shape_run": run_index,  # the shape's place in --shapes: a shape may come twice
                             "floor_s": floor_s, "per_op_of_floor": floor_s / best_per_op,
                             "mono_of_floor": floor_s / mono if mono else None,
                             "speedup": best_per_op / mono if mono else None})
                # saved and shown as it comes: a run cut short (a device call's time limit) keeps its rows
                if leader:
                    (out / "bench_layer.json").write_text(json.dumps(report, indent=1))
                say(f"{KINDS[ratio]} layer, {width} rows, {m['shape']}: per-op graph {us_text(m['per_op_graph_s'])} us, "
                    f"mono {us_text(mono)} us, floor {floor_s * 1e6:.1f} us" + agreement_text(m), flush=True)
                if m["refused"]:
                    say(f"{KINDS[ratio]} layer, {width} rows, {m['shape']}: refused: {m['refused']}")
                if m["stages"]:
                    for kind, times in m["stages"].items():
                        say(f"{KINDS[ratio]} layer, {width} rows, {m['shape']}, {kind}:\n{format_times(times)}")
                    gaps = m["launches_in_graph"]
                    say(f"{KINDS[ratio]} layer, {width} rows, {m['shape']}: the kernels' span in the graph "
                          f"{gaps['span_us']:.1f} us; gaps before " +
                          ", ".join(f"{kind} {us:.1f} us" for kind, us in gaps["gaps_us"].items()))
    report["complete"] = True
    if not leader:
        return 0
    (out / "bench_layer.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'bench_layer.json'}")
    return show(report, out) if tp.size == 1 else 0
