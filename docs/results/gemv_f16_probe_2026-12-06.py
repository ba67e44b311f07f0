"""Probe (not part of the project; copy into a folder probe/ at the repository root and run
`python probe/gemv_f16_probe.py`): the 2+ row dense GEMV stage alone as the kernels run it (SMs
programs of 8 warps, BN = BK = 128, balanced splits), its FP8 K step in four forms, at 2-48 rows:
- bf16: the codes converted to bf16 for a bf16 dot (main's step at BR 64),
- split: x as two e4m3 parts for two FP8 dots (main's step at BR <= 32),
- f16row: the codes converted to fp16 (one conversion a pair of codes; e4m3 is exact in fp16) and
  x scaled by a power of two a row (its largest into [2^14, 2^15): exact in fp16) for one fp16
  dot with fp32 accumulation: the old bf16 step's numerics, cheaper to convert,
- f16fixed: the same with x scaled by 2^-8 for every row (no reduction over the row: a speed
  bound only, not safe for every input).
Every form at every width (SPLIT_X_ROWS = 64). CUDA-graph medians, weights rotating past L2; the
bf16 output's worst row error against float64 and the fp32 output's error per element relative
to sum |x| |w|."""
import importlib, os, sys, torch, triton
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), here]
from monodecode.mono import gemv as base

BRANCH = """            hi, lo, down = e4m3_pair(x)
            w = w.to(tl.float8e4nv, bitcast=True)
            acc += (tl.dot(w, tl.trans(hi)) + tl.dot(w, tl.trans(lo))) * (scale * down)[None, :]
"""
FORMS = {
    "split": BRANCH,
    "bf16": """            acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), tl.trans(x.to(tl.bfloat16))) * scale
""",
    "f16row": """            xs = x.to(tl.float32)
            e = tl.maximum(tl.max(tl.abs(xs), axis=1).to(tl.int32, bitcast=True) >> 23, 15)
            up = ((268 - e) << 23).to(tl.float32, bitcast=True)
            down = ((e - 14) << 23).to(tl.float32, bitcast=True)
            xh = (xs * up[:, None]).to(tl.float16)
            acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.float16), tl.trans(xh)) * (scale * down)[None, :]
""",
    "f16fixed": """            xh = (x.to(tl.float32) * 0.00390625).to(tl.float16)
            acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.float16), tl.trans(xh)) * (scale * 256.0)
""",
}


def variant(name):
    src = open(base.__file__).read().replace("from .", "from monodecode.mono.")
    assert BRANCH in src
    src = src.replace(BRANCH, FORMS[name])
    src = src.replace("SPLIT_X_ROWS: tl.constexpr = tl.constexpr(32)", "SPLIT_X_ROWS: tl.constexpr = tl.constexpr(64)")
    with open(os.path.join(here, f"gemv_{name}.py"), "w") as f:
        f.write(src)
    return importlib.import_module(f"gemv_{name}")


VARIANTS = {name: variant(name) for name in FORMS}
dev = "cuda"
G = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
SHAPES = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "w13": (4096, 4096)}


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
    x = (torch.randn(R, K, device=dev) * torch.logspace(-2, 2, R, device=dev)[:, None]).to(torch.bfloat16)
    y = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
    y32 = torch.empty(R, N, dtype=torch.float32, device=dev)
    split = base.balanced_split(triton.cdiv(N, 128), K, 128, G)
    sums_n, tick_n = base.split_scratch(N, 128, split, base.row_block(R))
    sums = torch.zeros(max(sums_n, 1), device=dev)
    tickets = torch.zeros(max(tick_n, 1), dtype=torch.int32, device=dev)
    blocks = (2.0 ** (s.double() - 127)).repeat_interleave(128, 0).repeat_interleave(128, 1)
    wv = ws[0].view(torch.float8_e4m3fn).double() * blocks
    ref, magnitude = x.double() @ wv.T, x.double().abs() @ wv.abs().T
    out = [f"{name:5s} R={R:2d} split={split}"]
    for vname, mod in VARIANTS.items():
        it = iter(range(10**9))
        try:
            t = timed(lambda: launch(mod, x, ws[next(it) % copies], s, y, sums, tickets, split))
            y.fill_(float("nan")); y32.fill_(float("nan"))
            launch(mod, x, ws[0], s, y, sums, tickets, split)
            launch(mod, x, ws[0], s, y32, sums, tickets, split)
            rel = ((y.double() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
            acc = ((y32.double() - ref).abs() / magnitude).max().item()
            out.append(f"{vname} {t:6.1f} us {N * K / t / 1e6:4.2f} TB/s row err {rel:.1e} fp32 err {acc:.1e}")
        except Exception as e:
            out.append(f"{vname} failed: {str(e).splitlines()[0][:160]}")
    print(" | ".join(out), flush=True)


if __name__ == "__main__":
    a = torch.empty(1 << 28, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    print(f"{torch.cuda.get_device_name()} copy {2 * a.numel() / timed(lambda: b.copy_(a), reps=5) / 1e6:.2f} TB/s")
    for R in (2, 6, 16, 32, 48):
        for name in SHAPES:
            run(name, R)
