"""(Copy into a folder probe/ at the repository root to run: `python probe/<this file>`.)
Probe: the FP8 split-x dots' numerics on the GPU against the per-op bf16 product and float64,
on the unit tests' data (tests/test_mono_gemv.py's generators) and on rows with an outlier."""
import os, sys, torch
import torch.nn.functional as F
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), os.path.join(os.path.dirname(here), "tests")]
from test_mono_gemv import fp8_weight, activations, rel_l2
from monodecode import formats
from monodecode.mono import gemv as G


def stats(tag, x, q, s, w, sb, block=None):
    xd, wd = x.double(), w.double()
    exact, magnitude = xd @ wd.T, xd.abs() @ wd.abs().T
    # the split's own scale: each K tile's largest |x| of the row, times |w|
    k = x.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile = (block or G.default_blocks(w.shape[0], k, sb, sms))[1]
    tmax = xd.abs().view(x.shape[0], k // tile, tile).amax(-1).repeat_interleave(tile, 1)
    split_mag = tmax @ wd.abs().T
    y = G.gemv(x.cuda(), q.cuda(), s.cuda(), block=block, poison=True).cpu().double()
    y32 = G.gemv(x.cuda(), q.cuda(), s.cuda(), block=block, out_dtype=torch.float32, poison=True).cpu().double()
    ref = F.linear(x.cuda(), w.cuda()).cpu().double()
    ulp = 2.0 ** (torch.frexp(ref.abs().clamp(min=1e-30))[1] - 8)
    over = ((y - ref).abs() - ulp).clamp(min=0)
    print(f"{tag:34s} cos {F.cosine_similarity(y.flatten(), ref.flatten(), dim=0).item():.7f} "
          f"rel {rel_l2(y, ref):.1e} eq {(y == ref).double().mean().item():.3f} "
          f"ratio {rel_l2(y, exact) / rel_l2(ref, exact):.4f} over/mag {(over / magnitude).max().item():.1e} "
          f"fp32 err/mag {((y32 - exact).abs() / magnitude).max().item():.1e} "
          f"err/split {((y32 - exact).abs() / split_mag).max().item():.1e} rel32 {rel_l2(y32, exact):.1e}", flush=True)


for rows in (2, 5, 16, 24, 32, 48):
    for n, k, sb in [(64, 128, 32), (256, 256, 128), (192, 256, 128), (4096, 4096, 128), (1024, 8192, 128)]:
        g = torch.Generator().manual_seed(rows * 1000 + n + k + sb)
        q, s, w = fp8_weight(g, n, k, sb)
        x = activations(g, rows, k)
        stats(f"rows {rows} {n}x{k} sb {sb}", x, q, s, w, sb, block=(64, 128) if n == 192 else None)
        if n == 4096:
            x = x.float()
            x[:, 5] *= 300.0  # an outlier channel
            stats(f"rows {rows} {n}x{k} outlier x300", x.to(torch.bfloat16), q, s, w, sb)
