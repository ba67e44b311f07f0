"""Probe (issue 28, 2026-12-03): how many weight bytes a dense GEMV stage of a persistent kernel
keeps in flight, and what that does to its speed, at 1 / 6 / 16 / 48 rows.

Each variant runs ONE dense FP8 matrix of the window layer as a persistent launch of one program
a SM (what K1 / K2 do), rotated over enough copies of the weights that every launch reads HBM:
- cur:   the project's `gemv_task` in the kernels' task loop (program p takes tasks p, p + grid,
         ...; each task a serial K loop that Triton pipelines at the launch's depth, 3 stages).
- flat:  one loop over this program's (task, K step) pairs, pipelined `S` stages deep with
         `tl.range(num_stages=S)`, so that the pipeline does not drain between tasks; the
         accumulator is stored and reset at each task's last K step. A tensor-core dot (rows
         padded to 16), including at 1 row.
- flatf: the same loop for one row on the CUDA cores (fp32 products summed along K).
CUDA-graph medians a launch (the graph holds one launch per weight copy), an empty persistent
launch reported for reference; every variant checked against torch (rel L2 of the bf16 output).
Usage: OUT=dir python docs/results/dense_pipeline_probe_2026-12-03.py [--quick]
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from monodecode.mono.gemv import _e8m0_value, gemv_task, row_block, single_row_blocks  # noqa: E402

dev = torch.device("cuda")
SB = 128
# (name, N, K): wo_a as one 8192 x 4096 matrix (same bytes as its 8 groups)
SHAPES = [("wq_a|wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wo_a", 8192, 4096), ("wo_b", 4096, 8192),
          ("w1|w3", 4096, 4096), ("w2", 4096, 2048)]


@triton.jit
def cur_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
              BR: tl.constexpr):
    for t in range(tl.program_id(0), tl.cdiv(N, BN), tl.num_programs(0)):
        gemv_task(t, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, N, K, 0, 0, 128, BN, BK, BR, True, True)


@triton.jit
def flat_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
               BR: tl.constexpr, S: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    K = K // BK * BK
    k_steps = K // BK
    mine = tl.cdiv(tl.maximum(tl.cdiv(N, BN) - pid, 0), grid)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    r = tl.arange(0, BR)
    r_mask = r < R
    scale_cols = tl.cdiv(K, 128)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for i in tl.range(0, mine * k_steps, num_stages=S):
        j = i // k_steps
        kk = i - j * k_steps
        t = pid + j * grid
        n = t * BN + rn
        k0 = kk * BK
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
        x = tl.load(x_ptr + r[:, None] * x_stride + (k0 + rk)[None, :], mask=r_mask[:, None], other=0.0)
        if BK > 128:
            codes = tl.load(s_ptr + (t * BN // 128) * scale_cols + (k0 + rk) // 128)
            wb = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * _e8m0_value(codes.to(tl.int32)).to(tl.bfloat16)[None, :]
            acc = tl.dot(wb, tl.trans(x), acc)
        else:
            scale = _e8m0_value(tl.load(s_ptr + (t * BN // 128) * scale_cols + k0 // 128).to(tl.int32))
            acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), tl.trans(x)) * scale
        if kk == k_steps - 1:
            tl.store(y_ptr + r[None, :] * N + n[:, None], acc.to(tl.bfloat16), mask=(n < N)[:, None] & r_mask[None, :])
            acc = tl.zeros((BN, BR), dtype=tl.float32)


@triton.jit
def flatf_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                BR: tl.constexpr, S: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    K = K // BK * BK
    k_steps = K // BK
    mine = tl.cdiv(tl.maximum(tl.cdiv(N, BN) - pid, 0), grid)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    scale_cols = tl.cdiv(K, 128)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for i in tl.range(0, mine * k_steps, num_stages=S):
        j = i // k_steps
        kk = i - j * k_steps
        t = pid + j * grid
        n = t * BN + rn
        k0 = kk * BK
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
        codes = tl.load(s_ptr + (t * BN // 128) * scale_cols + (k0 + rk) // 128)
        x = tl.load(x_ptr + k0 + rk).to(tl.float32) * _e8m0_value(codes.to(tl.int32))
        acc += tl.sum(w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :], axis=1)
        if kk == k_steps - 1:
            tl.store(y_ptr + n, acc.to(tl.bfloat16), mask=n < N)
            acc = tl.zeros((BN,), dtype=tl.float32)


@triton.jit
def split_stage(x_ptr, x_stride, R, w_ptr, s_ptr, p_ptr, N, K, KC, BN: tl.constexpr, BK: tl.constexpr,
                BR: tl.constexpr, S: tl.constexpr):
    """flat over (task, K step) with tasks (output block, K chunk of KC): fp32 partial sums to
    p [K / KC, R, N]. BK == 128 (one scale column a step); BN any multiple of 16 (a scale a row)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    K = K // BK * BK
    KC = KC // BK * BK
    k_steps = KC // BK
    splits = K // KC
    mine = tl.cdiv(tl.maximum(tl.cdiv(N, BN) * splits - pid, 0), grid)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    r = tl.arange(0, BR)
    r_mask = r < R
    scale_cols = tl.cdiv(K, 128)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for i in tl.range(0, mine * k_steps, num_stages=S):
        j = i // k_steps
        kk = i - j * k_steps
        t = pid + j * grid
        nb = t // splits
        ks = t - nb * splits
        n = nb * BN + rn
        k0 = ks * KC + kk * BK
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
        x = tl.load(x_ptr + r[:, None] * x_stride + (k0 + rk)[None, :], mask=r_mask[:, None], other=0.0)
        scale = _e8m0_value(tl.load(s_ptr + (n // 128) * scale_cols + k0 // 128, mask=n < N, other=127).to(tl.int32))
        acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), tl.trans(x)) * scale[:, None]
        if kk == k_steps - 1:
            tl.store(p_ptr + ks * R * N + r[None, :] * N + n[:, None], acc, mask=(n < N)[:, None] & r_mask[None, :])
            acc = tl.zeros((BN, BR), dtype=tl.float32)


@triton.jit
def _pref_load(w_ptr, s_ptr, x_ptr, x_stride, i, pid, grid, k_steps, splits, N, K, KC, r, r_mask, rn, rk,
               BN: tl.constexpr, BK: tl.constexpr):
    """The weight codes, scales and x of flat step i (task pid + (i // k_steps) * grid)."""
    j = i // k_steps
    kk = i - j * k_steps
    t = pid + j * grid
    nb = t // splits
    n = nb * BN + rn
    k0 = (t - nb * splits) * KC + kk * BK
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(n < N)[:, None], other=0)
    codes = tl.load(s_ptr + (n // 128) * tl.cdiv(K, 128) + k0 // 128, mask=n < N, other=127)
    x = tl.load(x_ptr + r[:, None] * x_stride + (k0 + rk)[None, :], mask=r_mask[:, None], other=0.0)
    return w, codes, x


@triton.jit
def pref_stage(x_ptr, x_stride, R, w_ptr, s_ptr, p_ptr, N, K, KC, BN: tl.constexpr, BK: tl.constexpr,
               BR: tl.constexpr, S: tl.constexpr):
    """split_stage with the next step's codes, scales and x loaded into registers by hand while
    the current step is converted and multiplied (no shared-memory staging: num_stages 1)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    K = K // BK * BK
    KC = KC // BK * BK
    k_steps = KC // BK
    splits = K // KC
    total = tl.cdiv(tl.maximum(tl.cdiv(N, BN) * splits - pid, 0), grid) * k_steps
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    r = tl.arange(0, BR)
    r_mask = r < R
    w, codes, x = _pref_load(w_ptr, s_ptr, x_ptr, x_stride, 0, pid, grid, k_steps, splits, N, K, KC, r, r_mask,
                             rn, rk, BN, BK)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for i in tl.range(0, total, num_stages=1):
        nw, ncodes, nx = _pref_load(w_ptr, s_ptr, x_ptr, x_stride, tl.minimum(i + 1, total - 1), pid, grid, k_steps,
                                    splits, N, K, KC, r, r_mask, rn, rk, BN, BK)
        scale = _e8m0_value(codes.to(tl.int32))
        acc += tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), tl.trans(x)) * scale[:, None]
        j = i // k_steps
        kk = i - j * k_steps
        if kk == k_steps - 1:
            t = pid + j * grid
            nb = t // splits
            n = nb * BN + rn
            tl.store(p_ptr + (t - nb * splits) * R * N + r[None, :] * N + n[:, None], acc,
                     mask=(n < N)[:, None] & r_mask[None, :])
            acc = tl.zeros((BN, BR), dtype=tl.float32)
        w, codes, x = nw, ncodes, nx


@triton.jit
def empty_stage(y_ptr):
    if tl.program_id(0) < 0:
        tl.store(y_ptr, 0.0)


def make(N, K, copies):
    sets = []
    for _ in range(copies):
        w = (torch.randn(N, K, device=dev) * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
        s = torch.randint(122, 131, (N // SB, K // SB), device=dev, dtype=torch.uint8)
        sets.append((w, s))
    return sets


def reference(x, w, s):
    scale = torch.pow(2.0, s.float() - 127).repeat_interleave(SB, 0).repeat_interleave(SB, 1)
    wd = (w.view(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16).float()
    return x.float() @ wd.T


def time_graph(launches, reps=20):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launches()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        launches()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


def variants(R):
    """(kind, BN, BK, warps, stages, K chunk (split only; 0: whole K), programs a SM)."""
    if R == 1:
        out = [("cur", 0, 0, 8, 3, 0, 1), ("flatf", 32, 512, 4, 4, 0, 1)]
    else:
        out = [("cur", 64, 128, 4, 3, 0, 1), ("cur", 64, 128, 4, 3, 0, 2)]
    out += [("split", 128, 128, 8, 4, 1024, 1), ("split", 64, 128, 4, 4, 1024, 1)]
    for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        for kc in (512, 1024, 0):
            out.append(("pref", bn, 128, warps, 1, kc, 1))
    out += [("pref", 128, 128, 4, 1, 1024, 2), ("pref", 64, 128, 4, 1, 1024, 2)]
    return out


def main():
    quick = "--quick" in sys.argv
    out_dir = os.environ.get("OUT", "/tmp")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y0 = torch.zeros(1, device=dev)
    empty = time_graph(lambda: [empty_stage[(sms,)](y0) for _ in range(8)]) / 8
    print(f"{torch.cuda.get_device_name()} triton {triton.__version__} torch {torch.__version__}; "
          f"{sms} SMs; empty persistent launch {empty:.2f} us", flush=True)
    rows_out = []
    widths = (1, 6, 48) if quick else (1, 6, 16, 48)
    for name, N, K in SHAPES:
        copies = max(2, -(-160_000_000 // (N * K)))
        sets = make(N, K, copies)
        for R in widths:
            x = torch.randn(R, K, device=dev).to(torch.bfloat16)
            ys = [torch.empty(R, N, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            parts = [torch.empty(K // 512, R, N, device=dev) for _ in range(copies)]
            ref = reference(x, *sets[0])
            for kind, bn, bk, warps, stages, kc, pps in variants(R):
                if kind == "cur" and R == 1:
                    bn, bk = single_row_blocks(N, K, SB, sms)
                br = 1 if kind == "flatf" or (kind == "cur" and R == 1) else row_block(max(R, 2))
                kc_run = kc or K
                if K % bk or K % kc_run:
                    continue
                grid = (sms * pps,)

                def launch(c, kind=kind, bn=bn, bk=bk, warps=warps, stages=stages, br=br, kc_run=kc_run, grid=grid):
                    w, s = sets[c]
                    if kind == "cur":
                        return cur_stage[grid](x, K, R, w, s, ys[c], N, K, BN=bn, BK=bk, BR=br, num_warps=warps)
                    if kind in ("split", "pref"):
                        fn = split_stage if kind == "split" else pref_stage
                        return fn[grid](x, K, R, w, s, parts[c], N, K, kc_run, BN=bn, BK=bk, BR=br, S=stages,
                                                 num_warps=warps)
                    fn = flat_stage if kind == "flat" else flatf_stage
                    return fn[grid](x, K, R, w, s, ys[c], N, K, BN=bn, BK=bk, BR=br, S=stages, num_warps=warps)

                label = f"{name:9s} R={R:2d} {kind:5s} {bn:3d}x{bk:4d} kc{kc:5d} w{warps} S{stages} pps{pps}"
                try:
                    ys[0].fill_(float("nan"))
                    parts[0].fill_(float("nan"))
                    compiled = launch(0)
                    torch.cuda.synchronize()
                    got = parts[0][: K // kc_run].sum(0) if kind in ("split", "pref") else ys[0].float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    us = time_graph(lambda: [launch(c) for c in range(copies)]) / copies
                except Exception as e:  # a variant that does not build or launch is reported, not fatal
                    print(f"{label}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                regs, spills, smem = compiled.n_regs, compiled.n_spills, compiled.metadata.shared
                tbps = N * K * (1 + 1 / SB / SB) / us / 1e6
                tasks = -(-N // bn) * (K // kc_run)
                print(f"{label}: {us:7.2f} us {tbps:5.2f} TB/s err {err:.1e} tasks {tasks} regs {regs} spill {spills} "
                      f"smem {smem // 1024} KB", flush=True)
                key = f"{kind} {'rule' if kind == 'cur' and R == 1 else f'{bn}x{bk}'} kc{kc} w{warps} S{stages} pps{pps}"
                rows_out.append(dict(shape=name, rows=R, key=key, us=us, tbps=tbps, err=err, regs=regs, spills=spills,
                                     smem=smem, tasks=tasks))
        del sets
        torch.cuda.empty_cache()
    print("\nbest per shape and rows:")
    for name, _, _ in SHAPES:
        for R in widths:
            rs = sorted((r for r in rows_out if r["shape"] == name and r["rows"] == R and r["err"] < 1e-2),
                        key=lambda r: r["us"])
            print(f"{name:9s} R={R:2d} " + "; ".join(f"{r['key']} {r['us']:.1f}" for r in rs[:3]))
    print("\nsums over the six matrices:")
    for R in widths:
        keys = sorted({r["key"] for r in rows_out if r["rows"] == R})
        sums = []
        for key in keys:
            rs = [r for r in rows_out if r["rows"] == R and r["key"] == key]
            if len(rs) == len(SHAPES):
                sums.append((sum(r["us"] for r in rs), key))
        for total, key in sorted(sums):
            print(f"R={R:2d} {key:40s} {total:7.1f} us")
    with open(os.path.join(out_dir, "dense_pipeline_probe.json"), "w") as f:
        json.dump(dict(empty_us=empty, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
