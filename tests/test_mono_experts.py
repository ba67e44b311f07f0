"""The routed-expert stage against a float64 reference of the same MXFP4 weights.

On the CPU the kernels run under Triton's interpreter (the portable decode); with
MONODECODE_TEST_DEVICE=cuda they run compiled, with the fast decode.
"""

import os

if os.environ.get("MONODECODE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

from dataclasses import replace

import pytest
import torch

from monodecode import formats
from monodecode.mono import experts as X

LIMIT = 10.0


def assert_close(y, ref):
    """Rows agree at fp32-accumulation level. The kernel rounds h to bf16 from fp32, the
    reference from float64: an h value within fp32 error of a bf16 rounding boundary can round
    the other way (one bf16 ulp of one element, seen in 1 row of 80), so a few rows may differ
    by up to ~2^-8 of that element's share; a wrong expert, row or scale is off by far more."""
    row_err = (y.cpu().double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
    live = ref.norm(dim=-1) > 0
    assert torch.isfinite(y).all()
    assert row_err[live].median() < 1e-6
    assert row_err[live].max() < 5e-3
    assert (row_err[live] > 1e-6).float().mean() <= 0.1


def random_bank(g, num_experts, hidden, inter, device):
    def matrix(n, k):
        return formats.quantize_mxfp4(torch.randn(n, k, generator=g) / k**0.5)

    return on_device(X.prepare([(matrix(inter, hidden), matrix(hidden, inter), matrix(inter, hidden))
                                for _ in range(num_experts)]), device)


def on_device(weights, device):
    """The same experts (codes, scales, code order) on `device`."""
    return X.ExpertWeights(*((c.to(device), s.to(device)) for c, s in (weights.w1, weights.w2, weights.w3)),
                           fragments=weights.fragments)


@pytest.fixture(scope="module")
def bank(device):
    return random_bank(torch.Generator().manual_seed(0), num_experts=8, hidden=64, inter=32, device=device)


@pytest.fixture(scope="module")
def fragment_bank(device):
    """Experts in the fragment order (`ExpertWeights.fragments`: K a multiple of 128), on `device`,
    and the same experts in the checkpoint's order on the CPU for the reference."""
    checkpoint = random_bank(torch.Generator().manual_seed(1), num_experts=8, hidden=256, inter=128, device="cpu")
    return on_device(X.in_fragment_order(checkpoint), device), checkpoint


def picks(g, rows, topk, num_experts, routing):
    if routing == "hash":  # a fixed table per token id: tokens repeat, so do whole pick sets
        table = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(5)])
        return table[torch.randint(0, 5, (rows,), generator=g)]
    scores = torch.rand(rows, num_experts, generator=g)
    return scores.topk(topk, dim=-1).indices


@pytest.mark.parametrize("rows", [1, 2, 6, 16, 48])
@pytest.mark.parametrize("routing", ["hash", "bias"])
@pytest.mark.parametrize("order", ["checkpoint", "fragments"])
def test_matches_float64_reference(bank, fragment_bank, device, rows, routing, order):
    """Hash routing repeats whole pick sets across rows (rows share experts), bias routing draws
    them; a pad row from 6 rows on; the checkpoint's code order and the fragment order (whose
    launch takes K steps of 128)."""
    g = torch.Generator().manual_seed(rows * 7 + len(routing))
    ids = picks(g, rows, 2, 8, routing)
    if rows > 2:
        ids[rows // 2] = -1  # a pad row
    if order == "fragments":
        experts, checkpoint = fragment_bank
        config = X.LaunchConfig(fast=device == "cuda" and experts.supports_fast_decode(), block_n=32, block_k=128)
    else:
        experts, config = bank, None
        checkpoint = on_device(bank, "cpu")
    x = torch.randn(rows, experts.hidden, generator=g).to(torch.bfloat16)
    weights = torch.rand(rows, 2, generator=g) + 0.1
    y = X.routed_experts(x.to(device), ids.to(device), weights.to(device), experts, LIMIT, config, poison=True)
    assert_close(y, X.reference(x, ids, weights, checkpoint, LIMIT))
    if rows > 2:
        assert (y[rows // 2] == 0).all()


def test_many_rows_on_one_expert_are_split_into_tasks(device):
    """40 rows all picking expert 3 (three tasks of up to 16 rows) and expert 0."""
    g = torch.Generator().manual_seed(5)
    bank = random_bank(g, num_experts=4, hidden=64, inter=32, device=device)
    ids = torch.tensor([[3, 0]] * 40)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    weights = torch.rand(40, 2, generator=g)
    y = X.routed_experts(x.to(device), ids.to(device), weights.to(device), bank, LIMIT, poison=True)
    assert_close(y, X.reference(x, ids, weights, on_device(bank, "cpu"), LIMIT))


def assert_rows_and_a_pad_match(g, experts, checkpoint, config, device):
    """6 bias-routed rows of 2 picks of 8 experts, row 2 a pad: the reference's result (from
    `checkpoint`, the same experts on the CPU in the checkpoint's order), zeros for the pad."""
    ids = picks(g, 6, 2, 8, "bias")
    ids[2] = -1
    x = torch.randn(6, experts.hidden, generator=g).to(torch.bfloat16)
    weights = torch.rand(6, 2, generator=g) + 0.1
    y = X.routed_experts(x.to(device), ids.to(device), weights.to(device), experts, LIMIT, config, poison=True)
    assert_close(y, X.reference(x, ids, weights, checkpoint, LIMIT))
    assert (y[2] == 0).all()


@pytest.mark.parametrize("programs,block_k,tma", [(1, 64, False), (3, 64, False), (3, 32, False), (0, 64, True),
                                               (3, 32, True)])
def test_persistent_programs_run_the_tasks_of_k2(bank, device, programs, block_k, tma):
    """`LaunchConfig.programs`: a few programs looping over every task (K2's loops) give the
    reference's result too; under the interpreter the programs run one after another. K steps
    of 32: two of w1 / w3 and one of w2; with `tma`, the codes through tensor descriptors."""
    fast = device == "cuda" and bank.supports_fast_decode()
    config = X.LaunchConfig(fast=fast, block_n=32, block_k=block_k, programs=programs, tma=tma)
    assert_rows_and_a_pad_match(torch.Generator().manual_seed(40 + programs), bank, on_device(bank, "cpu"), config,
                                device)


def test_group_picks():
    ids = torch.tensor([[2, 0], [-1, -1], [2, 1], [0, 2]])
    order, experts, counts = X.group_picks(ids, rows=2)
    # sorted picks: expert 0 (picks 1, 6), 1 (pick 5), 2 (picks 0, 4, 7), pads last
    assert order.tolist()[:6] == [1, 6, 5, 0, 4, 7]
    assert counts.tolist() == [2, 0, 1, 2, 0, 1, 0, 0]  # expert 2's third pick starts a new task
    assert experts.tolist()[:6] == [0, 0, 1, 2, 0, 2]


@pytest.mark.parametrize("fragments", [False, True])
def test_prepare_round_trips(fragments):
    g = torch.Generator().manual_seed(3)
    experts = [tuple(formats.quantize_mxfp4(torch.randn(32, 256, generator=g)) for _ in range(3)) for _ in range(4)]
    prepared = X.prepare(experts, fragments=fragments)
    assert torch.equal(prepared.w1[0][2], X.to_fragment_order(experts[2][0][0]) if fragments else experts[2][0][0])
    back = X.unprepare(prepared)
    for original, restored in zip(experts, back):
        for (codes, scale), (codes2, scale2) in zip(original, restored):
            assert torch.equal(codes, codes2)
            assert torch.equal(scale.view(torch.uint8), scale2.view(torch.uint8))
    assert X.prepare(experts).supports_fast_decode()
    bank = X.prepare(experts)
    bank.w2[1][0, 0, 0] = 200
    assert not bank.supports_fast_decode()
    with pytest.raises(ValueError, match="scale codes outside"):
        X.launch_stages(None, None, None, bank, LIMIT, X.LaunchConfig(fast=True), None)


def permute_bytes(a, b, selector: int):
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector >> 4i) & 7 of b:a."""
    pool = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    assert all(selector >> 4 * i & 8 == 0 for i in range(4)), "sign-replicating selectors not emulated"
    return sum(pool[selector >> 4 * i & 7] << 8 * i for i in range(4))


def run_ptx(asm: str, registers: dict) -> dict:
    """The fast decode's PTX (mov, prmt, shl, shr, and, or on .b32) executed here, on int64 tensors."""
    regs = dict(registers)
    for line in asm.strip("{}\n").splitlines():
        op, *args = line.rstrip(";").replace(",", " ").split()
        value = [regs[a] if a in regs else int(a, 0) for a in args[1:]] if op != ".reg" else []
        if op == ".reg":
            continue
        regs[args[0]] = {"mov.b32": lambda a: a, "prmt.b32": permute_bytes,
                         "shl.b32": lambda a, n: (a << n) & 0xFFFFFFFF, "shr.b32": lambda a, n: a >> n,
                         "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b}[op](*value)
    return regs


def test_the_fast_fragment_decode_places_each_code():
    """The PTX of the fast decode of the fragment order, run op by op, turns a register of two
    16-bit halves into code c of each as the bf16 bits of its value times 2^-126 (sign at 15,
    exponent and mantissa at 8..6; +16 for the register's high half), each half on its own: any two
    halves may share a register."""
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=g)  # one block: 16 rows, 128 columns
    nibbles = torch.stack((codes[0] & 15, codes[0] >> 4), dim=-1).reshape(128).long()
    b = X.to_fragment_order(codes).long().reshape(-1, 2)[:32]  # row 0: the block's first 64 bytes
    halves = b[:, 0] | b[:, 1] << 8  # half (t, m, r)
    low, high = torch.arange(32), torch.randperm(32, generator=g)
    out = run_ptx(X.HALVES_DECODE_ASM.value, {"$4": halves[low] | halves[high] << 16})
    for code in range(4):
        s, q = code // 2, code % 2
        for part, index in ((0, low), (1, high)):
            t, m, r = index // 8, index // 2 % 4, index % 2
            n = nibbles[m * 32 + s * 16 + q * 8 + 2 * t + r]
            assert torch.equal(out[f"${code}"] >> 16 * part & 0xFFFF, ((n & 7) << 6) | ((n & 8) << 12))


@pytest.mark.parametrize("programs,block_k,block_n,tma", [(0, 128, 32, False), (3, 128, 32, False),
                                                       (0, 256, 16, False), (3, 128, 64, False),
                                                       (0, 256, 32, True), (3, 128, 32, True)])
def test_experts_in_the_fragment_order_match_the_reference(fragment_bank, device, programs, block_k, block_n, tma):
    """The same experts in the fragment order give the reference's result: a program a task and
    persistent programs, the codes loaded as pointers one K step ahead (over tiles of 16, 32 and
    64 rows: one to four 16-row blocks of the dot's operand) or through tensor descriptors, over
    two K steps of 128 or one of 256 (w1 / w3: hidden 256; w2: intermediate 128, one step). K
    steps that split a fragment group, and tiles that split a 16-row block, are refused."""
    bank, checkpoint = fragment_bank
    fast = device == "cuda" and bank.supports_fast_decode()
    config = X.LaunchConfig(fast=fast, block_n=block_n, block_k=block_k, programs=programs, tma=tma)
    assert_rows_and_a_pad_match(torch.Generator().manual_seed(50 + programs + block_k + block_n), bank, checkpoint,
                                config, device)
    with pytest.raises(ValueError, match=r"fragment order need expert K steps of a multiple of 128 \(here \[64\]\)"):
        assert_rows_and_a_pad_match(torch.Generator(), bank, checkpoint, X.LaunchConfig(fast, 32, 64), device)
    with pytest.raises(ValueError, match=r"fragment order need expert tiles of a multiple of 16 rows \(here \[8\]\)"):
        assert_rows_and_a_pad_match(torch.Generator(), bank, checkpoint, X.LaunchConfig(fast, 8, 128), device)


@pytest.mark.parametrize("block_n,block_k", [(32, 128), (64, 256), (256, 128)])
def test_paired_gate_up_tiles_match_the_reference(fragment_bank, device, block_n, block_k):
    """`LaunchConfig.paired`: gate and up of a block in one tile (half its rows from w1, half from
    w3) and the SwiGLU in its epilogue give the reference's result: tiles of 16 + 16, 32 + 32 and
    128 + 128 rows (all of the intermediate 128), 6 rows with a pad, and 20 rows on one expert (two
    tasks of it); on the GPU with down a programmatic dependent of the paired kernel. Nothing goes
    through the gate/up buffer: it stays poisoned."""
    bank, checkpoint = fragment_bank
    cuda = device == "cuda"
    config = X.LaunchConfig(cuda and bank.supports_fast_decode(), block_n, block_k, paired=True, pdl=cuda)
    g = torch.Generator().manual_seed(80 + block_n + block_k)
    assert_rows_and_a_pad_match(g, bank, checkpoint, config, device)
    ids = torch.full((20, 1), 5)
    x = torch.randn(20, bank.hidden, generator=g).to(torch.bfloat16)
    weights = torch.rand(20, 1, generator=g) + 0.1
    buffers = X.StageBuffers(20, bank, device, poison=True)
    X.launch_stages(x.to(device), X.group_picks(ids.to(device)), weights.flatten().to(device), bank, LIMIT, config,
                    buffers)
    assert buffers.gate_up.isnan().all()
    assert_close(buffers.per_pick[0], X.reference(x, ids, weights, checkpoint, LIMIT))


def test_paired_tiles_are_refused_where_they_cannot_run(fragment_bank, bank):
    """A paired tile reads fragment-order codes through pointers, a program a task, in halves of
    whole 16-row blocks: anything else is refused before a launch, naming what it needs."""
    fragments, _ = fragment_bank
    for experts, config in ((fragments, X.LaunchConfig(False, 32, 128, programs=4, paired=True)),
                            (fragments, X.LaunchConfig(False, 32, 128, tma=True, paired=True)),
                            (bank, X.LaunchConfig(False, 32, 32, paired=True))):
        with pytest.raises(ValueError, match="needs the fragment order, no tma and programs = 0"):
            X.launch_stages(None, (None, None, None), None, experts, LIMIT, config, None)
    with pytest.raises(ValueError, match=r"order need paired tiles of a multiple of 32 rows \(here 16\)"):
        X.launch_stages(None, (None, None, None), None, fragments, LIMIT, X.LaunchConfig(False, 16, 128, paired=True),
                        None)


@pytest.mark.parametrize("paired", [False, True])
def test_down_in_slices_matches_the_reference(device, paired):
    """`LaunchConfig.down_split`: down in two slices of the intermediate (256: two K steps of 128),
    each writing its partial per-pick outputs, summed in slice order, gives the reference's result
    (with paired gate/up tiles too, the 1-row default); a split into slices of part of a K step is
    refused, naming the sizes."""
    checkpoint = random_bank(torch.Generator().manual_seed(2), num_experts=8, hidden=256, inter=256, device="cpu")
    bank = on_device(X.in_fragment_order(checkpoint), device)
    cuda = device == "cuda"
    config = X.LaunchConfig(cuda and bank.supports_fast_decode(), 32, 128, paired=paired, down_split=2, pdl=cuda)
    assert_rows_and_a_pad_match(torch.Generator().manual_seed(85 + paired), bank, checkpoint, config, device)
    with pytest.raises(ValueError, match=r"slices of whole K steps \(here 256 / 2 in steps of 256\)"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT, replace(config, block_k=256), None)
    with pytest.raises(ValueError, match=r"down_split is a number of slices, at least 1 \(here 0\)"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT, replace(config, down_split=0), None)


@pytest.mark.parametrize("split", [1, 2])
def test_down_waiting_for_its_group_matches_the_reference(device, split):
    """`LaunchConfig.overlap`: both grids in group order, each gate/up task publishing its block to
    its group's counter, each down task waiting for its own group's (on the GPU as a dependent
    launch that starts during gate/up): the reference's result, with a pad row and poisoned
    intermediates; afterwards each group's counter holds its number of gate/up tasks (the
    intermediate 256 in paired tiles of 32 + 32 rows: 8), the other words and the error word 0.
    Down alone (the benchmark's) runs the same grid without waiting: the same outputs. Without
    paired tiles it is refused."""
    checkpoint = random_bank(torch.Generator().manual_seed(3), num_experts=8, hidden=256, inter=256, device="cpu")
    bank = on_device(X.in_fragment_order(checkpoint), device)
    cuda = device == "cuda"
    config = X.LaunchConfig(cuda and bank.supports_fast_decode(), 64, 128, paired=True, pdl=cuda, overlap=True,
                            down_split=split)
    g = torch.Generator().manual_seed(95 + split)
    assert_rows_and_a_pad_match(g, bank, checkpoint, config, device)
    ids = picks(g, 6, 2, 8, "bias")
    groups = X.group_picks(ids.to(device))
    buffers = X.StageBuffers(ids.numel(), bank, device, poison=True, splits=split)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16).to(device)
    route_weights = torch.rand(12, generator=g).to(device)
    X.launch_stages(x, groups, route_weights, bank, LIMIT, config, buffers)
    starts = groups[2] > 0
    assert (buffers.ready[:-1][starts] == 8).all() and (buffers.ready[:-1][~starts] == 0).all()
    assert buffers.ready[-1] == 0 and torch.isfinite(buffers.per_pick).all()
    full = buffers.per_pick.clone()  # down alone (the benchmark's): the same grid, no wait
    buffers.per_pick.fill_(float("nan"))
    buffers.ready.zero_()  # a down alone that waited would give up here and leave NaN
    X.launch_stages(x, groups, route_weights, bank, LIMIT, config, buffers, ("down",))
    assert torch.equal(buffers.per_pick, full)
    with pytest.raises(ValueError, match="overlap .* needs paired tiles"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT, replace(config, paired=False), None)


@pytest.mark.parametrize("launch", ["paired", "paired, down in slices", "a program a task", "K2's loops"])
def test_block_scales_on_the_partial_sums_match_the_reference(device, launch):
    """`LaunchConfig.diagonal`: a task of one or two rows multiplies x laid out block-diagonally (a
    column of the dot a 32-column block) and scales the fp32 partial sums; bigger groups take the
    ordinary loop in the same kernels. The reference's result with a pad row (groups of one and two
    rows), and with 20 rows on one expert, 3 on another and 2 on a third (tasks of 16, 4 and 3
    rows: the ordinary loop; 2: the diagonal one): with paired tiles (down in one and in two
    slices), with gate and up apart (a program a task) and in K2's persistent loops (3 programs).
    Refused with tma or with K steps other than 256, naming them."""
    checkpoint = random_bank(torch.Generator().manual_seed(4), num_experts=8, hidden=512, inter=512, device="cpu")
    bank = on_device(X.in_fragment_order(checkpoint), device)
    cuda = device == "cuda"
    config = X.LaunchConfig(cuda and bank.supports_fast_decode(), 64, 256, diagonal=True, **{
        "paired": dict(paired=True, pdl=cuda, overlap=True),
        "paired, down in slices": dict(paired=True, pdl=cuda, overlap=True, down_split=2),
        "a program a task": dict(pdl=cuda),
        "K2's loops": dict(programs=3)}[launch])
    g = torch.Generator().manual_seed(120)
    assert_rows_and_a_pad_match(g, bank, checkpoint, config, device)
    ids = torch.tensor([5] * 20 + [1] * 3 + [3] * 2)[torch.randperm(25, generator=g)].unsqueeze(1)
    x = torch.randn(25, 512, generator=g).to(torch.bfloat16)
    weights = torch.rand(25, 1, generator=g) + 0.1
    y = X.routed_experts(x.to(device), ids.to(device), weights.to(device), bank, LIMIT, config, poison=True)
    assert_close(y, X.reference(x, ids, weights, checkpoint, LIMIT))
    with pytest.raises(ValueError, match=r"diagonal .* needs .* K steps of 256 \(here 128 and 128\)"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT, replace(config, block_k=128), None)
    with pytest.raises(ValueError, match=r"diagonal .* needs the fragment order read through pointers \(no tma\)"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT,
                        X.LaunchConfig(config.fast, 64, 256, tma=True, diagonal=True), None)


@pytest.mark.parametrize("diagonal", [False, True])
def test_gate_up_in_slices_matches_the_reference(device, diagonal):
    """`LaunchConfig.up_split`: the paired gate/up tiles in two slices of the hidden, each storing
    its partial sums and arriving at its block's counter, the last summing them in slice order
    for the SwiGLU: the reference's result with a pad row, with and without block scales on the
    partial sums; a second launch on the same buffers gives the same bits (the counters went back
    to 0). Slices of part of a K step, and slices without paired tiles, are refused."""
    checkpoint = random_bank(torch.Generator().manual_seed(5), num_experts=8, hidden=512, inter=256, device="cpu")
    bank = on_device(X.in_fragment_order(checkpoint), device)
    cuda = device == "cuda"
    config = X.LaunchConfig(cuda and bank.supports_fast_decode(), 64, 256, paired=True, pdl=cuda, overlap=True,
                            diagonal=diagonal, up_split=2)
    g = torch.Generator().manual_seed(130 + diagonal)
    assert_rows_and_a_pad_match(g, bank, checkpoint, config, device)
    ids = picks(g, 3, 2, 8, "bias").to(device)
    groups = X.group_picks(ids)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16).to(device)
    route_weights = torch.rand(6, generator=g).to(device)
    buffers = X.StageBuffers(6, bank, device, poison=True, up_splits=2)
    outputs = []
    for _ in range(2):
        X.launch_stages(x, groups, route_weights, bank, LIMIT, config, buffers)
        outputs.append(buffers.per_pick.clone())
        assert (buffers.arrivals == 0).all()
    assert torch.isfinite(outputs[0]).all() and torch.equal(outputs[0], outputs[1])
    with pytest.raises(ValueError, match=r"up_split .* slices of whole K steps \(here 512 / 4 in steps of 256\)"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT, replace(config, up_split=4), None)
    with pytest.raises(ValueError, match=r"up_split .* needs paired tiles"):
        X.launch_stages(None, (None, None, None), None, bank, LIMIT,
                        replace(config, paired=False, overlap=False, diagonal=False), None)


@pytest.mark.skipif(os.environ.get("MONODECODE_TEST_DEVICE", "cpu") != "cuda",
                    reason="programmatic dependent launches need an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 6, 48])
def test_down_waiting_for_its_group_gives_the_same_result(device, rows):
    """`LaunchConfig.overlap` at v4-flash's hidden size: bit for bit the result of down waiting for
    the whole gate/up kernel (the same arithmetic), in one and in two slices, with and without
    block scales on the partial sums (`diagonal`), poisoned intermediates. (Not a race detector.)"""
    g = torch.Generator().manual_seed(110 + rows)
    experts = on_device(X.in_fragment_order(random_bank(g, num_experts=8, hidden=4096, inter=512, device="cpu")),
                        device)
    ids = picks(g, rows, 4, 8, "bias")
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16).to(device)
    weights = (torch.rand(rows, 4, generator=g) + 0.1).to(device)
    for split, diagonal in ((1, False), (2, False), (1, True), (2, True)):
        config = X.LaunchConfig(True, 128, 256, 8, max_registers=128, pdl=True, paired=True, down_split=split,
                                diagonal=diagonal)
        grid_wait, group_wait = (X.routed_experts(x, ids.to(device), weights, experts, LIMIT,
                                                  replace(config, overlap=overlap), poison=True)
                                 for overlap in (False, True))
        assert torch.isfinite(group_wait).all()
        assert torch.equal(grid_wait, group_wait)


@pytest.mark.skipif(os.environ.get("MONODECODE_TEST_DEVICE", "cpu") != "cuda",
                    reason="programmatic dependent launches need an NVIDIA GPU")
@pytest.mark.parametrize("rows,block_n,warps,paired", [(1, 32, 4, False), (48, 128, 8, False), (1, 128, 8, True)])
def test_dependent_launches_give_the_same_result(device, rows, block_n, warps, paired):
    """`LaunchConfig.pdl`: SwiGLU launched while gate/up still runs and down while SwiGLU does, down
    loading its first weights before it waits for h, give bit for bit the result of ordinary
    launches (the same arithmetic), with poisoned intermediates (an element read before it was
    written would be NaN); also the 1-row default's paired gate/up and down in two slices, down a
    direct dependent of the paired kernel. At 1 row also against the float64 reference. (Not a
    race detector: with down's wait taken out this test still passed on the H200.)"""
    g = torch.Generator().manual_seed(90 + rows)
    checkpoint = random_bank(g, num_experts=8, hidden=4096, inter=512, device="cpu")
    experts = on_device(X.in_fragment_order(checkpoint), device)
    ids = picks(g, rows, 4, 8, "bias")
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
    weights = torch.rand(rows, 4, generator=g) + 0.1
    results = [X.routed_experts(x.to(device), ids.to(device), weights.to(device), experts, LIMIT,
                                X.LaunchConfig(True, block_n, 256, warps, max_registers=128, pdl=pdl, paired=paired,
                                               down_split=1 + paired), poison=True)
               for pdl in (False, True)]
    assert torch.isfinite(results[1]).all()
    assert torch.equal(results[0], results[1])
    if rows == 1:
        assert_close(results[1], X.reference(x, ids, weights, checkpoint, LIMIT))


def test_dependent_launches_are_refused_where_they_cannot_run(fragment_bank, bank):
    """`LaunchConfig.pdl` waits inside the fragment order's own K loop, a program a task, with the
    fast decode: anything else is refused before a launch."""
    fragments, _ = fragment_bank
    for experts, config in ((fragments, X.LaunchConfig(True, 32, 128, programs=4, pdl=True)),
                            (fragments, X.LaunchConfig(True, 32, 128, tma=True, pdl=True)),
                            (fragments, X.LaunchConfig(False, 32, 128, pdl=True)),
                            (bank, X.LaunchConfig(True, 32, 32, pdl=True))):
        with pytest.raises(ValueError, match="it needs the fast decode, the fragment order, no tma and programs = 0"):
            X.launch_stages(None, (None, None, None), None, experts, LIMIT, config, None)


def test_the_default_launch_follows_the_layout_and_the_rows(fragment_bank, device):
    """`default_config`: the H200's fastest measured launch in the fragment order, 128 x 256 tiles
    with 8 warps, registers capped at 128, paired gate/up tiles, down a dependent launch waiting
    for its own group (`overlap`), block scales on the partial sums where the K steps are 256
    (v4-flash; not the test bank's intermediate of 128), and at 1 row gate/up and down in two
    slices where each slice has whole K steps; with it (None) the launcher still gives the
    reference's result."""
    bank, checkpoint = fragment_bank
    wide = X.default_config(bank, 6, True)
    assert wide == X.LaunchConfig(True, 128, 256, 8, max_registers=128, pdl=True, paired=True, overlap=True)
    assert X.default_config(bank, 1, True) == wide

    def shaped(hidden, inter):  # experts of these sizes (the launch config reads only the shapes)
        up, down = (torch.zeros(1, inter, hidden // 2), None), (torch.zeros(1, hidden, inter // 2), None)
        return X.ExpertWeights(up, down, up, fragments=True, _fast_decode=True)

    assert X.default_config(shaped(4096, 2048), 1, True) == replace(wide, diagonal=True, up_split=2, down_split=2)
    for rows in (2, 48):
        assert X.default_config(shaped(4096, 2048), rows, True) == replace(wide, diagonal=True)
    assert X.default_config(shaped(4096, 256), 1, True) == replace(wide, diagonal=True)  # down: one K step
    assert X.default_config(checkpoint, 6, True) == X.LaunchConfig(True)
    assert X.default_config(bank, 6, False) == X.LaunchConfig(False)
    assert_rows_and_a_pad_match(torch.Generator().manual_seed(61), bank, checkpoint, None, device)


def test_launch_stages_runs_the_kernels_asked_for(bank, device):
    """`launch_stages(..., kernels)`: the benchmark times the gate/up and the down kernel alone;
    what is not asked for is not written (poisoned buffers stay NaN)."""
    g = torch.Generator().manual_seed(71)
    ids = picks(g, 3, 2, 8, "bias").to(device)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(device)
    buffers = X.StageBuffers(6, bank, device, poison=True)
    config = X.LaunchConfig(fast=device == "cuda" and bank.supports_fast_decode(), block_n=32, block_k=32)
    X.launch_stages(x, X.group_picks(ids), torch.rand(6, generator=g).to(device), bank, LIMIT, config, buffers,
                    ("up",))
    assert not buffers.gate_up.isnan().any()
    assert buffers.h.isnan().all() and buffers.per_pick.isnan().all()


def test_the_benchmark_sweeps_each_layout(monkeypatch):
    """experts_bench's grid (the benchmark itself needs a GPU): each layout's launch config at
    every tile, a program a task and persistent programs a SM."""
    from types import SimpleNamespace

    from monodecode.mono import experts_bench as B

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=132))
    found = {name: (layout, config)
             for name, layout, config in B.variants(False, [0, 1], ["interleave", "fragments+tma"])}
    assert found.pop("portable")[1].fast is False
    assert all(config.tma == (layout == "fragments+tma") for layout, config in found.values())
    assert len(found) == 3 * 3 * 2 * 3 * 2 * 2  # BN, BK, warps, stages; two layouts; two launches
    assert {config.block_k for _, config in found.values()} == {128, 256, 512}
    assert {config.programs for _, config in found.values()} == {0, 132}
    chosen = {name: config for name, _, config in B.variants(True, [1], ["fragments"], [(128, 512, 8, 3)])}
    assert list(chosen) == ["portable", "fast bn128 bk512 w8 s3 fragments pps1"]
    assert chosen.popitem()[1].num_stages == 3
    capped = list(B.variants(True, [0], ["fragments"], [(128, 256, 8, 1, 128)], portable=False))
    assert [(name, config.max_registers) for name, _, config in capped] == [("fast bn128 bk256 w8 s1 fragments r128",
                                                                             128)]
    dependent = list(B.variants(True, [0], ["fragments"], [(64, 256, 4, 1, 128, 1)], portable=False))
    assert [(name, config.pdl) for name, _, config in dependent] == [("fast bn64 bk256 w4 s1 fragments r128 pdl", True)]
    paired = list(B.variants(True, [0], ["fragments"], [(128, 256, 8, 1, 128, 1, 1, 2)], portable=False))
    assert [(name, config.pdl, config.paired, config.down_split) for name, _, config in paired] == [
        ("fast bn128 bk256 w8 s1 fragments r128 pdl paired ds2", True, True, 2)]
    with pytest.raises(SystemExit):  # parse errors come before any GPU work
        B.main(["--configs", "128,512"])
