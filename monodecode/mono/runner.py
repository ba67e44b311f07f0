"""`MonoRunner`: decode steps of 1..48 rows with each layer as three persistent kernels.

Owns, for one model: the kernel views of the weights (checked at build), the device sync state of
each kernel family (epochs advanced on the device), one `Scratch` per step width, and one CUDA
graph per (width, cache). `step` has Model.step's signature and result for the steps it takes
(`prepare` checks and loads the rows on the host, `run_rows` launches the kernels: device work
only, which a whole speculative step captures inside its own graph, spec/step_graph.py);
`refusal` says why it would not take one (more than 48 rows, a request with more rows than the
cache can rewind, i.e. a prefill chunk), and the caller (`decode.Decoder`) runs that one per-op.

A step on the mono path:
  embed -> per layer: K1 (fold the owed FFN output, attention seam, q/kv projections, KV write;
  a compressed layer's compressor and its entries; a CSA layer's indexer and its top-k), K2
  (attention, output projections, fold, FFN seam, router, shared expert) and K3 (the routed
  experts; the FFN output is owed) -> fold the last owed output, hc_head, norm, lm_head (torch
  ops).
Nothing in a step syncs with the host, so every step is graph-captured (one graph per width and
cache).
Tensor parallelism (`model.tp`; each rank a runner on its own Model): the kernels run the rank's
slices (`sizes`, `TensorParallel.rank_sizes`), and K2 and K3 sum the attention and FFN outputs
over the ranks inside the launches (k2.py, peers.py: the runner's peer memory, allocated by every
rank at construction). The embedding's sum and the logits' gather around the layers are still
host collectives (gloo, NCCL), which the runner does not capture: under tensor parallelism a
step's graph holds its layers only (`run_layers`), the embedding and the head run around it.
Co-residency: every launch is cooperative (the driver refuses a grid that cannot be co-resident);
at build, `check_residency` launches each kernel at its widest build once, so a refusal comes then.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import NamedTuple

import torch
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..config import CSA_RATIO, ModelConfig
from ..model.hc import hc_post
from . import attend_entries as AE
from . import attention as A
from . import experts as X
from . import hc as HC
from . import indexer as I
from . import k1, k2
from .gemv_tiles import kernel_blocks, split_needs
from .plan import MAX_ROWS, MonoRefused, interpreted, refusals
from .scratch import Scratch
from .shape import LaunchShape
from .sync import DEFAULT_MAX_POLLS, ERROR, TIMELINE_SLOTS, SyncArgs, SyncState
from .weights import check_cache, fp8_names, layer_weights, read_fp8

log = logging.getLogger("monodecode.mono")


def kernel_grids(shape: LaunchShape, sms: int) -> dict[str, int]:
    """Programs a launch of each kernel family takes on `sms` SMs with `shape`: K1 (`k1c`: a CSA
    layer's, seven stages more), K2 and K3 (the routed experts)."""
    return {"k1": sms * shape.k1_programs_per_sm, "k1c": sms * shape.k1_programs_per_sm,
            "k2": sms * shape.k2_programs_per_sm, "k3": sms * shape.expert_programs_per_sm}


class LayerStack(NamedTuple):
    """The layers a runner runs: their sizes (`config`), compression ratios, checkpoint prefixes,
    per-op blocks, and for each a callable that hands the per-op path the kernels' stacked
    experts."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # the per-op weights by checkpoint name
    ratios: tuple[int, ...]  # each layer's compression ratio (0: window)
    prefixes: list[str]
    blocks: list
    replace_experts: list


def target_stack(model) -> LayerStack:
    """The model's decoder layers."""
    n = model.config.num_hidden_layers
    return LayerStack(model.config, model.w, tuple(model.config.compress_ratios),
                      [f"layers.{i}." for i in range(n)], model.blocks,
                      [functools.partial(model.replace_experts, i) for i in range(n)])


class MonoRunner:
    draft_block = 0  # rows of a draft block (DraftRunner); the target's attention is causal

    def __init__(self, model, *, graphs: bool = True, max_polls: int = DEFAULT_MAX_POLLS, poison: bool = False,
                 shape: LaunchShape = LaunchShape(), stack: LayerStack | None = None):
        """`stack`: the layers to run (default: the model's, `target_stack`). Under tensor
        parallelism (`model.tp`, each rank a runner on its own Model) the runner runs this rank's
        slices (`self.sizes`; `self.config` is their config: this rank's heads and o groups), sums
        over the ranks in its peer memory (a collective: every rank builds its runner at once),
        and its graphs hold the layers only (the embedding and the logits are host collectives)."""
        whole = stack.config if stack else model.config
        self.model, self.tp = model, model.tp
        reasons = refusals(whole, model.device, model.dtype) + self.tp.fp8_refusals(whole)
        if self.tp.size > 1 and not hasattr(model, "blocks"):
            reasons.append("the kernels run under tensor parallelism only as one runner a rank, on that rank's own "
                           "Model; a model over ranks (ranks.load_ranks) runs per-op")
        if reasons:
            raise MonoRefused(reasons)
        stack = stack or target_stack(model)  # after the refusals: a model over ranks has no blocks here
        self.sizes = self.tp.rank_sizes(whole)
        self.config = self.sizes.config
        self.peer_sites = k2.peer_sites(self.tp, model.device, whole.hidden_size)
        shared = bool(self.config.n_shared_experts)
        names = [n for p, ratio in zip(stack.prefixes, stack.ratios)
                 for n in fp8_names(p, shared, indexed=ratio == CSA_RATIO)]
        fp8 = read_fp8(model.checkpoint, names, model.device, self.tp)
        self.ratios = stack.ratios
        self.layers = [layer_weights(stack.weights, self.sizes, p, block, replace, fp8, ratio)
                       for p, block, replace, ratio in zip(stack.prefixes, stack.blocks, stack.replace_experts,
                                                           self.ratios)]
        self.device = model.device
        self.fast = not interpreted()  # the NVIDIA paths (PTX decode, bf16 dots); refusals() ruled out others
        for lw in self.layers:
            lw.experts.supports_fast_decode()  # checked (a host sync) now, before any capture
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self.timelines: dict[str, torch.Tensor] = {}
        self.configure(shape, check=False)  # checked below, once the runner is complete
        self.max_polls = max_polls
        self.poison = poison  # NaN-filled scratch: a stage output no task wrote shows in the result
        self.timeline = False  # per-stage stamps (timeline.py); GPU only; `bench layer --timeline` sets it
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.scratch: dict[int, Scratch] = {}
        self.checked_caches: set[int] = set()  # ids of live caches whose rings passed check_cache
        log.info("mono: %d layers (compression ratios %s); %.1f MiB of FP8 weights held for the kernels",
                 len(self.layers), "/".join(map(str, self.ratios)),
                 self.memory()["fp8_weights"] / 2**20)
        if not interpreted():
            self.check_residency()

    @torch.no_grad()
    def check_residency(self) -> None:
        """Launch every kernel the layers use at its widest build (MAX_ROWS rows: the most registers
        and shared memory) on a private cache, so that a grid that cannot be co-resident is refused
        now, at build, with the reason (MonoRefused from `launch`), and not at a serving step. It
        also compiles those builds. The outputs are discarded."""
        requests = 8
        rows = MAX_ROWS // requests
        cache = self._residency_cache(requests, rows)
        # a private scratch: the runner's own of this width may hold a caller's step (`bench layer`
        # configures each shape after preparing its step)
        s = Scratch(self.config, MAX_ROWS, self.device)
        s.tokens.zero_()
        s.positions.copy_(torch.arange(rows).repeat(requests))
        s.slots.copy_(torch.arange(requests).repeat_interleave(rows))
        self.run_rows(s, cache, return_hidden=False)
        self.check()  # a host sync

    def _residency_cache(self, requests: int, rows: int):
        """A private cache for `check_residency`: `requests` slots, steps of `rows` rows."""
        return self.model.make_cache(requests, 2 * rows, rows)

    def configure(self, shape: LaunchShape, check: bool = True) -> None:
        """Launch the kernels with `shape` from now on (each kernel's grid: its programs a SM times
        the SMs; 1 under the interpreter). Resets the sync state (its barrier targets count
        programs), drops the graphs and timelines captured so far and, on a GPU, checks
        co-residency (`check_residency`: raises MonoRefused if the shape cannot be resident, and
        keeps the shape it had)."""
        self._check_shape(shape)
        previous = getattr(self, "shape", None)
        sms = 1 if interpreted() else torch.cuda.get_device_properties(self.device).multi_processor_count
        self.grids = kernel_grids(shape, sms)
        if interpreted():
            self.grids = dict.fromkeys(self.grids, 1)
        self.shape = shape
        self.sync = {family: SyncState(self.device, k1.stage_names(family) if family.startswith("k1") else
                                       k2.stage_names(family, self.tp.size)) for family in self.grids}
        # The split GEMVs' slice sums and tickets: one set for every launch and width (launches
        # run in stream order, and a stage's tickets are 0 again when it ends), sized for the
        # widest step's largest stage.
        sums, tickets = (max(n) for n in zip(*(split_needs(family.dense_stages(self, MAX_ROWS), MAX_ROWS)
                                               for family in (k1, k2))))
        self.split_sums = torch.zeros(max(sums, 1), dtype=torch.float32, device=self.device)
        self.split_tickets = torch.zeros(max(tickets, 1), dtype=torch.int32, device=self.device)
        self.graphs.clear()
        self.timelines.clear()
        self.compiled = {}  # (kernel name, row block): the compiled kernel last launched (GPU)
        if check and not interpreted():
            try:
                self.check_residency()
            except MonoRefused:
                self.configure(previous, check=False)
                raise

    def _check_shape(self, shape: LaunchShape) -> None:
        """A shape whose expert tiles the experts' fragment order cannot serve, without K3
        programs, or whose fold rows or settle tiles no fold or settle task takes, is a caller's
        error."""
        c = self.config
        if shape.expert_programs_per_sm < 1:
            raise ValueError(f"launch shape {shape.spec()}: K3 (the routed experts) needs at least one program a "
                             f"SM (expert_programs_per_sm {shape.expert_programs_per_sm})")
        refusal = X.tiles_refusal(shape.expert_block_n, shape.expert_block_k, c.hidden_size, c.moe_intermediate_size)
        if refusal:
            raise ValueError(f"launch shape {shape.spec()}: the experts' fragment order needs {refusal}")
        refusal = HC.fold_rows_refusal(shape.fold_rows) or HC.settle_columns_refusal(shape.settle_columns)
        if refusal:
            raise ValueError(f"launch shape {shape.spec()}: the mHC fold and settle need {refusal}")
        splits = shape.attend_splits
        if splits & (splits - 1) or splits > AE.MAX_SPLITS:
            raise ValueError(f"launch shape {shape.spec()}: attend_splits must be 0 (automatic) or a power of two "
                             f"up to {AE.MAX_SPLITS}")
        parts, chunks = shape.attend_parts, c.head_dim // A.BD
        if parts & (parts - 1) or parts > chunks:
            raise ValueError(f"launch shape {shape.spec()}: attend_parts must be 0 (automatic) or a power of two up "
                             f"to head_dim / {A.BD} = {chunks}")
        if shape.attend_heads not in (0, *A.TASK_HEADS) or shape.attend_chunk not in (0, *A.CHUNKS):
            raise ValueError(f"launch shape {shape.spec()}: attend_heads must be 0 (automatic) or one of "
                             f"{A.TASK_HEADS}, attend_chunk 0 or one of {A.CHUNKS}")
        block = shape.select_block
        if block and (block & (block - 1) or not I.MIN_SELECT_BLOCK <= block <= I.MAX_SELECT_BLOCK):
            raise ValueError(f"launch shape {shape.spec()}: select_block must be 0 (automatic) or a power of two "
                             f"from {I.MIN_SELECT_BLOCK} to {I.MAX_SELECT_BLOCK}")

    def gemv_blocks(self, family: str, N: int, K: int, rows: int, fp8: bool = True,
                    group_rows: int = 0) -> tuple[int, int, int]:
        """(BN, BK, SPLIT) of a dense [N, K] GEMV stage of kernel `family` ("k1", "k2") for a step
        of `rows` rows (`gemv_tiles.kernel_blocks`: one row by its own rule, more by the launch shape);
        BN at most `group_rows` for a grouped one."""
        bn, bk, split = kernel_blocks(self.shape.block_n, self.shape.block_k, self.shape.dense_chunk, N, K,
                                      self.config.fp8_block[0] if fp8 else None, self.grids[family], rows,
                                      self.warps(family))
        return (min(bn, group_rows) if group_rows else bn), bk, split

    def memory(self) -> dict[str, int]:
        """Bytes the runner holds beyond the per-op path's weights: the FP8 dense copies the
        kernels read and the scratch of every width built so far (the experts are shared)."""
        return {"fp8_weights": sum(lw.nbytes_extra() for lw in self.layers),
                "scratch": sum(s.nbytes() for s in self.scratch.values())}

    # --- the step ---------------------------------------------------------------------------------
    def refusal(self, cache, tokens, positions, slots) -> str | None:
        """Why the kernels do not take this step (it then runs per-op), or None. Rows that no path
        can run raise ValueError (`Model.group_rows`)."""
        host = [torch.as_tensor(t, dtype=torch.long).cpu() for t in (tokens, positions, slots)]
        groups = self.model.group_rows(cache, *host)
        reason = self.rows_refusal(host[0].numel())
        if reason is None and any(len(g.index) > cache.max_step_rows for g in groups):
            return "a request with more rows than the cache rewinds (prefill)"
        return reason

    def rows_refusal(self, rows: int) -> str | None:
        """Why the kernels do not take a step of `rows` rows, whatever the rows are (None: they may)."""
        return f"more than {MAX_ROWS} rows" if rows > MAX_ROWS else None

    @torch.no_grad()
    def step(self, cache, tokens, positions, slots, return_hidden: bool = False, refusal_checked: bool = False):
        """Model.step on the kernels, for a step they take (`refusal` None; `refusal_checked`: the
        caller has just asked, so the rows are not grouped twice)."""
        scratch = self.prepare(cache, tokens, positions, slots, refusal_checked=refusal_checked)
        out = self._replay(scratch, cache, return_hidden) if self.graphs_enabled else None
        if out is None:
            out = self.run_rows(scratch, cache, return_hidden)
        self.check()
        return out

    def prepare(self, cache, tokens, positions, slots, refusal_checked: bool = False) -> Scratch:
        """Make a step's rows ready for `run_rows`, on the host: the refusal (a ValueError naming it;
        skipped with `refusal_checked`), then `load_rows`. Returns the width's scratch."""
        reason = None if refusal_checked else self.refusal(cache, tokens, positions, slots)
        if reason:
            raise ValueError(f"the mono kernels do not take this step: {reason}")
        return self.load_rows(cache, torch.stack([torch.as_tensor(t, dtype=torch.long).cpu()
                                                  for t in (tokens, positions, slots)]))

    def load_rows(self, cache, host: torch.Tensor) -> Scratch:
        """Rows already checked (int64 [3, rows] on the host: tokens, positions, slots) into the
        scratch of their width (made now, never first inside a capture), after the cache's check
        (once a cache). A whole speculative step (spec/step_graph.py) loads its verify rows with 0
        in the drafts' places and writes the drafts there on the device."""
        if id(cache) not in self.checked_caches:
            check_cache(self.config, cache)
            self.checked_caches.add(id(cache))
            weakref.finalize(cache, self.checked_caches.discard, id(cache))
        scratch = self._scratch(host.shape[1])
        scratch.load_rows(host)  # one copy a step (each is a host round trip)
        return scratch

    def _replay(self, scratch: Scratch, cache, return_hidden: bool):
        """The step through the graph of its width and cache (captured on first use), or None
        when that graph was captured for the other kind of output."""
        key = (scratch.rows, id(cache))
        if key not in self.graphs:
            self.graphs[key] = self._capture(scratch, cache, return_hidden)
            # the graph holds the cache's pointers: it goes with the cache (and its id with it)
            weakref.finalize(cache, self.graphs.pop, key, None)
        graph, out, captured_hidden = self.graphs[key]
        if captured_hidden != return_hidden:
            return None
        if self.tp.size > 1:  # the graph holds the layers only (`_capture`)
            self._embed(scratch)
            graph.replay()
            return self.head(tuple(None if t is None else t.clone() for t in out))
        graph.replay()
        return tuple(t.clone() for t in out) if return_hidden else out.clone()

    def sync_args(self, kind: str) -> SyncArgs:
        """The synchronisation arguments of a launch of family `kind` (`kernel_grids`' keys)."""
        return SyncArgs(words=self.sync[kind].words, max_polls=self.max_polls, timeline=self.timeline_buffer(kind))

    def timeline_buffer(self, kind: str) -> torch.Tensor:
        """The stamps buffer of a kernel family ([its grid, TIMELINE_SLOTS] int64; the last launch's
        stamps), or, with the timeline off, any device pointer (the kernels do not touch it)."""
        if not self.timeline:
            return self.sync[kind].words
        if interpreted():
            raise RuntimeError("the mono timeline reads the GPU's global timer: it needs a GPU")
        if kind not in self.timelines:
            self.timelines[kind] = torch.zeros(self.grids[kind], TIMELINE_SLOTS, dtype=torch.int64, device=self.device)
        return self.timelines[kind]

    def launch(self, kernel, name: str, family: str, *args, meta) -> None:
        """One persistent launch of kernel `family`'s grid: `kernel(*args, meta)`, the fields of the
        `meta` named tuple passed as compile-time constants. On the GPU it is cooperative: the
        driver refuses a grid whose programs cannot all be resident at once (registers, shared
        memory) instead of letting their waits on each other hang; that refusal becomes
        MonoRefused, as does a build that needs more shared memory than one SM has."""
        warps, grid = self.warps(family), self.grids[family]
        constants = type(meta)(*(tl.constexpr(value) for value in meta))
        options = {"maxnreg": self.shape.expert_registers()} if family == "k3" else {}
        if interpreted():
            kernel[(grid,)](*args, constants, num_warps=warps, **options)
            return
        try:
            compiled = kernel[(grid,)](*args, constants, num_warps=warps, launch_cooperative_grid=True, **options)
            if compiled is not None:  # Triton returns the compiled kernel it launched
                self.compiled[(name, getattr(meta, "BR", None))] = compiled  # K3: one build for every width
        except OutOfResources as e:
            raise MonoRefused([f"{name} ({self.shape.spec()}: {warps} warps) does not fit a SM: {e}"]) from e
        except RuntimeError as e:
            if "cooperative" not in str(e).lower():
                raise
            raise MonoRefused([f"{name}: {grid} programs ({self.shape.spec()}: {warps} warps) "
                               f"cannot all be resident at once: {e}"]) from e

    def warps(self, family: str) -> int:
        """Warps a program of kernel `family` runs (K1's for `k1` and `k1c`, K2's, K3's)."""
        return {"k1": self.shape.k1_warps, "k1c": self.shape.k1_warps,
                "k3": self.shape.expert_warps}.get(family, self.shape.k2_warps)  # K2's launches

    def kernel_resources(self) -> list[dict]:
        """What each compiled persistent kernel holds per program (GPU only; the kernels launched so
        far, one entry per kernel and row block BR): registers a thread (255 at most), spilled
        registers, shared memory. Registers decide how many programs a SM can hold."""
        return [{"kernel": name, "row_block": row_block, "warps": kernel.metadata.num_warps,
                 "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                 "shared_bytes": kernel.metadata.shared}
                for (name, row_block), kernel in sorted(self.compiled.items())]

    def check(self) -> None:
        """Raise MonoSyncError if a kernel's wait expired since the last check (one host sync a
        step: the step's logits are wrong then, and the caller must fail its requests)."""
        self.raise_errors(self.error_words().tolist())

    def error_words(self) -> torch.Tensor:
        """Each launch family's error word, on the device (int32 [families]): `check` reads them; a
        caller with more to read after the step reads them with it and hands them to `raise_errors`."""
        return torch.stack([state.words[ERROR] for state in self.sync.values()])

    def raise_errors(self, errors: list[int]) -> None:
        """`check` on error words already read (`error_words`, in its order)."""
        for state, error in zip(self.sync.values(), errors):
            if error:
                state.check()

    def _scratch(self, rows: int) -> Scratch:
        if rows not in self.scratch:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"mono: width {rows} is first reached inside a CUDA graph capture; "
                                   "run one eager step of that width before capturing")
            self.scratch[rows] = Scratch(self.config, rows, self.device, self.poison)
        return self.scratch[rows]

    def _capture(self, scratch: Scratch, cache, return_hidden: bool):
        """A graph of the step: `run_rows`, or under tensor parallelism `run_layers` only (the
        embedding's and the head's host collectives run around its replays, `_replay`)."""
        if self.tp.size == 1:
            body = self.run_rows
        else:
            self._embed(scratch)  # the warm-up's input
            body = self.run_layers
        body(scratch, cache, return_hidden)  # compile and warm up (this step's real result is replayed)
        torch.cuda.synchronize(self.device)
        self.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body(scratch, cache, return_hidden)
        # The warm-up wrote this step's KV rows already; the replay rewrites the same values.
        return graph, out, return_hidden

    def run_rows(self, s: Scratch, cache, return_hidden: bool):
        """Launch the step on rows that `prepare` made ready in `s`: device work only (no refusal,
        no graph of its own, no error check, nothing read back), so that a caller can capture it
        inside a larger graph (spec/step_graph.py). The logits, with `return_hidden` also the
        draft's features (Model.step's result). Under tensor parallelism the embedding and the
        head make host collectives."""
        self._embed(s)
        return self.head(self.run_layers(s, cache, return_hidden))

    def _embed(self, s: Scratch) -> None:
        """The step's tokens embedded into s.streams[0], where `run_layers` starts (under tensor
        parallelism a host collective: never inside a graph)."""
        s.streams[0].copy_(self.model.embed(s.tokens))

    def run_layers(self, s: Scratch, cache, return_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers on the kernels from the embedded streams in s.streams[0]: the settled
        streams and, with `return_hidden`, the draft's features (else None). No collective."""
        cur, owed, captured = 0, None, {}
        targets = (self.config.dspark_target_layer_ids or ()) if return_hidden else ()
        for i, (lw, lc) in enumerate(zip(self.layers, cache.layers)):
            cur = k1.launch(self, s, lw, lc, cur, owed)
            cur = k2.launch(self, s, lw, lc, cur)
            owed = s.owed()
            if i in targets:
                captured[i] = self._settled(s, cur).mean(dim=1)
        return self._settled(s, cur), torch.cat([captured[i] for i in targets], dim=-1) if return_hidden else None

    def head(self, layers_out: tuple[torch.Tensor, torch.Tensor | None]):
        """The step's result from `run_layers`' (settled streams, features): the logits, or with
        features (logits, features)."""
        settled, hidden = layers_out
        logits = self.model.logits(settled)
        return logits if hidden is None else (logits, hidden)

    def _settled(self, s: Scratch, cur: int) -> torch.Tensor:
        """The residual streams with the owed FFN output folded in."""
        return _folded(s.streams[cur], s.owed())


def _folded(streams: torch.Tensor, owed) -> torch.Tensor:
    """The per-op fold (hc_post) of an owed (y, post, comb) into the residual streams."""
    y, post, comb = owed
    return hc_post(y, streams, post, comb)
