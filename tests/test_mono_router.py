"""The MoE's small stages (route, group, combine) against the per-op MoE.

On the CPU the kernels run under Triton's interpreter (the portable path); with
MONODECODE_TEST_DEVICE=cuda they run compiled (FAST).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from monodecode.model.moe import MoE
from monodecode.mono import experts as X
from monodecode.mono import router as M

LIMIT, SCALE = 10.0, 1.5
ROWS = [1, 5, 16, 48]


def moe(w: dict, hash_routed: bool, topk: int) -> MoE:
    """The per-op MoE with only what route reads (no experts, no shared expert)."""
    config = SimpleNamespace(n_shared_experts=0, swiglu_limit=LIMIT, routed_scaling_factor=SCALE)
    return MoE(config, w, "ffn.", None, hash_routed, topk)


def pad_rows(g, rows):
    """Cache slots with about a quarter of the rows pads (-1), never all of them."""
    slots = torch.arange(rows, dtype=torch.int64)
    slots[torch.rand(rows, generator=g) < 0.25] = -1
    slots[0] = 0
    return slots


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("experts,topk", [(8, 2), (256, 6)])
@pytest.mark.parametrize("hash_routed", [False, True])
def test_route_matches_moe_route(device, rows, experts, topk, hash_routed):
    g = torch.Generator().manual_seed(rows * 1000 + experts + hash_routed)
    d, vocab = 64, 50
    x = torch.randn(rows, d, generator=g).to(torch.bfloat16)
    w = {"ffn.gate": (torch.randn(experts, d, generator=g) / 2).to(torch.bfloat16),
         "ffn.gate.bias": torch.randn(experts, generator=g) / 4,
         "ffn.gate.tid2eid": torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(vocab)])}
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    ref_ids, ref_weights = moe(w, hash_routed, topk).route(x, tokens)
    logits = F.linear(x.float(), w["ffn.gate"].float())  # the gate GEMV, as route does it
    slots = pad_rows(g, rows)
    live = slots >= 0
    tokens[~live], logits[~live] = -(1 << 40), float("nan")  # a pad row's inputs: not to be read
    on = {"tokens": tokens.to(device), "tid2eid": w["ffn.gate.tid2eid"].to(device)} if hash_routed \
        else {"bias": w["ffn.gate.bias"].to(device)}
    ids, weights = M.route(logits.to(device), slots.to(device), topk, SCALE, poison=True, **on)
    ids, weights = ids.cpu(), weights.cpu()
    assert torch.equal(ids[live], ref_ids[live].to(torch.int32))
    # observed (CPU): max relative difference 3.1e-7 over all cases, 0 for k = 2 rows of 1 (a few
    # fp32 ulps: log1p(exp) computed differently, and the k scores summed in another order)
    torch.testing.assert_close(weights[live], ref_weights[live], rtol=1e-6, atol=0)
    assert (ids[~live] == -1).all() and (weights[~live] == 0).all()


def test_route_scores_over_the_whole_softplus_range(device):
    """Hash rows that pick every expert: the weights are the scores renormalised, for logits from
    deep in log1p's small-argument range (-40: log(1 + y) alone would give 0) to past the
    threshold (x > 20 passes through)."""
    g = torch.Generator().manual_seed(11)
    rows, experts = 6, 8
    logits = torch.rand(rows, experts, generator=g) * 80 - 40
    logits[0] = torch.tensor([-40.0, -30.0, -17.0, -1e-3, 0.0, 19.99, 20.0, 20.01])
    table = torch.stack([torch.randperm(experts, generator=g) for _ in range(3)])
    tokens = torch.randint(0, 3, (rows,), generator=g)
    ids, weights = M.route(logits.to(device), torch.arange(rows).to(device), experts, SCALE,
                           tokens=tokens.to(device), tid2eid=table.to(device), poison=True)
    scores = F.softplus(logits).sqrt().gather(1, table[tokens])
    assert torch.equal(ids.cpu(), table[tokens].to(torch.int32))
    # observed (CPU): 2.1e-7 relative at most, down to the smallest weight (2e-10)
    torch.testing.assert_close(weights.cpu(), scores / scores.sum(-1, keepdim=True) * SCALE, rtol=1e-6, atol=0)


def test_route_ties_go_to_the_lowest_expert(device):
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, 1.0, 0.0, 1.0]])
    ids, _ = M.route(logits.to(device), torch.zeros(1, dtype=torch.int64).to(device), 4, SCALE,
                     bias=torch.zeros(8).to(device), poison=True)
    assert ids.cpu().tolist() == [[1, 3, 4, 2]]


def test_a_rank_routes_as_one_and_keeps_its_own_picks(device):
    """A tensor-parallel rank holding experts 4..7 of 8: the one-rank picks and weights, its own
    picks renumbered from 0, the others' -1 (their weights kept: a row's weights stay normalised
    over all k picks)."""
    g = torch.Generator().manual_seed(5)
    rows, experts, topk = 7, 8, 3
    logits, slots = torch.randn(rows, experts, generator=g), pad_rows(g, rows).to(device)
    bias = (torch.randn(experts, generator=g) / 4).to(device)
    ids, weights = M.route(logits.to(device), slots, topk, SCALE, bias=bias, poison=True)
    mine, my_weights = M.route(logits.to(device), slots, topk, SCALE, bias=bias, held=range(4, 8), poison=True)
    held = ids >= 4
    assert torch.equal(mine, torch.where(held, ids - 4, -1)) and torch.equal(my_weights, weights)
    assert held.any() and ((ids >= 0) & ~held).any()


def assert_groups_equal(ids, device):
    """Bit for bit what group_picks returns; gives the kernel's (order, experts, counts)."""
    got = tuple(a.cpu() for a in M.group(ids.to(device), poison=True))
    for name, a, b in zip(("order", "experts", "counts"), got, X.group_picks(ids)):
        assert torch.equal(a, b), f"{name} differs for ids {ids.tolist()}"
    return got


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 29, 48])
def test_group_matches_group_picks(device, rows):
    """Top-k style picks of 256 experts, k = 6, with pad rows and a few popular experts."""
    g = torch.Generator().manual_seed(rows)
    popular = torch.rand(rows, 256, generator=g)
    popular[:, :4] += 0.9  # most rows pick experts 0..3: runs longer than ROWS
    ids = popular.topk(6, dim=-1).indices
    ids[torch.rand(rows, generator=g) < 0.2] = -1
    assert_groups_equal(ids, device)


def test_group_splits_an_expert_picked_by_more_than_rows(device):
    """40 rows of one hash token and 5 of another, shuffled with 3 pad rows: experts 5 and 200
    have 45 picks (tasks of 16 + 16 + 13), 0, 3, 17 and 99 have 40 (16 + 16 + 8), the rest 5."""
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[5, 200, 17, 3, 99, 0]] * 40 + [[-1] * 6] * 3 + [[200, 5, 1, 2, 4, 6]] * 5)
    ids = ids[torch.randperm(48, generator=g)]
    _, _, counts = assert_groups_equal(ids, device)
    assert sorted(c for c in counts.tolist() if c) == [5] * 4 + [8] * 4 + [13] * 2 + [16] * 12


@pytest.mark.parametrize("case", ["small", "all pads", "one expert", "one row"])
def test_group_edge_cases(device, case):
    g = torch.Generator().manual_seed(7)
    ids = {"small": torch.randint(-1, 8, (16, 2), generator=g),  # E = 8, k = 2: many repeats
           "all pads": torch.full((4, 6), -1),
           "one expert": torch.full((48, 1), 255),
           "one row": torch.tensor([[9, 3]])}[case]
    assert_groups_equal(ids, device)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_matches_torch_sum(device, rows, with_shared):
    """Each pick rounded to bf16 (the reference's expert output), an fp32 sum in top-k order, then
    the shared output, then bf16: bit-exact. Pad picks' rows are
    NaN (never written by the expert stage) and must not be read."""
    g = torch.Generator().manual_seed(200 + rows)
    topk, d = 6, 80  # d = 80 with blocks of 32 leaves a masked tail
    ids = torch.randint(0, 256, (rows, topk), generator=g)
    ids[torch.rand(rows, generator=g) < 0.25] = -1
    ids[torch.rand(rows, topk, generator=g) < 0.15] = -1  # single picks too: another rank's experts
    per_pick = torch.randn(rows * topk, d, generator=g) * 3
    per_pick[ids.flatten() < 0] = float("nan")
    shared = torch.randn(rows, d, generator=g).to(torch.bfloat16) if with_shared else None
    expected = torch.zeros(rows, d)
    for s in range(topk):
        pick = per_pick.view(rows, topk, d)[:, s].to(torch.bfloat16).float()
        expected += torch.where((ids[:, s] >= 0).unsqueeze(-1), pick, 0.0)
    if with_shared:
        expected += shared.float()
    y = M.combine(per_pick.to(device), ids.to(torch.int32).to(device),
                  None if shared is None else shared.to(device), block=32, poison=True).cpu()
    assert torch.equal(y, expected.to(torch.bfloat16))


def test_task_counts():
    assert M.route_tasks(48) == 48 and M.group_tasks() == 1
    assert M.combine_tasks(3, 4096, 1024) == 12


@pytest.mark.parametrize("hash_routed", [False, True])
def test_the_route_margin_is_the_gap_past_the_kth_pick(hash_routed):
    """`MoE.margin` (how near a row's picks are to a flip; the checks' routing-flip reports): the
    k-th minus the (k+1)-th biased score; infinite where the tokens pick the experts."""
    g = torch.Generator().manual_seed(5)
    experts, topk, d = 8, 2, 16
    w = {"ffn.gate": torch.randn(experts, d, generator=g), "ffn.gate.bias": torch.randn(experts, generator=g),
         "ffn.gate.tid2eid": torch.randint(0, experts, (4, topk), generator=g)}
    layer, x = moe(w, hash_routed, topk), torch.randn(3, d, generator=g)
    biased = (F.softplus(x @ w["ffn.gate"].T).sqrt() + w["ffn.gate.bias"]).sort(dim=-1, descending=True).values
    expected = torch.full((3,), float("inf")) if hash_routed else biased[:, topk - 1] - biased[:, topk]
    torch.testing.assert_close(layer.margin(x), expected)
