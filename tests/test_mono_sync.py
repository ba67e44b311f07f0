"""Persistent-kernel synchronisation: barriers across programs, the device epoch, bounded waits.

On the CPU the kernel runs under Triton's interpreter with grid=(1,) (one program takes every
task, in order); with MONODECODE_TEST_DEVICE=cuda it runs one program per SM, cooperatively, with
either wait: every thread polling (the interpreter's), or one thread a program (`sync.leader_wait`,
the compiled builds' wait; PTX: GPU only).
"""

import pytest
import torch
import triton
import triton.language as tl

from monodecode.mono import sync

TASKS = 300
STAGES = ["write", "rotate"]


@triton.jit
def _two_stages(data_ptr, out_ptr, sync_ptr, max_polls, extra_target, TASKS_: tl.constexpr,
                LEADER: tl.constexpr):
    """Stage 0: task t writes data[t] = 10 t + epoch. Barrier. Stage 1: task t reads the value
    another program wrote, data[(t + 7) % TASKS], and writes it + 1 to out[t]. Barrier.
    `extra_target` > 0 makes the second barrier wait for arrivals that never come."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = sync.launch_epoch(sync_ptr)
    for t in range(pid, TASKS_, grid):
        tl.store(data_ptr + t, 10 * t + epoch)
    sync.grid_barrier(sync_ptr, epoch, 0, 2, max_polls, data_ptr, False, LEADER)
    for t in range(pid, TASKS_, grid):
        tl.store(out_ptr + t, tl.load(data_ptr + (t + 7) % TASKS_) + 1)
    sync.grid_barrier(sync_ptr, epoch + extra_target, 1, 2, max_polls, data_ptr, False, LEADER)
    sync.finish_launch(sync_ptr, epoch)


def launch(device, state, data, out, max_polls=sync.DEFAULT_MAX_POLLS, extra_target=0, leader=False):
    on_gpu = device != "cpu"
    grid = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
    extra = {"launch_cooperative_grid": True} if on_gpu else {}
    _two_stages[(grid,)](data, out, state.words, max_polls, extra_target, TASKS_=TASKS, LEADER=leader, **extra)


# the leader's wait is PTX: compiled GPU builds only
WAITS = ["all", pytest.param("leader", marks=pytest.mark.gpu)]


def expected(epoch):
    t = torch.arange(TASKS)
    return 10 * ((t + 7) % TASKS) + epoch + 1


@pytest.mark.parametrize("wait", WAITS)
def test_barriers_order_stages_across_programs_and_the_epoch_advances(device, wait):
    state = sync.SyncState(device, STAGES)
    data = torch.full((TASKS,), -1, dtype=torch.int32, device=device)
    for epoch in range(3):
        out = torch.full((TASKS,), -1, dtype=torch.int32, device=device)  # poison
        launch(device, state, data, out, leader=wait == "leader")
        state.check()
        assert state.epoch == epoch + 1
        assert torch.equal(out.cpu(), expected(epoch).to(torch.int32))


@pytest.mark.parametrize("wait", WAITS)
def test_an_expired_wait_is_reported_not_hung(device, wait):
    state = sync.SyncState(device, STAGES)
    data = torch.zeros(TASKS, dtype=torch.int32, device=device)
    out = torch.zeros(TASKS, dtype=torch.int32, device=device)
    launch(device, state, data, out, max_polls=1000, extra_target=5, leader=wait == "leader")  # must still end
    assert state.epoch == 1  # the launch finished and advanced the epoch
    with pytest.raises(sync.MonoSyncError, match="stage 'rotate'"):
        state.check()
    state.check()  # the error was consumed: the next launches are judged on their own
    assert state.epoch == 0  # and the counters started over
    out.fill_(-1)
    launch(device, state, data, out, leader=wait == "leader")
    state.check()
    assert torch.equal(out.cpu(), expected(0).to(torch.int32))


@pytest.mark.gpu
def test_graph_replays_advance_the_epoch_on_the_device(device):
    state = sync.SyncState(device, STAGES)
    data = torch.zeros(TASKS, dtype=torch.int32, device=device)
    out = torch.zeros(TASKS, dtype=torch.int32, device=device)
    launch(device, state, data, out)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(device, state, data, out)
    for replay in range(200):
        graph.replay()
    torch.cuda.synchronize()
    state.check()
    assert state.epoch == 1 + 200  # the warm-up launch and 200 replays (capture runs nothing)
    assert torch.equal(out.cpu(), expected(state.epoch - 1).to(torch.int32))
