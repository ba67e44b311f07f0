"""Timing shared by the benchmarks: the copy bandwidth that sets the floor, a median timer,
CUDA-graph capture of a step, and the count of GPU kernels a step launches."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device) -> float:
    """Bytes a second of a large device-to-device copy (read + written), eager (a graph-captured copy reads slower: measure the floor eagerly)."""
    device = torch.device(device)
    n = 2 * 1024**3 if device.type == "cuda" else 64 * 1024**2
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * n / timed(lambda: b.copy_(a), device, reps=5)


def timed(fn, device, reps: int, back_to_back: int = 1) -> float:
    """Median seconds of one fn() over `reps` samples (events on a GPU, wall clock on a CPU). On
    a GPU a sample times `back_to_back` calls in a row, divided: with more than one, a graph's
    replay queues behind the one before, so the GPU does not sit idle while the host launches it
    (as a layer in a step's graph starts when the layer before ends)."""
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(back_to_back):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / back_to_back)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def graphed(fn, device):
    """fn captured in a CUDA graph (after a warm-up run) on a GPU; fn itself on a CPU."""
    fn()
    if torch.device(device).type != "cuda":
        return fn
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernels_launched(fn, device) -> int | None:
    """GPU kernels one eager fn() launches (the profiler's device kernel events; copies and
    memsets not counted); None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))
