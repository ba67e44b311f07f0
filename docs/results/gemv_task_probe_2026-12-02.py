"""What one dense GEMV task costs: the project's gemv_task (dot, BK=128, the kernels' default BN)
against wider dot tiles and a CUDA-core (FMA) task, on the window layer's six FP8 matrices at
1 / 6 / 48 rows, each as a persistent stage of SMs x pps programs (one launch, tasks p, p+G, ...).
Timed as CUDA-graph replays of one launch per weight copy (copies rotate past L2), minus an
empty persistent launch. Checks every variant against torch on fresh random data, output poisoned."""
import itertools, json, os, sys, time
import torch, triton, triton.language as tl

sys.path.insert(0, os.getcwd())  # run from the repository root
from monodecode.formats import quantize_fp8_block, dequantize_fp8_block  # noqa: E402
from monodecode.mono.gemv import gemv_task, default_blocks, row_block, _e8m0_value  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


@triton.jit
def dot_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, group_rows, n_tasks,
              BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        gemv_task(t, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, N, K, group_rows,
                  0, 128, BN, BK, BR, True, True)


@triton.jit
def fma_task(nb, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, group_rows,
             BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
    n = nb * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    cols = tl.arange(0, RP)
    xoff = 0
    if group_rows > 0:
        xoff = (nb * BN) // group_rows * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + rk[None, :]
    s_row = s_ptr + (nb * BN // 128) * (K // 128)
    acc = tl.zeros((BN, RP), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_rows + k0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = _e8m0_value(tl.load(s_row + k0 // 128 + tl.arange(0, BK // 128)).to(tl.int32))
        for r in tl.static_range(RP):
            x = tl.load(x_ptr + r * x_stride + xoff + k0 + rk, mask=(rk < BK) & (r < R), other=0.0).to(tl.float32)
            part = tl.sum(tl.reshape(w * x[None, :], (BN, BK // 128, 128)), axis=2)
            acc += tl.where(cols[None, :] == r, tl.sum(part * scale[None, :], axis=1)[:, None], 0.0)
    tl.store(y_ptr + cols[None, :] * N + n[:, None], acc.to(tl.bfloat16), mask=cols[None, :] < R)


@triton.jit
def fma_stage(x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, group_rows, n_tasks,
              BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        fma_task(t, x_ptr, x_stride, R, w_ptr, s_ptr, y_ptr, N, K, group_rows, BN, BK, RP)


@triton.jit
def empty_stage(y_ptr):
    tl.store(y_ptr + tl.program_id(0), 0.0)


# (name, N, K, group_rows): x has K columns, or groups * K for a grouped one
SHAPES = [("wq_a|wkv", 1536, 4096, 0), ("wq_b", 32768, 1024, 0), ("wo_a", 8192, 4096, 1024),
          ("wo_b", 4096, 8192, 0), ("w1|w3", 4096, 4096, 0), ("w2", 4096, 2048, 0)]


def make(N, K, copies):
    out = []
    for _ in range(copies):
        w = torch.randn(N, K, device=dev) * 0.05
        codes, scales = quantize_fp8_block(w, (128, 128))
        out.append((codes.view(torch.uint8).contiguous(), scales.view(torch.uint8).contiguous()))
    return out


def time_graph(launches, reps=30):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for fn in launches:
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in launches:
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(launches))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    only = os.environ.get("ONLY", "")
    rows_list = [int(r) for r in os.environ.get("ROWS", "1,6,48").split(",")]
    results = []
    ybuf = torch.zeros(SMS * 4, device=dev)
    empty = {pps: time_graph([lambda pps=pps: empty_stage[(SMS * pps,)](ybuf)] * 8) for pps in (1, 2)}
    print("empty launch us", empty, flush=True)
    t_start = time.time()
    for name, N, K, group_rows in SHAPES:
        if only and name not in only.split(","):
            continue
        nbytes = N * K
        copies = max(2, min(16, -(-160_000_000 // nbytes)))
        ws = make(N, K, copies)
        width = (N // group_rows) * K if group_rows else K
        ref_w = dequantize_fp8_block(ws[0][0].view(torch.float8_e4m3fn), ws[0][1].view(torch.float8_e8m0fnu), (128, 128)).float()
        for R in rows_list:
            x = torch.randn(R, width, device=dev).to(torch.bfloat16)
            if group_rows:
                g = N // group_rows
                ref = torch.cat([x[:, i * K:(i + 1) * K].float() @ ref_w[i * group_rows:(i + 1) * group_rows].T
                                 for i in range(g)], dim=1)
            else:
                ref = x.float() @ ref_w.T
            y = torch.empty(R, N, device=dev, dtype=torch.bfloat16)
            bn0 = default_blocks(N, K, 128, SMS)[0]
            variants = [("cur", bn0, 128, w, p, 3) for w in (4, 8) for p in (1, 2)]
            variants += [("dot", bn, bk, w, p, 3) for bn, bk in ((16, 512), (32, 512), (64, 256))
                         for w in (4, 8) for p in (1, 2)]
            if R <= 8:
                variants += [("fma", bn, bk, w, p, st) for bn, bk in ((16, 1024), (32, 512), (32, 1024), (64, 256))
                             for w in (4, 8) for p in (1, 2) for st in (1, 3)]
            for kind, bn, bk, warps, pps, stages in variants:
                if group_rows and group_rows % bn:
                    continue
                tasks = triton.cdiv(N, bn)
                grid = (SMS * pps,)

                def launch(c, kind=kind, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid, tasks=tasks):
                    codes, sc = ws[c]
                    if kind == "fma":
                        fma_stage[grid](x, width, R, codes, sc, y, N, K, group_rows, tasks, BN=bn, BK=bk,
                                        RP=triton.next_power_of_2(R), num_warps=warps, num_stages=stages)
                    else:
                        dot_stage[grid](x, width, R, codes, sc, y, N, K, group_rows, tasks, BN=bn, BK=bk,
                                        BR=row_block(R), num_warps=warps, num_stages=stages)
                try:
                    y.fill_(float("nan"))
                    launch(0); torch.cuda.synchronize()
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    us = time_graph([lambda c=c: launch(c) for c in range(copies)]) - empty[pps]
                except Exception as e:  # a variant that does not build is reported, not fatal
                    print(f"{name} R={R} {kind} {bn}x{bk} w{warps} pps{pps} st{stages}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                row = dict(shape=name, rows=R, kind=kind, bn=bn, bk=bk, warps=warps, pps=pps, stages=stages,
                           us=round(us, 2), tbps=round(nbytes / us / 1e6, 2), err=err)
                results.append(row)
                flag = "" if err < 1e-2 else "  WRONG"
                print(f"{name:9s} R={R:2d} {kind} {bn:3d}x{bk:4d} w{warps} pps{pps} st{stages}: {us:7.2f} us "
                      f"{row['tbps']:5.2f} TB/s err {err:.1e}{flag}", flush=True)
        json.dump(results, open(f"{OUT}/gemv_task_probe.json", "w"), indent=1)
        print(f"-- {name} done at {time.time() - t_start:.0f} s", flush=True)
    print("\nbest per shape and rows:")
    for (name, R), group in itertools.groupby(sorted(results, key=lambda r: (r["shape"], r["rows"], r["us"])),
                                              key=lambda r: (r["shape"], r["rows"])):
        group = list(group)
        cur = min((r for r in group if r["kind"] == "cur"), key=lambda r: r["us"])
        top = group[:3]
        print(f"{name:9s} R={R:2d} cur best {cur['us']:.1f} us (w{cur['warps']} pps{cur['pps']}); " +
              "; ".join(f"{r['kind']} {r['bn']}x{r['bk']} w{r['warps']} pps{r['pps']} st{r['stages']} {r['us']:.1f}" for r in top))


if __name__ == "__main__":
    main()
