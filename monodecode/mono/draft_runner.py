"""`DraftRunner`: the DSpark draft's stages on the kernels, a runner of its own.

The draft's stages are window-only V4 blocks (`mtp.{k}.`, model/draft.py) whose rows come in
blocks of B (the anchor, then noise tokens) that see their whole block. They run as a target
window layer does, K1 + K2 + K3 a stage, with:
- the draft's layer stack (`MonoRunner`'s `stack`: its prefixes, blocks and its own experts
  config), and the runner's own sync state, scratch and CUDA graphs, so that nothing the target's
  runner counts or waits on is touched;
- `draft_block` = B: K2's attend takes every row of a block over the context before the anchor
  and the whole block (`attention.attend_task`'s draft blocks), from the draft cache's rings of
  `sliding_window + B` keys, into which K1 writes the block's keys past the context;
- no owed output before the first stage (the embedding broadcast to the streams, as a target's
  layer 0), and the settled streams after the last one as the step's output.
The head (the last stage's hc_head and norm, the shared lm_head) and the Markov and confidence
heads stay with `Draft.propose`, which takes this runner's `stages` in place of its own.
Under tensor parallelism each rank runs one on its own part of the draft (its heads, o groups,
shared-expert slice and routed experts), as `MonoRunner` does for the target: the sums over the
ranks inside K2 and K3 (in the runner's own peer memory), its graphs holding the stages only.
"""

from __future__ import annotations

import functools

import torch

from .runner import LayerStack, MonoRunner


def draft_stack(model, draft) -> LayerStack:
    """The draft's stages as a runner's layers, sized by the draft's own experts."""
    c = model.config
    config = c.replace(n_routed_experts=c.draft_n_routed_experts, num_experts_per_tok=c.draft_num_experts_per_tok,
                       num_hash_layers=0)
    n = len(draft.stages)
    return LayerStack(config, draft.w, (0,) * n, [f"mtp.{k}." for k in range(n)], draft.stages,
                      [functools.partial(draft.replace_experts, k) for k in range(n)])


class DraftRunner(MonoRunner):
    def __init__(self, model, draft, **options):
        """`draft`: the model's `Draft`; `options` as `MonoRunner`'s (graphs, max_polls, poison,
        shape)."""
        self.draft, self.draft_block = draft, draft.block_size
        super().__init__(model, stack=draft_stack(model, draft), **options)

    def stages(self, cache):
        """`Draft.propose`'s `stages` on the kernels for this draft cache."""
        return functools.partial(self.step, cache)

    def refusal(self, cache, tokens, positions, slots) -> str | None:
        return self.rows_refusal(torch.as_tensor(tokens).numel())

    def rows_refusal(self, rows: int) -> str | None:
        """Why the kernels do not take a draft pass of `rows` rows (None: they do)."""
        reason = super().rows_refusal(rows)
        if reason is None and rows % self.draft_block:
            return f"{rows} rows are not whole draft blocks of {self.draft_block}"
        return reason

    def takes(self, requests: int) -> bool:
        """Whether the kernels take a draft pass of `requests` blocks."""
        return self.rows_refusal(requests * self.draft_block) is None

    def _residency_cache(self, requests: int, rows: int):
        return self.draft.make_cache(requests)

    def head(self, layers_out):
        """A draft pass's result: the settled streams after the last stage (its head is the draft's)."""
        return layers_out[0]
