"""(Copy into a folder probe/ at the repository root to run: `python probe/<this file>`.)
Probe (not part of the project): the 2+ row dense GEMV stage alone, as the persistent kernels
run it (SMs programs of 8 warps, BN = BK = 128, balanced splits): x split into two e4m3 parts and
FP8 dots (`gemv._e4m3_pair`) up to BR = SPLIT_X_ROWS, the bf16 dot beyond. Variants of
mono/gemv.py with SPLIT_X_ROWS set: bf16 (0: the bf16 dot at every width, the code before),
default (the module's: 16 when this ran), split (64: every width). CUDA-graph medians, weights rotating past L2; the bf16
output's worst row error and the fp32 output's error against float64 (per element, relative to
sum |x| |w|)."""
import importlib, os, re, sys, torch, triton
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), here]
from monodecode.mono import gemv as base

CONST = re.compile(r"SPLIT_X_ROWS: tl.constexpr = tl.constexpr\((\d+)\)")


def variant(name, rows):
    src = open(base.__file__).read().replace("from .", "from monodecode.mono.")
    assert CONST.search(src)
    with open(os.path.join(here, f"gemv_{name}.py"), "w") as f:
        f.write(CONST.sub(f"SPLIT_X_ROWS: tl.constexpr = tl.constexpr({rows})", src))
    return importlib.import_module(f"gemv_{name}")


VARIANTS = {"bf16": variant("bf16", 0), "default": base, "split": variant("split", 64)}
dev = "cuda"
G = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "w13": (4096, 4096), "wq_a|wkv": (1536, 4096)}


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


def launch(mod, x, w, s, y, sums, tickets, split):
    R, K = x.shape
    N = w.shape[0]
    mod._gemv_stage[(G,)](x, K, R, w, s, y, N, N, K, 0, sums, tickets, x, 0.0, WFMT=0, SB=128, BN=128, BK=128,
                          SPLIT=split, BR=base.row_block(R), OUT_BF16=y.dtype == torch.bfloat16, FAST=True,
                          STAGES=4, SWIGLU=False, num_warps=8)


def run(name, R):
    N, K = SHAPES[name]
    copies = max(2, (200 << 20) // (N * K))
    ws = [torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, device=dev) for _ in range(copies)]
    s = torch.randint(115, 125, (N // 128, K // 128), dtype=torch.uint8, device=dev)
    # rows of very different sizes, one with an outlier: the per-row scale must keep all of them
    x = (torch.randn(R, K, device=dev) * torch.logspace(-3, 2, R, device=dev)[:, None])
    x[0, 7] = 300.0
    x = x.to(torch.bfloat16)
    y = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
    y32 = torch.empty(R, N, dtype=torch.float32, device=dev)
    BR = base.row_block(R)
    split = base.balanced_split(triton.cdiv(N, 128), K, 128, G)
    sums_n, tick_n = base.split_scratch(N, 128, split, BR)
    sums = torch.zeros(max(sums_n, 1), device=dev)
    tickets = torch.zeros(max(tick_n, 1), dtype=torch.int32, device=dev)
    blocks = (2.0 ** (s.double() - 127)).repeat_interleave(128, 0).repeat_interleave(128, 1)
    wv = ws[0].view(torch.float8_e4m3fn).double() * blocks
    ref = x.double() @ wv.T
    magnitude = x.double().abs() @ wv.abs().T
    out = [f"{name:9s} R={R:2d} split={split}"]
    for vname, mod in VARIANTS.items():
        it = iter(range(10**9))
        try:
            t = timed(lambda: launch(mod, x, ws[next(it) % copies], s, y, sums, tickets, split))
            y.fill_(float("nan")); y32.fill_(float("nan"))
            launch(mod, x, ws[0], s, y, sums, tickets, split)
            launch(mod, x, ws[0], s, y32, sums, tickets, split)
            rel = ((y.double() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
            acc = ((y32.double() - ref).abs() / magnitude).max().item()
            out.append(f"{vname} {t:6.1f} us {N * K / t / 1e6:4.2f} TB/s bf16 row err {rel:.1e} fp32 err {acc:.1e}")
        except Exception as e:
            out.append(f"{vname} failed: {str(e).splitlines()[0][:160]}")
    print(" | ".join(out), flush=True)


def copy_rate():
    a = torch.empty(1 << 28, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), reps=5)
    print(f"{torch.cuda.get_device_name()} copy {2 * a.numel() / t / 1e6:.2f} TB/s", flush=True)


copy_rate()
for R in (2, 6, 16, 24, 32, 48):
    for name in SHAPES:
        run(name, R)
