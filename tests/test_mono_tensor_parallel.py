"""The mono kernels under tensor parallelism on the CPU: 2 processes over gloo, each rank a
`Decoder(model, "on")` on its own part of a synthetic checkpoint (bf16, Triton's interpreter),
against one process on the kernels.

A short per-op prefill of several requests, then decode steps on the kernels at two widths (one
row; six rows of three requests and a pad row). Every rank must give bit-identical logits, and
those must be the one process's up to bf16 noise (the ranks' partial sums are rounded to bf16
before they are summed): cosine >= 0.9999 a live row and the same greedy token. The model: the
tiny preset (window, CSA, HCA and CSA layers). Every live row is compared: a routing or index
near-tie that flipped (tests/test_mono_runner.py sets those rows aside) would fail the test;
at these seeds none needs setting aside. The DSpark draft's stages likewise, each rank a
`DraftRunner` on its part of the draft, and (`slow`) greedy speculation over two ranks with the
draft on their kernels.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.decode import Decoder, KernelDraft
from monodecode.model import Model
from monodecode.model.parallel import TensorParallel
from monodecode.ranks import join_ranks
from monodecode.mono.runner import MonoRunner
from monodecode.mono.sync import MonoSyncError
from monodecode.sampling import RowSettings

DEVICE = os.environ.get("MONODECODE_TEST_DEVICE", "cpu")
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


def draft_stages(decoder: Decoder) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's stages on the kernels over two requests' blocks after their context (random
    target features committed to the rings), and the greedy proposal's tokens."""
    g = torch.Generator().manual_seed(11)
    c, draft = decoder.config, decoder.draft()
    assert isinstance(draft, KernelDraft)
    cache = draft.make_cache(2)
    for slot, n in ((0, 7), (1, 4)):
        features = torch.randn(n, len(c.dspark_target_layer_ids) * c.hidden_size, generator=g)
        draft.commit(cache, slot, torch.arange(n), features.to(decoder.model.device, torch.bfloat16))
    anchors, starts, b = torch.tensor([3, 9]), torch.tensor([7, 4]), draft.block_size
    tokens = torch.full((2, b), c.dspark_noise_token_id)
    tokens[:, 0] = anchors
    streams = draft.runner.stages(cache)(tokens.flatten(), (starts[:, None] + torch.arange(b)).flatten(),
                                         torch.tensor([0, 1]).repeat_interleave(b))
    proposal = draft.propose(cache, anchors, starts, [0, 1], RowSettings.of([(0.0, 1.0, 0)] * 2, decoder.model.device), None)
    return streams, proposal.tokens


def _rank(rank: int, size: int, store: str, results: str, device: str = "cpu"):
    device = join_ranks(rank, size, store, device)
    try:
        torch.set_num_threads(1)
        model = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), device, torch.bfloat16,
                                      tp=TensorParallel.from_process_group())
        decoder = Decoder(model, "on")
        logits = decode(decoder)
        launches = {family: state.epoch for family, state in decoder.mono.sync.items()}
        streams, tokens = draft_stages(decoder)
        draft_launches = {family: state.epoch for family, state in decoder.draft().runner.sync.items()}
        torch.save({"logits": [x.cpu() for x in logits], "launches": launches,
                    "heads": decoder.mono.config.num_attention_heads, "draft_streams": streams.cpu(),
                    "draft_tokens": tokens.cpu(), "draft_launches": draft_launches}, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_on_the_kernels_give_the_one_process_logits(tmp_path, device):
    """The target's decode steps, then the draft's stages (each rank a DraftRunner on its part)
    and a greedy proposal: bit-identical across ranks, and one process's up to bf16 noise (the
    draft's streams after three stages: cosine >= 0.9998 a row, the proposal's tokens equal).
    With MONODECODE_TEST_DEVICE=cuda and two GPUs: NCCL, symmetric memory, compiled kernels."""
    results = str(tmp_path / "logits")
    # the ranks inherit TRITON_INTERPRET (conftest) with the environment
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), results, device), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{results}.{rank}") for rank in range(2)]
    layers_run = len(STEPS) * tiny().num_hidden_layers
    stages_run = 2 * tiny().num_nextn_predict_layers  # draft_stages' two passes
    for result in ranks:  # K2 and K3 once a layer (their sums over the ranks inside), on half of the heads
        assert result["heads"] == tiny().num_attention_heads // 2
        assert result["launches"]["k2"] == result["launches"]["k3"] == layers_run
        assert result["draft_launches"]["k2"] == result["draft_launches"]["k3"] == stages_run
    assert torch.equal(ranks[0]["draft_streams"], ranks[1]["draft_streams"])
    assert torch.equal(ranks[0]["draft_tokens"], ranks[1]["draft_tokens"])
    one_decoder = Decoder(Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), device, torch.bfloat16), "on")
    streams, tokens = (x.cpu() for x in draft_stages(one_decoder))
    cosine = torch.nn.functional.cosine_similarity(ranks[0]["draft_streams"].double().flatten(1),
                                                   streams.double().flatten(1), dim=1)
    assert (cosine >= 0.9998).all(), cosine
    assert torch.equal(ranks[0]["draft_tokens"], tokens)
    one = [x.cpu() for x in decode(one_decoder)]
    for step, ((groups, pads), want) in enumerate(zip(STEPS, one)):
        got = ranks[0]["logits"][step]
        assert torch.equal(got, ranks[1]["logits"][step]), step  # bit-identical across ranks
        live, got = want[:len(want) - pads].double(), got[:len(want) - pads].double()
        cosine = torch.nn.functional.cosine_similarity(got, live, dim=-1)
        assert (cosine >= 0.9999).all(), (step, cosine)
        assert torch.equal(got.argmax(-1), live.argmax(-1)), step


def _silent_rank(rank: int, size: int, store: str, results: str):
    """Both ranks build a runner and make one step, but rank 1 never launches K2."""
    join_ranks(rank, size, store, "cpu")
    try:
        torch.set_num_threads(1)
        model = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), "cpu", torch.bfloat16,
                                      tp=TensorParallel.from_process_group())
        runner = MonoRunner(model, max_polls=20000)
        if rank == 1:
            launch = runner.launch
            runner.launch = lambda kernel, name, *args, **kw: None if name == "K2" else launch(kernel, name, *args,
                                                                                                **kw)
        error = None
        try:
            runner.step(model.make_cache(1, 16, 1), [3], [0], [0])
        except MonoSyncError as e:
            error = str(e)
        torch.save(error, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def _replaying_rank(rank: int, size: int, store: str, results: str, device: str):
    """300 steps alternating between two widths, each the same rows again (its KV rows rewritten
    with the same values), so the graph of each width replays from the second on."""
    device = join_ranks(rank, size, store, device)
    try:
        model = Model.from_checkpoint(SyntheticCheckpoint(tiny(), seed=5), device, torch.bfloat16,
                                      tp=TensorParallel.from_process_group())
        decoder = Decoder(model, "on")
        assert decoder.mono.graphs_enabled
        cache = decoder.make_cache(num_slots=2, max_context=32, max_step_rows=4)
        for slot, n in enumerate((5, 3)):
            decoder.model.step(cache, torch.arange(n) + 7 * slot, torch.arange(n), [slot] * n)
        steps = {1: ([11], [5], [0]), 6: ([11, 12, 13, 21, 22, 0], [5, 6, 7, 3, 4, 0], [0, 0, 0, 1, 1, -1])}
        first, mismatches = {}, 0
        for i in range(300):
            width = (1, 6)[i % 2]
            out = decoder.step(cache, *steps[width]).cpu()
            assert decoder.last_path == "mono"
            mismatches += width in first and not torch.equal(out, first[width])
            first.setdefault(width, out)
        torch.save({"first": first, "mismatches": mismatches, "graphs": len(decoder.mono.graphs)},
                   f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_graphs_over_two_ranks_replay_bit_exact(tmp_path, device):
    """Under tensor parallelism a step's graph holds its layers (the embedding's sum and the logits'
    gather run around it): 300 steps of two widths, every replay equal to the width's first
    result, and the ranks equal to each other."""
    results = str(tmp_path / "replays")
    mp.start_processes(_replaying_rank, args=(2, str(tmp_path / "store"), results, device), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(f"{results}.{rank}") for rank in range(2)]
    for result in ranks:
        assert result["mismatches"] == 0 and result["graphs"] == 2
    for width in (1, 6):
        assert torch.equal(ranks[0]["first"][width], ranks[1]["first"][width]), width


@pytest.mark.cpu  # CPU ranks under the interpreter
def test_a_rank_that_never_launches_makes_the_other_raise(tmp_path):
    """A sum over the ranks whose other rank never comes gives up (bounded) and names its stage."""
    results = str(tmp_path / "errors")
    mp.start_processes(_silent_rank, args=(2, str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
    error = torch.load(f"{results}.0")
    assert error is not None and "'k2 attention sum over ranks'" in error, error


def test_a_size_whose_slices_split_fp8_blocks_is_refused():
    from monodecode.mono.plan import MonoRefused
    from monodecode.mono.runner import MonoRunner

    config = preset("tiny", num_attention_heads=8, o_groups=8)  # 8 ranks: 16 shared-expert rows each, blocks of 32
    model = Model.from_checkpoint(SyntheticCheckpoint(config, seed=3), "cpu", torch.bfloat16)
    eighth = Model(model.config, model.w, "cpu", torch.bfloat16, model.checkpoint, tp=TensorParallel(rank=0, size=8))
    with pytest.raises(MonoRefused, match=r"tensor parallel size 8 gives each rank 16 rows of the shared expert's "
                                          r"w1 / w3 \(its intermediate\), not a multiple of the FP8 block 32"):
        MonoRunner(eighth)


@pytest.mark.cpu  # CPU ranks under the interpreter
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
        assert two.last_path == "mono" and two.mono.sync["k2"].epoch > 0
    finally:
        two.close()
    assert tokens == generate(load("tiny", dtype=torch.bfloat16, mono="on"), prompt, 2)


@pytest.mark.slow
@pytest.mark.cpu  # CPU ranks under the interpreter
def test_greedy_speculation_over_two_ranks_runs_the_draft_on_their_kernels():
    """`generate --speculative-config ... --tensor-parallel-size 2 --mono on`: rank 0's Decoder
    builds the draft's runner on every rank (`LeadingDraft.build_mono`), each proposal's stages
    run on them, and greedy speculation gives the ranks' own greedy decoding's tokens (lossless).
    `slow`: every verify step and draft pass runs interpreted on both ranks."""
    from monodecode.decode import load
    from monodecode.generate import generate, generate_speculative
    from monodecode.ranks import LeadingDraft
    from monodecode.spec.config import SpeculativeConfig

    prompt = [7, 70, 300, 12]
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5})
    two = load("tiny", dtype=torch.bfloat16, mono="on", tensor_parallel_size=2)
    try:
        fast, stats = generate_speculative(two, prompt, 4, spec)
        draft = two.draft()
        assert isinstance(draft, LeadingDraft) and draft.runner.sync["k2"].epoch >= stats.steps
        assert fast == generate(two, prompt, 4)
    finally:
        two.close()
