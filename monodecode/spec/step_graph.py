"""`WholeStep`: a whole speculative step on the mono kernels, as device work only.

When `SpeculativeDecoder.step` takes it: the kernels run both the target (a `decode.Decoder`
with its `MonoRunner`) and the draft's stages (a `decode.KernelDraft` with its `DraftRunner`),
and both runners take the step's rows (`rows_refusal`). Otherwise the step runs stepwise, as
before. Any verification method and any sampling settings: the step runs the stepwise path's
operations on the same uniforms (spec/draws.py), so it commits the same tokens.

Host, before: the requests are checked (slots, positions within the cache, anchors: a ValueError
naming the request, before anything runs; the checks the runners' refusals would make of the
rows, without their row-by-row grouping) and each runner's `load_rows` loads them, in one copy,
into the scratch of its width: the draft's blocks [anchor, noise x (B - 1)], the
verify rows [anchor, 0 x B] (0 in the drafts' places, which the device fills), their positions
and slots. Then the request count's input buffers: each request's sampling settings
(`RowSettings`, one copy) and the keys of its draws (`draws.step_keys`: its seed and its count of
drawing steps, one copy). Those buffers are the step's only inputs.

Device (`_device_step`; nothing read back to the host, no tensor made from host data): the
step's uniforms from the keys (`draws.keyed_uniforms`, as the stepwise path makes them), the
draft's stages (`DraftRunner.run_rows`), its head (every request greedy: `Draft.greedy_tokens`,
the argmax proposals; else `Draft.sampled_tokens`, the tokens picked by the Markov head's
uniforms and their distributions; neither makes the confidences, which the step does not read),
the drafts written into the verify rows, the target's verify step
(`MonoRunner.run_rows`: logits and the draft's features), the commit of every verify row to the
draft's rings (`Draft.commit`), and verification's device part (`verify.verify_rows`). These are
the operations of the stepwise path, in its order.

On a GPU (both runners' graphs enabled) that device work is one CUDA graph a key: (request
count, whether every request is greedy, whether any request filters by top-k or top-p, the
target cache's identity, the draft cache's identity, the part clock's); the graph holds the two
widths' scratch, the input buffers and both caches' pointers. A key's first step runs eagerly (it compiles the
kernels at its widths and makes the scratch's lazily made buffers, outside any capture); its
second step captures the graph and replays it; later steps replay it. A graph goes with either
of its caches, and is captured again after either runner's `configure` (new grids and sync
words). On a CPU (Triton's interpreter) the same device work runs eagerly every step.

A part clock (`clock`, None unless a benchmark sets one: `bench decode`'s `PartClock`) is
called with a part's name at the device work's start ("start") and after each of its parts
(`PARTS`), in the work's order; on a GPU its marks are recorded inside the graph.

Host, after: one read of the device, both runners' error words and the verdict rows together,
which the device work gathers into one tensor (one host round trip a step). A wait that gave up
in either runner raises MonoSyncError naming the runner and stage (`MonoRunner.raise_errors`:
the step's results are invalid and the requests are left as they were); else the verdicts
(accepted counts and committed tokens) go to the caller to update the requests with.
"""

from __future__ import annotations

import weakref
from array import array
from typing import NamedTuple

import torch

from ..decode import Decoder, KernelDraft
from ..sampling import RowSettings
from .draws import keyed_uniforms, markov, step_keys, uniforms_per_step, verification
from .verify import Verdict, verdicts, verify_rows


class Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    readback: torch.Tensor  # the graph's outputs: both runners' error words, then verify_rows' [R, B + 2]
    logits: torch.Tensor  # [R, B + 1, vocab]
    syncs: tuple[dict, dict]  # the runners' sync states it was captured with
    clock: object  # the part clock it marks (None: none), kept alive while the graph records its marks


class StepInputs(NamedTuple):
    """A request count's input buffers, written by the host before each step."""

    settings: torch.Tensor  # RowSettings.values [3, R]
    keys: torch.Tensor  # the draws' keys, int64 [2, R] (spec/draws.py)


# the device work's parts, in order: what a part clock is called with after each
PARTS = ("draft stages", "draft head", "verify step", "commit and verification")


class WholeStep:
    def __init__(self, target, draft, draft_runner, method: str, acceptance_length: float | None = None):
        """`target`: the target's `MonoRunner`; `draft`: the `Draft` (its head and commit);
        `draft_runner`: the `DraftRunner` of its stages; `method`: the verification method
        (`acceptance_length`: synthetic's)."""
        self.target, self.draft, self.draft_runner = target, draft, draft_runner
        self.method, self.acceptance_length = method, acceptance_length
        self.block_size = draft.block_size
        self.inputs: dict[int, StepInputs] = {}
        self.graphs_enabled = target.graphs_enabled and draft_runner.graphs_enabled
        self.graphs: dict[tuple, Captured] = {}
        self.warmed: set[tuple] = set()  # keys whose eager first step has run
        self.clock = None  # a part clock (module docstring), set by a benchmark

    @classmethod
    def of(cls, model, draft, config) -> WholeStep | None:
        """The whole step of a speculative decoder's `model`, `draft` and `config` (its
        SpeculativeConfig) when the kernels run both (a Decoder with its runner, a KernelDraft),
        else None."""
        if isinstance(model, Decoder) and model.mono is not None and isinstance(draft, KernelDraft):
            return cls(model.mono, draft.draft, draft.runner, config.rejection_sample_method,
                       config.synthetic_acceptance_length)
        return None

    def refusal(self, requests: int) -> str | None:
        """Why the runners do not take a step of `requests` requests (None: they do)."""
        b = self.block_size
        return self.target.rows_refusal(requests * (b + 1)) or self.draft_runner.rows_refusal(requests * b)

    @torch.no_grad()
    def run(self, caches, requests) -> tuple[list[Verdict], torch.Tensor]:
        """One whole step of `requests` (SpecRequests, not updated here) on `caches` (SpecCaches):
        each request's verdict, and the target's logits [R, B + 1, vocab] of the verify rows (on a
        GPU the graph's output: valid until the next step)."""
        drafted, verified = self._prepare(caches, requests)
        settings, keys = self._load_inputs(requests)
        readback, logits = self.device_work(caches, drafted, verified, settings, keys)
        read = readback.tolist()  # the step's one read of the device
        n_draft, n_target = len(self.draft_runner.sync), len(self.target.sync)  # their error words
        self._raise_errors(read[:n_draft], read[n_draft:n_draft + n_target])
        found = read[n_draft + n_target:]
        width = len(found) // len(requests)
        return verdicts([found[i:i + width] for i in range(0, len(found), width)]), logits

    def _raise_errors(self, draft_errors: list[int], target_errors: list[int]) -> None:
        """Each runner's `raise_errors` on its error words (each that finds one starts its counters
        over), then MonoSyncError naming the runner and stage of each wait that gave up."""
        from ..mono.sync import MonoSyncError  # a kernel module: imported once the runners exist

        failed = []
        for name, runner, errors in (("draft", self.draft_runner, draft_errors),
                                     ("target", self.target, target_errors)):
            try:
                runner.raise_errors(errors)
            except MonoSyncError as e:
                failed.append(f"the {name}'s kernels: {e}")
        if failed:
            raise MonoSyncError("a whole speculative step failed, its results discarded: " + "; ".join(failed))

    def _prepare(self, caches, requests):
        """Both runners' scratch, loaded with the step's rows (host side). The rows are made here
        from the requests, checked as requests (`_check_requests`) rather than row by row by the
        runners' refusals: the step's host work is on the path of every token."""
        self._check_requests(caches, requests)
        b, noise = self.block_size, self.draft.c.dspark_noise_token_id

        def rows(after_anchor: list[int]) -> torch.Tensor:
            """Each request's anchor then `after_anchor`, at consecutive positions from the
            anchor's, in its slot: [3, rows] (tokens, positions, slots), made as one flat int64
            array, a request's run at a time (torch.tensor of nested lists converts element by
            element)."""
            n, flat = len(after_anchor) + 1, array("q")
            for q in requests:
                flat.append(q.anchor)
                flat.extend(after_anchor)
            for q in requests:
                flat.extend(range(q.position, q.position + n))
            for q in requests:
                flat.extend([q.slot] * n)
            return torch.frombuffer(flat, dtype=torch.long).view(3, -1)

        return (self.draft_runner.load_rows(caches.draft, rows([noise] * (b - 1))),
                self.target.load_rows(caches.target, rows([0] * b)))

    def _check_requests(self, caches, requests) -> None:
        """What the runners' row checks (`Model.group_rows`, `MonoRunner.refusal`) would find in the
        rows `_prepare` makes of `requests`, as a ValueError naming the request: nothing has run
        then, and the requests are as they were."""
        b, target = self.block_size, caches.target
        slots = min(target.num_slots, caches.draft.rings[0].pos.shape[0])
        last = target.max_context - b  # a request's verify rows reach its position + b
        vocab = self.target.config.vocab_size
        if refusal := self.refusal(len(requests)):
            raise ValueError(f"the mono kernels do not take this step: {refusal}")
        if target.max_step_rows < b + 1:
            raise ValueError(f"the cache rewinds {target.max_step_rows} rows a request, a step writes {b + 1} "
                             "(make the caches with SpeculativeDecoder.make_caches)")
        taken = set()
        for i, q in enumerate(requests):
            where = f"request {i} (slot {q.slot})"
            if not 0 <= q.slot < slots:
                raise ValueError(f"{where}: the slot is outside [0, {slots})")
            if q.slot in taken:
                raise ValueError(f"{where}: an earlier request of the step has this slot")
            if not 0 <= q.position < last:
                raise ValueError(f"{where}: position {q.position} is outside [0, {last}): its verify rows reach "
                                 f"position + {b}, and the cache holds {target.max_context} positions")
            if not 0 <= q.anchor < vocab:
                raise ValueError(f"{where}: token id {q.anchor} is outside [0, {vocab})")
            taken.add(q.slot)

    def _load_inputs(self, requests) -> tuple[RowSettings, torch.Tensor]:
        """The requests' settings and draws' keys, written into the input buffers of their count
        (what the step's graph reads)."""
        r = len(requests)
        if r not in self.inputs:
            device = self.target.device
            self.inputs[r] = StepInputs(torch.empty(3, r, device=device),
                                        torch.empty(2, r, dtype=torch.long, device=device))
        inputs = self.inputs[r]
        settings = RowSettings.of([q.settings for q in requests], out=inputs.settings)
        return settings, inputs.keys.copy_(step_keys(requests, self.method), non_blocking=True)

    def device_work(self, caches, drafted, verified, settings: RowSettings,
                    keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The device step eagerly, or through its key's graph (module docstring): what the host
        reads (both runners' error words, then the verdict rows, flat) and the logits. `run` calls
        it between the host's parts (bench decode times it alone)."""
        def work():
            return self._device_step(caches, drafted, verified, settings, keys)

        if not self.graphs_enabled:
            return work()
        key = (keys.shape[1], settings.greedy, settings.filters, id(caches.target), id(caches.draft),
               None if self.clock is None else id(self.clock))
        captured = self.graphs.get(key)
        if captured is not None and not self._current(captured):  # a runner was configured since
            del self.graphs[key]
            self.warmed.discard(key)
            captured = None
        if captured is None:
            if key not in self.warmed:
                self.warmed.add(key)
                self._forget_with(key, caches)
                return work()
            captured = self.graphs[key] = self._capture(work)
        captured.graph.replay()
        return captured.readback, captured.logits

    def _current(self, captured: Captured) -> bool:
        """Whether `captured` launches with the runners' present grids and sync words."""
        target_sync, draft_sync = captured.syncs
        return target_sync is self.target.sync and draft_sync is self.draft_runner.sync

    def _forget_with(self, key, caches) -> None:
        """Drop the key's graph, and that it was warmed, with either of its caches: the graph holds
        their pointers, and a later cache may take their ids."""
        for cache in (caches.target, caches.draft):
            weakref.finalize(cache, self.graphs.pop, key, None)
            weakref.finalize(cache, self.warmed.discard, key)

    def _capture(self, work) -> Captured:
        torch.cuda.synchronize(self.target.device)  # the eager step and the rows' copies are done
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rows, logits = work()
        return Captured(graph, rows, logits, (self.target.sync, self.draft_runner.sync), self.clock)

    def _device_step(self, caches, drafted, verified, settings: RowSettings,
                     keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step on the prepared scratch `drafted` (the draft runner's) and `verified`
        (the target runner's): what the host reads (the draft's and the target's error words,
        then the verdict rows [R, B + 2], flat: made in the graph, so the host makes no tensor
        to read them) and the logits [R, B + 1, vocab]."""
        b, mark = self.block_size, self.clock or (lambda part: None)
        mark("start")
        uniforms = keyed_uniforms(keys, uniforms_per_step(b))
        streams = self.draft_runner.run_rows(drafted, caches.draft, return_hidden=False)
        mark(PARTS[0])
        anchors = drafted.tokens.view(-1, b)[:, 0]
        if settings.greedy:
            drafts, draft_probs = self.draft.greedy_tokens(streams, anchors), None
        else:
            drafts, draft_probs = self.draft.sampled_tokens(streams, anchors, settings, markov(uniforms, b))
        mark(PARTS[1])
        verified.tokens.view(-1, b + 1)[:, 1:].copy_(drafts)
        logits, hidden = self.target.run_rows(verified, caches.target, return_hidden=True)
        mark(PARTS[2])
        self.draft.commit(caches.draft, verified.slots, verified.positions, hidden)
        logits = logits.view(drafts.shape[0], b + 1, -1)
        rows = verify_rows(self.method, logits, drafts, draft_probs, settings, verification(uniforms, b),
                           self.acceptance_length)
        words = (self.draft_runner.error_words(), self.target.error_words())
        readback = torch.cat([*words, rows.flatten()])
        mark(PARTS[3])
        return readback, logits
