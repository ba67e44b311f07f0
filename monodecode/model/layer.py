"""One decoder block: mHC site, attention, mHC site, MoE."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .attention import Attention, RequestRows
from .cache import LayerCache, PositionRing
from .hc import hc_post, hc_pre
from .moe import MoE
from .norm import rms_norm
from .parallel import SINGLE, TensorParallel
from .weights import ExpertBank


class Block:
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str, experts: ExpertBank,
                 ratio: int, hash_routed: bool, topk: int, attention_cls: type[Attention] = Attention,
                 tp: TensorParallel = SINGLE):
        self.c, self.w, self.p = config, w, prefix
        self.attention = attention_cls(config, w, f"{prefix}attn.", ratio, tp)
        self.moe = MoE(config, w, f"{prefix}ffn.", experts, hash_routed, topk, tp)

    def __call__(self, streams: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 groups: list[RequestRows], cache: LayerCache | PositionRing) -> torch.Tensor:
        x, post, comb = self.site_input(streams, "attn")
        streams = hc_post(self.attention(x, positions, groups, cache), streams, post, comb)
        x, post, comb = self.site_input(streams, "ffn")
        return hc_post(self.moe(x, tokens), streams, post, comb)

    def site_input(self, streams: torch.Tensor, site: str):
        """`site_input` of this block's site ("attn" or "ffn")."""
        return site_input(streams, *self.site_weights(site), self.c)

    def site_weights(self, site: str) -> tuple[torch.Tensor, ...]:
        """A site's ("attn" or "ffn") mHC weights (fn, base, scale) and its norm's weight."""
        w, p = self.w, self.p
        return w[f"{p}hc_{site}_fn"], w[f"{p}hc_{site}_base"], w[f"{p}hc_{site}_scale"], w[f"{p}{site}_norm"]


def site_input(streams: torch.Tensor, fn, base, scale, norm, c: ModelConfig):
    """An mHC site's input: the collapse of the streams (`fn`, `base`, `scale`), normed (`norm`);
    with the collapse's post and comb, for the fold after the site."""
    x, post, comb = hc_pre(streams, fn, base, scale, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps,
                           sinkhorn_iters=c.hc_sinkhorn_iters)
    return rms_norm(x, norm, c.rms_norm_eps), post, comb
