"""Probe (not part of the project; copy into a folder probe/ at the repository root and run `python probe/stream_layout_probe.py`): does the dense weights'
layout in memory set how fast a GEMV stage streams them? A persistent stream of [N, K] uint8
weights (read as int32 words, xor-reduced: no arithmetic to speak of) dealt as mono/gemv.py deals
its tasks (task t = pid + j * grid, the task's K steps inner, tl.range pipelined STAGES deep),
one BN x BK tile a step, with the tile's bytes where each layout puts them:
- rows: row-major [N, K] (the checkpoint's layout; the kernels' today),
- blocks: 16-row x 128-column blocks of 2 KB each contiguous, band after band,
- tiles: each BN x BK tile contiguous, tile row after tile row.
Weights rotate through copies past L2; CUDA-graph medians; TB/s of the weights' bytes."""
import torch, triton
import triton.language as tl

dev = "cuda"
G = torch.cuda.get_device_properties(0).multi_processor_count


@triton.jit
def _stream(w_ptr, out_ptr, N, K, LAYOUT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    KW = K // 4  # int32 words a row
    steps = K // BK
    n_tasks = N // BN
    mine = tl.cdiv(tl.maximum(n_tasks - pid, 0), grid)
    rn = tl.arange(0, BN)
    rw = tl.arange(0, BK // 4)
    acc = tl.zeros((BN, BK // 4), dtype=tl.int32)
    for i in tl.range(0, mine * steps, num_stages=STAGES):
        j = i // steps
        s = i - j * steps
        nb = pid + j * grid
        if LAYOUT == 0:
            off = (nb * BN + rn)[:, None].to(tl.int64) * KW + (s * (BK // 4) + rw)[None, :]
        elif LAYOUT == 1:
            n = nb * BN + rn
            w = s * (BK // 4) + rw
            block = (n // 16).to(tl.int64)[:, None] * (K // 128) + (w // 32)[None, :]
            off = block * 512 + ((n % 16) * 32)[:, None] + (w % 32)[None, :]
        else:
            tile = (nb.to(tl.int64) * steps + s) * (BN * BK // 4)
            off = tile + (rn * (BK // 4))[:, None] + rw[None, :]
        acc ^= tl.load(w_ptr + off)
    tl.store(out_ptr + pid * BN * (BK // 4) + rn[:, None] * (BK // 4) + rw[None, :], acc)


def timed(fn, reps=20, rounds=7):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(ts)[len(ts) // 2]


SHAPES = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "w13": (4096, 4096), "big": (65536, 4096)}
out = torch.empty(2 * G * 16384, dtype=torch.int32, device=dev)
a = torch.empty(1 << 28, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
print(f"{torch.cuda.get_device_name()} copy {2 * a.numel() / timed(lambda: b.copy_(a), reps=5) / 1e6:.2f} TB/s", flush=True)
for name, (N, K) in SHAPES.items():
    copies = max(2, (256 << 20) // (N * K))
    ws = [torch.randint(-2**31, 2**31 - 1, (N * K // 4,), dtype=torch.int32, device=dev) for _ in range(copies)]
    for BN, BK in ((128, 128), (64, 256), (32, 512)):
        for per_sm, warps in ((1, 8), (2, 4)):
            row = [f"{name:4s} [{N}x{K}] {BN}x{BK} {per_sm}x{warps}w"]
            for layout, lname in enumerate(("rows", "blocks", "tiles")):
                for stages in (3, 4):
                    it = iter(range(10**9))

                    def launch():
                        _stream[(G * per_sm,)](ws[next(it) % copies], out, N, K, LAYOUT=layout, BN=BN, BK=BK,
                                               STAGES=stages, num_warps=warps)
                    try:
                        t = timed(launch)
                        row.append(f"{lname}@{stages} {t:5.1f} us {N * K / t / 1e6:4.2f}")
                    except Exception as e:
                        row.append(f"{lname}@{stages} failed {str(e).splitlines()[0][:60]}")
            print(" | ".join(row), flush=True)
