"""CSA's indexer scores as kernel tasks (`mono.indexer`) against `Indexer.scores` on the same
bf16 inputs: rows of several requests far on and fresh ones, a pad row, the entries past a row's
visible ones (random data, which must not count), blocks of entries partly and wholly past them."""

import pytest
import torch

from monodecode.config import preset
from monodecode.model.compressor import Indexer
from monodecode.model.rope import apply_rope, layer_frequencies
from monodecode.mono import indexer as K


@pytest.mark.parametrize("entry_block, programs", [(16, None), (64, None), (16, 24), (16, 8)])
def test_scores_match_the_indexer(device, entry_block, programs):
    """programs: the tasks laid out for that many (8 rows of 8 blocks of 16 entries: a block a
    task, runs of 3, 3 and 2 blocks, a row's 8 blocks in one task); the weights' rows strided."""
    config = preset("tiny")
    HI, DI = config.index_n_heads, config.index_head_dim
    g = torch.Generator().manual_seed(entry_block)
    freqs = layer_frequencies(config, compressed=True)
    w = {name: torch.zeros(1) for name in ("i.wq_b", "i.weights_proj", "i.compressor.wkv", "i.compressor.wgate",
                                           "i.compressor.ape", "i.compressor.norm")}
    indexer = Indexer(w, "i.", config, freqs)
    slots = torch.tensor([3, 3, 0, -1, 5, 1, 2, 4])
    # 100 / 100 / 0 / - / 37 / 22 visible entries, then two rows far past 65,536 positions (YaRN's
    # range at v4-flash sizes: the RoPE angles in fp32 at large positions), every entry visible
    positions = torch.tensor([401, 402, 2, 0, 150, 90, 70_001, 262_143])
    E = 120
    keys = torch.randn(6, E, DI, generator=g).to(torch.bfloat16)
    q_raw = (2 * torch.randn(8, HI, DI, generator=g)).to(torch.bfloat16)
    # the weights_proj GEMV's output: columns of a wider buffer, as K1's stacked projections write it
    # (sliced on the device: a column view moved there would arrive contiguous)
    weights_raw = torch.randn(8, HI + 40, generator=g).to(torch.bfloat16).to(device)[:, 8:8 + HI]
    weights = weights_raw.cpu().float() * HI ** -0.5  # as Indexer.queries scales it
    out = K.scores(q_raw.to(device), weights_raw, positions.to(device), slots.to(device), freqs.to(device),
                   keys.to(device), ratio=4, entry_block=entry_block, programs=programs).cpu()
    q = apply_rope(q_raw, positions, freqs)
    for r, (slot, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        if slot < 0:
            assert torch.isneginf(out[r]).all()
            continue
        ref = indexer.scores(q[r:r + 1], weights[r:r + 1], keys[slot], positions[r:r + 1])[0]
        visible = min((p + 1) // 4, E)
        assert torch.isneginf(out[r, visible:]).all() and torch.isneginf(ref[visible:]).all()
        # observed: fp32 summation order only (the dot's and the heads' sum)
        torch.testing.assert_close(out[r, :visible], ref[:visible], rtol=1e-5, atol=1e-5)


def test_scores_skip_the_rows_that_keep_every_visible_entry(device):
    """With a top-k (K1's scores stage), a row of at most k visible entries keeps them all
    whatever their scores, so none of its scores is written (NaN stays); the others' are what
    the scores without a top-k are. Rows at k - 1, k and k + 1 visible entries, and a pad row."""
    config = preset("tiny")
    HI, DI = config.index_n_heads, config.index_head_dim
    g = torch.Generator().manual_seed(5)
    k, E = 25, 60
    slots = torch.tensor([0, 1, 2, -1, 3])
    positions = torch.tensor([4 * 60 - 1, 4 * 25 - 1, 4 * 26 - 1, 0, 4 * 24 - 1])  # 60, 25, 26, -, 24 visible
    keys = torch.randn(4, E, DI, generator=g).to(torch.bfloat16)
    q_raw = (2 * torch.randn(5, HI, DI, generator=g)).to(torch.bfloat16)
    weights_raw = torch.randn(5, HI, generator=g).to(torch.bfloat16)
    freqs = layer_frequencies(config, compressed=True)
    args = [t.to(device) for t in (q_raw, weights_raw, positions, slots, freqs, keys)]
    every, skipping = (K.scores(*args, topk=topk).cpu() for topk in (0, k))
    for r, scored in enumerate([True, False, True, False, False]):
        if scored:
            assert torch.equal(skipping[r], every[r]), r
        else:
            assert skipping[r].isnan().all(), r


def test_the_launch_refuses_shapes_that_do_not_fit(device):
    with pytest.raises(ValueError, match="do not fit"):
        K.scores(torch.zeros(2, 16, 32, dtype=torch.bfloat16, device=device), torch.zeros(2, 8, dtype=torch.bfloat16, device=device),
                 torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, dtype=torch.long, device=device),
                 torch.ones(8, device=device), torch.zeros(1, 8, 32, dtype=torch.bfloat16, device=device))


def test_k1s_select_block_grows_with_the_rows_unless_the_shape_names_one():
    """The launch shape's 0 leaves K1's selection 256 entries a task below 32 rows and 1024 from
    32 on; a shape's own block holds at every width."""
    assert [K.select_block(0, rows) for rows in (1, 6, 16, 31, 32, 48)] == [256] * 4 + [1024] * 2
    assert [K.select_block(16, rows) for rows in (1, 48)] == [16, 16]


@pytest.mark.parametrize("block", [16, 256])
def test_select_takes_each_rows_top_k(device, block):
    """The radix select: each row's top min(k, visible) entries as a set equal to torch.topk's
    (random scores: no ties), in entry order, then -1 (blocks of 16: a row's selection spread
    over 19 blocks, its ties over two); scores of both signs and wide range; a row whose visible
    entries are fewer than k; a pad row; and a row of equal scores (ties: the first k in entry
    order)."""
    g = torch.Generator().manual_seed(block)
    k, E = 32, 300
    scores = torch.randn(5, E, generator=g) * torch.exp2(torch.randint(-20, 20, (5, E), generator=g).float())
    slots = torch.tensor([0, 1, -1, 2, 3])
    positions = torch.tensor([4 * 300 - 1, 4 * 20 - 1, 0, 4 * 300 - 1, 4 * 100 - 1])  # 300, 20, -, 300, 100 visible
    scores[3] = 0.5  # all tied
    visible = [300, 20, 0, 300, 100]
    for r, v in enumerate(visible):
        scores[r, v:] = float("-inf")
    out = K.select(scores.to(device), positions.to(device), slots.to(device), k, block=block).cpu()
    for r, v in enumerate(visible):
        n = min(k, v)
        assert (out[r, n:] == -1).all(), r
        if r == 3 or v <= k:  # all tied, or every visible entry kept: in entry order
            assert out[r, :n].tolist() == list(range(n))
        elif n:
            assert set(out[r, :n].tolist()) == set(scores[r].topk(n).indices.tolist()), r
            assert out[r, :n].tolist() == sorted(out[r, :n].tolist()), r  # in entry order


def test_select_at_long_context(device):
    """A request 160 K positions on: 40,000 visible entries, v4-flash's top 512 of them (the
    selection's passes are bounded by the row's entries, whatever the cache holds), equal as a set
    to torch.topk's; a second row at 4 K positions (1,024 visible) beside it."""
    g = torch.Generator().manual_seed(7)
    k, E = 512, 40_000
    scores = torch.randn(2, E, generator=g)
    positions = torch.tensor([4 * E - 1, 4 * 1024 - 1])
    scores[1, 1024:] = float("-inf")
    out = K.select(scores.to(device), positions.to(device), torch.tensor([0, 1]).to(device), k).cpu()
    for r, visible in enumerate((E, 1024)):
        assert (out[r] >= 0).all() and len(set(out[r].tolist())) == k
        assert set(out[r].tolist()) == set(scores[r, :visible].topk(k).indices.tolist()), r
