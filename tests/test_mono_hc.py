"""The mHC seam stages (fold, settle) against the per-op hc_post, hc_pre and rms_norm.

On the CPU the kernels run under Triton's interpreter; with MONODECODE_TEST_DEVICE=cuda they run
compiled. The references run on the same device, on the same bf16 inputs.
"""

import pytest
import torch

from monodecode.model.hc import hc_post, hc_pre
from monodecode.model.norm import rms_norm
from monodecode.mono import hc as H

HC = 4
MIX = (2 + HC) * HC
EPS = dict(hc_eps=1e-6, norm_eps=1e-6, sinkhorn_iters=20)  # the config's defaults

# (d, chunk): one chunk; three chunks; two chunks with a 64-column tail (settle also runs in
# `chunk`-column pieces, so the tail case covers its tail too)
WIDTHS = [(64, 64), (192, 64), (192, 128)]


def site(g, d, device):
    """A site's mHC parameters, shaped as monodecode/schema.py has them: fn [MIX, hc * d],
    base [MIX], scale [3] fp32; fn scaled so that the mixes are O(1)."""
    fn = torch.randn(MIX, HC * d, generator=g) / (HC * d) ** 0.5
    base = torch.randn(MIX, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return fn.to(device), base.to(device), scale.to(device)


def owed(g, rows, d, device):
    """A realistic owed triple: out [R, d] bf16 and post / comb from a real hc_pre call."""
    streams = torch.randn(rows, HC, d, generator=g).to(torch.bfloat16).to(device)
    _, post, comb = hc_pre(streams, *site(g, d, device), **EPS)
    return torch.randn(rows, d, generator=g).to(torch.bfloat16).to(device), post, comb


def bf16_ulps(a, b):
    """|a - b| in units of b's bf16 ulp (one ulp = 2^(exponent - 7))."""
    a, b = a.double(), b.double()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=1e-30))) - 7)
    return (a - b).abs() / ulp


def hc_post_exact(out, residual, post, comb):
    """`hc_post` with each of its sums exact (float64), rounded to bf16 where hc_post rounds. On the
    GPU, hc_post's bf16 matmul may sum in bf16 (cuBLAS's reduced-precision reduction), looser
    than the kernel's fp32 sum, and a near-cancelling row then differs by many ulps: so the
    kernel is held to the definition, which hc_post matches bit for bit on the CPU."""
    bf16 = torch.bfloat16
    spread = (post.to(bf16).double().unsqueeze(-1) * out.double().unsqueeze(-2)).to(bf16)
    mixed = torch.matmul(comb.to(bf16).double().transpose(-1, -2), residual.double()).to(bf16)
    return (spread.double() + mixed.double()).to(bf16)


def agreement(x, ref):
    x, ref = x.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(x, ref, dim=0)
    return float(cos), float((x - ref).norm() / ref.norm())


def test_the_exact_reference_is_hc_post_on_the_cpu():
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(48, HC, 192, generator=g).to(torch.bfloat16)
    debt = owed(g, 48, 192, "cpu")
    ulps = bf16_ulps(hc_post(*debt[:1], residual, *debt[1:]), hc_post_exact(*debt[:1], residual, *debt[1:]))
    assert ulps.max() <= 1 and (ulps > 0).double().mean() <= 1e-3


@pytest.mark.parametrize("d,chunk", WIDTHS)
@pytest.mark.parametrize("rows,task_rows", [(1, 1), (1, 16), (5, 16), (16, 16), (48, 16)])
@pytest.mark.parametrize("has_owed", [True, False])
def test_fold(device, rows, task_rows, d, chunk, has_owed):
    """Tasks of 16 rows (a dot) at every width, and of one row (products summed in registers:
    a one-row step's tasks)."""
    g = torch.Generator().manual_seed(1000 * rows + d + chunk + has_owed + task_rows)
    residual = torch.randn(rows, HC, d, generator=g).to(torch.bfloat16).to(device)
    fn, _, _ = site(g, d, device)
    debt = owed(g, rows, d, device) if has_owed else None
    streams, partials = H.fold(residual, fn, debt, chunk=chunk, rows=task_rows, poison=True)

    if has_owed:
        ref = hc_post_exact(*debt[:1], residual, *debt[1:])
        assert torch.isfinite(streams).all()
        # The kernel's four-term fp32 sum rounds once more than the exact one: a one-ulp flip, rarely.
        ulps = bf16_ulps(streams, ref)
        assert ulps.max() <= 1 and (ulps > 0).double().mean() <= 1e-3
    else:
        assert streams is residual
        ref = residual
    # partials against float64 sums of the (reference) streams, chunk by chunk
    n_chunks = partials.shape[1]
    assert partials.shape == (rows, -(-d // chunk), MIX + 1) and torch.isfinite(partials).all()
    for c in range(n_chunks):
        cols = slice(c * chunk, min(d, (c + 1) * chunk))
        part = ref[:, :, cols].double()
        dots = torch.einsum("rkc,mkc->rm", part, fn.double().view(MIX, HC, d)[:, :, cols])
        sumsq = part.square().sum(dim=(1, 2))
        # Observed: fp32 accumulation error, < 1e-6 relative to the scale of the terms.
        scale = part.abs().sum(dim=(1, 2)).max() * fn.abs().max()
        assert (partials[:, c, :MIX].double() - dots).abs().max() <= 1e-6 * scale
        torch.testing.assert_close(partials[:, c, MIX].double(), sumsq, rtol=1e-6, atol=0)


# settle does not know where its streams came from: most sizes with a fold before it, two without
# (the interpreter's time goes to settle's Sinkhorn loop, row by row: 48 rows take seconds)
SETTLE_CASES = [(rows, d, chunk, True) for rows in (1, 5, 16, 48) for d, chunk in WIDTHS
                if (rows, chunk) != (48, 64) or d == 64] + [(5, 192, 128, False), (48, 64, 64, False)]


@pytest.mark.parametrize("rows,d,chunk,has_owed", SETTLE_CASES)
def test_settle(device, rows, d, chunk, has_owed):
    """The seam end to end: fold, then settle, against hc_pre + rms_norm on the streams."""
    g = torch.Generator().manual_seed(2000 * rows + d + chunk + has_owed)
    residual = torch.randn(rows, HC, d, generator=g).to(torch.bfloat16).to(device)
    fn, base, scale = site(g, d, device)
    norm_w = (1 + 0.2 * torch.randn(d, generator=g)).to(device)
    debt = owed(g, rows, d, device) if has_owed else None
    streams, partials = H.fold(residual, fn, debt, chunk=chunk, poison=True)
    x_norm, post, comb = H.settle(streams, partials, base, scale, norm_w, **EPS, chunk=chunk, block=chunk,
                                  poison=True)

    x_ref, post_ref, comb_ref = hc_pre(streams, fn, base, scale, **EPS)
    xn_ref = rms_norm(x_ref, norm_w, EPS["norm_eps"])
    assert torch.isfinite(x_norm).all() and torch.isfinite(post).all() and torch.isfinite(comb).all()
    # Observed (CPU): post within 1.4e-6 and comb within 2.5e-6 relative (the mixes differ only in
    # fp32 summation order).
    torch.testing.assert_close(post, post_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref, rtol=1e-5, atol=1e-6)
    # Observed (CPU): x_norm bit-equal but for one-ulp flips on <= 0.07 % of elements (the collapsed
    # row rounds to bf16 from an fp32 sum whose pre weights differ in their last bits); relative L2
    # <= 5e-6, cos >= 1 - 1e-11.
    cos, rel = agreement(x_norm, xn_ref)
    assert cos >= 0.99999 and rel <= 1e-4
    ulps = bf16_ulps(x_norm, xn_ref)
    assert ulps.max() <= 1 and (ulps > 0).double().mean() <= 0.005


def test_fold_row_block_and_strided_out(device):
    """One row block of 64 (BR for 48 rows: fn read once a step), with `out` a slice of a wider
    buffer (row stride 2d), gives the same streams and partials as blocks of 16 on a plain out."""
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(48, HC, 64, generator=g).to(torch.bfloat16).to(device)
    fn, _, _ = site(g, 64, device)
    out, post, comb = owed(g, 48, 64, device)
    wide = torch.randn(48, 128, generator=g).to(torch.bfloat16).to(device)
    wide[:, 64:] = out
    s16, p16 = H.fold(residual, fn, (out, post, comb), poison=True)
    s64, p64 = H.fold(residual, fn, (wide[:, 64:], post, comb), rows=64, poison=True)
    assert torch.equal(s16, s64)
    torch.testing.assert_close(p16, p64, rtol=1e-6, atol=1e-6)


def test_task_counts():
    assert H.fold_tasks(48, 7168, 64, 16) == 3 * 112
    assert H.fold_tasks(5, 192, 128, 16) == 2
    assert H.settle_tasks(5) == 10  # a collapse and a mix task a row
    assert H.mix_pad(4) == 32


def test_seam_blocks():
    """Fold tasks of 16 rows (or of the step's rows padded, up to `fold_rows`; one row in a
    one-row step) as large as leave
    none to a second round (one a program), from MIN_CHUNK (which sizes the partials buffers) to
    MAX_CHUNK; the settle sums a row's partials in one go and takes 512 columns a warp."""
    assert H.seam_blocks(4, 4096, 1, 132) == (1, 32, 128, 2048)  # 128 tasks of the one row
    assert H.seam_blocks(8, 4096, 16, 132) == (16, 32, 128, 4096)  # one row block
    assert H.seam_blocks(8, 4096, 48, 132) == (16, 64, 64, 4096)  # 3 row blocks: 192 tasks at the cap
    assert H.seam_blocks(8, 4096, 1, 264) == (1, 16, 256, 4096)
    assert H.seam_blocks(8, 256, 1, 1) == (1, 64, 4, 256)
    assert H.seam_blocks(8, 4096, 2, 132) == (16, 32, 128, 4096)
    assert H.seam_blocks(8, 4096, 48, 132, fold_rows=64) == (64, 32, 128, 4096)  # one row block: 128 tasks
    assert H.seam_blocks(8, 4096, 20, 132, fold_rows=64) == (32, 32, 128, 4096)
    assert H.seam_blocks(8, 4096, 6, 132, fold_rows=64) == (16, 32, 128, 4096)
    assert H.fold_rows_refusal(32) is None and H.fold_rows_refusal(128) and H.fold_rows_refusal(24)
    assert H.seam_blocks(8, 4096, 1, 132, settle_columns=1024) == (1, 32, 128, 1024)  # the settle in 4 tiles
    assert H.seam_blocks(8, 256, 6, 132, settle_columns=1024)[3] == 256  # never wider than the row
    assert H.settle_columns_refusal(0) is None and H.settle_columns_refusal(64) is None
    assert H.settle_columns_refusal(8) and H.settle_columns_refusal(96)
    for rows in (1, 6, 48):
        _, chunk, _, _ = H.seam_blocks(4, 7168, rows, 132)
        assert H.MIN_CHUNK <= chunk <= H.MAX_CHUNK
        assert H.fold_tasks(rows, 7168, chunk) <= 132 or chunk == H.MAX_CHUNK
