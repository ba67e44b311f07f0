"""The routed-expert tasks that K2 runs, launched alone (`mono.expert_stage`), against a float64
reference of the same MXFP4 weights.

On the CPU the kernels run under Triton's interpreter (the portable decode); with
MONODECODE_TEST_DEVICE=cuda they run compiled, with the fast decode.
"""

import pytest
import torch

from monodecode import formats
from monodecode.mono import expert_decode
from monodecode.mono import experts as X
from monodecode.mono.expert_reference import reference
from monodecode.mono.expert_stage import StageBuffers, launch_stages, routed_experts
from monodecode.mono.fragments import to_fragment_order
from monodecode.mono.shape import LaunchShape

LIMIT = 10.0


def assert_close(y, ref):
    """Rows agree at fp32-accumulation level. The kernel rounds h to bf16 from fp32, the
    reference from float64: an h value within fp32 error of a bf16 rounding boundary can round
    the other way (one bf16 ulp of one element, seen in 1 row of 80; on the H200, 2 rows of 5 at
    ~1e-4), so a few rows (a tenth, or two) may differ by up to ~2^-8 of that element's share; a
    wrong expert, row or scale is off by far more."""
    row_err = (y.cpu().double() - ref.cpu()).norm(dim=-1) / ref.cpu().norm(dim=-1).clamp(min=1e-30)
    live = ref.cpu().norm(dim=-1) > 0
    assert torch.isfinite(y).all()
    assert row_err[live].median() < 1e-6
    assert row_err[live].max() < 5e-3
    assert (row_err[live] > 1e-6).sum() <= max(2, 0.1 * live.sum())


def random_experts(g, num_experts, hidden, inter, device) -> X.ExpertWeights:
    def matrix(n, k):
        return formats.quantize_mxfp4(torch.randn(n, k, generator=g) / k**0.5)

    experts = X.stack([(matrix(inter, hidden), matrix(hidden, inter), matrix(inter, hidden))
                       for _ in range(num_experts)])
    return X.ExpertWeights(*((c.to(device), s.to(device)) for c, s in (experts.w1, experts.w2, experts.w3)))


@pytest.fixture(scope="module")
def experts(device):
    """Hidden 256 (w1 / w3: two K steps of 128 or one of 256), intermediate 128 (w2: one step)."""
    return random_experts(torch.Generator().manual_seed(1), num_experts=8, hidden=256, inter=128, device=device)


def picks(g, rows, topk, num_experts, routing):
    if routing == "hash":  # a fixed table per token id: tokens repeat, so do whole pick sets
        table = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(5)])
        return table[torch.randint(0, 5, (rows,), generator=g)]
    scores = torch.rand(rows, num_experts, generator=g)
    return scores.topk(topk, dim=-1).indices


def run(experts, ids, g, device, shape=LaunchShape()):
    """(the stage's result, the float64 reference) for these picks and fresh x and weights."""
    x = torch.randn(ids.shape[0], experts.hidden, generator=g).to(torch.bfloat16).to(device)
    weights = (torch.rand(ids.shape, generator=g) + 0.1).to(device)
    y = routed_experts(x, ids.to(device), weights, experts, LIMIT, shape=shape, poison=True)
    return y, reference(x, ids.to(device), weights, experts, LIMIT)


@pytest.mark.parametrize("rows", [1, 2, 6, 16, 48])
@pytest.mark.parametrize("routing", ["hash", "bias"])
def test_matches_float64_reference(experts, device, rows, routing):
    """Hash routing repeats whole pick sets across rows (rows share experts), bias routing draws
    them; a pad row from 6 rows on, whose output is zero."""
    g = torch.Generator().manual_seed(rows * 7 + len(routing))
    ids = picks(g, rows, 2, 8, routing)
    if rows > 2:
        ids[rows // 2] = -1
    y, ref = run(experts, ids, g, device)
    assert_close(y, ref)
    if rows > 2:
        assert (y[rows // 2] == 0).all()


@pytest.mark.parametrize("block_n,block_k", [(16, 256), (32, 128), (64, 128)])
def test_other_tiles_match_the_reference(experts, device, block_n, block_k):
    """Tiles of one to four 16-row blocks of the dot's operand, K steps of 128 (two for w1 / w3)
    or 256, two programs a SM on a GPU: the reference's result."""
    g = torch.Generator().manual_seed(50 + block_n + block_k)
    ids = picks(g, 6, 2, 8, "bias")
    ids[2] = -1
    y, ref = run(experts, ids, g, device, LaunchShape(k2_programs_per_sm=2, expert_block_n=block_n,
                                                      expert_block_k=block_k))
    assert_close(y, ref)


def test_tiles_the_fragment_order_cannot_serve_are_refused(experts):
    for shape, reason in ((LaunchShape(expert_block_k=64), r"K steps of a multiple of 128 \(here \[64\]\)"),
                          (LaunchShape(expert_block_n=8), r"tiles of a multiple of 16 rows \(here \[8\]\)")):
        with pytest.raises(ValueError, match=reason):
            launch_stages(None, (None, None, None), None, experts, LIMIT, None, shape=shape, fast=False)


def test_many_rows_on_one_expert_are_split_into_tasks(experts, device):
    """40 rows all picking expert 3 (three tasks of up to 16 rows) and expert 0."""
    g = torch.Generator().manual_seed(5)
    y, ref = run(experts, torch.tensor([[3, 0]] * 40), g, device)
    assert_close(y, ref)


def test_block_scales_on_the_partial_sums_match_the_reference(device):
    """K steps of 256 on both matrices: tasks of one or two rows take the diagonal loop (x laid out
    block-diagonally, the fp32 partial sums scaled), bigger groups the ordinary one, in the same
    launch. A pad row (groups of one and two rows), and 20 rows on one expert, 3 on another and 2 on
    a third (tasks of 16, 4 and 3 rows: the ordinary loop; 2: the diagonal one)."""
    g = torch.Generator().manual_seed(120)
    experts = random_experts(g, num_experts=8, hidden=512, inter=512, device=device)
    assert X.takes_diagonal(LaunchShape().expert_block_k, 512, 512)
    ids = picks(g, 6, 2, 8, "bias")
    ids[2] = -1
    assert_close(*run(experts, ids, g, device, LaunchShape(expert_block_n=64)))
    ids = torch.tensor([5] * 20 + [1] * 3 + [3] * 2)[torch.randperm(25, generator=g)].unsqueeze(1)
    assert_close(*run(experts, ids, g, device, LaunchShape(expert_block_n=64)))


def test_group_picks():
    ids = torch.tensor([[2, 0], [-1, -1], [2, 1], [0, 2]])
    order, experts, counts = X.group_picks(ids, rows=2)
    # sorted picks: expert 0 (picks 1, 6), 1 (pick 5), 2 (picks 0, 4, 7), pads last
    assert order.tolist()[:6] == [1, 6, 5, 0, 4, 7]
    assert counts.tolist() == [2, 0, 1, 2, 0, 1, 0, 0]  # expert 2's third pick starts a new task
    assert experts.tolist()[:6] == [0, 0, 1, 2, 0, 2]


def test_the_stack_gives_back_the_checkpoint_tensors_and_checks_its_scales():
    g = torch.Generator().manual_seed(3)
    tensors = [tuple(formats.quantize_mxfp4(torch.randn(n, k, generator=g)) for n, k in ((128, 256), (256, 128), (128, 256)))
               for _ in range(4)]
    stacked = X.stack(tensors)
    assert torch.equal(stacked.w1[0][2], to_fragment_order(tensors[2][0][0]))
    for e, original in enumerate(tensors):
        for (codes, scale), (codes2, scale2) in zip(original, stacked.checkpoint_tensors(e)):
            assert torch.equal(codes, codes2)
            assert torch.equal(scale.view(torch.uint8), scale2.view(torch.uint8))
    assert stacked.supports_fast_decode()
    bad = X.stack(tensors)
    bad.w2[1][0, 0, 0] = 200
    assert not bad.supports_fast_decode()
    with pytest.raises(ValueError, match="scale codes outside"):
        launch_stages(None, None, None, bad, LIMIT, None, fast=True)


def test_the_stage_runs_the_kernels_asked_for(experts, device):
    """`launch_stages(..., kernels)`: the benchmark may time one kernel; what is not asked for is not
    written (poisoned buffers stay NaN)."""
    g = torch.Generator().manual_seed(71)
    ids = picks(g, 3, 2, 8, "bias").to(device)
    x = torch.randn(3, experts.hidden, generator=g).to(torch.bfloat16).to(device)
    buffers = StageBuffers(6, experts, device, poison=True)
    launch_stages(x, X.group_picks(ids), torch.rand(6, generator=g).to(device), experts, LIMIT, buffers,
                  fast=device == "cuda", kernels=("up",))
    assert not buffers.gate_up.isnan().any()
    assert buffers.h.isnan().all() and buffers.per_pick.isnan().all()


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
    b = to_fragment_order(codes).long().reshape(-1, 2)[:32]  # row 0: the block's first 64 bytes
    halves = b[:, 0] | b[:, 1] << 8  # half (t, m, r)
    low, high = torch.arange(32), torch.randperm(32, generator=g)
    out = run_ptx(expert_decode.HALVES_DECODE_ASM.value, {"$4": halves[low] | halves[high] << 16})
    for code in range(4):
        s, q = code // 2, code % 2
        for part, index in ((0, low), (1, high)):
            t, m, r = index // 8, index // 2 % 4, index % 2
            n = nibbles[m * 32 + s * 16 + q * 8 + 2 * t + r]
            assert torch.equal(out[f"${code}"] >> 16 * part & 0xFFFF, ((n & 7) << 6) | ((n & 8) << 12))
