"""Probe: does a cold instruction cache cost a persistent kernel's stage ~8 ns an instruction?
A straight-line body of N unrolled FMAs (4 independent a thread) runs twice in a runtime loop;
each program stamps the global timer before, between and after. Cold (1st) vs warm (2nd)."""
import os, sys, json
import torch, triton, triton.language as tl


@triton.jit
def clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def body(x_ptr, stamps_ptr, reps, N: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, 4 * 32 * 8)
    x = tl.load(x_ptr + offs)
    tl.store(stamps_ptr + pid * 8, clock_ns())
    for r in range(reps):
        for i in tl.static_range(N):
            x = x * (1.0 + i * 1e-7) + (i * 1e-3)
        tl.debug_barrier()
        tl.store(stamps_ptr + pid * 8 + 1 + r, clock_ns())
    tl.store(x_ptr + pid * 1024 + offs, x)


def main():
    out = os.environ.get("OUT", "/tmp")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(sms * 1024 + 1024, device="cuda")
    res = {}
    for n in [256, 1024, 4096]:
        stamps = torch.zeros(sms, 8, dtype=torch.int64, device="cuda")
        k = body[(sms,)](x, stamps, 3, N=n, num_warps=8)
        sass_bytes = None
        rows = []
        for trial in range(5):
            body[(sms,)](x, stamps, 3, N=n, num_warps=8)
            torch.cuda.synchronize()
            s = stamps.cpu()
            d = (s[:, 1:4] - s[:, 0:3]).double() / 1000  # us per rep per program
            rows.append([float(d[:, j].median()) for j in range(3)])
        instrs = len(k.asm["cubin"])
        res[n] = {"median_us_per_rep_trials": rows, "ffma": instrs}
        print(f"N={n} cubin bytes {instrs}: per rep (cold, warm, warm) us, 5 launches:", [[round(v, 2) for v in r] for r in rows], flush=True)
    json.dump(res, open(f"{out}/icache_probe.json", "w"), indent=1)


main()
