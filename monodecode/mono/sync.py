"""Synchronisation of persistent kernels: monotonic counters, bounded waits, a device epoch.

Invariants (docs/ARCHITECTURE.md, "Kernel rules")
- One program per SM, all co-resident: a wait on a program that never got scheduled would never
  end, so launches that wait across programs are cooperative (`launch_cooperative_grid=True`):
  the driver refuses a grid that cannot be co-resident instead of letting it hang.
- Counters only grow; nothing on the host resets them. A launch reads the device-resident epoch
  `e` at its start and derives every target from it: barrier k of a launch with B barriers waits
  for `(e * B + k + 1) * grid` arrivals. So a CUDA graph replays the launch as is.
- The epoch advances on the device: every program arrives at an exit counter; the program that
  arrives last has seen every other program finish, so none still needs to read `e`, and it
  stores `e + 1`.
- Producer: its stores, a CTA barrier, then one release atomic at gpu scope (cumulativity
  publishes the whole CTA's writes). Consumer, in a compiled NVIDIA build (LEADER): one thread
  of the program polls with acquire loads and a CTA barrier holds the others until it is
  through (`leader_wait`, PTX); under the interpreter, which has no PTX, every thread polls
  with volatile loads (never hoisted or cached) and an acquire atomic ends the wait
  (`wait_at_least`).
- Waits are bounded: after `max_polls` polls a wait gives up, records `stage + 1` in the error
  word (the first error wins), and the kernel carries on to its end without waiting again, so
  the launch finishes; the host then raises `MonoSyncError` naming the stage. A hung GPU is
  never the failure mode.
- Under `TRITON_INTERPRET=1` programs run one after another, so a kernel runs there with
  grid=(1,): one program takes every task in order and every wait is already satisfied.

The state lives in one int32 buffer (`SyncState.words`): [epoch, error, exit counter, barrier
counter], each on its own 32-word line so that contended atomics do not share a line.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LINE = 32  # int32 words per 128-byte line
EPOCH, ERROR, EXIT, BARRIER = 0, LINE, 2 * LINE, 3 * LINE
WORDS = 4 * LINE
DEFAULT_MAX_POLLS = 1 << 22  # seconds of polling on an H200: far past any real wait
_ERROR: tl.constexpr = tl.constexpr(ERROR)
_EXIT: tl.constexpr = tl.constexpr(EXIT)
_BARRIER: tl.constexpr = tl.constexpr(BARRIER)
TIMELINE_SLOTS = 32  # per program: start, 2 per barrier (up to 15), end
_TIMELINE_SLOTS: tl.constexpr = tl.constexpr(TIMELINE_SLOTS)


class SyncArgs(NamedTuple):
    """What a persistent launch synchronises through, as its kernel takes it."""

    words: torch.Tensor  # SyncState.words of the launch's family
    max_polls: int  # polls before a wait gives up
    timeline: torch.Tensor  # [grid, TIMELINE_SLOTS] int64 stamps, written only with TIMELINE


class MonoSyncError(RuntimeError):
    """A persistent kernel's wait expired; the message names the stage that was waiting."""


class SyncState:
    """The device words of one family of persistent launches (one epoch, its counters)."""

    def __init__(self, device, stage_names: list[str]):
        self.words = torch.zeros(WORDS, dtype=torch.int32, device=device)
        self.stage_names = stage_names

    @property
    def epoch(self) -> int:
        return int(self.words[EPOCH])

    def check(self) -> None:
        """Raise MonoSyncError if a wait expired in a launch since the last check (a host sync).
        The counters then start over from zero: the failed launches have all finished (their
        waits gave up), so nothing is waiting on them, and later launches stay consistent."""
        error = int(self.words[ERROR])
        if error:
            self.words.zero_()
            name = self.stage_names[error - 1] if error - 1 < len(self.stage_names) else f"#{error - 1}"
            raise MonoSyncError(
                f"a persistent kernel gave up waiting in stage {name!r}: a program it waited on never "
                "arrived (grid not co-resident, a wrong target, or, in a sum over tensor-parallel ranks, "
                "another rank that failed or never launched); its outputs are invalid")


@triton.jit
def signal(counter_ptr):
    """Publish this CTA's stores: CTA barrier, then one release increment at gpu scope."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def arrive(counter_ptr):
    """Publish this CTA's stores and count its arrival: CTA barrier, one acq_rel increment at gpu
    scope, CTA barrier. Returns the count before it: the arrival that sees n - 1 of n is the last,
    and every earlier arrival's stores are visible to the whole CTA."""
    tl.debug_barrier()
    before = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    return before


@triton.jit
def wait_at_least(counter_ptr, target, error_ptr, stage, max_polls):
    """Wait until *counter_ptr >= target; acquire on success. After `max_polls` polls record
    `stage + 1` in the error word (if none is there) and return False. Skips the wait, returning
    False, when an error is already recorded: the launch is lost and must finish."""
    return wait_until(counter_ptr, target, error_ptr, stage, max_polls, False, "gpu")


@triton.jit
def wait_until(word_ptr, target, error_ptr, stage, max_polls, EXACT: tl.constexpr, SCOPE: tl.constexpr):
    """`wait_at_least`, for *word_ptr == target with EXACT, its acquire at SCOPE ("gpu", or "sys"
    for a word other devices write: peers.py)."""
    state = tl.where(tl.load(error_ptr, volatile=True) == 0, 0, 2)  # 0 waiting, 1 done, 2 failed
    polls = 0
    while state == 0:
        value = tl.load(word_ptr, volatile=True)
        if EXACT:
            arrived = value == target
        else:
            arrived = value >= target
        if arrived:
            tl.atomic_add(word_ptr, 0, sem="acquire", scope=SCOPE)  # on the exit path
            state = 1
        else:
            polls += 1
            if polls >= max_polls:
                tl.atomic_cas(error_ptr, 0, stage + 1, sem="relaxed", scope="gpu")
                state = 2
    tl.debug_barrier()
    return state == 1


# One thread of the program waits (LEADER): it reads the error word and the counter together, then
# polls the counter with acquire loads (no separate acquire atomic), bounded, recording `stage + 1`
# in the error word if the polls run out; returns 1 (arrived) or 2 (gave up, or an earlier wait
# had), 1 in every other thread. The CTA barrier after it holds the program's other threads back
# and, after the leader's acquire, orders their reads after the other programs' published writes.
# Labels and registers are local to the braces, so the block can be inlined at every barrier.
_LEADER_WAIT: tl.constexpr = tl.constexpr("""{
.reg .pred %lw_p;
.reg .u32 %lw_t, %lw_e, %lw_c;
.reg .s32 %lw_v, %lw_n;
mov.u32 $0, 1;
mov.u32 %lw_t, %tid.x;
setp.ne.u32 %lw_p, %lw_t, 0;
@%lw_p bra LW_DONE;
ld.relaxed.gpu.global.u32 %lw_e, [$3];
ld.acquire.gpu.global.s32 %lw_v, [$1];
setp.ne.u32 %lw_p, %lw_e, 0;
@%lw_p bra LW_FAILED;
mov.s32 %lw_n, 0;
LW_POLL:
setp.ge.s32 %lw_p, %lw_v, $2;
@%lw_p bra LW_DONE;
add.s32 %lw_n, %lw_n, 1;
setp.ge.s32 %lw_p, %lw_n, $5;
@%lw_p bra LW_EXPIRED;
ld.acquire.gpu.global.s32 %lw_v, [$1];
bra LW_POLL;
LW_EXPIRED:
atom.relaxed.gpu.global.cas.b32 %lw_c, [$3], 0, $4;
LW_FAILED:
mov.u32 $0, 2;
LW_DONE:
}""")


@triton.jit
def leader_wait(counter_ptr, target, error_ptr, stage, max_polls):
    """`wait_at_least` with one thread of the program polling (NVIDIA PTX: compiled builds only)."""
    state = tl.inline_asm_elementwise(_LEADER_WAIT, "=r,l,r,l,r,r",
                                      [counter_ptr, target, error_ptr, stage + 1, max_polls],
                                      dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    return state == 1


@triton.jit
def grid_barrier(sync_ptr, epoch, k, num_barriers, max_polls, timeline_ptr, TIMELINE: tl.constexpr,
                 LEADER: tl.constexpr):
    """Barrier k of a launch with `num_barriers` barriers: every program's earlier stores are
    visible to every program after it. A wait that expires names stage k (the stage before it).
    Returns False if the wait expired (or already had; with LEADER, in the waiting thread only).
    With TIMELINE, stamps this program's arrival and release (slots 2k + 1 and 2k + 2, see
    `stamp`). LEADER (compiled NVIDIA builds): one thread a program polls (`leader_wait`), the
    others wait at a CTA barrier; else every thread polls (`wait_at_least`)."""
    grid = tl.num_programs(0)
    stamp(timeline_ptr, 2 * k + 1, TIMELINE)
    signal(sync_ptr + _BARRIER)
    target = (epoch * num_barriers + k + 1) * grid
    if LEADER:
        done = leader_wait(sync_ptr + _BARRIER, target, sync_ptr + _ERROR, k, max_polls)
    else:
        done = wait_at_least(sync_ptr + _BARRIER, target, sync_ptr + _ERROR, k, max_polls)
    stamp(timeline_ptr, 2 * k + 2, TIMELINE)
    return done


@triton.jit
def barrier(sync, epoch, k, num_barriers, TIMELINE: tl.constexpr, LEADER: tl.constexpr):
    """`grid_barrier` k of `num_barriers` for a launch's `SyncArgs`."""
    return grid_barrier(sync.words, epoch, k, num_barriers, sync.max_polls, sync.timeline, TIMELINE, LEADER)


@triton.jit
def pass_barriers(sync, FIRST: tl.constexpr, COUNT: tl.constexpr, TIMELINE: tl.constexpr):
    """Barriers FIRST .. FIRST + COUNT - 1 passed by without waiting: this program's COUNT arrivals
    counted by one relaxed increment (the launch's later barriers' targets hold, and their release
    publishes what came before) and each stamped as arrival and release. Only where every program
    of the launch passes them so, and no stage between them reads what one before it wrote."""
    for k in tl.static_range(FIRST, FIRST + COUNT):
        stamp(sync.timeline, 2 * k + 1, TIMELINE)
        stamp(sync.timeline, 2 * k + 2, TIMELINE)
    tl.atomic_add(sync.words + _BARRIER, COUNT, sem="relaxed", scope="gpu")


@triton.jit
def clock_ns():
    """The GPU's global timer (ns; NVIDIA PTX, so compiled only when a timeline is asked for)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def stamp(timeline_ptr, slot, TIMELINE: tl.constexpr):
    """With TIMELINE, record the time in timeline[program, slot] ([grid, TIMELINE_SLOTS] int64).
    Slots: 0 the launch's start, 2k + 1 / 2k + 2 arrival at / release from barrier k, and
    2B + 1 the end of a launch with B barriers."""
    if TIMELINE:
        tl.store(timeline_ptr + tl.program_id(0) * _TIMELINE_SLOTS + slot, clock_ns())


@triton.jit
def begin_launch(sync, TIMELINE: tl.constexpr):
    """A persistent launch's first step (`sync`: its SyncArgs); returns its epoch."""
    epoch = launch_epoch(sync.words)
    stamp(sync.timeline, 0, TIMELINE)
    return epoch


@triton.jit
def end_launch(sync, epoch, BARRIERS: tl.constexpr, TIMELINE: tl.constexpr):
    """A persistent launch's last step, after its last stage (it has BARRIERS barriers)."""
    stamp(sync.timeline, 2 * BARRIERS + 1, TIMELINE)
    finish_launch(sync.words, epoch)


@triton.jit
def launch_epoch(sync_ptr):
    """The epoch this launch runs in (read once, at the start)."""
    return tl.load(sync_ptr, volatile=True)


@triton.jit
def finish_launch(sync_ptr, epoch):
    """Arrive at the exit counter; the last program to arrive advances the epoch."""
    grid = tl.num_programs(0)
    if arrive(sync_ptr + _EXIT) == (epoch + 1) * grid - 1:
        tl.atomic_xchg(sync_ptr, epoch + 1, sem="release", scope="gpu")
