"""An independent test oracle for DeepSeek-V4.1's text model: plain, dense, whole-sequence.

One prefill of one sequence at positions 0..T-1, no caches, everything in fp32, every tensor
materialised densely (scores over all entries, masks, then selection). Written straight from the
V4.1 specs (DeepSeek's official V4.1 `inference/model.py` and `engram.py` as the specs describe
them), without looking at the per-op model it checks, so that the two agree only if both follow
the specs. Used by tests to check the model, and to show that each V4.1 rule matters: `rules`
switches one V4.1 rule to a V4-like alternative (RULES, below).

What it deliberately leaves out, as the project's per-op reference does: the reference's
activation quantisation simulations (FP8 window KV, NVFP4 compressed KV, MXFP4 index q/k,
act_quant in front of FP8 linears) and its bf16 rounding points. Weights are used as given
(`read_weights(..., torch.float32)`: FP8 already dequantised, MXFP4 experts and Engram tables
dequantised here). The index keys follow the intended rule (each layer reads its KV source's own
keys), not the official code's stale-pointer quirk at even-position decode steps.

The model, in order (skeleton.md, attention.md, engram.md, dspark.md section 1):
- entry: X = embed(ids) copied onto hc_mult streams; the carried pre = one-hot on stream 0.
- layer L: Engram (Engram layers) on the full streams; [capture the draft feature: the stream mean
  entering the layer]; attention site: (pre, post, comb) from X, the attention input collapses X
  with the CARRIED pre; FFN site: (pre, post, comb) from the post-attention streams X1, the FFN
  input collapses X1 with this layer's attention-site pre; the FFN-site pre is carried on.
- end: collapse the final streams with the last FFN-site pre (no hc_head), norm, head.
- attention: q = rope(wq_b(q_norm(wq_a x))) (no per-head norm), window KV rope(kv_norm(wkv x)),
  compressed entries of the layer's KV source (compressor at ratio 2 / 1, RoPE at each entry's
  first position), chosen by the top-k of the latest index source; candidates from the candidate
  layer restrict the index sources above it; softmax with the sink in the denominator only.
- MoE: sqrt(softplus) scores, biased top-k selection, unbiased weights normalised (+1e-20) and
  scaled, SwiGLU experts clamped at swiglu_limit (the shared expert too).

Ties (exact equal index or block scores, e.g. several all-ReLU-zero index scores) are broken
towards the lower position: the selection uses a stable descending sort, so it does not depend
on how many columns the score matrix has (the prefix of a longer sequence selects the same).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from monodecode import formats
from monodecode.model.norm import rms_norm
from monodecode.model.rope import apply_rope, layer_frequencies
from monodecode.v41 import engram_primes

# Each switches ONE V4.1 rule to a V4-like alternative:
# v4_collapse      each mHC site collapses its input with its own fresh pre (V4), and the model's
#                  end collapses with a pre computed from the final streams (as final_fresh_pre)
# q_head_norm      V4's per-head unweighted RMSNorm of q after wq_b
# no_kv_reuse      compressed layers that are not KV sources attend their window only
# no_topk_reuse    compressed layers that are not index sources attend every visible entry of
#                  their KV source (V4's HCA rule) instead of the latest index source's top-k
# no_candidates    the index sources above the candidate layer do not mask their scores
# no_engram        the Engram layers skip Engram
# eps_1e-6         every RMSNorm eps (the mHC mixes' and the Engram gate's too) is 1e-6
# final_fresh_pre  the final collapse uses a pre computed from the final streams with the last
#                  layer's FFN-site weights instead of the carried pre
# capture_output   the draft features are the means of the streams LEAVING the target layers
RULES = ("v4_collapse", "q_head_norm", "no_kv_reuse", "no_topk_reuse", "no_candidates", "no_engram",
         "eps_1e-6", "final_fresh_pre", "capture_output")
V4_EPS = 1e-6
ENGRAM_GATE_CLAMP = 1e-6  # |dot| floor under the gate's square root (not an RMSNorm eps)
ROUTE_NORM_EPS = 1e-20  # the routing weights' normalisation (a literal, not rms_norm_eps)
ENGRAM_SCALE_BLOCK = (1, 32)  # an Engram row's FP8 values share one UE8M0 scale per 32


def oracle_forward(config, weights: dict, token_ids, token_map: torch.Tensor,
                   rules: frozenset = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits [T, vocab], draft features [T, len(dspark_target_layer_ids) * hidden]) of one
    sequence at positions 0..T-1."""
    logits, features, _ = _Oracle(config, weights, token_map, rules).run(token_ids)
    return logits, features


def oracle_trace(config, weights: dict, token_ids, token_map: torch.Tensor,
                 rules: frozenset = frozenset()) -> dict:
    """The same forward, with its selections: {"logits", "features", "layers": {L: {...}}} where
    a compressed layer's entry holds bool [T, G] masks over its KV source's G entries:
    "visible" (w < (t+1) // ratio), "attended" (the compressed entries its attention reads) and,
    on index sources, "selected" (its own top-k) and "scores" (masked, fp32); the candidate layer's
    entry also holds "candidates" (the kept blocks' entries)."""
    oracle = _Oracle(config, weights, token_map, rules)
    logits, features, trace = oracle.run(token_ids)
    return {"logits": logits, "features": features, "layers": trace}


# --- Engram hashing (engram.md sections 2-4) ---------------------------------------------------------
def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """The odd multiplier of each look-back distance 0..max_ngram_size-1 of one Engram layer:
    numpy default_rng(10007 * layer_id), one draw of max_ngram_size values in [0, bound), 2v + 1;
    bound keeps compressed id * multiplier below 2**63."""
    bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
    values = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in values]


def hash_offsets(primes) -> list[int]:
    """Each hash column's first row in its layer's table: the exclusive cumulative sum of the
    layer's primes (order-major), restarting at 0 for every layer."""
    out, total = [], 0
    for p in primes:
        out.append(total)
        total += p
    return out


def engram_hashes(config, token_ids, token_map: torch.Tensor) -> torch.Tensor:
    """LongTensor [T, n_engram_layers, (max_ngram - 1) * n_heads] of table rows: for position p
    and look-back s = 0..N-1 the rolling hash XORs compressed_id(p - s) * mult[s] (the pad token's
    compressed id before the sequence start); after s >= 1 it is the (s+1)-gram's hash, and head h
    of that order takes row rolling % prime + offset."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().tolist()
    layers = config.engram_layer_ids
    n, heads = config.engram_max_ngram_size, config.engram_n_heads
    cids = [int(token_map[i]) for i in ids]
    pad = int(token_map[config.engram_pad_token_id])
    primes_all = engram_primes(len(layers), n, heads, config.engram_vocab_size)
    out = torch.zeros(len(ids), len(layers), (n - 1) * heads, dtype=torch.long)
    for slot, layer_id in enumerate(layers):
        mult = hash_multipliers(layer_id, n, config.engram_compressed_vocab_size)
        primes, offsets = primes_all[slot], hash_offsets(primes_all[slot])
        for p in range(len(ids)):
            rolling = 0
            for s in range(n):
                v = cids[p - s] if p - s >= 0 else pad
                rolling ^= v * mult[s]
                if s >= 1:
                    for h in range(heads):
                        col = (s - 1) * heads + h
                        out[p, slot, col] = rolling % primes[col] + offsets[col]
    return out


def engram_rows(table: tuple, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [len(rows), width] of an Engram table as read_weights keeps it: (FP8 codes, UE8M0
    scale per 32 values) or (plain,)."""
    if len(table) == 1:
        return table[0][rows].float()
    codes, scale = table
    return formats.dequantize_fp8_block(codes[rows], scale[rows], ENGRAM_SCALE_BLOCK, torch.float32)


# --- mHC (skeleton.md section 2) -----------------------------------------------------------------------
def hc_mixes(X: torch.Tensor, fn, scale, base, hc_eps: float, iters: int, norm_eps: float):
    """(pre [T, H], post [T, H], comb [T, H, H]) of streams X [T, H, d]; comb[t, i, j] weighs
    input stream i into output stream j."""
    T, H, _ = X.shape
    xf = X.reshape(T, -1)
    m = (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[:, :H] * scale[0] + base[:H]) + hc_eps
    post = 2 * torch.sigmoid(m[:, H:2 * H] * scale[1] + base[H:2 * H])
    comb = (m[:, 2 * H:] * scale[2] + base[2 * H:]).view(T, H, H)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[:, :, None] * X).sum(1)


def hc_expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[j] = post[j] * y + sum_i comb[i, j] * X[i]."""
    return post[:, :, None] * y[:, None, :] + torch.einsum("tij,tid->tjd", comb, X)


# --- selection helpers ---------------------------------------------------------------------------------
def _top_mask(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """bool [T, N]: each row's k[t] highest scores above -inf (ties to the lower column)."""
    T, N = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(N).expand(T, N).contiguous())
    return (rank < k[:, None]) & (scores > -math.inf)


def candidate_mask(scores: torch.Tensor, compress_lens: torch.Tensor, block_size: int,
                   topk_blocks: int) -> torch.Tensor:
    """bool [T, G] of the candidate layer's kept entries (attention.md section 4): block score =
    max of its entries' masked scores, the block holding the newest visible entry pinned (+inf),
    the top min(topk_blocks, blocks) blocks, blocks at -inf dropped."""
    T, G = scores.shape
    nb = math.ceil(G / block_size)
    padded = F.pad(scores, (0, nb * block_size - G), value=-math.inf)
    block = padded.view(T, nb, block_size).amax(-1)
    rows = torch.nonzero(compress_lens > 0).flatten()
    block[rows, (compress_lens[rows] - 1) // block_size] = math.inf
    # _top_mask drops the -inf blocks (unreachable: no visible entry)
    keep = _top_mask(block, torch.full((T,), min(topk_blocks, nb), dtype=torch.long))
    return keep.repeat_interleave(block_size, dim=1)[:, :G]


class _Oracle:
    def __init__(self, config, weights: dict, token_map: torch.Tensor, rules):
        rules = frozenset(rules)
        unknown = sorted(rules - set(RULES))
        if unknown:
            raise ValueError(f"unknown rule(s) {unknown}; known: {RULES}")
        if not config.is_v41:
            raise ValueError(f"the V4.1 oracle needs a V4.1 config, got model_type {config.model_type!r}")
        if config.num_hash_layers:
            raise ValueError("V4.1 has no hash-routed layers")
        self.c, self.w, self.token_map, self.rules = config, weights, token_map, rules
        self.eps = V4_EPS if "eps_1e-6" in rules else config.rms_norm_eps

    def W(self, name: str) -> torch.Tensor:
        return self.w[name].float()

    # --- the model -------------------------------------------------------------------------------------
    def run(self, token_ids):
        c, rules = self.c, self.rules
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        T, H, d = ids.numel(), c.hc_mult, c.hidden_size
        self.T, self.pos = T, torch.arange(T)
        self.comp_kv: dict[int, torch.Tensor] = {}  # KV source -> RoPE'd compressed entries [G, head_dim]
        self.index_keys: dict[int, torch.Tensor] = {}  # KV source -> index keys [G, index_head_dim]
        self.topk: dict[int, torch.Tensor] = {}  # index source -> bool [T, G] selected entries
        self.candidates: torch.Tensor | None = None
        self.trace: dict[int, dict] = {}
        use_engram = bool(c.engram_layer_ids) and "no_engram" not in rules
        hashes = engram_hashes(c, ids, self.token_map) if use_engram else None
        targets = tuple(c.dspark_target_layer_ids or ())
        fresh = "v4_collapse" in rules

        X = self.W("embed")[ids][:, None, :].expand(T, H, d).clone()
        pre = torch.zeros(T, H)
        pre[:, 0] = 1.0
        features: dict[int, torch.Tensor] = {}
        for L in range(c.num_hidden_layers):
            p = f"layers.{L}."
            if use_engram and c.is_engram_layer(L):
                X = self.engram(L, X, hashes[:, c.engram_layer_ids.index(L)])
            if L in targets and "capture_output" not in rules:
                features[L] = X.mean(1)
            a_pre, a_post, a_comb = self.mixes(X, p + "hc_attn")
            u = rms_norm(hc_collapse(X, a_pre if fresh else pre), self.W(p + "attn_norm"), self.eps)
            X1 = hc_expand(self.attention(L, u), X, a_post, a_comb)
            f_pre, f_post, f_comb = self.mixes(X1, p + "hc_ffn")
            v = rms_norm(hc_collapse(X1, f_pre if fresh else a_pre), self.W(p + "ffn_norm"), self.eps)
            X = hc_expand(self.moe(L, v), X1, f_post, f_comb)
            pre = f_pre
            if L in targets and "capture_output" in rules:
                features[L] = X.mean(1)
        if fresh or "final_fresh_pre" in rules:
            pre = self.mixes(X, f"layers.{c.num_hidden_layers - 1}.hc_ffn")[0]
        h = rms_norm(hc_collapse(X, pre), self.W("norm"), self.eps)
        logits = h @ self.W("head").T
        feats = torch.cat([features[L] for L in targets], dim=-1) if targets else torch.zeros(T, 0)
        return logits, feats, self.trace

    def mixes(self, X: torch.Tensor, site: str):
        return hc_mixes(X, self.W(site + "_fn"), self.W(site + "_scale"), self.W(site + "_base"),
                        self.c.hc_eps, self.c.hc_sinkhorn_iters, self.eps)

    # --- Engram (engram.md sections 5-6) ------------------------------------------------------------------
    def engram(self, L: int, X: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """X + gate * value on each stream; hashes [T, C] table rows."""
        p = f"layers.{L}.engram."
        T, H, d = X.shape
        rows = engram_rows(self.w[p + "embed"], hashes.reshape(-1)).view(T, -1)  # order-major columns
        kv = rows @ self.W(p + "wkv").T  # [T, (H + 1) * d]
        key, value = kv[:, :H * d].view(T, H, d), kv[:, H * d:]
        wqk = self.W(p + "q_weight") * self.W(p + "k_weight")  # [H, d]
        rstd = (torch.rsqrt(X.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps))
        dot = (X * wqk * key).sum(-1) * rstd * d ** -0.5  # [T, H]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=ENGRAM_GATE_CLAMP).sqrt(), dot))
        return X + gate[:, :, None] * value[:, None, :]

    # --- attention (attention.md) -----------------------------------------------------------------------
    def attention(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c, rules, T, pos = self.c, self.rules, self.T, self.pos
        p = f"layers.{L}.attn."
        ratio = c.compress_ratios[L]
        freqs = layer_frequencies(c, ratio > 0)
        nh, hd = c.num_attention_heads, c.head_dim
        qr = rms_norm(x @ self.W(p + "wq_a").T, self.W(p + "q_norm"), self.eps)
        q = (qr @ self.W(p + "wq_b").T).view(T, nh, hd)
        if "q_head_norm" in rules:
            q = rms_norm(q, None, self.eps)
        q = apply_rope(q, pos, freqs)
        kv = apply_rope(rms_norm(x @ self.W(p + "wkv").T, self.W(p + "kv_norm"), self.eps), pos, freqs)
        s, t = pos[None, :], pos[:, None]
        keys, mask = kv, (s <= t) & (s > t - c.sliding_window)  # the window, the query included
        if ratio > 0:
            src, isrc = c.kv_source_of(L), c.index_source_of(L)
            if src == L:
                self.compress(L, x, freqs)
            entries = self.comp_kv[src]
            G = entries.shape[0]
            visible = torch.arange(G)[None, :] < ((pos + 1) // ratio)[:, None]
            info = self.trace.setdefault(L, {})
            info["visible"] = visible
            if isrc == L:
                self.topk[L] = self.indexer(L, x, qr, freqs, visible, info)
            if src != L and "no_kv_reuse" in rules:
                attended = torch.zeros_like(visible)
            elif isrc != L and "no_topk_reuse" in rules:
                attended = visible
            else:
                attended = self.topk[isrc]
            info["attended"] = attended
            keys, mask = torch.cat([kv, entries]), torch.cat([mask, attended], dim=1)
        o = self.sparse_attention(q, keys, mask, self.W(p + "attn_sink"))
        o = apply_rope(o, pos, freqs, inverse=True).view(T, c.o_groups, -1)
        wo_a = self.W(p + "wo_a").view(c.o_groups, c.o_lora_rank, -1)
        z = torch.einsum("tgd,grd->tgr", o, wo_a)
        return z.flatten(1) @ self.W(p + "wo_b").T

    @staticmethod
    def sparse_attention(q, keys, mask, sink) -> torch.Tensor:
        """K = V = keys [S, hd]; the sink joins the softmax's denominator only."""
        T, nh, hd = q.shape
        logits = torch.einsum("thd,sd->ths", q, keys) * hd ** -0.5
        logits = logits.masked_fill(~mask[:, None, :], -math.inf)
        with_sink = torch.cat([logits, sink[None, :, None].expand(T, nh, 1)], dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1]
        return torch.einsum("ths,sd->thd", probs, keys)

    def compress(self, L: int, x: torch.Tensor, freqs: torch.Tensor) -> None:
        """A KV source's compressed entries (RoPE'd at each entry's first position) and its index
        keys (wk + k_norm on the pre-RoPE latent, then RoPE at the same position)."""
        c, T = self.c, self.T
        p = f"layers.{L}.attn."
        ratio, hd = c.compress_ratios[L], c.head_dim
        G = T // ratio
        kv = (x @ self.W(p + "compressor.wkv").T)[:G * ratio]
        if ratio == 1:
            pooled = kv
        else:
            score = (x @ self.W(p + "compressor.wgate").T)[:G * ratio].view(G, ratio, hd)
            pooled = (torch.softmax(score, dim=1) * kv.view(G, ratio, hd)).sum(1)
        latent = rms_norm(pooled, self.W(p + "compressor.norm"), self.eps)
        first = torch.arange(G) * ratio
        self.comp_kv[L] = apply_rope(latent, first, freqs)
        k = rms_norm(latent @ self.W(p + "indexer.wk").T, self.W(p + "indexer.k_norm"), self.eps)
        self.index_keys[L] = apply_rope(k, first, freqs)

    def indexer(self, L: int, x, qr, freqs, visible, info) -> torch.Tensor:
        """bool [T, G]: the top min(index_topk, visible) entries of this layer's scores against
        its KV source's index keys (candidate-masked above the candidate layer)."""
        c, T = self.c, self.T
        p = f"layers.{L}.attn.indexer."
        n, dim = c.index_n_heads, c.index_head_dim
        q = apply_rope((qr @ self.W(p + "wq_b").T).view(T, n, dim), self.pos, freqs)
        weights = (x @ self.W(p + "weights_proj").T) * (dim ** -0.5 * n ** -0.5)  # [T, n]
        keys = self.index_keys[c.kv_source_of(L)]
        scores = (torch.einsum("thd,gd->thg", q, keys).relu() * weights[:, :, None]).sum(1)  # [T, G]
        scores = scores.masked_fill(~visible, -math.inf)
        if c.uses_candidates(L) and "no_candidates" not in self.rules:
            scores = scores.masked_fill(~self.candidates, -math.inf)
        if L == c.candidate_source_layer_id:  # from its own masked scores, before its (unmasked) top-k
            compress_lens = (self.pos + 1) // c.compress_ratios[L]
            self.candidates = candidate_mask(scores, compress_lens, c.candidate_block_size, c.candidate_topk_blocks)
            info["candidates"] = self.candidates
        selected = _top_mask(scores, visible.sum(1).clamp(max=c.index_topk))
        info["scores"], info["selected"] = scores, selected
        return selected

    # --- MoE (skeleton.md section 7) -------------------------------------------------------------------
    def moe(self, L: int, v: torch.Tensor) -> torch.Tensor:
        c = self.c
        p = f"layers.{L}.ffn."
        scores = torch.sqrt(F.softplus(v @ self.W(p + "gate").T))
        k = c.num_experts_per_tok
        idx = torch.topk(scores + self.W(p + "gate.bias"), k, dim=-1).indices
        route = scores.gather(1, idx)
        if c.norm_topk_prob and k > 1:
            route = route / (route.sum(-1, keepdim=True) + ROUTE_NORM_EPS)
        route = route * c.routed_scaling_factor
        y = torch.zeros_like(v)
        for e in range(c.n_routed_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel():
                w1, w2, w3 = (self.expert_matrix(f"{p}experts.{e}.{m}") for m in ("w1", "w2", "w3"))
                y[tok] += self.swiglu(v[tok], w1, w2, w3, route[tok, slot])
        if c.n_shared_experts:
            y = y + self.swiglu(v, *(self.W(f"{p}shared_experts.{m}") for m in ("w1", "w2", "w3")))
        return y

    def expert_matrix(self, name: str) -> torch.Tensor:
        stored = self.w[name]
        if isinstance(stored, tuple):
            return stored[0].float() if len(stored) == 1 else formats.dequantize_mxfp4(*stored, torch.float32)
        return stored.float()

    def swiglu(self, x, w1, w2, w3, route=None) -> torch.Tensor:
        limit = self.c.swiglu_limit
        g = (x @ w1.T).clamp(max=limit)
        u = (x @ w3.T).clamp(-limit, limit)
        h = F.silu(g) * u
        if route is not None:
            h = h * route[:, None]
        return h @ w2.T
