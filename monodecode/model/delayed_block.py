"""A DeepSeek-V4.1 decoder block: V4's sub-blocks under a delayed mHC collapse.

Each mHC site still computes its mixes (pre, post, comb) from the streams entering it, and applies
post and comb at once; but the sub-block's input is collapsed with the pre of the sub-block before
it, carried along: the attention with the previous block's FFN pre (the model's first attention
with the one-hot on stream 0, `entry_pre`: all streams equal the embedding then), the FFN with
this block's attention pre. The block returns its FFN pre for the next one; after the last block
the model collapses with it (no hc_head). On an Engram layer the model adds the gated n-gram
memory to the streams before the block (engram.py), after the carried pre was computed.
DeepSeek-V4.1's `inference/model.py` (Block.forward, Transformer.forward) defines this order.
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
                 attention, tp: TensorParallel = SINGLE):
        """`attention`: the block's attention (shared_attention.SharedAttention, or a draft
        stage's)."""
        self.c, self.w, self.p = config, w, prefix
        self.attention = attention
        self.moe = MoE(config, w, f"{prefix}ffn.", experts, False, topk, tp)

    def __call__(self, streams: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, groups, cache,
                 pre: torch.Tensor, *, share=None):
        """(streams after the block, its FFN pre) from the streams entering it and the carried
        `pre` [N, hc]; `share`: the step's cross-layer state, for the attention
        (shared_attention.StepShare; none for a draft stage's)."""
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
