"""`monodecode bench decode`: whole speculative decode steps of an N-layer model, per-op against mono.

A model of the first N layers of `--preset` (synthetic weights, bf16; N = `--layers`, or `fit`: as
many as the GPU holds with the mono kernels' copies, stated in the report) and its DSpark draft.
For each request count B of `--requests`: B requests, each with `--context` prefilled tokens, decode
`--steps` speculative steps with synthetic verification (`--acceptance`: the mean tokens committed
a step; `--temperature` and `--top-p`: how the draft and the appended tokens are drawn), the target
verifying B x (1 + block) rows a step, through
- `per-op graph`: the per-op layers in fixed shapes (`bench/batched.py` BatchedLayer: the routed
  experts dequantized to bf16 once, about 12.9 GB a v4-flash layer, so only when they fit) and
  the head, captured in a CUDA graph per width;
- `mono stepwise`: the mono runner (K1, K2, K3 a layer, its CUDA graph per width) for the verify
  step, the draft's stages on the kernels (`Decoder.draft`), the rest as the per-op path runs it;
- `mono`: the whole step (spec/step_graph.py: draft, verify step, commits and verification as one
  CUDA graph a request count), what the engine runs on the kernels.
Per path and B: the median step time; stepwise, split into the draft's proposal (of which, on
mono stepwise, its stages on the kernels: the draft runner's steps), the target's verify step
(of which the head: hc_head, norm, lm_head, timed alone) and the rest (verification, sampling,
commits to the draft's rings: host work); whole, split into its device work (the graph's replay,
the device synchronised around it), itself split into its parts (`PartClock`: the draft's stages,
the draft's head, the verify step, the commit and verification, as the graph runs them), and the
rest (host work, itself split: making and loading the rows, the settings and keys, the wait for
their copies, and after the device work reading the verdicts and moving the requests on, each the
median over the steps, so that the parts need not sum to the rest's median); tokens committed a step
a request; tokens/s per user. The
draft follows its path: per-op and eager with the per-op graph, on the kernels with mono.
`--paths` picks among them (`per-op`, `stepwise`, `whole`; default all three: a GPU call short of
time can leave the per-op graph out, whose experts take minutes to dequantize).
`--host-profile`: after each path's timed steps, as many more under torch.profiler, and the
operations the host spends the most of its own time in a step (what the host column is made of),
and on a GPU the kernels the device spends the most time in (a whole step's graph's among them).
`--tensor-parallel-size N`: the model over N ranks (`ranks.load_ranks`), only `mono stepwise`
(the per-op graph's fixed-shape layers hold whole layers; the whole step is one process's).
Not a test: it never fails for being slow. On a CPU (tests) the kernels run under Triton's
interpreter: the code paths, not the numbers.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import SyntheticCheckpoint
from ..config import preset
from ..decode import Decoder, load_any
from ..model import Model
from ..model.weights import free_memory, resident_bytes
from ..sampling import check_sampling
from ..spec.config import SpeculativeConfig
from ..spec.decoder import SpecRequest, SpeculativeDecoder
from .batched import BatchedLayer
from .timing import graphed, timed

RESERVE = 24 * 2**30  # bytes left free by `--layers fit`: caches, scratch, graphs, the draft's weights
PATHS = ("per-op", "stepwise", "whole")  # `--paths`' names of the per-op graph, mono stepwise and mono (whole)


def build(name: str, layers: int, device: str, tensor_parallel_size: int = 1) -> Decoder:
    """The first `layers` layers of `name` (the draft's target layers moved onto the last ones),
    on the mono kernels; over `tensor_parallel_size` ranks, this process their rank 0."""
    return Decoder(load_any(name, device=device, dtype=torch.bfloat16, seed=0, tensor_parallel_size=tensor_parallel_size,
                            overrides={"num_hidden_layers": layers}), "on")


def layers_that_fit(name: str, device) -> int:
    """The first N layers of `name` whose weights (as the per-op path keeps them, plus the mono
    kernels' FP8 copies of the dense ones) fit in the free memory less RESERVE."""
    config = preset(name)
    ckpt = SyntheticCheckpoint(config)
    per_layer = []
    for i in range(config.num_hidden_layers):
        specs = [s for s in ckpt.specs if s.name.startswith(f"layers.{i}.")]
        per_layer.append(resident_bytes(specs, torch.bfloat16) + sum(s.nbytes() for s in specs if s.fmt == "fp8"))
    shared = resident_bytes([s for s in ckpt.specs if s.group == "model" and not s.name.startswith("layers.")],
                            torch.bfloat16)
    budget, n = free_memory(device) - RESERVE - shared, 0
    while n < len(per_layer) and per_layer[n] <= budget:
        budget -= per_layer[n]
        n += 1
    if n == 0:
        raise SystemExit(f"--layers fit: not one {name} layer fits in the free memory of {device}")
    return n


class PerOpGraphStep:
    """`Model.step` for verify steps on the per-op path in fixed shapes (BatchedLayer per layer,
    then the head), captured in a CUDA graph per (width, cache, hidden) on a GPU."""

    def __init__(self, model: Model):
        self.model, self.layers = model, [BatchedLayer(block) for block in model.blocks]
        self.graphs: dict[tuple, tuple] = {}

    @torch.no_grad()
    def __call__(self, cache, tokens, positions, slots, return_hidden: bool = False):
        key = (len(tokens), id(cache), return_hidden)
        if key not in self.graphs:
            inputs = [torch.as_tensor(t, device=self.model.device).clone() for t in (tokens, positions, slots)]
            outputs = {}
            run = graphed(lambda: outputs.update(out=self.forward(cache, *inputs, return_hidden)), self.model.device)
            self.graphs[key] = (inputs, outputs, run)
        inputs, outputs, run = self.graphs[key]
        for buffer, values in zip(inputs, (tokens, positions, slots)):
            buffer.copy_(torch.as_tensor(values, device=buffer.device))
        run()
        out = outputs["out"]
        return tuple(t.clone() for t in out) if return_hidden else out.clone()

    def forward(self, cache, tokens, positions, slots, return_hidden: bool):
        model = self.model
        targets = (model.config.dspark_target_layer_ids or ()) if return_hidden else ()
        streams, captured = model.embed(tokens), {}
        for i, layer in enumerate(self.layers):
            streams = layer(streams, tokens, positions, slots, cache.layers[i])
            if i in targets:
                captured[i] = streams.mean(dim=1)
        logits = model.logits(streams)
        return (logits, torch.cat([captured[i] for i in targets], dim=-1)) if return_hidden else logits


class Timer:
    """Wraps a function: the host's clock at the start and end of each call (`spans`), the device
    synchronised around it (`device` None: not, for host work)."""

    def __init__(self, fn, device=None):
        self.fn, self.device, self.spans = fn, device and torch.device(device), []

    def __call__(self, *args, **kwargs):
        self._sync()
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self._sync()
        self.spans.append((start, time.perf_counter()))
        return out

    @property
    def seconds(self) -> list[float]:
        return [end - start for start, end in self.spans]

    def _sync(self):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


HOST_PARTS = ("rows", "inputs", "copies", "after")  # a whole step's host work (`host_parts`)


def host_parts(step: Timer, rows: Timer, inputs: Timer, device_work: Timer) -> dict[str, list[float]]:
    """A whole step's time outside its device work, step by step, as consecutive spans of the host's
    clock: making and loading the rows (from the step's start: its checks too), the settings and
    keys, the wait for their copies (the device work's first sync), and after the device work
    (reading the verdicts, moving the requests on). Their sum is the step less its device work."""
    spans = zip(step.spans, rows.spans, inputs.spans, device_work.spans, strict=True)
    parts = [(r_end - s_start, i_end - r_end, d_start - i_end, s_end - d_end)
             for (s_start, s_end), (_, r_end), (_, i_end), (d_start, d_end) in spans]
    return dict(zip(HOST_PARTS, map(list, zip(*parts))))


class PartClock:
    """A whole step's device work part by part (`WholeStep.clock`, spec/step_graph.py): called with
    "start" and then each part's name as the work goes. On a GPU each name has one timing event,
    recorded where the call is made: inside the step's graph, as an external event (a node of the
    graph, recorded again by every replay); on a CPU the host's clock (the device work runs
    synchronously there). `read`, once the step's device work is done, adds each part's seconds."""

    def __init__(self, device):
        self.on_gpu = torch.device(device).type == "cuda"
        self.marks: dict[str, object] = {}  # name -> its event (GPU) or its time (CPU), in the work's order
        self.seconds: dict[str, list[float]] = {}

    def __call__(self, name: str) -> None:
        if not self.on_gpu:
            self.marks[name] = time.perf_counter()
            return
        if name not in self.marks:
            self.marks[name] = torch.cuda.Event(enable_timing=True, external=True)
        self.marks[name].record()

    def read(self) -> None:
        names = list(self.marks)
        for before, name in zip(names, names[1:]):
            start, end = self.marks[before], self.marks[name]
            seconds = start.elapsed_time(end) / 1e3 if self.on_gpu else end - start
            self.seconds.setdefault(name, []).append(seconds)


def measure(model, target_step, caches, requests, steps: int, acceptance: float, whole: bool = False,
            host_profile: bool = False) -> dict:
    """`steps` timed speculative steps (after two warm-up steps, which capture the graphs) of
    `model` (a Model: the draft per-op; a Decoder: the draft as it gives it) verifying with
    `target_step`; `whole`: every step whole (a Decoder's, spec/step_graph.py), else stepwise;
    `host_profile`: then `steps` more under torch.profiler (`profile_host`)."""
    block = model.draft().block_size
    config = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": block,
                                          "rejection_sample_method": "synthetic",
                                          "synthetic_acceptance_length": acceptance})
    verify = Timer(target_step, model.device)
    decoder = SpeculativeDecoder(model, config, target_step=verify)
    if not whole:
        decoder.whole_step = None
    elif not decoder.takes_whole(requests):
        raise SystemExit(f"mono: a step of {len(requests)} requests does not run whole here")
    draft = decoder.draft
    propose = Timer(draft.propose, model.device)
    draft.propose = propose
    runner = getattr(draft, "runner", None)  # a KernelDraft's: its stages on the kernels
    stages = Timer(runner.step, model.device) if runner else None
    if runner:
        runner.step = stages
    device_work = clock = rows = inputs = None
    if whole:  # its device work timed (and its parts), and the host's rows and inputs
        w = decoder.whole_step
        device_work, clock = Timer(w.device_work, model.device), PartClock(model.device)
        rows, inputs = Timer(w._prepare), Timer(w._load_inputs)  # host work: no syncs
        w.device_work, w.clock, w._prepare, w._load_inputs = device_work, clock, rows, inputs
    step = Timer(decoder.step, model.device)
    try:
        for _ in range(2):
            step(caches, requests)
        for timer in (verify, propose, step, stages, device_work, rows, inputs):
            if timer:
                timer.spans.clear()
        committed = 0
        for _ in range(steps):
            committed += sum(len(tokens) for tokens in step(caches, requests))
            if clock:  # the step's device work is done (its timer synchronised)
                clock.read()
    finally:  # the timers off, back to the classes' methods (the draft and its runner are the model's)
        for obj, name in ((draft, "propose"), (runner, "step"), (decoder.whole_step, "device_work"),
                          (decoder.whole_step, "_prepare"), (decoder.whole_step, "_load_inputs")):
            if obj is not None and name in vars(obj):
                delattr(obj, name)
    decoder.target_step = target_step
    # without the timers and their syncs, the part clock still set (a graph of the same key: no
    # capture inside the profile)
    profile = profile_host(lambda: decoder.step(caches, requests), steps, model.device) if host_profile else None
    median = statistics.median
    parts = {"draft_s": propose, "draft_stages_s": stages, "verify_s": verify, "device_s": device_work}
    # a step's other time less its timed parts, step by step: the difference of the medians would
    # carry the device time's spread from step to step (each step routes its rows anew)
    timed_parts = (device_work,) if whole else (propose, verify)
    others = [s - sum(t) for s, *t in zip(step.seconds, *(timer.seconds for timer in timed_parts), strict=True)]
    return {"step_s": median(step.seconds), "other_s": median(others),
            **{name: median(t.seconds) if t and t.seconds else None for name, t in parts.items()},
            "device_parts_s": {name: median(s) for name, s in clock.seconds.items()} if clock else None,
            "other_parts_s": {name: median(s) for name, s in host_parts(step, rows, inputs, device_work).items()}
            if whole else None,
            "tokens_per_step": committed / steps / len(requests),
            "tokens_per_s_per_user": committed / steps / len(requests) / median(step.seconds),
            **({"host_profile": profile} if host_profile else {})}


PROFILE_ROWS = 12  # operations, and kernels, `--host-profile` reports a path


def profile_host(step, steps: int, device) -> dict[str, list[dict]]:
    """`steps` calls of `step` under torch.profiler. "host": the operations the host spends the
    most of its own time in (torch's and, on a GPU, the CUDA runtime's calls: copies, launches,
    and the syncs, whose time is the wait for the device), each with its calls and self
    microseconds a step. "device" (a GPU's; empty on a CPU): the kernels the device spends the most
    time in, a graph's replays included (what the device column is made of), the same way."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
    events = profiler.key_averages()
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]

    def top(chosen, us) -> list[dict]:
        ranked = sorted(chosen, key=us, reverse=True)[:PROFILE_ROWS]
        return [{"op": e.key, "calls_a_step": e.count / steps, "self_us_a_step": us(e) / steps} for e in ranked]

    return {"host": top(events, lambda e: e.self_cpu_time_total),
            "device": top(kernels, lambda e: e.self_device_time_total)}


def seeded(requests: list[SpecRequest], device, temperature: float, top_p: float) -> list[SpecRequest]:
    """Copies of the requests at `temperature` and `top_p`, each with a generator seeded by its
    slot: every path draws the same uniforms, so the same synthetic acceptances, and tokens/s
    compare step times."""
    return [replace(r, temperature=temperature, top_p=top_p, generator=torch.Generator(device).manual_seed(r.slot))
            for r in requests]


def head_seconds(model: Model, rows: int, reps: int) -> float:
    streams = torch.randn(rows, model.config.hc_mult, model.config.hidden_size).to(model.dtype).to(model.device)
    return timed(graphed(lambda: model.logits(streams), model.device), model.device, reps)


def run(args) -> int:
    check_sampling(args.temperature, args.top_p)
    size = args.tensor_parallel_size
    if args.layers == "fit" and size > 1:
        raise ValueError("--layers fit sizes a model for one GPU: give --layers N with --tensor-parallel-size")
    device = torch.device(args.device)
    layers = layers_that_fit(args.preset, device) if args.layers == "fit" else args.layers
    started = time.strftime("%Y-%m-%d %H:%M")
    model = build(args.preset, layers, args.device, size)  # a Decoder: prefills run per-op, verify steps on the kernels
    try:
        rows = measure_paths(args, model, layers, device)
    finally:
        model.close()
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "date": started,
              "preset": args.preset, "layers": layers, "layer_kinds": list(model.config.compress_ratios),
              "tensor_parallel_size": size, "context": args.context, "block": model.draft().block_size,
              "acceptance": args.acceptance, "steps": args.steps, "temperature": args.temperature,
              "top_p": args.top_p, "mono_shape": model.mono.shape.spec(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, torch {report['torch']}, Triton {report['triton']}; {args.preset}, {layers} layers "
          f"(compress ratios {report['layer_kinds']}), tensor parallel size {size}, context {args.context}, block "
          f"{report['block']}, synthetic acceptance {args.acceptance}, temperature {args.temperature}, top-p "
          f"{args.top_p}\nwrote {out / 'bench_decode.json'}")
    return 0


def measure_paths(args, model: Decoder, layers: int, device: torch.device) -> list[dict]:
    """The report's rows: each path at each request count (`run`). Over ranks only `mono
    stepwise`: the per-op graph holds whole layers and the whole step is one process's."""
    block, over_ranks = model.draft().block_size, args.tensor_parallel_size > 1
    bank_bytes = 3 * 2 * model.config.n_routed_experts * model.config.moe_intermediate_size * model.config.hidden_size
    per_op, reserve = None, RESERVE if device.type == "cuda" else 0
    if over_ranks:
        print("per-op graph and mono (whole): not run over ranks (the per-op graph's layers are whole layers; "
              "the whole step is built for one process)")
    elif "per-op" in args.paths:  # not asked for, its expert banks are not even dequantized
        if bank_bytes * layers + reserve <= free_memory(device):
            per_op = PerOpGraphStep(model.model)
        else:
            print(f"per-op graph: not run: its bf16 expert banks need {bank_bytes * layers / 2**30:.0f} GiB for "
                  f"{layers} layers (use --layers N for a model where both paths fit)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for count in args.requests:
        base = SpeculativeDecoder(model, SpeculativeConfig.from_json(
            {"method": "dspark", "num_speculative_tokens": block, "rejection_sample_method": "synthetic",
             "synthetic_acceptance_length": args.acceptance}))
        steps = args.steps * (2 if args.host_profile else 1) + 3  # timed (and profiled), and the warm-up
        caches = base.make_caches(count, args.context + steps * (block + 1) + block + 2)
        requests = [base.prefill(caches, slot, torch.randint(0, model.config.vocab_size, (args.context,),
                                                               generator=g).tolist()) for slot in range(count)]
        head = None if over_ranks else head_seconds(model.model, count * (block + 1), args.reps)
        paths = (("per-op graph", model.model, per_op, False), ("mono stepwise", model, model.step, False),
                 ("mono", model, None if over_ranks else model.step, True))
        for (path, decoder, step, whole), name in zip(paths, PATHS):
            if step is None or name not in args.paths:
                continue
            m = measure(decoder, step, copy.deepcopy(caches), seeded(requests, model.device, args.temperature, args.top_p),
                        args.steps, args.acceptance, whole, args.host_profile)
            rows.append({"path": path, "requests": count, "rows": count * (block + 1), "head_s": head, **m})
            print(line(rows[-1]), flush=True)
            if args.host_profile:
                print(profile_lines(m["host_profile"]), flush=True)
    return rows


def profile_lines(profile: dict[str, list[dict]]) -> str:
    return "\n".join(f"    {side:6} {p['self_us_a_step']:8.1f} us a step in {p['calls_a_step']:5.1f} calls: {p['op']}"
                     for side, rows in profile.items() for p in rows)


def line(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:8.2f}"  # noqa: E731
    head = f" (head {ms(r['head_s']).strip()})" if r["head_s"] is not None else ""
    if r["device_s"] is not None:
        parts = ", ".join(f"{name} {ms(s).strip()}{head if name == 'verify step' else ''}"
                          for name, s in r["device_parts_s"].items())
        split = f"device {ms(r['device_s'])} (one graph: {parts})"
    else:
        stages = f" (stages {ms(r['draft_stages_s']).strip()})" if r["draft_stages_s"] is not None else ""
        split = f"draft {ms(r['draft_s'])}{stages} + verify {ms(r['verify_s'])}{head}"
    other = f"other {ms(r['other_s'])}"
    if r["other_parts_s"] is not None:
        other += f" ({', '.join(f'{name} {ms(s).strip()}' for name, s in r['other_parts_s'].items())})"
    return (f"{r['path']:<14}{r['requests']:>3} requests ({r['rows']:>2} rows): step {ms(r['step_s'])} ms = {split} "
            f"+ {other}; {r['tokens_per_step']:.2f} tokens a step, "
            f"{r['tokens_per_s_per_user']:.1f} tokens/s/user")
