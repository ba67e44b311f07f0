"""(Copy into a folder probe/ at the repository root to run: `python probe/<this file>`.)
Probe (not part of the project): what a 2+ row K step of the dense GEMV spends its ~1.1 us on,
by ablation. The stage alone as the kernels run it (SMs programs of 8 warps, BN = BK = 128,
balanced splits, weights rotating past L2), with parts of mono/gemv.py's FP8 step (x split into
two e4m3 parts, two FP8 dots) taken out one at a time. Speed only: every variant but `step` gives
wrong numbers.
- step: the step as it is;
- noscale: the tile's E8M0 code not loaded (scale 1): what its one-byte L2 load costs;
- norow: x not scaled a row (no max over the row, no per-row factor moved to the dot's layout);
- onedot: the hi part's dot alone;
- nodot: no dot, acc += the x tile's row sums (the loop streams and waits on its copies only);
- nox: no x at all, the weight tile's column sums (the copies of the weights alone).
"""
import importlib, os, sys, torch, triton
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), here]
from monodecode.mono import gemv as base

SCALE = """        scale = e8m0_value(tl.load(s_ptr + (nb * BN // SB) * tl.cdiv(K, SB) + k0 // SB).to(tl.int32))
"""
STEP = """            hi, lo, down = e4m3_pair(x)
            w = w.to(tl.float8e4nv, bitcast=True)
            acc += (tl.dot(w, tl.trans(hi)) + tl.dot(w, tl.trans(lo))) * (scale * down)[None, :]
"""
REWRITES = {
    "step": [],
    "noscale": [(SCALE, "        scale = 1.0\n")],
    "norow": [(STEP, """            hi = x.to(tl.float8e4nv)
            lo = (x.to(tl.float32) - hi.to(tl.float32)).to(tl.float8e4nv)
            w = w.to(tl.float8e4nv, bitcast=True)
            acc += (tl.dot(w, tl.trans(hi)) + tl.dot(w, tl.trans(lo))) * scale
""")],
    "onedot": [(STEP, """            hi, lo, down = e4m3_pair(x)
            w = w.to(tl.float8e4nv, bitcast=True)
            acc += tl.dot(w, tl.trans(hi)) * (scale * down)[None, :]
""")],
    "nodot": [(STEP, """            acc += tl.sum(x.to(tl.float32), axis=1)[None, :] * scale + w.to(tl.float32).sum(axis=1)[:, None]
""")],
    "nox": [(STEP, """            acc += w.to(tl.float32).sum(axis=1)[:, None] * scale
""")],
}


def variant(name):
    src = open(base.__file__).read().replace("from .", "from monodecode.mono.")
    for old, new in REWRITES[name]:
        assert old in src, name
        src = src.replace(old, new)
    with open(os.path.join(here, f"gemv_ablate_{name}.py"), "w") as f:
        f.write(src)
    return importlib.import_module(f"gemv_ablate_{name}")


VARIANTS = {name: variant(name) for name in REWRITES}
dev = "cuda"
G = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = {"wq_b": (32768, 1024), "wo_b": (4096, 8192)}


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


def run(name, R, stages=(4,)):
    N, K = SHAPES[name]
    copies = max(2, (200 << 20) // (N * K))
    ws = [torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, device=dev) for _ in range(copies)]
    s = torch.randint(115, 125, (N // 128, K // 128), dtype=torch.uint8, device=dev)
    x = torch.randn(R, K, device=dev).to(torch.bfloat16)
    y = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
    split = base.balanced_split(triton.cdiv(N, 128), K, 128, G)
    sums_n, tick_n = base.split_scratch(N, 128, split, base.row_block(R))
    sums = torch.zeros(max(sums_n, 1), device=dev)
    tickets = torch.zeros(max(tick_n, 1), dtype=torch.int32, device=dev)
    steps = triton.cdiv(triton.cdiv(N, 128) * split, G) * (K // 128 // split)
    out = [f"{name:5s} R={R:2d} split={split} busiest {steps} steps"]
    for vname, mod, st in [(v, m, st) for v, m in VARIANTS.items() for st in stages if st == 4 or v == "step"]:
        vname = vname if st == 4 else f"{vname}@{st}"
        it = iter(range(10**9))

        def launch():
            mod._gemv_stage[(G,)](x, K, R, ws[next(it) % copies], s, y, N, N, K, 0, sums, tickets, x, 0.0, WFMT=0,
                                  SB=128, BN=128, BK=128, SPLIT=split, BR=base.row_block(R), OUT_BF16=True,
                                  FAST=True, STAGES=st, SWIGLU=False, num_warps=8)
        try:
            t = timed(launch)
            out.append(f"{vname} {t:5.1f} us ({t / steps:.2f} a step)")
        except Exception as e:
            out.append(f"{vname} failed: {str(e).splitlines()[0][:120]}")
    print(" | ".join(out), flush=True)


a = torch.empty(1 << 28, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
print(f"{torch.cuda.get_device_name()} copy {2 * a.numel() / timed(lambda: b.copy_(a), reps=5) / 1e6:.2f} TB/s")
for R in (6, 16):
    for name in SHAPES:
        run(name, R, stages=(2, 3, 4, 6, 8))
