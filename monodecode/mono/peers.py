"""The ranks' sums inside the kernels (tensor parallelism): every rank pushes its partial sum of a
[R, N] bf16 tensor into every rank's inbox, then each sums all the ranks' parts in rank order.

Contract (`peer_sum_stage`; WORLD ranks, this one `site.rank`; a site is one place a launch sums):
- Tasks: `sum_tasks(R, N)` = R * ceil(N / COLUMNS); task t is row t // n_chunks, columns
  (t % n_chunks) * COLUMNS .. + COLUMNS (masked at N), n_chunks = ceil(N / COLUMNS). Program p
  takes tasks p, p + grid, ...; every program resident (the launches are cooperative), and every
  program pushes all its tasks before it waits on any, so no wait holds back a push.
- Push: for each of its tasks a program loads the tile of `src` [R, N] (row stride `stride`),
  stores it into every rank q's inbox (this rank's too) at [parity, rank, row, columns], parity =
  epoch % 2, then (a CTA barrier: the program's stores first) sets rank q's flag [parity, rank, t]
  to epoch + 1 with a release store at system scope.
- Sum: then, for each of its tasks again, it waits until its own flags [parity, q, t] equal
  epoch + 1 for every q (polls of volatile loads, then an acquire at system scope), and writes
  dst[row, columns] = bf16(sum over q = 0, 1, .., WORLD - 1 in that order of fp32(inbox[parity,
  q, row, columns])): `TensorParallel.reduce`'s rule, so every rank holds the same bits, and
  those of the host collective.
- Why two parities: a rank may start its next launch's push while a slower rank still reads this
  launch's inbox, but never two launches ahead (its next sum waits for the slower rank's next push,
  which that rank makes after its reads: stream order); the flags are per parity and compared for
  equality, so a flag of a launch two back never passes for this one's.
- Epoch: the launch family's (sync.py); every rank makes the same launches, so their epochs agree.
- Waits are bounded as the grid barriers' (sync.py): after `max_polls` polls the wait records
  `stage + 1` in the launch's error word and the program carries on, so a rank that died or never
  launched makes the others raise MonoSyncError naming the stage, not hang. After that the ranks'
  epochs no longer agree (the failed rank's sync state starts over): the runners must be rebuilt.
- Rounding: each rank's part is bf16 (its GEMV's output) and the sum is rounded to bf16 once.
- Memory (`PeerMemory`, one a runner, allocated by every rank at once): each rank's inboxes
  [2, WORLD, MAX_ROWS, N] bf16 and flags [2, WORLD, MAX_ROWS * n_chunks] int32 a site, mapped into
  every rank's address space: torch's symmetric memory on GPUs (NVLink peers), a shared file a
  rank on CPUs (`torch.from_file(shared=True)`: ranks of one host, Triton's interpreter, which
  runs each rank's programs in its own process, so the waits see the other process's stores).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .plan import MAX_ROWS, interpreted
from .rounding import bf16
from .sync import ERROR, SyncArgs, finish_launch, launch_epoch, wait_until

COLUMNS = 512  # columns a sum task carries: 8 tasks a row of a 4096-wide hidden state
_COLUMNS: tl.constexpr = tl.constexpr(COLUMNS)
_MAX_ROWS: tl.constexpr = tl.constexpr(MAX_ROWS)
_ERROR: tl.constexpr = tl.constexpr(ERROR)


class PeerSite(NamedTuple):
    """One place where a launch sums a [R, N] tensor over the ranks, as a kernel takes it."""

    inboxes: tuple  # every rank's inboxes [2, WORLD, MAX_ROWS, N] bf16, in rank order
    flags: tuple  # every rank's flags [2, WORLD, MAX_ROWS * ceil(N / COLUMNS)] int32, in rank order
    rank: int


def sum_tasks(R: int, N: int) -> int:
    return R * triton.cdiv(N, COLUMNS)


@triton.jit
def peer_sum_stage(pid, grid, site, src_ptr, dst_ptr, stride, R, N, sync, epoch, stage, WORLD: tl.constexpr,
                   FAST: tl.constexpr):
    """Program `pid`'s share of summing `src` over the ranks into `dst` (the module's contract), in
    stage `stage` of a launch of epoch `epoch` synchronised through `sync` (its SyncArgs)."""
    n_chunks = tl.cdiv(N, _COLUMNS)
    parity = epoch % 2
    tasks = R * n_chunks
    inbox_block = _MAX_ROWS * N  # one rank's part of one parity
    flag_block = _MAX_ROWS * n_chunks
    columns = tl.arange(0, _COLUMNS)
    for t in range(pid, tasks, grid):
        row = t // n_chunks
        cols = (t - row * n_chunks) * _COLUMNS + columns
        tile = tl.load(src_ptr + row * stride + cols, mask=cols < N)
        part = (parity * WORLD + site.rank) * inbox_block + row * N + cols
        for q in tl.static_range(WORLD):
            tl.store(site.inboxes[q] + part, tile, mask=cols < N)
        tl.debug_barrier()
        for q in tl.static_range(WORLD):
            tl.atomic_xchg(site.flags[q] + (parity * WORLD + site.rank) * flag_block + t, epoch + 1, sem="release",
                           scope="sys")
    own_inbox, own_flags = _own(site, WORLD)
    for t in range(pid, tasks, grid):
        row = t // n_chunks
        cols = (t - row * n_chunks) * _COLUMNS + columns
        total = tl.zeros((_COLUMNS,), dtype=tl.float32)
        for q in tl.static_range(WORLD):
            wait_until(own_flags + (parity * WORLD + q) * flag_block + t, epoch + 1, sync.words + _ERROR, stage,
                       sync.max_polls, True, "sys")
            # L2 loads (.cg): this SM's L1 may hold these addresses from two launches back
            total += tl.load(own_inbox + (parity * WORLD + q) * inbox_block + row * N + cols, mask=cols < N,
                             other=0.0, cache_modifier=".cg").to(tl.float32)
        if not FAST:
            total = bf16(total)
        tl.store(dst_ptr + row * stride + cols, total.to(tl.bfloat16), mask=cols < N)


@triton.jit
def _own(site, WORLD: tl.constexpr):
    """This rank's inbox and flags (site.rank is not a compile-time index into the tuples)."""
    own_inbox = site.inboxes[0]
    own_flags = site.flags[0]
    for q in tl.static_range(1, WORLD):
        if site.rank == q:
            own_inbox = site.inboxes[q]
            own_flags = site.flags[q]
    return own_inbox, own_flags


@triton.jit
def _peer_sums(site, src_ptr, dst_ptr, stride, R, N, sync, WORLD: tl.constexpr, FAST: tl.constexpr):
    """The standalone launch: one stage (0), no grid barrier."""
    epoch = launch_epoch(sync.words)
    peer_sum_stage(tl.program_id(0), tl.num_programs(0), site, src_ptr, dst_ptr, stride, R, N, sync, epoch, 0,
                   WORLD, FAST)
    finish_launch(sync.words, epoch)


def peer_sum(x: torch.Tensor, site: PeerSite, sync: SyncArgs, poison: bool = False) -> torch.Tensor:
    """The sum over the ranks of every rank's x [R, N] bf16 (R <= MAX_ROWS), as a standalone launch
    on `sync`'s words (the caller's `SyncState`: its epoch counts these launches; check it after);
    every rank calls it with its own x. `poison` fills the result with NaN first, so that a test
    sees any element no task wrote."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"peer_sum: x must be [R <= {MAX_ROWS}, N] bf16 with unit column stride, "
                         f"found {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.full_like(x, float("nan") if poison else 0.0)
    R, N = x.shape
    if interpreted():
        grid, options = 1, {}
    else:  # every program resident: a waiting program must not keep a peer's push from running
        grid = min(sum_tasks(R, N), torch.cuda.get_device_properties(x.device).multi_processor_count)
        options = {"launch_cooperative_grid": True}
    _peer_sums[(grid,)](site, x, y, x.stride(0), R, N, sync, WORLD=len(site.inboxes), FAST=not interpreted(),
                        **options)
    return y


class PeerMemory:
    """Memory every rank of a tensor-parallel group reads and writes: one region a rank, of the
    same size on every rank (`regions`, in rank order, as this rank addresses them), carved into
    sites (`site`), one a place the kernels sum at, each of N columns."""

    def __init__(self, regions: list[torch.Tensor], rank: int, columns: list[int]):
        self.regions, self.rank, self.columns = regions, rank, columns
        self.site_bytes = [site_bytes(len(regions), n) for n in columns]
        if any(r.numel() != sum(self.site_bytes) or r.dtype != torch.uint8 for r in regions):
            raise ValueError(f"peer memory: every rank's region must be {sum(self.site_bytes)} bytes (uint8)")

    @classmethod
    def allocate(cls, tp, device, columns: list[int]) -> "PeerMemory":
        """Every rank's region of `tp`'s group (size > 1) for sites of `columns`, zeroed: a
        collective, which every rank makes at the same point (its runner's construction)."""
        nbytes = sum(site_bytes(tp.size, n) for n in columns)
        device = torch.device(device)
        regions = _cuda_regions(tp, device, nbytes) if device.type == "cuda" else _shared_files(tp, nbytes)
        return cls(regions, tp.rank, columns)

    def site(self, index: int) -> PeerSite:
        """Site `index`'s inboxes and flags on every rank."""
        n, world = self.columns[index], len(self.regions)
        start = sum(self.site_bytes[:index])
        inbox_bytes = 2 * world * MAX_ROWS * n * 2
        flags = 2 * world * MAX_ROWS * triton.cdiv(n, COLUMNS)
        views = [region[start:start + self.site_bytes[index]] for region in self.regions]
        return PeerSite(inboxes=tuple(v[:inbox_bytes].view(torch.bfloat16) for v in views),
                        flags=tuple(v[inbox_bytes:inbox_bytes + 4 * flags].view(torch.int32) for v in views),
                        rank=self.rank)


def site_bytes(world: int, n: int) -> int:
    """A site's bytes a rank: its inboxes, then its flags, rounded up to 256 bytes."""
    inbox = 2 * world * MAX_ROWS * n * 2
    flags = 4 * 2 * world * MAX_ROWS * triton.cdiv(n, COLUMNS)
    return -(-(inbox + flags) // 256) * 256


def _shared_files(tp, nbytes: int) -> list[torch.Tensor]:
    """Every rank's region as shared file mappings (CPU ranks of one host), zeroed: rank 0 makes a
    folder, each rank a file in it, every rank maps them all, then rank 0 removes the folder (the
    mappings stay)."""
    where = [tempfile.mkdtemp(prefix="monodecode-peers-") if tp.rank == 0 else None]
    dist.broadcast_object_list(where, src=_global_rank(tp, 0), group=tp.group)
    folder = Path(where[0])
    own = torch.from_file(str(folder / f"rank{tp.rank}"), shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=tp.group)
    regions = [own if q == tp.rank else torch.from_file(str(folder / f"rank{q}"), shared=True, size=nbytes,
                                                        dtype=torch.uint8) for q in range(tp.size)]
    dist.barrier(group=tp.group)
    if tp.rank == 0:
        shutil.rmtree(folder)
    return regions


def _cuda_regions(tp, device: torch.device, nbytes: int) -> list[torch.Tensor]:
    """Every rank's region as torch symmetric memory, zeroed before any rank can push into it."""
    from torch.distributed import _symmetric_memory as symmetric

    group = tp.group or dist.group.WORLD
    own = symmetric.empty(nbytes, dtype=torch.uint8, device=device)
    own.zero_()
    handle = symmetric.rendezvous(own, group.group_name)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return [own if q == tp.rank else handle.get_buffer(q, (nbytes,), torch.uint8) for q in range(tp.size)]


def _global_rank(tp, rank: int) -> int:
    """The default group's rank of the group's rank `rank` (broadcast names its source so)."""
    return rank if tp.group is None else dist.get_global_rank(tp.group, rank)
