"""Speculative decoding with the DSpark draft on the per-op path: one step for a batch of requests.

A request waits with an anchor: the last token emitted, at `position`, not yet run through the
target; every position before it is committed (in the target's caches and, as context keys, in
the draft's rings). One step:
1. the draft proposes a block of B tokens for each request (one parallel pass + Markov head);
2. the target runs [anchor, d_0 .. d_{B-1}] for each request in one step (1 + B rows a request);
3. the target features of every verify row go to the draft's rings (before verification, so the
   step's launches do not wait on its verdicts);
4. each request's rows are verified (greedy, standard, block or synthetic), committing a + 1
   tokens: a accepted draft tokens and one from the target; the last committed token becomes the
   new anchor.
Rejected rows need no undo: the target's caches keep enough history to overwrite them when those
positions are decoded again (model/cache.py). The draft's rings likewise: a block reads only the
positions before its anchor, all committed, and the step that commits a position writes it last
(a rejected row's position is written again by every later step until one commits it).
Every draw of a step (the Markov head's, verification's) picks by a uniform made at the start of
the step from the request's seed and its count of drawing steps (spec/draws.py: keyed draws).
With the mono kernels running both the target and the draft's stages, a step runs whole
instead: steps 1-4 as device work only, one CUDA graph on a GPU, then one read of the kernels'
error words and one of the verdicts (spec/step_graph.py, `WholeStep`); it commits what the
stepwise path commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model import Model
from ..model.cache import DecodeCache
from ..model.draft import DraftCache
from ..sampling import RowSettings, check_sampling, sample
from .config import SpeculativeConfig
from .draws import draws, keyed_uniforms, markov, step_keys, uniforms_per_step, verification
from .step_graph import WholeStep
from .verify import Verdict, read_verdicts, verify_rows


@dataclass
class SpecRequest:
    slot: int
    position: int  # the anchor's position: every position before it is committed
    anchor: int
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None  # its initial seed keys the steps' draws (spec/draws.py)
    top_k: int = 0  # <= 0: no limit
    draws: int = 0  # the committed steps that drew its uniforms: the next one's key

    @property
    def settings(self) -> tuple[float, float, int]:
        return self.temperature, self.top_p, self.top_k


@dataclass
class AcceptanceStats:
    """Verify steps taken, tokens committed, and how often each draft position was accepted."""

    steps: int = 0
    committed: int = 0
    accepted_at: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + 1)."""
        return self.committed / self.steps if self.steps else 0.0

    def rates(self) -> list[float]:
        return [n / self.steps for n in self.accepted_at] if self.steps else []


@dataclass
class SpecCaches:
    target: DecodeCache
    draft: DraftCache


class SpeculativeDecoder:
    def __init__(self, model: Model, config: SpeculativeConfig, target_step=None, count_path=None):
        """`model`: a `Model`, or a `decode.Decoder` (its steps on the mono kernels where they take
        them; prompt-sized steps go per-op). `target_step` runs the target's verify rows of a
        stepwise step (Model.step's signature; default model.step); the engine passes its own,
        which counts the path each verify step took. `count_path`, if given, is called once a
        step with the path the step took: "whole" (`WholeStep`) or "stepwise"."""
        self.model, self.config = model, config
        self.target_step = target_step or model.step
        self.count_path = count_path or (lambda path: None)
        self.draft = model.draft()
        config.check_block_size(self.draft.block_size)
        self.block_size = self.draft.block_size
        self.stats = AcceptanceStats(accepted_at=[0] * self.block_size)
        self.whole_step = WholeStep.of(model, self.draft, config)  # None unless the kernels run target and draft

    def make_caches(self, num_slots: int, max_context: int) -> SpecCaches:
        """Caches for `num_slots` requests; a request's positions must stay below
        `max_context - block_size - 1` (a verify step looks that far ahead)."""
        target = self.model.make_cache(num_slots, max_context, max_step_rows=self.block_size + 1)
        return SpecCaches(target, self.draft.make_cache(num_slots))

    def prefill(self, caches: SpecCaches, slot: int, prompt_ids: list[int], temperature: float = 0.0,
                top_p: float = 1.0, generator: torch.Generator | None = None, top_k: int = 0) -> SpecRequest:
        """Run a prompt, commit it, and sample its first token, which becomes the anchor."""
        check_sampling(temperature, top_p, top_k)
        self.config.check_temperature(temperature)
        logits = self.prefill_chunk(caches, slot, prompt_ids, start=0)
        first = int(sample(logits[-1:], temperature, top_p, generator, top_k))
        return SpecRequest(slot, len(prompt_ids), first, temperature, top_p, generator, top_k)

    def prefill_chunk(self, caches: SpecCaches, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Run and commit prompt tokens at positions start, start + 1, ... (a chunked prefill
        calls this chunk by chunk, in order); their fp32 logits [len(token_ids), vocab]."""
        positions = torch.arange(start, start + len(token_ids), device=self.model.device)
        logits, hidden = self.model.step(caches.target, token_ids, positions, [slot] * len(token_ids),
                                         return_hidden=True)
        self.draft.commit(caches.draft, slot, positions, hidden)
        return logits

    def step(self, caches: SpecCaches, requests: list[SpecRequest], return_logits: bool = False):
        """One verify step for all `requests` (updated in place); the tokens each committed. With
        `return_logits`, also per request the target's fp32 logits [len(committed), vocab] that
        each committed token was verified or sampled against (row j: the token at anchor + 1 + j).
        Whole (`WholeStep`: one CUDA graph on a GPU) when `takes_whole` says so, else stepwise."""
        path = "whole" if self.takes_whole(requests) else "stepwise"
        if path == "whole":
            verdicts, logits = self.whole_step.run(caches, requests)
            if return_logits:
                logits = logits.clone()  # on a GPU the graph's output, which the next step overwrites
        else:
            verdicts, logits = self._stepwise(caches, requests)
        self.count_path(path)
        committed = [self._advance(r, verdict) for r, verdict in zip(requests, verdicts)]
        if return_logits:
            return committed, [logits[i, :len(tokens)] for i, tokens in enumerate(committed)]
        return committed

    def takes_whole(self, requests: list[SpecRequest]) -> bool:
        """Whether a step of `requests` runs whole: the kernels run target and draft and the
        runners take the rows (any verification method, any sampling settings)."""
        return self.whole_step is not None and self.whole_step.refusal(len(requests)) is None

    def _stepwise(self, caches: SpecCaches, requests: list[SpecRequest]):
        """Draft, verify step, commit and verification in turn: the verdicts, the logits [R, B + 1, vocab]."""
        b, device, method = self.block_size, self.model.device, self.config.rejection_sample_method
        anchors = torch.tensor([r.anchor for r in requests], device=device)
        starts = torch.tensor([r.position for r in requests], device=device)
        settings = RowSettings.of([r.settings for r in requests], device)
        uniforms = keyed_uniforms(step_keys(requests, method).to(device), uniforms_per_step(b))
        proposal = self.draft.propose(caches.draft, anchors, starts, [r.slot for r in requests], settings,
                                      markov(uniforms, b))
        tokens = torch.cat([anchors[:, None], proposal.tokens], dim=1).flatten()
        positions = (starts[:, None] + torch.arange(b + 1, device=device)).flatten()
        slots = torch.tensor([r.slot for r in requests], device=device).repeat_interleave(b + 1)
        logits, hidden = self.target_step(caches.target, tokens, positions, slots, return_hidden=True)
        self.draft.commit(caches.draft, slots, positions, hidden)
        logits = logits.view(len(requests), b + 1, -1)
        rows = verify_rows(method, logits, proposal.tokens, proposal.probs, settings, verification(uniforms, b),
                           self.config.synthetic_acceptance_length)
        return read_verdicts(rows), logits

    def _advance(self, r: SpecRequest, verdict: Verdict) -> list[int]:
        """Move the request past its verdict's tokens (its new anchor the last) and its draws past
        the step's, and count them."""
        r.position += verdict.accepted + 1  # the anchor's row and the accepted drafts' rows
        r.anchor = verdict.tokens[-1]
        r.draws += int(draws(r.temperature, self.config.rejection_sample_method))
        self._count(verdict.accepted)
        return verdict.tokens

    def _count(self, accepted: int) -> None:
        self.stats.steps += 1
        self.stats.committed += accepted + 1
        for k in range(accepted):
            self.stats.accepted_at[k] += 1
