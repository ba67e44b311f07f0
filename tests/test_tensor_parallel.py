"""Tensor parallelism of the per-op model (model/parallel.py) on the CPU: 2 and 4 processes over
gloo, each loading only its part of a synthetic checkpoint, against one process.

Every rank runs the same steps (prefills of two requests, multi-row verify-like steps with a pad
row, a reused slot) and must produce the one-process logits up to fp32 summation order, the
same greedy tokens, and logits bit-identical across ranks; and the DSpark draft's proposal
distributions of the one process."""


import pytest
import torch
import torch.multiprocessing as mp

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.model import Model
from monodecode.model.parallel import SINGLE, TensorParallel
from monodecode.sampling import RowSettings


def tiny(size: int, name: str = "tiny"):
    """A tiny preset (V4's or V4.1's), with heads and o groups that `size` ranks divide."""
    return preset(name, num_attention_heads=max(4, 2 * size), o_groups=max(2, size))


def steps(model: Model) -> list[torch.Tensor]:
    """Logits of a fixed run: prefills of slots 0 and 1, then decode steps with several rows of
    slot 0, one of slot 1 and a pad row, then slot 1 reused for a new request."""
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    cache = model.make_cache(num_slots=3, max_context=48, max_step_rows=4)
    out = []
    lengths = {0: 9, 1: 6}
    for slot, n in lengths.items():
        out.append(model.step(cache, torch.randint(0, vocab, (n,), generator=g), torch.arange(n), [slot] * n))
    for _ in range(3):
        p0, p1 = lengths[0], lengths[1]
        tokens = torch.randint(0, vocab, (5,), generator=g)
        out.append(model.step(cache, tokens, [p0, p0 + 1, p0 + 2, p1, 0], [0, 0, 0, 1, -1]))
        lengths[0] += 3
        lengths[1] += 1
    out.append(model.step(cache, torch.randint(0, vocab, (4,), generator=g), torch.arange(4), [1] * 4))
    return out


def draft_probs(model: Model) -> torch.Tensor:
    """The DSpark draft's proposal distributions for two requests after their prompts."""
    g = torch.Generator().manual_seed(11)
    draft = model.draft()
    cache, dcache = model.make_cache(num_slots=2, max_context=48, max_step_rows=8), draft.make_cache(2)
    for slot, n in ((0, 7), (1, 4)):
        _, hidden = model.step(cache, torch.randint(0, model.config.vocab_size, (n,), generator=g), torch.arange(n),
                               [slot] * n, return_hidden=True)
        draft.commit(dcache, slot, torch.arange(n), hidden)
    greedy = RowSettings.of([(0.0, 1.0, 0)] * 2, model.device)
    return draft.propose(dcache, torch.tensor([3, 9]), torch.tensor([7, 4]), [0, 1], greedy, None).probs


def _rank(rank: int, size: int, name: str, store: str, results: str):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        tp = TensorParallel.from_process_group()
        model = Model.from_checkpoint(SyntheticCheckpoint(tiny(size, name), seed=3), "cpu", torch.float32, tp=tp)
        held = sum(t.numel() for v in model.w.values() for t in (v if isinstance(v, tuple) else (v,)))
        torch.save({"logits": steps(model), "draft": draft_probs(model), "held": held}, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(size: int, tmp_path, name: str = "tiny") -> list[dict]:
    results = str(tmp_path / "logits")
    mp.start_processes(_rank, args=(size, name, str(tmp_path / "store"), results), nprocs=size, start_method="spawn")
    return [torch.load(f"{results}.{rank}") for rank in range(size)]


@pytest.mark.parametrize("size, name", [(2, "tiny"), (2, "tiny-v4.1"), pytest.param(4, "tiny", marks=pytest.mark.slow),
                                        pytest.param(4, "tiny-v4.1", marks=pytest.mark.slow)])
def test_ranks_give_the_one_process_logits(size, name, tmp_path):
    """V4 and V4.1 (whose compressors, indexers and Engram every rank holds whole)."""
    one = Model.from_checkpoint(SyntheticCheckpoint(tiny(size, name), seed=3), "cpu", torch.float32)
    reference, reference_draft = steps(one), draft_probs(one)
    ranks = run_ranks(size, tmp_path, name)
    whole = sum(t.numel() for v in one.w.values() for t in (v if isinstance(v, tuple) else (v,)))
    for rank, result in enumerate(ranks):
        assert result["held"] < whole  # a rank holds its part, not the whole model
        for step, (got, want) in enumerate(zip(result["logits"], reference)):
            assert got.shape == want.shape
            assert torch.equal(got, ranks[0]["logits"][step]), (rank, step)  # bit-identical across ranks
            scale = want.abs().max()
            assert (got - want).abs().max() <= 1e-5 * scale, (rank, step)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (rank, step)
        torch.testing.assert_close(result["draft"], reference_draft, rtol=1e-5, atol=1e-6)  # the draft's too


def test_a_size_that_does_not_divide_the_model_is_refused():
    with pytest.raises(ValueError, match=r"tensor parallel size 3 must divide the attention heads 4, o_groups 2, "
                                         r"routed experts 8, vocabulary 512"):
        TensorParallel(rank=0, size=3).check(preset("tiny"))
    SINGLE.check(preset("tiny"))


def test_a_rank_holds_its_slices():
    c = preset("tiny")
    tp = TensorParallel(rank=1, size=2)
    assert tp.holds("layers.0.ffn.experts.5.w1.weight", c) and not tp.holds("layers.0.ffn.experts.3.w1.weight", c)
    assert tp.holds("layers.0.attn.wq_b.weight", c)
    wq_b = torch.arange(c.num_attention_heads * c.head_dim).float()[:, None].expand(-1, 3)
    assert torch.equal(tp.shard("layers.0.attn.wq_b", wq_b, c)[:, 0], torch.arange(128, 256).float())
    wo_b = torch.arange(c.o_groups * c.o_lora_rank).float()[None, :].expand(5, -1)
    assert torch.equal(tp.shard("layers.0.attn.wo_b", wo_b, c)[0], torch.arange(32, 64).float())
    assert tp.shard("embed", torch.zeros(c.vocab_size, 2), c).shape == (c.vocab_size // 2, 2)
    norm = torch.ones(c.hidden_size)
    assert tp.shard("layers.0.attn_norm", norm, c) is norm


def test_a_rank_that_dies_while_starting_is_an_error_not_a_wait():
    """The leader joins the group and loads while watching the other ranks: one that exits
    meanwhile raises at once, though the leader's own start would wait for it."""
    import threading
    import time

    from monodecode.ranks import RankError, _watching

    class Exited:
        def join(self, timeout=None):
            raise mp.ProcessExitedException("process 0 terminated with exit code 1", error_index=0, error_pid=1,
                                            exit_code=1)

    never = threading.Event()
    began = time.monotonic()
    with pytest.raises(RankError, match="exited while starting"):
        _watching(Exited(), never.wait)  # a start that would wait forever
    assert time.monotonic() - began < 5
    never.set()


def test_a_bad_step_is_refused_on_every_rank_and_the_ranks_go_on():
    """From Python (`monodecode.load(..., tensor_parallel_size=2)`): a step with a token out of
    range raises on rank 0 and is dropped by rank 1, which stays in step for the next ones."""
    from monodecode.decode import load

    one, two = load("tiny"), load("tiny", tensor_parallel_size=2)
    try:
        caches = [m.make_cache(num_slots=2, max_context=16) for m in (one, two)]
        with pytest.raises(ValueError, match="row 1: token id 9999 is outside"):
            two.step(caches[1], [1, 9999], [0, 1], [0, 0])
        for _ in range(2):
            want, got = (m.step(c, [1, 2, 3], [0, 1, 2], [0, 0, 0]) for m, c in zip((one, two), caches))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            caches[0].clear(0)
            caches[1].clear(0)
    finally:
        two.close()
