"""Probe (prepared 2026-12-06; its first run, on an H100 the same night, timed each launch with
`do_bench`, the host's work included: 140-490 us whatever the rows, against K2's 53-206 us
stage, so it measured the host, not the layouts: now each variant's launches replay in a CUDA
graph, as K2 runs it (a persistent program a SM, 8 warps); its second run, the same night:
attend_long_context_probe_h100_2026-12-06b.txt): what a CSA layer's attend costs at long context, and
which launch layout shortens it. The standalone attend (`mono.attention.attend`) at v4-flash sizes
(64 heads of 512 channels, a 128-token window, ratio 4, 512 selected entries a row), rows of 8
requests (6 drafts each at 48 rows) with `--context` cached tokens each, timed per variant:
heads a task (16, the kernels' HB, against 32 and 64: K = V is one head, so a task of more heads
reads a row's entries once for all of them), channels a chunk (64, the kernels' BD, against
128), warps, and entry splits / output parts where they apply. Each variant's output is
compared with the default's (max abs difference): a layout must not change the result beyond
fp32 summation order. Each variant runs K2's way (the task code over a persistent program a
SM, 8 warps), but alone: K2's attend stage starts after wq_b's, with other data in L2.

Run: `python docs/results/attend_long_context_probe_2026-12-06.py --rows 6,16,48` on a GPU
(`--preset tiny --context 64 --rows 1` checks it on the CPU interpreter)."""

import argparse
import itertools

import torch
import triton

from monodecode.config import preset
from monodecode.model.cache import PositionRing
from monodecode.model.rope import layer_frequencies
from monodecode.mono import attention as A

REQUESTS = 8


def step(config, rows: int, context: int, device, g: torch.Generator):
    """A step of `rows` rows over REQUESTS requests at `context` cached tokens (consecutive
    positions a request), its ring filled, its entries random, each row's selection random."""
    D, H, ratio, topk = config.head_dim, config.num_attention_heads, 4, config.index_topk
    per_request = max(rows // REQUESTS, 1)
    slots = torch.arange(rows) // per_request % REQUESTS
    positions = context + torch.arange(rows) % per_request
    ring = PositionRing(REQUESTS, config.sliding_window + 64, {"kv": D}, device, torch.bfloat16)
    for slot in range(REQUESTS):
        span = torch.arange(context + per_request - config.sliding_window - 8, context + per_request)
        ring.write(slot, span.to(device), {"kv": torch.randn(len(span), D, generator=g).to(device)})
    entries = torch.randn(REQUESTS, (context + per_request) // ratio + 1, D, generator=g).to(torch.bfloat16)
    selected = torch.stack([torch.randperm((int(p) + 1) // ratio, generator=g)[:topk].sort().values
                            for p in positions])
    q_raw = (3 * torch.randn(rows, H, D, generator=g)).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    move = lambda t: t.to(device)
    return dict(q_raw=move(q_raw), ring=ring, positions=move(positions), slots=move(slots), sink=move(sink),
                freqs=move(layer_frequencies(config, compressed=True)), window=config.sliding_window,
                eps=config.rms_norm_eps, entries=move(entries), ratio=ratio, selected=move(selected))


def variants(rows: int, heads: int, D: int, programs: int):
    """(name, keyword arguments) of the layouts to time, each at K2's 8 warps; the first is what
    K2 runs today. Tasks of more heads or longer chunks take the output parts that fill the
    programs (`output_parts`), no entry splits."""
    splits, parts, split_parts = A.compressed_layout(rows, heads, D, 512, programs)
    yield "k2 layout", dict(splits=splits, parts=parts, split_parts=split_parts, num_warps=8)
    for hb, chunk in itertools.product((16, 32, 64), (64, 128)):
        if (hb, chunk) != (A.HB, A.BD):
            fill = A.output_parts(rows, heads, D, programs, HB=hb, BD=chunk)
            yield (f"heads {hb}, chunk {chunk}, parts {fill}",
                   dict(heads_per_task=hb, d_chunk=chunk, parts=fill, num_warps=8))
    for s, p in ((2, 1), (4, 1), (2, 2)):
        yield f"splits {s}, parts {p}", dict(splits=s, parts=p, num_warps=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--rows", default="6,16,48")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset(args.preset)
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    print(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch.__version__,
          triton.__version__, f"context {args.context}", flush=True)
    if device.type == "cuda":  # K2's grid: a persistent program a SM walks the tasks
        A.task_grid = lambda n_tasks: (min(n_tasks, programs),)
    for rows in map(int, args.rows.split(",")):
        inputs = step(config, rows, args.context, device, torch.Generator().manual_seed(rows))
        reference = None
        for name, options in variants(rows, config.num_attention_heads, config.head_dim, programs):
            run = lambda: A.attend(**inputs, **options)
            try:
                out = run()
            except Exception as e:  # a layout that does not fit (registers, shared memory) is reported
                print(f"{rows:3d} rows  {name:32s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            reference = out if reference is None else reference
            differ = (out.float() - reference.float()).abs().max().item()
            check, A.SyncState.check = A.SyncState.check, lambda self: None  # reads a word: not capturable
            us = triton.testing.do_bench_cudagraph(run, rep=50) * 1e3 if device.type == "cuda" else float("nan")
            A.SyncState.check = check
            print(f"{rows:3d} rows  {name:32s} {us:8.1f} us  max |out - k2 layout's| {differ:.2e}", flush=True)


if __name__ == "__main__":
    main()
