"""`Decoder`: a model's steps on the per-op path or on the mono kernels, chosen step by step.

The per-op model (`model.Model`) is the reference and knows nothing of the kernels; the mono
runner (`mono.MonoRunner`) runs a decode step of 1..48 rows as three persistent kernels a layer.
A `Decoder` holds both and sends each step to one of them: to the kernels when they are in use
and take the step (`MonoRunner.refusal` is None), to the per-op path otherwise (a prefill chunk,
a step of more than 48 rows), counting those fallbacks by reason. Both paths read and write the
same caches, so they interleave freely. It offers the model's own interface (`config`, `device`,
`make_cache`, `draft`, `score`), so the engine and the speculative decoder take it as the model;
with the kernels in use its `draft` runs the DSpark draft's stages on them too (`KernelDraft`).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .model import Model, load_model
from .mono import build

log = logging.getLogger("monodecode")


class Decoder:
    def __init__(self, model: Model, mono: str = "off"):
        """`mono`: "off", "auto" (refusals logged, per-op then) or "on" (refusals raised). Given a
        Decoder, it decodes the same model with this `mono`."""
        self.model = model.model if isinstance(model, Decoder) else model
        self.mono_mode = mono
        # a MonoRunner, or None; a model over ranks (ranks.LeadingModel) builds one on every rank
        build_mono = getattr(self.model, "build_mono", None)
        self.mono = build_mono(mono) if build_mono else build(self.model, mono)
        self.fallbacks: Counter[str] = Counter()  # steps the kernels did not take, by reason
        self.last_path: str | None = None  # "mono" or "per-op": the path the last step took
        self._draft = None  # built on first use: a draft on the kernels compiles and graphs its own

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def make_cache(self, num_slots: int, max_context: int, max_step_rows: int = 8):
        return self.model.make_cache(num_slots, max_context, max_step_rows)

    def draft(self):
        """The model's DSpark draft, built on first use; with the kernels in use, its stages run
        on them (`KernelDraft`, or a draft over ranks on every rank's kernels: `LeadingDraft.build_mono`;
        "auto": per-op if they refuse the draft, the reasons logged; "on": the refusal raised)."""
        if self._draft is None:
            self._draft = self._build_draft()
        return self._draft

    def _build_draft(self):
        draft = self.model.draft()
        if self.mono is None:
            return draft
        from .mono import MonoRefused
        from .mono.draft_runner import DraftRunner  # the kernels are imported (build) by now

        try:
            build_mono = getattr(draft, "build_mono", None)  # a draft over ranks (ranks.LeadingDraft)
            return build_mono() if build_mono else KernelDraft(draft, DraftRunner(self.model, draft))
        except MonoRefused as refused:
            if self.mono_mode == "on":
                raise
            for reason in refused.reasons:
                log.warning("mono %s: the draft runs per-op: %s", self.mono_mode, reason)
            return draft

    def close(self) -> None:
        self.model.close()

    def score(self, token_ids) -> torch.Tensor:
        """fp32 logits [T, vocab] of a full prefill of one sequence (per-op: too many rows)."""
        return self.model.score(token_ids)

    def step(self, cache, tokens, positions, slots, return_hidden: bool = False):
        """`Model.step`'s result, on the kernels where they are in use and take the step."""
        if self.mono is not None:
            reason = self.mono.refusal(cache, tokens, positions, slots)
            if reason is None:
                self.last_path = "mono"
                return self.mono.step(cache, tokens, positions, slots, return_hidden=return_hidden,
                                      refusal_checked=True)
            self.fallbacks[reason] += 1
        self.last_path = "per-op"
        return self.model.step(cache, tokens, positions, slots, return_hidden=return_hidden)


class KernelDraft:
    """A `Draft` whose stages run on the kernels (`mono.DraftRunner`) for every block they take
    (the rest, and the draft's head, on the per-op path)."""

    def __init__(self, draft, runner):
        self.draft, self.runner = draft, runner
        self.block_size = draft.block_size

    def make_cache(self, num_slots: int):
        return self.draft.make_cache(num_slots)

    def commit(self, cache, slot: int | list[int] | torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        self.draft.commit(cache, slot, positions, hidden)

    def propose(self, cache, anchors, anchor_positions, slots, settings, uniforms):
        return self.draft.propose(cache, anchors, anchor_positions, slots, settings, uniforms,
                                  stages=self.runner.stages(cache) if self.runner.takes(len(slots)) else None)


def load(source, *, device="cpu", dtype=torch.float32, seed: int = 0, mono: str = "off",
         tensor_parallel_size: int = 1) -> Decoder:
    """The decoder of a checkpoint directory, or of a preset name (deterministic random weights
    built in memory). `mono`: "off", "auto" or "on" (`Decoder`). `tensor_parallel_size` > 1:
    the model over that many processes, this one their rank 0 (`ranks.load_ranks`)."""
    return Decoder(load_any(source, device=device, dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size),
                   mono)


def load_any(source, *, device="cpu", dtype=torch.float32, seed: int = 0, tensor_parallel_size: int = 1,
             overrides: dict | None = None):
    """The per-op model in this process (size 1), or rank 0 of `tensor_parallel_size` ranks
    (`overrides`: a preset's config fields changed, `load_model`)."""
    if tensor_parallel_size == 1:
        return load_model(source, device=device, dtype=dtype, seed=seed, overrides=overrides)
    from .ranks import load_ranks

    return load_ranks(source, tensor_parallel_size, device=device, dtype=dtype, seed=seed, overrides=overrides)
