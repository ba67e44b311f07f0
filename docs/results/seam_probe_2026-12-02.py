"""Where the 1-row seams' time goes: hc.settle (sinkhorn_iters 1 / 20, 4 / 8 warps) and hc.fold
(CHUNK 64 / 32 / 16, 4 / 8 warps) standalone at R = 1, v4-flash sizes (hc 4, d 4096), as
CUDA-graph replays of 20 launches (an empty launch's time printed for reference)."""
import os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.getcwd())  # run from the repository root
from monodecode.mono import hc as HC

dev = torch.device("cuda")


@triton.jit
def _empty(p):
    tl.store(p + tl.program_id(0), 0.0)


def graph_us(fn, n=20, reps=30):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / n)
    return sorted(ts)[len(ts) // 2]


def main():
    hc, d, R = 4, 4096, 1
    mix = (2 + hc) * hc
    buf = torch.zeros(1024, device=dev)
    print(f"empty launch {graph_us(lambda: _empty[(1,)](buf)):.2f} us")
    res = torch.randn(R, hc, d, device=dev).to(torch.bfloat16)
    out = torch.randn(R, d, device=dev).to(torch.bfloat16)
    post = torch.rand(R, hc, device=dev) * 2
    comb = torch.rand(R, hc, hc, device=dev)
    fn = torch.randn(mix, hc * d, device=dev) * 0.01
    streams = torch.empty_like(res)
    for chunk in (64, 32, 16):
        n_chunks = triton.cdiv(d, chunk)
        part = torch.empty(R, n_chunks, mix + 1, device=dev)
        n_tasks = HC.fold_tasks(R, d, chunk, HC.RB)
        for warps in (4, 8):
            for owed in (True, False):
                us = graph_us(lambda: HC._fold[(n_tasks,)](n_tasks, R, d, res, out, out.stride(0), post, comb, streams, fn, part,
                                                          HC=hc, MIXP=HC.mix_pad(hc), RB=HC.RB, CHUNK=chunk, HAS_OWED=owed,
                                                          num_stages=1, num_warps=warps))
                print(f"fold   chunk {chunk:2d} tasks {n_tasks:3d} warps {warps} owed {owed}: {us:6.2f} us")
    streams, part = HC.fold(res, fn, (out, post, comb))
    base, scale, norm_w = torch.randn(mix, device=dev), torch.rand(3, device=dev), torch.rand(d, device=dev)
    xn = torch.empty(R, d, device=dev, dtype=torch.bfloat16)
    p2, c2 = torch.empty(R, hc, device=dev), torch.empty(R, hc, hc, device=dev)
    for iters in (1, 20):
        for warps in (1, 2, 4, 8):
            for bd in (1024, 4096):
                us = graph_us(lambda: HC._settle[(R,)](R, d, streams, part, base, scale, norm_w, p2, c2, xn, 1e-6, 1e-6, iters,
                                                       HC=hc, CHUNK=HC.CHUNK, CB=HC.CB, BD=bd, num_stages=1, num_warps=warps))
                print(f"settle iters {iters:2d} warps {warps} BD {bd}: {us:6.2f} us")


if __name__ == "__main__":
    main()
