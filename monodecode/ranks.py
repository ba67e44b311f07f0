"""A model over N processes, one a device (tensor parallelism: model/parallel.py), per-op or on the kernels.

`load_ranks(source, size, ...)`: this process becomes rank 0 and starts ranks 1 .. N-1
(spawned; each loads its own part of the checkpoint on its own device: rank r on cuda:r, or all
on the CPU). It returns a `LeadingModel`: the model's interface (config, device, dtype, tp,
checkpoint, make_cache, step, score, draft) for the engine, `generate` and the server, which
sends each call that reads or changes model state to the other ranks before making it itself.
The other ranks (`follow`) make the same calls in the same order, so every collective of a step
meets its partners. Caches are mirrored: each rank holds its own copy; the leader's
`MirroredCache` forwards `clear` and copies (`copy.deepcopy`: each rank copies its own). The
DSpark draft likewise (`LeadingDraft`: make_cache, commit, propose, with the settings and
uniforms of rank 0's requests, so every rank drafts the same tokens; rank 0's proposal is the
one used; with the kernels in use, each rank runs the draft's stages on its own `DraftRunner`,
`LeadingDraft.build_mono`). The mono kernels likewise
(`LeadingModel.build_mono`, which a `decode.Decoder` over it calls: every rank builds its own
runner on its own part, and `LeadingRunner.step` sends each step the kernels take; whether they
take it depends only on the step's rows and the cache, alike on every rank).
Commands travel over a gloo group (Python objects) whatever carries the model's reductions
(gloo on CPUs, NCCL on GPUs). `LeadingModel.close` (also at exit) stops the ranks; a rank whose
leader vanished gets an error from its wait and exits, and every wait gives up after
`TIMEOUT` (a rank that died makes the others raise, not hang).
"""

from __future__ import annotations

import atexit
import copy
import itertools
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .model import load_model
from .model.parallel import TensorParallel
from .presets import load_config
from .sampling import RowSettings

class RankError(RuntimeError):
    """Another tensor-parallel rank failed or exited while this one started."""


TIMEOUT = timedelta(minutes=10)  # a collective's longest wait: loading a shard takes minutes


def rank_device(device, rank: int) -> torch.device:
    """Rank r's device: cuda:(index + r) for a GPU `device`, the CPU for the CPU."""
    device = torch.device(device)
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def join_ranks(rank: int, size: int, store: str, device) -> torch.device:
    """Join the default process group as `rank` of `size` (NCCL for GPUs, gloo on the CPU; `store`
    a file path every rank is given) on this rank's device (`rank_device` of `device`), and return
    that device."""
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives (all_gather_object too) use the current device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=size, timeout=TIMEOUT)
    return device


def _join(rank: int, size: int, store: str, device) -> tuple[torch.device, object]:
    """`join_ranks`, and the group commands travel over: (this rank's device, that group)."""
    device = join_ranks(rank, size, store, device)
    return device, dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else dist.group.WORLD


def _plain(values) -> list:
    return values.tolist() if torch.is_tensor(values) else list(values)


class MirroredCache:
    """The leader's cache: its own copy, whose changes outside a step reach the other ranks."""

    def __init__(self, local, cache_id: int, leader: "LeadingModel"):
        self.local, self.id, self._leader = local, cache_id, leader

    def clear(self, slot: int) -> None:
        self._leader.send("clear", self.id, slot)
        self.local.clear(slot)

    def __deepcopy__(self, memo) -> "MirroredCache":
        """A copy on every rank (each rank copies its own), under a new id."""
        copy_id = next(self._leader.ids)
        self._leader.send("copy_cache", self.id, copy_id)
        return MirroredCache(copy.deepcopy(self.local, memo), copy_id, self._leader)

    def __getattr__(self, name):
        return getattr(self.local, name)


class LeadingModel:
    """Rank 0's model: every state-changing call is sent to the other ranks, then made here."""

    def __init__(self, model, control, ranks):
        self.model, self._control, self._ranks = model, control, ranks
        self.ids = itertools.count()
        self._draft = None
        self._closed = False
        atexit.register(self.close)

    config = property(lambda self: self.model.config)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    tp = property(lambda self: self.model.tp)
    checkpoint = property(lambda self: self.model.checkpoint)

    def send(self, *command) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel ranks were stopped (LeadingModel.close)")
        dist.broadcast_object_list([command], src=0, group=self._control)

    def make_cache(self, num_slots: int, max_context: int, max_step_rows: int = 8) -> MirroredCache:
        cache_id = next(self.ids)
        self.send("make_cache", cache_id, num_slots, max_context, max_step_rows)
        return MirroredCache(self.model.make_cache(num_slots, max_context, max_step_rows), cache_id, self)

    def step(self, cache: MirroredCache, tokens, positions, slots, return_hidden: bool = False):
        tokens, positions, slots = _plain(tokens), _plain(positions), _plain(slots)
        self.send("step", cache.id, tokens, positions, slots, return_hidden)
        return self.model.step(cache.local, tokens, positions, slots, return_hidden=return_hidden)

    def score(self, token_ids) -> torch.Tensor:
        token_ids = _plain(token_ids)
        self.send("score", token_ids)
        return self.model.score(token_ids)

    def build_mono(self, mono: str):
        """Every rank's mono runner for `mono` ("off", "auto", "on": `mono.build`), each on its own
        part; rank 0's as a `LeadingRunner`, or None (off, or refused under "auto"). The command
        goes first: building can launch the kernels, whose reductions need every rank. A rank
        that refuses under "on" raises here on rank 0 (the others refuse alike and go on)."""
        from .mono import build, check_mode

        check_mode(mono)
        if mono == "off":
            return None
        self.send("mono", mono)
        runner = build(self.model, mono)
        return None if runner is None else LeadingRunner(runner, self)

    def draft(self) -> "LeadingDraft":
        if self._draft is None:
            self.send("draft")
            self._draft = LeadingDraft(self.model.draft(), self)
        return self._draft

    def close(self) -> None:
        """Stop the other ranks and leave the process group (once; also at exit)."""
        if self._closed:
            return
        self.send("stop")
        self._closed = True
        while not self._ranks.join():
            pass
        dist.destroy_process_group()


class LeadingRunner:
    """Rank 0's mono runner: each step the kernels take is sent to the other ranks, then run here;
    everything else is the runner's own (its refusal is the same on every rank)."""

    def __init__(self, runner, leader: LeadingModel):
        self.runner, self._leader = runner, leader

    def refusal(self, cache: MirroredCache, tokens, positions, slots) -> str | None:
        return self.runner.refusal(cache.local, tokens, positions, slots)

    def step(self, cache: MirroredCache, tokens, positions, slots, return_hidden: bool = False,
             refusal_checked: bool = False):
        tokens, positions, slots = _plain(tokens), _plain(positions), _plain(slots)
        self._leader.send("mono_step", cache.id, tokens, positions, slots, return_hidden)
        return self.runner.step(cache.local, tokens, positions, slots, return_hidden=return_hidden,
                                refusal_checked=refusal_checked)

    def __getattr__(self, name):
        return getattr(self.runner, name)


class LeadingDraft:
    """Rank 0's DSpark draft: each call is sent to the other ranks, then made here. After
    `build_mono`, every rank runs the draft's stages on its own kernels for the blocks they take."""

    def __init__(self, draft, leader: LeadingModel):
        self.draft, self._leader = draft, leader
        self.runner = None  # rank 0's DraftRunner, once built

    def build_mono(self) -> "LeadingDraft":
        """Every rank's `DraftRunner` on its own part (the command first: building can launch the
        kernels, whose reductions need every rank). MonoRefused here where rank 0's refuses; the
        other ranks refuse alike and stay per-op."""
        from .mono.draft_runner import DraftRunner

        self._leader.send("draft_mono")
        self.runner = DraftRunner(self.draft.model, self.draft)
        return self

    block_size = property(lambda self: self.draft.block_size)

    def make_cache(self, num_slots: int) -> MirroredCache:
        cache_id = next(self._leader.ids)
        self._leader.send("draft_make_cache", cache_id, num_slots)
        return MirroredCache(self.draft.make_cache(num_slots), cache_id, self._leader)

    def commit(self, cache: MirroredCache, slot: int | list[int], positions: torch.Tensor, hidden: torch.Tensor) -> None:
        self._leader.send("draft_commit", cache.id, slot, _plain(positions), hidden.cpu())
        self.draft.commit(cache.local, slot, positions, hidden)

    def propose(self, cache: MirroredCache, anchors, anchor_positions, slots, settings, uniforms):
        kernels = self.runner is not None and self.runner.takes(len(slots))
        plain_settings = (settings.values.cpu(), settings.greedy, settings.filters)
        self._leader.send("draft_propose", cache.id, _plain(anchors), _plain(anchor_positions), list(slots),
                          plain_settings, None if uniforms is None else uniforms.cpu(), kernels)
        return self.draft.propose(cache.local, anchors, anchor_positions, slots, settings, uniforms,
                                  stages=self.runner.stages(cache.local) if kernels else None)


def _follow(index: int, size: int, store: str, source: str, device: str, dtype: torch.dtype, seed: int,
            overrides: dict | None):
    """Rank index + 1: load its part, then make the leader's calls until told to stop."""
    rank = index + 1
    device, control = _join(rank, size, store, device)
    model = load_model(source, device=device, dtype=dtype, seed=seed, tp=TensorParallel.from_process_group(),
                       overrides=overrides)
    caches, draft, runner, draft_runner = {}, None, None, None

    def as_tensor(values):
        return torch.as_tensor(values, device=model.device)

    while True:
        received = [None]
        dist.broadcast_object_list(received, src=0, group=control)
        name, *args = received[0]
        if name == "stop":
            break
        try:
            if name == "make_cache":
                cache_id, *shape = args
                caches[cache_id] = model.make_cache(*shape)
            elif name == "step":
                cache_id, tokens, positions, slots, return_hidden = args
                model.step(caches[cache_id], tokens, positions, slots, return_hidden=return_hidden)
            elif name == "clear":
                cache_id, slot = args
                caches[cache_id].clear(slot)
            elif name == "copy_cache":
                cache_id, copy_id = args
                caches[copy_id] = copy.deepcopy(caches[cache_id])
            elif name == "score":
                model.score(*args)
            elif name == "mono":
                runner = _follower_runner(model, *args)
            elif name == "mono_step":
                cache_id, tokens, positions, slots, return_hidden = args
                runner.step(caches[cache_id], tokens, positions, slots, return_hidden=return_hidden)
            elif name == "draft":
                draft = model.draft()
            elif name == "draft_make_cache":
                cache_id, num_slots = args
                caches[cache_id] = draft.make_cache(num_slots)
            elif name == "draft_commit":
                cache_id, slot, positions, hidden = args
                draft.commit(caches[cache_id], slot, as_tensor(positions), hidden.to(model.device))
            elif name == "draft_mono":
                draft_runner = _follower_draft_runner(model, draft)
            elif name == "draft_propose":
                cache_id, anchors, anchor_positions, slots, (values, greedy, filters), uniforms, kernels = args
                settings = RowSettings(values.to(model.device), greedy, filters)
                draft.propose(caches[cache_id], as_tensor(anchors), as_tensor(anchor_positions), slots, settings,
                              None if uniforms is None else uniforms.to(model.device),
                              stages=draft_runner.stages(caches[cache_id]) if kernels else None)
            else:
                raise RankError(f"tensor-parallel rank {rank}: unknown command {name!r} from rank 0")
        except ValueError:
            pass  # bad input (a row out of range): rank 0 refused it too, by the same check, before any collective
    dist.destroy_process_group()


def _follower_draft_runner(model, draft):
    """A follower's DraftRunner, built as rank 0 builds its own (`LeadingDraft.build_mono`); None
    where it refuses (rank 0 refuses alike and runs the draft per-op, or raises under "on")."""
    from .mono import MonoRefused
    from .mono.draft_runner import DraftRunner

    try:
        return DraftRunner(model, draft)
    except MonoRefused:
        return None


def _follower_runner(model, mono: str):
    """A follower's mono runner, built as rank 0 builds its own (`LeadingModel.build_mono`); None
    where they refuse (rank 0 raises that under "on", then stops the ranks)."""
    from .mono import MonoRefused, build

    try:
        return build(model, mono)
    except MonoRefused:
        return None


def load_ranks(source, size: int, *, device="cpu", dtype=torch.float32, seed: int = 0,
               overrides: dict | None = None) -> LeadingModel:
    """Rank 0 of `size` ranks of the per-op model of `source` (a checkpoint directory or preset;
    `overrides`: a preset's config fields changed, `load_model`)."""
    if size < 2:
        raise ValueError(f"load_ranks runs 2 or more ranks, got a tensor parallel size of {size}")
    TensorParallel(rank=0, size=size).check(load_config(source, **(overrides or {})))  # before any process starts
    device = torch.device(device)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor parallel size {size} from {device} needs {(device.index or 0) + size} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")
    store = str(Path(tempfile.mkdtemp(prefix="monodecode-tp-")) / "store")
    ranks = mp.start_processes(_follow, args=(size, store, str(source), str(device), dtype, seed, overrides),
                               nprocs=size - 1, join=False, daemon=True, start_method="spawn")

    def start():
        own, control = _join(0, size, store, device)
        model = load_model(source, device=own, dtype=dtype, seed=seed,
                           tp=TensorParallel.from_process_group(), overrides=overrides)
        return LeadingModel(model, control, ranks)

    return _watching(ranks, start)


def _watching(ranks, start):
    """start() (joining the group, loading this rank's part), while watching the other ranks: a
    rank that fails meanwhile (a bad checkpoint, no memory) raises its error here at once,
    instead of leaving this rank waiting for it until TIMEOUT."""
    done = {}

    def run():
        try:
            done["result"] = start()
        except BaseException as e:  # handed to the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, daemon=True)  # daemon: a rank's failure must not keep it waiting
    thread.start()
    while thread.is_alive():
        try:
            ranks.join(timeout=0.1)
        except mp.ProcessRaisedException as e:
            raise RankError(f"a tensor-parallel rank failed while starting: {e}") from None
        except mp.ProcessExitedException as e:
            raise RankError(f"a tensor-parallel rank exited while starting ({e})") from None
        thread.join(0.1)
    if "error" in done:
        raise done["error"]
    return done["result"]
