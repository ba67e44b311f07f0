"""The DSpark draft: `num_nextn_predict_layers` window-only blocks (`mtp.{k}.*`) that propose a
whole block of tokens in one parallel pass.

Context: for every committed target position p, `main_x = main_norm(main_proj(h_p))`, where h_p
concatenates, over `dspark_target_layer_ids`, the mean over the hc streams of the target's
residual after that layer (DeepSeek-V4.1: entering it; `Model.step`). Each stage keeps a ring of context keys
`rope(kv_norm(wkv(main_x_p)), p)` for the last `sliding_window` committed positions; context
positions have no queries.

A block: with t the last committed position and the anchor (the token the target just emitted)
at t + 1, the stages run over `[anchor, noise x (block_size - 1)]` at positions t + 1 .. t + B,
embedding broadcast to the hc streams. Every block query attends the stage's context ring and
all B block keys (non-causal inside the block); block keys never enter the ring. The last
stage's hc_head and norm and the shared lm_head give B rows of base logits U; row k is for the
token at position t + 2 + k. DeepSeek-V4.1's draft: its stages are V4.1 blocks (the delayed mHC
collapse, from the one-hot pre of the first stage; no per-head query norm) with the draft's own
expert count and top-k, and the last stage's output is collapsed with its FFN pre (no hc_head);
its Markov tables are named `markov_head.embed` / `markov_head.head` (`markov_w1` / `markov_w2`
below).

The Markov head then samples left to right: with prev = anchor, for k = 0..B-1,
`logits_k = U_k + markov_w2 @ markov_w1[prev]`, d_k ~ probabilities(logits_k) (picked by the
request's k-th uniform of the step, spec/draws.py), and the confidence
`c_k = sigmoid(w_conf . [hb_k ; markov_w1[prev]])` (hb: the pre-norm hc_head output) estimates
the chance that d_k survives verification.

When every request of a proposal is greedy (temperature 0), d_k is the argmax of logits_k and
its distribution the one-hot there: no uniform is read, and on a GPU the whole head
(hc_head, norm, lm_head, the Markov and confidence heads) replays as one CUDA graph per request
count (`_greedy_head`; the same operations as eagerly, so the same tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling import RowSettings, argmax_rows, pick, row_probabilities
from .attention import Attention, RequestRows, rotated_keys
from .cache import PositionRing
from .delayed_block import DelayedBlock, entry_pre
from .hc import collapse, hc_head
from .layer import Block
from .norm import rms_norm
from .weights import expert_bank


class DraftAttention(Attention):
    """A stage's attention: block queries over the context ring plus the whole block."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, groups: list[RequestRows],
                 ring: PositionRing) -> torch.Tensor:
        _, q, kv = self.project(x, positions)
        out = torch.zeros_like(q)
        for g in groups:
            anchor = int(g.positions[0])
            context, valid = ring.read(g.slot, torch.arange(anchor - self.c.sliding_window, anchor, device=x.device))
            keys = torch.cat([context["kv"], kv[g.index]])
            mask = torch.cat([valid, torch.ones_like(g.positions, dtype=torch.bool)])
            out[g.index] = self.attend(q[g.index], keys, mask.expand(len(g.index), -1))
        return self.output(out, positions)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [R, B] draft tokens
    probs: torch.Tensor  # [R, B, vocab] the distributions they were drawn from
    confidence: torch.Tensor  # [R, B] estimated survival of each draft token


@dataclass
class DraftStageCache:
    """A stage's cache, shaped as a target layer's (`window`): its context ring."""

    window: PositionRing


class DraftCache:
    """One context ring a stage, `sliding_window + dspark_block_size` keys a slot: the context a
    block reads, and room past it for the block's own keys where the kernels write them
    (mono/attention.py); `commit` overwrites those positions before they are context."""

    def __init__(self, config, num_slots: int, device, dtype):
        size = config.sliding_window + config.dspark_block_size
        self.layers = [DraftStageCache(PositionRing(num_slots, size, {"kv": config.head_dim}, device, dtype))
                       for _ in range(config.num_nextn_predict_layers)]

    @property
    def rings(self) -> list[PositionRing]:
        return [layer.window for layer in self.layers]

    def clear(self, slot: int) -> None:
        for ring in self.rings:
            ring.clear(slot)


class Draft:
    def __init__(self, model, weights: dict):
        c = model.config
        self.model, self.c, self.w = model, c, weights
        self.block_size = c.dspark_block_size
        self.stages = [self._stage(k) for k in range(c.num_nextn_predict_layers)]
        self.last = f"mtp.{c.num_nextn_predict_layers - 1}."
        self.markov_w1, self.markov_w2 = (f"{self.last}markov_head.{name}" for name in c.markov_tensor_names)
        self._greedy_graphs: dict[int, tuple] = {}  # requests -> (inputs, outputs, graph)
        self._stacked_keys = self._stack_keys()

    def _stage(self, k: int) -> Block:
        c, p, tp = self.c, f"mtp.{k}.", self.model.tp
        experts = expert_bank(self.w, f"{p}ffn.", tp.part(c.draft_n_routed_experts), self.model.dtype)
        if c.is_v41:
            attention = DraftAttention(c, self.w, f"{p}attn.", 0, tp)
            return DelayedBlock(c, self.w, p, experts, c.draft_num_experts_per_tok, attention, tp=tp)
        return Block(c, self.w, p, experts, 0, False, c.draft_num_experts_per_tok, attention_cls=DraftAttention, tp=tp)

    def _stack_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stage's `wkv` stacked [S * D, d] and `kv_norm` [S, D], so that `commit` makes all
        stages' context keys in one pass; the stages (and `self.w`) read views of the stacks from
        now on, so those weights are held once."""
        names = ("wkv", "kv_norm")
        stacks = {name: torch.stack([stage.attention.w[name] for stage in self.stages]) for name in names}
        for k, stage in enumerate(self.stages):
            views = {name: stacks[name][k] for name in names}
            self.w.update({f"mtp.{k}.attn.{name}": view for name, view in views.items()})
            stage.attention.share_weights(views)
        return stacks["wkv"].flatten(0, 1), stacks["kv_norm"]

    def replace_experts(self, stage: int, experts) -> None:
        """Serve the stage's routed experts from `experts` (as `Model.replace_experts`)."""
        self.stages[stage].moe.experts = experts

    def make_cache(self, num_slots: int) -> DraftCache:
        return DraftCache(self.c, num_slots, self.model.device, self.model.dtype)

    @torch.no_grad()
    def commit(self, cache: DraftCache, slot: int | list[int] | torch.Tensor, positions: torch.Tensor,
               hidden: torch.Tensor) -> None:
        """Add target positions [n] with their features `hidden` [n, T * d] to the context rings
        of `slot`, or of each row's slot (`slot` a list or tensor: a verify step's rows of several
        requests at once, rejected ones included: later steps write those positions again)."""
        main_x = rms_norm(F.linear(hidden.to(self.model.dtype), self.w["mtp.0.main_proj"]),
                          self.w["mtp.0.main_norm"], self.c.rms_norm_eps)
        keys = rotated_keys(main_x, *self._stacked_keys, positions, self.stages[0].attention.freqs,
                            self.c.rms_norm_eps)  # [n, stages, D]
        for k, ring in enumerate(cache.rings):
            ring.write(slot, positions, {"kv": keys[:, k]})

    @torch.no_grad()
    def propose(self, cache: DraftCache, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                slots: list[int], settings: RowSettings, uniforms: torch.Tensor | None, *, stages=None) -> Proposal:
        """One block for each of R requests: anchors, anchor_positions [R], their slots, their
        sampling `settings`, and the Markov head's uniforms [R, B] (spec/draws.py; unread when
        every request is greedy). `stages`: a callable (tokens, positions, slots of the R * B
        rows) -> the streams after the last stage, run instead of the per-op stages (the
        kernels: `mono.DraftRunner.stages`)."""
        r, b = anchors.shape[0], self.block_size
        device = self.model.device
        tokens = torch.full((r, b), self.c.dspark_noise_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = anchors
        positions = anchor_positions.to(device)[:, None] + torch.arange(b, device=device)
        pre = None  # V4.1: the last stage's FFN pre, that its output is collapsed with
        if stages is None:
            groups = [RequestRows(s, torch.arange(i * b, (i + 1) * b, device=device), positions[i])
                      for i, s in enumerate(slots)]
            tokens, positions = tokens.flatten(), positions.flatten()
            streams = self.model.embed(tokens)
            if self.c.is_v41:
                pre = entry_pre(len(tokens), self.c.hc_mult, device)
            for stage, ring in zip(self.stages, cache.rings):
                if pre is None:
                    streams = stage(streams, tokens, positions, groups, ring)
                else:
                    streams, pre = stage(streams, tokens, positions, groups, ring, pre)
        else:
            streams = stages(tokens.flatten(), positions.flatten(), torch.tensor(slots).repeat_interleave(b))
        anchors = anchors.to(device)
        if settings.greedy:
            return self._greedy_head(streams, pre, anchors)
        return self.sampled_head(streams, pre, anchors, settings, uniforms)

    def sampled_head(self, streams: torch.Tensor, pre: torch.Tensor | None, anchors: torch.Tensor,
                     settings: RowSettings, uniforms: torch.Tensor) -> Proposal:
        """The head of a proposal (`propose`'s, from the stages' output `streams`) whose draws
        pick by the uniforms [R, B], with no host sync. Greedy requests among others take the
        argmax (their distributions are one-hot)."""
        hb, base = self._head(streams, pre, anchors.shape[0])
        return self._markov_sample(base, hb, anchors, functools.partial(_drawn, settings=settings, uniforms=uniforms))

    def _head(self, streams: torch.Tensor, pre: torch.Tensor | None, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's merged output hb [R, B, d] (V4: its hc_head; V4.1: the collapse with
        its FFN pre `pre`) and the base logits [R, B, vocab] (fp32)."""
        w, c, b = self.w, self.c, self.block_size
        if pre is None:
            hb = hc_head(streams, w[f"{self.last}hc_head_fn"], w[f"{self.last}hc_head_base"],
                         w[f"{self.last}hc_head_scale"], hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        else:
            hb = collapse(streams, pre)
        return hb.view(r, b, -1), self.model.lm_head(hb, w[f"{self.last}norm"]).view(r, b, -1)

    def _markov_logits(self, base_k, prev):
        """Position k's Markov logits from the previous token `prev` [R], and prev's row of markov_w1."""
        e = F.embedding(prev, self.w[self.markov_w1])
        return base_k + self.model.fp32_linear(e, self.w[self.markov_w2]), e

    def _markov_draws(self, base, anchors, draw, hb=None):
        """Left to right from the anchors: position k's logits, then `draw(logits, k)` -> (the
        tokens [R], the distributions [R, vocab] they came from, or None). The tokens [R, B], the
        distributions [R, B, vocab] (None where `draw` gives none) and, given the last stage's
        output hb [R, B, d], each position's confidence `sigmoid(w_conf . [hb_k ; markov_w1[prev]])`
        [R, B] (else None)."""
        prev, drafted, dists, confidence = anchors, [], [], []
        for k in range(self.block_size):
            logits, e = self._markov_logits(base[:, k], prev)
            if hb is not None:
                features = torch.cat([hb[:, k].float(), e.float()], dim=-1)
                weight = self.w[f"{self.last}confidence_head.proj"].float()
                confidence.append(torch.sigmoid(F.linear(features, weight)).squeeze(-1))
            prev, probs = draw(logits, k)
            drafted.append(prev)
            dists.append(probs)
        return (torch.stack(drafted, 1), None if dists[0] is None else torch.stack(dists, 1),
                torch.stack(confidence, 1) if confidence else None)

    def _markov_sample(self, base, hb, anchors, draw) -> Proposal:
        """`_markov_draws` with the confidences: a proposal."""
        return Proposal(*self._markov_draws(base, anchors, draw, hb))

    def _greedy_markov(self, streams: torch.Tensor, pre: torch.Tensor | None, anchors: torch.Tensor) -> Proposal:
        """The head of an all-greedy proposal: the sampling path's tokens and one-hot distributions
        at temperature 0 (the argmax, which is what sampling a one-hot gives), batched over the
        requests, with no host sync."""
        hb, base = self._head(streams, pre, anchors.shape[0])
        return self._markov_sample(base, hb, anchors, _argmax_and_one_hot)

    def greedy_tokens(self, streams: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The draft tokens [R, B] of an all-greedy proposal from the kernels' stages' output
        `streams`: `propose`'s tokens (each position's argmax, the same operations), with no host
        sync and no graph of its own (a whole speculative step, spec/step_graph.py, captures it in
        its graph), and neither the one-hot distributions nor the confidences, which the step
        does not read."""
        _, base = self._head(streams, None, anchors.shape[0])
        return self._markov_draws(base, anchors, lambda logits, _: (argmax_rows(logits), None))[0]

    def sampled_tokens(self, streams: torch.Tensor, anchors: torch.Tensor, settings: RowSettings,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sampled_head`'s tokens [R, B] and distributions [R, B, vocab] without the confidences,
        which a whole speculative step (spec/step_graph.py, whose graph holds this) does not read."""
        _, base = self._head(streams, None, anchors.shape[0])
        return self._markov_draws(base, anchors, functools.partial(_drawn, settings=settings, uniforms=uniforms))[:2]

    def _greedy_head(self, streams: torch.Tensor, pre: torch.Tensor | None, anchors: torch.Tensor) -> Proposal:
        """`_greedy_markov`, on a GPU through a CUDA graph of this request count (captured on first
        use; not under tensor parallelism, whose gathers are collectives)."""
        if streams.device.type != "cuda" or self.model.tp.size > 1 or torch.cuda.is_current_stream_capturing():
            return self._greedy_markov(streams, pre, anchors)
        r = anchors.shape[0]
        if r not in self._greedy_graphs:
            self._greedy_graphs[r] = self._capture_greedy(streams, pre, anchors)
        inputs, outputs, graph = self._greedy_graphs[r]
        for buffer, value in zip(inputs, (streams, pre, anchors)):
            if buffer is not None:
                buffer.copy_(value)
        graph.replay()
        return Proposal(*(t.clone() for t in outputs))

    def _capture_greedy(self, streams: torch.Tensor, pre: torch.Tensor | None, anchors: torch.Tensor):
        inputs = (streams.clone(), None if pre is None else pre.clone(), anchors.clone())
        side = torch.cuda.Stream(streams.device)  # the warm-up sets up the GEMMs' workspaces outside the capture
        side.wait_stream(torch.cuda.current_stream(streams.device))
        with torch.cuda.stream(side):
            self._greedy_markov(*inputs)
        torch.cuda.current_stream(streams.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            proposal = self._greedy_markov(*inputs)
        return inputs, (proposal.tokens, proposal.probs, proposal.confidence), graph


def _drawn(logits: torch.Tensor, position: int, settings: RowSettings,
           uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's token at draft `position`, picked from its distribution (its row of
    `settings`) by its uniform there; and the distributions."""
    probs = row_probabilities(logits, settings)
    return pick(probs, uniforms[:, position]), probs


def _argmax_and_one_hot(logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    best = argmax_rows(logits)
    return best, torch.zeros_like(logits).scatter_(-1, best[:, None], 1.0)
