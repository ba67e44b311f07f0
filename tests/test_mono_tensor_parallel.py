"""The mono kernels under tensor parallelism on the CPU: 2 processes over gloo, each rank a
`Decoder(model, "on")` on its own part of a synthetic checkpoint (bf16, Triton's interpreter),
against one process on the kernels.

A short per-op prefill of several requests, then decode steps on the kernels at two widths (one
row; six rows of three requests and a pad row). Every rank must give bit-identical logits, and
those must be the one process's up to bf16 noise (the ranks' partial sums are rounded to bf16
before they are summed): cosine >= 0.9999 a live row and the same greedy token. The model: the
tiny preset (window, CSA, HCA and CSA layers). Every live row is compared: a routing or index
near-tie that flipped (tests/test_mono_runner.py sets those rows aside) would fail the test;
at these seeds none needs setting aside.
"""

import pytest
import torch
import torch.multiprocessing as mp

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.decode import Decoder, KernelDraft
from monodecode.model import Model
from monodecode.model.parallel import TensorParallel

PROMPTS = (5, 3, 4)  # prefill lengths of slots 0, 1, 2
STEPS = (  # decode steps: (slot, rows) groups, then pad rows
    ([(0, 1)], 0),
    ([(0, 2), (1, 2), (2, 1)], 1),
)


def tiny():
    """The tiny preset: a window, a CSA, an HCA and a CSA layer (compression ratios 0, 4, 16, 4)."""
    return preset("tiny")


def decode(decoder: Decoder) -> list[torch.Tensor]:
    """The logits of each decode step (STEPS) after the prompts' per-op prefill; every step on the kernels."""
    g = torch.Generator().manual_seed(13)
    vocab = decoder.config.vocab_size
    cache = decoder.make_cache(num_slots=len(PROMPTS), max_context=32, max_step_rows=4)
    for slot, n in enumerate(PROMPTS):
        decoder.model.step(cache, torch.randint(0, vocab, (n,), generator=g), torch.arange(n), [slot] * n)
    lengths, out = list(PROMPTS), []
    for groups, pads in STEPS:
        tokens, positions, slots = [], [], []
        for slot, n in groups:
            tokens += torch.randint(0, vocab, (n,), generator=g).tolist()
            positions += range(lengths[slot], lengths[slot] + n)
            slots += [slot] * n
            lengths[slot] += n
        out.append(decoder.step(cache, tokens + [0] * pads, positions + [0] * pads, slots + [-1] * pads))
        assert decoder.last_path == "mono", decoder.fallbacks
    return out


def _rank(rank: int, size: int, store: str, results: str):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        model = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), "cpu", torch.bfloat16,
                                      tp=TensorParallel.from_process_group())
        decoder = Decoder(model, "on")
        logits = decode(decoder)
        launches = {family: state.epoch for family, state in decoder.mono.sync.items()}
        draft_per_op = not isinstance(decoder.draft(), KernelDraft)  # "on" too: the draft's kernels refuse TP
        torch.save({"logits": logits, "launches": launches, "heads": decoder.mono.config.num_attention_heads,
                    "draft_per_op": draft_per_op}, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_on_the_kernels_give_the_one_process_logits(tmp_path):
    results = str(tmp_path / "logits")
    # the ranks inherit TRITON_INTERPRET (conftest) with the environment
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{results}.{rank}") for rank in range(2)]
    layers_run = len(STEPS) * tiny().num_hidden_layers
    for result in ranks:  # K2 ran as its two launches, each rank on its half of the heads
        assert result["heads"] == tiny().num_attention_heads // 2 and result["draft_per_op"]
        assert result["launches"]["k2a"] == result["launches"]["k2f"] == result["launches"]["k3"] == layers_run
        assert result["launches"]["k2"] == 0
    one = decode(Decoder(Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), "cpu", torch.bfloat16), "on"))
    for step, ((groups, pads), want) in enumerate(zip(STEPS, one)):
        got = ranks[0]["logits"][step]
        assert torch.equal(got, ranks[1]["logits"][step]), step  # bit-identical across ranks
        live, got = want[:len(want) - pads].double(), got[:len(want) - pads].double()
        cosine = torch.nn.functional.cosine_similarity(got, live, dim=-1)
        assert (cosine >= 0.9999).all(), (step, cosine)
        assert torch.equal(got.argmax(-1), live.argmax(-1)), step


def test_a_size_whose_slices_split_fp8_blocks_is_refused():
    from monodecode.mono.plan import MonoRefused
    from monodecode.mono.runner import MonoRunner

    config = preset("tiny", num_attention_heads=8, o_groups=8)  # 8 ranks: 16 shared-expert rows each, blocks of 32
    model = Model.from_checkpoint(SyntheticCheckpoint(config, seed=3), "cpu", torch.bfloat16)
    eighth = Model(model.config, model.w, "cpu", torch.bfloat16, model.checkpoint, tp=TensorParallel(rank=0, size=8))
    with pytest.raises(MonoRefused, match=r"tensor parallel size 8 gives each rank 16 rows of the shared expert's "
                                          r"w1 / w3 \(its intermediate\), not a multiple of the FP8 block 32"):
        MonoRunner(eighth)


def test_the_draft_runs_per_op_under_tensor_parallelism():
    from monodecode.mono.draft_runner import DraftRunner
    from monodecode.mono.plan import MonoRefused

    model = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=3), "cpu", torch.bfloat16)
    half = Model(model.config, model.w, "cpu", torch.bfloat16, model.checkpoint, tp=TensorParallel(rank=0, size=2))
    with pytest.raises(MonoRefused, match=r"draft's stages do not run on the kernels under tensor parallelism"):
        DraftRunner(half, half.draft())


def test_generate_over_two_ranks_runs_the_kernels_on_each():
    """What `generate` and `serve` start at `--tensor-parallel-size 2 --mono on`: rank 0's
    Decoder builds a runner on every rank (`LeadingModel.build_mono`) and sends each decode step
    the kernels take to the other rank; the greedy tokens are one process's on the kernels. Two
    tokens: the second comes from a decode step on the kernels whose routing margins are >= 0.08
    (at the third, a pick of layer 3 is 0.003 from a tie: bf16 noise flips it either way)."""
    from monodecode.decode import load
    from monodecode.generate import generate
    from monodecode.ranks import LeadingRunner

    prompt = [7, 70, 300, 12]
    two = load("tiny", dtype=torch.bfloat16, mono="on", tensor_parallel_size=2)
    try:
        assert isinstance(two.mono, LeadingRunner) and two.mono.config.num_attention_heads == 2
        tokens = generate(two, prompt, 2)
        assert two.last_path == "mono" and two.mono.sync["k2f"].epoch > 0
    finally:
        two.close()
    assert tokens == generate(load("tiny", dtype=torch.bfloat16, mono="on"), prompt, 2)
