"""The window-attention stages (mono/attention.py) against the per-op reference (model/attention.py)
at tiny size, on the same bf16 inputs.

On the CPU the kernels run under Triton's interpreter (grid (1,), the portable path); with
MONODECODE_TEST_DEVICE=cuda they run compiled (FAST) and the reference runs in bf16 on the GPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from monodecode.config import preset
from monodecode.mono import attend_entries as AE
from monodecode.mono import attention as A
from monodecode.model.attention import Attention, RequestRows
from monodecode.model.cache import LayerCache, PositionRing
from monodecode.model.norm import rms_norm
from monodecode.model.rope import apply_rope

MAX_STEP_ROWS = 8
NUM_SLOTS = 24
ROWS = [1, 5, 16, 48]


def layer(config, g, device) -> Attention:
    """A window-only attention layer with random weights: bf16 matrices, fp32 norms and sinks."""
    c, d, hd = config, config.hidden_size, config.head_dim

    def matrix(n, k):
        return (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(device)

    w = {"wq_a": matrix(c.q_lora_rank, d), "wkv": matrix(hd, d),
         "wq_b": matrix(c.num_attention_heads * hd, c.q_lora_rank),
         "q_norm": (1 + 0.2 * torch.randn(c.q_lora_rank, generator=g)).to(device),
         "kv_norm": (1 + 0.2 * torch.randn(hd, generator=g)).to(device),
         "attn_sink": torch.randn(c.num_attention_heads, generator=g).to(device)}
    return Attention(config, w, "", ratio=0)


def make_step(g, rows: int, window: int):
    """(positions, slots [R] int64, groups) of a step: requests of 1 to 5 consecutive rows on distinct
    slots (R = 5: one verify-style request of 5 rows), rows scattered, ~1 in 8 a pad row (slot -1,
    position 0). A request starts at p0 < window (a fresh request) a third of the time, else far on."""
    pads = rows // 8
    order = torch.randperm(rows, generator=g)
    positions = torch.zeros(rows, dtype=torch.long)
    slots = torch.full((rows,), -1, dtype=torch.long)
    groups, used, slot_ids = [], pads, torch.randperm(NUM_SLOTS, generator=g).tolist()
    while used < rows:
        n = 5 if rows == 5 else min(int(torch.randint(1, 6, (1,), generator=g)), rows - used)
        p0 = int(torch.randint(0, window - 1, (1,), generator=g)) if (len(groups) + rows) % 3 == 1 else \
            int(torch.randint(window, 200_000, (1,), generator=g))
        index = order[used:used + n].sort().values
        positions[index] = torch.arange(p0, p0 + n)
        slots[index] = slot_ids[len(groups)]
        groups.append(RequestRows(slot_ids[len(groups)], index, positions[index]))
        used += n
    return positions, slots, groups


def fill_history(g, cache: LayerCache, groups, window: int) -> None:
    """Each request's earlier positions in the ring, with random holes, a stale row of a later
    position over an in-window entry, and stale rows of a rejected verify at and after p0; the
    rest of the ring (other slots, empty entries) holds random bf16 data."""
    ring = cache.window
    kv = ring.data["kv"]
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
    for i, grp in enumerate(groups):
        p0, n = int(grp.positions[0]), len(grp.positions)
        before = torch.arange(max(0, p0 - window - MAX_STEP_ROWS), p0 + n + 2)  # + rejected rows p0 ..
        ring.write(grp.slot, before.to(kv.device), {"kv": torch.randn(len(before), kv.shape[-1], generator=g).to(kv)})
        if p0 > 3 and i % 2 == 0:  # a hole
            ring.pos[grp.slot, (p0 - 2) % ring.size] = -1
        if p0 > 4 and i % 3 == 0:  # a stale row of a later position where p0 - 4 belongs
            ring.pos[grp.slot, (p0 - 4) % ring.size] = p0 - 4 + ring.size


def stats(out: torch.Tensor, ref: torch.Tensor):
    """(cos, relative L2, fraction of elements that differ, max |diff| / max |ref|)."""
    o, r = out.double().cpu().flatten(), ref.double().cpu().flatten()
    assert torch.isfinite(o).all(), "an element no task wrote (poison) or a NaN"
    cos = float(F.cosine_similarity(o, r, dim=0))
    rel = float((o - r).norm() / r.norm())
    return cos, rel, float((o != r).double().mean()), float((o - r).abs().max() / r.abs().max())


def assert_close(out, ref, *, differ: float, rel: float):
    """cos >= 0.9999 and relative L2 <= 1e-2 at the least; then the test's tighter bounds on the
    relative L2 and on the fraction of elements that differ at all."""
    cos, rel_l2, frac, worst = stats(out, ref)
    seen = f"cos {cos:.8f} rel {rel_l2:.2e} differ {frac:.4f} max {worst:.2e}"
    assert cos >= 0.9999 and rel_l2 <= 1e-2, seen
    assert rel_l2 <= rel and frac <= differ, seen


def setup(device, rows, seed, **overrides):
    config = preset("tiny", **overrides)
    g = torch.Generator().manual_seed(seed)
    attn = layer(config, g, device)
    positions, slots, groups = make_step(g, rows, config.sliding_window)
    cache = LayerCache(config, 0, NUM_SLOTS, 1 << 20, MAX_STEP_ROWS, device, torch.bfloat16)
    groups = [RequestRows(gr.slot, gr.index.to(device), gr.positions.to(device)) for gr in groups]
    fill_history(g, cache, groups, config.sliding_window)
    x = torch.randn(rows, config.hidden_size, generator=g).to(torch.bfloat16).to(device)
    return config, attn, positions.to(device), slots.to(device), groups, cache, x


def fused_raw(attn, x):
    """qr_raw and kv_raw as column slices of one [R, q_lora + D] buffer, as a fused wq_a|wkv GEMV
    writes them (row stride q_lora + D)."""
    qr_raw, kv_raw = F.linear(x, attn.w["wq_a"]), F.linear(x, attn.w["wkv"])
    raw = torch.cat([qr_raw, kv_raw], dim=1)
    return raw[:, :qr_raw.shape[1]], raw[:, qr_raw.shape[1]:]


@pytest.mark.parametrize("rows", ROWS)
def test_norm_rope_kv(device, rows):
    config, attn, positions, slots, groups, cache, x = setup(device, rows, seed=rows)
    qr_ref, _, kv_ref = attn.project(x, positions)
    expected = copy.deepcopy(cache.window)
    for grp in groups:
        expected.write(grp.slot, grp.positions, {"kv": kv_ref[grp.index]})
    before = cache.window.data["kv"].clone()
    qr_raw, kv_raw = fused_raw(attn, x)
    qr = A.norm_rope_kv(qr_raw, kv_raw, attn.w["q_norm"], attn.w["kv_norm"], positions, slots,
                        attn.freqs.to(device), cache.window, config.rms_norm_eps, poison=True)
    # observed, CPU (interpreter) and H200 (compiled): qr and kv bit-exact. The bounds leave room for
    # a one-ulp bf16 flip (an fp32 rsqrt or cos a rounding apart): one element of a 64-wide row
    assert_close(qr, qr_ref, differ=0.02, rel=1e-3)
    ring = cache.window
    assert torch.equal(ring.pos, expected.pos)  # the rows' entries got their positions, nothing else
    written = torch.zeros_like(ring.pos, dtype=torch.bool)
    for grp in groups:
        written[grp.slot, grp.positions % ring.size] = True
    assert torch.equal(ring.data["kv"][~written], before[~written])  # pad rows wrote nothing
    assert_close(ring.data["kv"][written], expected.data["kv"][written], differ=0.02, rel=1e-3)


def heads(attn, q_raw, positions):
    """The queries of the raw heads q_raw [R, H, D], as `Attention.project` makes them."""
    return apply_rope(rms_norm(q_raw, None, attn.c.rms_norm_eps), positions, attn.freqs.to(q_raw.device))


def reference_attention(attn, q, kv, positions, groups, cache):
    """Attention.__call__ up to its output's inverse rope (wo_a / wo_b are other stages): each
    request's keys from the cache and its own rows, then its rows written. Pad rows stay 0."""
    out = torch.zeros_like(q)
    for grp in groups:
        keys, mask = attn._window_keys(grp, kv[grp.index], cache)
        cache.window.write(grp.slot, grp.positions, {"kv": kv[grp.index]})
        out[grp.index] = attn.attend(q[grp.index], keys, mask)
    return apply_rope(out, positions, attn.freqs, inverse=True)


# (heads, window, D chunk): tiny (one head block of 16, 4 live; 16 key slots; one chunk of 64); and
# 40 heads over a window of 40 in D chunks of 16: three head blocks (the last partial), 64 key slots
# (24 dead), four chunks (the rope dims are the last)
# (heads, window, chunk, heads a task); head_dim 64 with 16 rope channels: chunks of 64 all rotate,
# of 16 the first three do not, of 32 the second holds plain and rope channels; 40 heads in tasks
# of 32 (the second block 8 live) and of 64 (one block, 24 dead)
SHAPES = [(4, 16, 64, 16), (40, 40, 16, 16), (4, 16, 32, 16), (40, 40, 16, 32), (40, 40, 32, 64)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n_heads,window,chunk,heads_per_task", SHAPES)
def test_attend(device, rows, n_heads, window, chunk, heads_per_task):
    config, attn, positions, slots, groups, cache, _ = setup(device, rows, seed=200 + rows + n_heads,
                                                               num_attention_heads=n_heads, sliding_window=window)
    g = torch.Generator().manual_seed(rows)
    q_raw = (3 * torch.randn(rows, n_heads, config.head_dim, generator=g)).to(torch.bfloat16).to(device)
    kv = torch.randn(rows, config.head_dim, generator=g).to(torch.bfloat16).to(device)  # the step's rows
    ref = reference_attention(attn, heads(attn, q_raw, positions), kv, positions, groups, cache)  # writes the rows
    o = A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device), window,
                 config.rms_norm_eps, d_chunk=chunk, heads_per_task=heads_per_task, poison=True)
    # observed: up to 0.02 % (CPU) / 0.4 % (H200) of elements differ by a bf16 ulp (fp32 summation
    # order before the rounding), rel L2 <= 4.4e-5 (CPU) / 8.1e-5 (H200; 1e-4 at 64 heads x 512, W 128)
    assert_close(o, ref, differ=0.02, rel=5e-4)
    assert (o[slots < 0] == 0).all()


# (heads, window, chunk, parts): head_dim 64 with 16 rope channels. Chunks of 16: 3 plain, 1 rope;
# parts of 2 split them 2 plain | 1 plain + 1 rope, parts of 4 one chunk each. Chunks of 32: the
# second holds plain and rope channels, each part one chunk.
PART_SHAPES = [(40, 40, 16, 2), (4, 16, 16, 4), (4, 16, 32, 2)]


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n_heads,window,chunk,parts", PART_SHAPES)
def test_attend_output_parts_equal_one_task(device, rows, n_heads, window, chunk, parts):
    """A window layer's pair spread over `parts` tasks, each its share of the output chunks, gives
    bit for bit what one task a pair gives (each chunk's operations are the same); pad rows 0."""
    config, attn, positions, slots, groups, cache, _ = setup(device, rows, seed=250 + rows + n_heads,
                                                               num_attention_heads=n_heads, sliding_window=window)
    g = torch.Generator().manual_seed(rows + parts)
    q_raw = (3 * torch.randn(rows, n_heads, config.head_dim, generator=g)).to(torch.bfloat16).to(device)
    for grp in groups:  # the step's rows in the ring, as stage 1 writes them
        cache.window.write(grp.slot, grp.positions,
                           {"kv": torch.randn(len(grp.index), config.head_dim, generator=g).to(torch.bfloat16).to(device)})
    args = (q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device), window,
            config.rms_norm_eps)
    one = A.attend(*args, d_chunk=chunk, poison=True)
    spread = A.attend(*args, d_chunk=chunk, parts=parts, poison=True)
    assert torch.equal(spread, one)
    assert (spread[slots < 0] == 0).all()


def test_the_attend_tile_grows_with_the_rows_unless_the_shape_names_one():
    """v4-flash's 64 heads of 512 channels on 132 programs: a CSA layer's attend takes chunks of 128
    from 16 rows; it and a window layer take tasks of 32 heads once 16-head pairs outnumber the
    programs (34 rows); an HCA layer keeps 16 heads and 64 channels; a shape's fields win; a chunk
    never outgrows a head."""
    csa, window, hca = (True, True), (False, False), (False, True)
    tile = lambda rows, kind, *shape: A.attend_tile(rows, 64, 512, 132, *kind, *shape)
    assert [tile(rows, csa) for rows in (1, 6, 15, 16, 33, 34, 48)] == \
        [(16, 64)] * 3 + [(16, 128)] * 2 + [(32, 128)] * 2
    assert [tile(rows, window) for rows in (1, 16, 33, 34, 48)] == [(16, 64)] * 3 + [(32, 64)] * 2
    assert {tile(rows, hca) for rows in (1, 16, 48)} == {(16, 64)}
    assert tile(48, csa, 64, 64) == (64, 64) and tile(1, hca, 32, 128) == (32, 128)
    assert tile(48, window, 16) == (16, 64)
    assert A.attend_tile(16, 4, 64, 132, *csa) == (16, 64)


def test_output_parts_fill_one_round():
    """Output parts a pair: a power of two, at most the D / BD chunks, parts x pairs within the
    programs, and no more parts would fit; 1 once the pairs alone fill them."""
    for rows in range(1, 49):
        parts = A.output_parts(rows, 64, 512, 132)
        pairs, chunks = rows * 4, 512 // A.BD
        assert parts & (parts - 1) == 0 and 1 <= parts <= chunks
        assert parts == 1 or pairs * parts <= 132
        assert parts == chunks or pairs * 2 * parts > 132
    with pytest.raises(AssertionError, match="output parts"):
        config, attn, positions, slots, _, cache, _ = setup("cpu", 1, seed=1)
        q_raw = torch.randn(1, config.num_attention_heads, config.head_dim).to(torch.bfloat16)
        A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs, config.sliding_window,
                 config.rms_norm_eps, parts=2)  # one chunk of 64: no second part


@pytest.mark.parametrize("rows", [5, 48])
def test_stages_in_sequence(device, rows):
    """Stage 1 writes the step's rows into the ring, stage 2 (after the wq_b GEMV) attends over
    it from the raw heads: against Attention.__call__'s own path, ring included."""
    config, attn, positions, slots, groups, cache, x = setup(device, rows, seed=300 + rows)
    ref_cache = copy.deepcopy(cache)
    qr_ref, q_ref, kv_ref = attn.project(x, positions)
    ref = reference_attention(attn, q_ref, kv_ref, positions, groups, ref_cache)
    freqs, eps = attn.freqs.to(device), config.rms_norm_eps
    qr = A.norm_rope_kv(*fused_raw(attn, x), attn.w["q_norm"], attn.w["kv_norm"], positions, slots, freqs,
                        cache.window, eps, poison=True)
    q_raw = F.linear(qr, attn.w["wq_b"]).unflatten(-1, (config.num_attention_heads, config.head_dim))
    o = A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], freqs, config.sliding_window, eps,
                 poison=True)
    assert torch.equal(cache.window.pos, ref_cache.window.pos)
    assert_close(cache.window.data["kv"], ref_cache.window.data["kv"], differ=0.001, rel=1e-3)
    # observed: ring bit-exact; o as in test_attend (rel <= 6e-6 CPU, 3e-5 H200)
    assert_close(o, ref, differ=0.02, rel=5e-4)


@pytest.mark.parametrize("requests", [1, 6])
def test_attend_over_draft_blocks(device, requests):
    """DSpark draft blocks (`block` > 0; model/draft.py's DraftAttention): every row of a request's
    block sees the context ring before its anchor and the whole block, its keys written into a ring
    of context + block entries as the step's kv write puts them; one pad block (slot -1). The
    reference is DraftAttention's key assembly over a ring read of the context alone."""
    block, window = 5, 16
    config, attn, *_ = setup(device, 1, seed=400 + requests, sliding_window=window)
    g = torch.Generator().manual_seed(requests)
    D, n_heads = config.head_dim, config.num_attention_heads
    ring = PositionRing(NUM_SLOTS, window + block, {"kv": D}, device, torch.bfloat16)
    ring.data["kv"].copy_(torch.randn(ring.data["kv"].shape, generator=g).to(torch.bfloat16))  # foreign rows
    rows = (requests + 1) * block
    positions, slots = torch.zeros(rows, dtype=torch.long), torch.full((rows,), -1, dtype=torch.long)
    q_raw = (3 * torch.randn(rows, n_heads, D, generator=g)).to(torch.bfloat16).to(device)
    kv = torch.randn(rows, D, generator=g).to(torch.bfloat16).to(device)  # the blocks' own keys
    ref = torch.zeros_like(q_raw)
    for i, slot in enumerate(torch.randperm(NUM_SLOTS, generator=g)[:requests].tolist()):
        index = torch.arange(i * block, (i + 1) * block)
        anchor = [2, window - 3, 1000][i % 3]  # a context shorter than the window, and full ones
        history = torch.arange(max(0, anchor - window - 3), anchor, device=device)
        ring.write(slot, history, {"kv": torch.randn(len(history), D, generator=g).to(torch.bfloat16).to(device)})
        if anchor > 4:  # a hole in the context
            ring.pos[slot, (anchor - 3) % ring.size] = -1
        context, valid = ring.read(slot, torch.arange(anchor - window, anchor, device=device))
        keys = torch.cat([context["kv"], kv[index]])
        mask = torch.cat([valid, torch.ones(block, dtype=torch.bool, device=device)])
        positions[index], slots[index] = torch.arange(anchor, anchor + block), slot
        ref[index] = attn.attend(heads(attn, q_raw[index], positions[index].to(device)), keys, mask.expand(block, -1))
        ring.write(slot, positions[index].to(device), {"kv": kv[index]})  # the step's kv write
    positions, slots = positions.to(device), slots.to(device)
    ref = apply_rope(ref, positions, attn.freqs.to(device), inverse=True)
    o = A.attend(q_raw, ring, positions, slots, attn.w["attn_sink"], attn.freqs.to(device), window + block,
                 config.rms_norm_eps, block=block, poison=True)
    assert_close(o, ref, differ=0.02, rel=5e-4)
    assert (o[slots < 0] == 0).all()
    spread = A.attend(q_raw, ring, positions, slots, attn.w["attn_sink"], attn.freqs.to(device), window + block,
                      config.rms_norm_eps, block=block, d_chunk=16, parts=4, poison=True)
    assert_close(spread, ref, differ=0.02, rel=5e-4)  # another chunking: another fp32 order


@pytest.mark.parametrize("rows,splits", [(1, 0), (5, 0), (16, 0), (1, 8), (5, 2), (16, 1)])
@pytest.mark.parametrize("ratio,entry_block", [(128, 16), (1024, 64)])
def test_attend_over_compressed_entries(device, rows, splits, ratio, entry_block):
    """A compressed layer's attend (HCA's: every visible entry): the window's keys and the slot's
    compressed entries w < (p + 1) // ratio, one softmax over both and the sink, against
    Attention.attend over [window keys; entries] with the reference's masks. Requests far on see
    hundreds to thousands of entries (blocks of `entry_block`, the last partial); the entries past the
    visible ones hold random data, which must not leak in. With `splits`, the entries' blocks are
    spread over that many tasks a pair (some with none) and the window's task combines them."""
    config, attn, positions, slots, groups, cache, _ = setup(device, rows, seed=500 + rows + ratio)
    g = torch.Generator().manual_seed(rows + ratio)
    D, n_heads = config.head_dim, config.num_attention_heads
    far = int(positions.max()) + 1
    entries = torch.randn(NUM_SLOTS, far // ratio + 3, D, generator=g).to(torch.bfloat16).to(device)
    q_raw = (3 * torch.randn(rows, n_heads, D, generator=g)).to(torch.bfloat16).to(device)
    kv = torch.randn(rows, D, generator=g).to(torch.bfloat16).to(device)
    ref = torch.zeros_like(q_raw)
    for grp in groups:
        keys, mask = attn._window_keys(grp, kv[grp.index], cache)
        cache.window.write(grp.slot, grp.positions, {"kv": kv[grp.index]})
        count = (int(grp.positions[-1]) + 1) // ratio
        visible = torch.arange(count, device=device)[None] < ((grp.positions + 1) // ratio)[:, None]
        keys, mask = torch.cat([keys, entries[grp.slot, :count]]), torch.cat([mask, visible], dim=1)
        ref[grp.index] = attn.attend(heads(attn, q_raw[grp.index], grp.positions), keys, mask)
    ref = apply_rope(ref, positions, attn.freqs.to(device), inverse=True)
    o = A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device),
                 config.sliding_window, config.rms_norm_eps, entries=entries, ratio=ratio, entry_block=entry_block,
                 splits=splits, poison=True)
    assert_close(o, ref, differ=0.02, rel=5e-4)
    assert (o[slots < 0] == 0).all()


@pytest.mark.parametrize("rows,splits", [(5, 0), (16, 0), (5, 4)])
def test_attend_over_selected_entries(device, rows, splits):
    """CSA's attend: the window's keys and the entries the row's indexer selected (a list of
    `topk` entry ids, -1 where fewer are visible), one softmax over both and the sink, against
    Attention.attend over [window keys; the visible entries] masked to the selected ones."""
    ratio, topk = 4, 24
    config, attn, positions, slots, groups, cache, _ = setup(device, rows, seed=600 + rows)
    g = torch.Generator().manual_seed(rows)
    D, n_heads = config.head_dim, config.num_attention_heads
    entries = torch.randn(NUM_SLOTS, (int(positions.max()) + 1) // ratio + 3, D, generator=g).to(torch.bfloat16)
    entries = entries.to(device)
    q_raw = (3 * torch.randn(rows, n_heads, D, generator=g)).to(torch.bfloat16).to(device)
    kv = torch.randn(rows, D, generator=g).to(torch.bfloat16).to(device)
    selected = torch.full((rows, topk), -1, dtype=torch.long)
    ref = torch.zeros_like(q_raw)
    for grp in groups:
        keys, mask = attn._window_keys(grp, kv[grp.index], cache)
        cache.window.write(grp.slot, grp.positions, {"kv": kv[grp.index]})
        count = (int(grp.positions[-1]) + 1) // ratio
        chosen = torch.zeros(len(grp.index), count, dtype=torch.bool)
        for j, (row, p) in enumerate(zip(grp.index.tolist(), grp.positions.tolist())):
            visible = (p + 1) // ratio
            ids = torch.randperm(visible, generator=g)[:min(topk, visible)]
            selected[row, :len(ids)] = ids
            chosen[j, ids] = True
        keys = torch.cat([keys, entries[grp.slot, :count]])
        mask = torch.cat([mask, chosen.to(device)], dim=1)
        ref[grp.index] = attn.attend(heads(attn, q_raw[grp.index], grp.positions), keys, mask)
    ref = apply_rope(ref, positions, attn.freqs.to(device), inverse=True)
    o = A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device),
                 config.sliding_window, config.rms_norm_eps, entries=entries, ratio=ratio, entry_block=16,
                 selected=selected.to(device), splits=splits, poison=True)
    assert_close(o, ref, differ=0.02, rel=5e-4)
    assert (o[slots < 0] == 0).all()


@pytest.mark.parametrize("parts", [1, 2])
def test_expired_split_wait_raises_and_keeps_tickets(device, parts):
    """Window tasks whose entry splits never reach their ticket (tickets far below zero) give up
    after their polls: the launch ends, MonoSyncError names attend, and every ticket ends where
    it began (the splits' signals and the last window task's take-back cancel), the arrivals of
    `parts` window tasks a pair back at 0."""
    from monodecode.mono.sync import MonoSyncError
    config, attn, positions, slots, groups, cache, _ = setup(device, 5, seed=700)
    g = torch.Generator().manual_seed(700)
    D, n_heads = config.head_dim, config.num_attention_heads
    entries = torch.randn(NUM_SLOTS, (int(positions.max()) + 1) // 128 + 3, D, generator=g).to(torch.bfloat16)
    q_raw = (3 * torch.randn(5, n_heads, D, generator=g)).to(torch.bfloat16).to(device)
    pairs = A.attend_tasks(5, n_heads)
    tickets = torch.zeros(2 * pairs, dtype=torch.int32, device=device)
    tickets[:pairs] = -1000
    with pytest.raises(MonoSyncError, match="'attend'"):
        A.attend(q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device),
                 config.sliding_window, config.rms_norm_eps, entries=entries.to(device), ratio=128, entry_block=16,
                 splits=2, parts=parts, d_chunk=16, tickets=tickets, max_polls=64)
    assert (tickets[:pairs] == -1000).all() and (tickets[pairs:] == 0).all()


@pytest.mark.parametrize("rows,splits,parts,split_parts", [(1, 2, 4, 2), (2, 0, 4, 1), (2, 4, 4, 4),
                                                           pytest.param(5, 0, 2, 1, marks=pytest.mark.slow),
                                                           pytest.param(5, 4, 2, 4, marks=pytest.mark.slow)])
def test_compressed_output_parts_equal_one_task(device, rows, splits, parts, split_parts):
    """A compressed layer's pair spread over `parts` window tasks (each waiting for the entry
    splits, or with splits 0 parking every entry's logits itself) and each split's channels over
    `split_parts` tasks gives bit for bit what one task a split and one window task give, and the
    last window task takes the tickets back to 0: a second launch on the same tickets gives the
    same again. The rows' visible entries (their seeds' steps): none at 1 row, 367 a row at 2 (the
    cheaper twins of the `slow` 5 rows' 1033: without splits, and with 4)."""
    config, attn, positions, slots, groups, cache, _ = setup(device, rows, seed=800 + rows + parts)
    g = torch.Generator().manual_seed(800 + rows)
    D, n_heads = config.head_dim, config.num_attention_heads
    entries = torch.randn(NUM_SLOTS, (int(positions.max()) + 1) // 128 + 3, D, generator=g).to(torch.bfloat16)
    q_raw = (3 * torch.randn(rows, n_heads, D, generator=g)).to(torch.bfloat16).to(device)
    for grp in groups:  # the step's rows in the ring, as stage 1 writes them
        cache.window.write(grp.slot, grp.positions,
                           {"kv": torch.randn(len(grp.index), D, generator=g).to(torch.bfloat16).to(device)})
    args = (q_raw, cache.window, positions, slots, attn.w["attn_sink"], attn.freqs.to(device),
            config.sliding_window, config.rms_norm_eps)
    options = dict(entries=entries.to(device), ratio=128, entry_block=16, splits=splits, d_chunk=16, poison=True)
    one = A.attend(*args, **options)
    tickets = torch.zeros(2 * A.attend_tasks(rows, n_heads), dtype=torch.int32, device=device)
    for _ in range(2):
        spread = A.attend(*args, parts=parts, split_parts=split_parts, tickets=tickets, **options)
        assert torch.equal(spread, one)
        assert (tickets == 0).all()


def test_compressed_layout_fills_one_round():
    """A compressed layer's (splits, parts, split parts): parts as `output_parts` gives for half
    the programs, splits filling what they leave, each split's channels over as many tasks as
    still fit: (splits x split parts + parts) tasks a pair within the programs."""
    for rows in range(1, 49):
        for entries in (4, 512, 1024):
            splits, parts, split_parts = A.compressed_layout(rows, 64, 512, entries, 132)
            assert parts == A.output_parts(rows, 64, 512, 66)
            assert splits == AE.entry_splits(rows, 64, entries, 132, parts)
            assert split_parts & (split_parts - 1) == 0 and 1 <= split_parts <= 512 // A.BD
            assert rows * 4 * (splits * split_parts + parts) <= 132 or (splits, parts) == (0, 1)
            assert split_parts == 512 // A.BD or splits == 0 or rows * 4 * (2 * splits * split_parts + parts) > 132
    assert A.compressed_layout(1, 64, 512, 512, 132) == (8, 8, 2)
    assert A.compressed_layout(6, 64, 512, 512, 132) == (2, 2, 1)
    assert A.compressed_layout(1, 64, 512, 512, 132, parts=2) == (8, 2, 2)


def test_entry_splits_fill_one_round():
    """Splits a pair: a power of two, at most MAX_SPLITS and the entries' blocks, and (splits + 1)
    tasks a pair fitting the programs; none once the pairs alone fill them."""
    for rows in range(1, 49):
        for entries in (4, 64, 128, 512, 1024):
            s = AE.entry_splits(rows, 64, entries, 132)
            blocks = -(-entries // AE.KE)
            assert s & (s - 1) == 0 and s <= min(AE.MAX_SPLITS, blocks)
            if s:
                assert rows * 4 * (s + 1) <= 132
                assert 2 * s > min(AE.MAX_SPLITS, blocks) or rows * 4 * (2 * s + 1) > 132
            else:
                assert rows * 4 * 2 > 132
