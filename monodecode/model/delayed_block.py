"""A DeepSeek-V4.1 decoder block: V4's sub-blocks under a delayed mHC collapse, and Engram.

Each mHC site still computes its mixes (pre, post, comb) from the streams entering it, and applies
post and comb at once; but the sub-block's input is collapsed with the pre of the sub-block before
it, carried along: the attention with the previous block's FFN pre (the model's first attention
with the one-hot on stream 0, `entry_pre`: all streams equal the embedding then), the FFN with
this block's attention pre. The block returns its FFN pre for the next one; after the last block
the model collapses with it (no hc_head). An Engram layer first adds its gated n-gram memory to
the streams (engram.py), after the carried pre was computed. DeepSeek-V4.1's `inference/model.py`
(Block.forward, Transformer.forward) defines this order.
"""

from __future__ import annotations

import torch

from .hc import collapse, hc_mixes, hc_post
from .layer import Block
from .moe import MoE
from .norm import rms_norm
from .parallel import SINGLE, TensorParallel
from .weights import ExpertBank


def entry_pre(rows: int, hc: int, device) -> torch.Tensor:
    """The pre that the first block's attention collapses with: [rows, hc], one-hot on stream 0."""
    pre = torch.zeros(rows, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1
    return pre


class DelayedBlock(Block):
    def __init__(self, config, w: dict[str, torch.Tensor], prefix: str, experts: ExpertBank, topk: int,
                 attention, engram=None, tp: TensorParallel = SINGLE):
        """`attention`: the block's attention (shared_attention.SharedAttention, or a draft
        stage's); `engram`: its Engram (engram.Engram) on an Engram layer."""
        self.c, self.w, self.p = config, w, prefix
        self.attention, self.engram = attention, engram
        self.moe = MoE(config, w, f"{prefix}ffn.", experts, False, topk, tp)

    def __call__(self, streams: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, groups, cache,
                 pre: torch.Tensor, *, ngrams: torch.Tensor | None = None, share=None):
        """(streams after the block, its FFN pre) from the streams entering it and the carried
        `pre` [N, hc]; `ngrams` [N, max_ngram_size]: the rows' compressed n-gram ids (Engram layers);
        `share`: the step's cross-layer state, for the attention (shared_attention.StepShare)."""
        if self.engram is not None:
            streams = self.engram(streams, ngrams)
        attn_pre, post, comb = self.mixes(streams, "attn")
        x = self.collapsed_input(streams, pre, "attn")
        extra = {} if share is None else {"share": share}
        streams = hc_post(self.attention(x, positions, groups, cache, **extra), streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        x = self.collapsed_input(streams, attn_pre, "ffn")
        return hc_post(self.moe(x, tokens), streams, post, comb), ffn_pre

    def mixes(self, streams: torch.Tensor, site: str):
        """(pre, post, comb) of a site ("attn" or "ffn") from the streams entering it."""
        fn, base, scale, _ = self.site_weights(site)
        c = self.c
        return hc_mixes(streams, fn, base, scale, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps,
                        sinkhorn_iters=c.hc_sinkhorn_iters)

    def collapsed_input(self, streams: torch.Tensor, pre: torch.Tensor, site: str) -> torch.Tensor:
        """A site's input: the streams collapsed with `pre`, normed with the site's norm."""
        return rms_norm(collapse(streams, pre), self.site_weights(site)[3], self.c.rms_norm_eps)
