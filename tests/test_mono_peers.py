"""The ranks' sums inside the kernels (mono/peers.py): two processes, on the CPU over gloo with
shared files for peer memory, each running the standalone sum launch under Triton's interpreter
(with MONODECODE_TEST_DEVICE=cuda and two GPUs: NCCL and symmetric memory, compiled).

Each rank sums its own random bf16 part over several launches (both parities, widths of 1, 5 and
48 rows, a width that leaves the last column task part-full): the result must be
`TensorParallel.reduce`'s bit for bit on both ranks. Then rank 0 launches once more without rank 1:
its wait must expire and name the stage, not hang.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from monodecode.model.parallel import TensorParallel
from monodecode.ranks import join_ranks
from monodecode.mono.peers import PeerMemory, peer_sum, site_bytes, sum_tasks
from monodecode.mono.plan import MAX_ROWS
from monodecode.mono.sync import MonoSyncError, SyncArgs, SyncState

DEVICE = os.environ.get("MONODECODE_TEST_DEVICE", "cpu")

WIDTHS = (1, 5, 48)
COLUMNS = 1100  # two whole 512-column tasks a row and a part-full one


def _rank(rank: int, size: int, store: str, results: str, device: str):
    device = join_ranks(rank, size, store, device)
    try:
        torch.set_num_threads(1)
        tp = TensorParallel.from_process_group()
        site = PeerMemory.allocate(tp, device, [COLUMNS]).site(0)
        state = SyncState(device, ["peer sum"])
        out = []
        for launch, rows in enumerate(WIDTHS):
            g = torch.Generator().manual_seed(100 * launch + rank)
            x = torch.randn(rows, COLUMNS, generator=g).to(device, torch.bfloat16)
            y = peer_sum(x, site, SyncArgs(state.words, 1 << 20, state.words), poison=True)
            state.check()
            out.append((y.cpu(), tp.reduce(x).cpu()))
        error = None
        if rank == 0:  # rank 1 never comes: the wait must give up
            x = torch.randn(2, COLUMNS).to(device, torch.bfloat16)
            peer_sum(x, site, SyncArgs(state.words, 2000, state.words))
            try:
                state.check()
            except MonoSyncError as e:
                error = str(e)
        torch.save({"sums": out, "epoch": state.epoch, "error": error}, f"{results}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_sum_their_parts_in_the_kernel(tmp_path, device):
    """On the CPU the ranks' memory is shared files, on GPUs torch's symmetric memory."""
    results = str(tmp_path / "sums")
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), results, device), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{results}.{rank}") for rank in range(2)]
    for launch, rows in enumerate(WIDTHS):
        for result in ranks:
            got, want = result["sums"][launch]
            assert got.shape == (rows, COLUMNS)
            assert torch.equal(got, want), launch  # the host collective's bits, NaN-poisoned elements none
        assert torch.equal(ranks[0]["sums"][launch][0], ranks[1]["sums"][launch][0])
    assert ranks[1]["epoch"] == len(WIDTHS)
    assert ranks[1]["error"] is None
    assert "peer sum" in ranks[0]["error"], ranks[0]["error"]


def test_a_sum_of_too_many_rows_is_refused():
    with pytest.raises(ValueError, match="R <= 48"):
        peer_sum(torch.zeros(49, 8, dtype=torch.bfloat16), None, None)


def test_a_rank_one_launch_ahead_does_not_overwrite_what_this_one_reads(device):
    """Rank 1 (simulated in rank 0's peer memory) has pushed its parts of launch 0 and launch 1
    before rank 0 sums launch 0: rank 0 must read launch 0's (its parity's inbox), then launch 1's.
    On a GPU: the compiled sum stage (system-scope flags, L2 loads) on one device."""
    rows, world = 3, 2
    regions = [torch.zeros(site_bytes(world, COLUMNS), dtype=torch.uint8, device=device) for _ in range(world)]
    site = PeerMemory(regions, 0, [COLUMNS]).site(0)
    inbox, flags = site.inboxes[0].view(2, world, MAX_ROWS, COLUMNS), site.flags[0].view(2, world, -1)
    theirs = [torch.randn(rows, COLUMNS, device=device).to(torch.bfloat16) for _ in range(2)]
    for launch, part in enumerate(theirs):  # what rank 1's launches 0 and 1 push into rank 0's memory
        inbox[launch % 2, 1, :rows] = part
        flags[launch % 2, 1, :sum_tasks(rows, COLUMNS)] = launch + 1
    state = SyncState(device, ["peer sum"])
    for launch, part in enumerate(theirs):
        mine = torch.randn(rows, COLUMNS, device=device).to(torch.bfloat16)
        got = peer_sum(mine, site, SyncArgs(state.words, 1000, state.words), poison=True)
        state.check()
        assert torch.equal(got, (mine.float() + part.float()).to(torch.bfloat16)), launch
