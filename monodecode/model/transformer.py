"""The per-op DeepSeek-V4 model: embedding, decoder blocks, hc_head, final norm, lm_head; and
DeepSeek-V4.1's (`config.is_v41`): embedding, Engram on its layers, decoder blocks under the
delayed mHC collapse (delayed_block.py) whose compressed layers read their source layers'
(shared_attention.py), the collapse with the last block's FFN pre, final norm, lm_head.

`step(cache, tokens, positions, slots)` runs one batch of rows (one row: a token, its absolute
position, its request's cache slot, or -1 for a pad row that reads and writes no cache) and
returns fp32 logits. A request's rows in one step are consecutive positions and see each other
causally, so a prefill, a decode step of many requests and a speculative verify step (1 + k rows
per request) are all steps. `score(ids)` is the prefill of one sequence.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import Checkpoint, SyntheticCheckpoint
from ..config import PRESETS, ModelConfig, preset
from .attention import RequestRows
from .cache import DecodeCache
from .delayed_block import DelayedBlock, entry_pre
from .engram import Engram, compressed_token_map, ngram_ids
from .hc import collapse, hc_head
from .layer import Block
from .norm import rms_norm
from .parallel import SINGLE, TensorParallel
from .shared_attention import SharedAttention, StepShare
from .weights import expert_bank, free_memory, read_weights, resident_bytes


class Model:
    """The model, or under tensor parallelism (`tp`, parallel.py) one rank's part of it: every
    rank runs every step with the same inputs and gets the same logits."""

    def __init__(self, config: ModelConfig, weights: dict, device, dtype, checkpoint=None, tp: TensorParallel = SINGLE):
        tp.check(config)
        self.config, self.device, self.dtype, self.tp = config, torch.device(device), dtype, tp
        self.w, self.checkpoint, self._draft = weights, checkpoint, None
        self._fp32_output_gemm = has_fp32_output_gemm(self.device, dtype)
        self.blocks = [self._block(i) for i in range(config.num_hidden_layers)]
        self.token_map, self.engrams = None, {}
        if config.engram_layer_ids:
            self.token_map = compressed_token_map(config, _tokenizer_file(checkpoint)).to(self.device)
            self.engrams = {i: Engram(config, weights, f"layers.{i}.engram.", i, self.token_map)
                            for i in config.engram_layer_ids}

    def _block(self, i: int) -> Block:
        c, p = self.config, f"layers.{i}."
        experts = expert_bank(self.w, f"{p}ffn.", self.tp.part(c.n_routed_experts), self.dtype)
        if c.is_v41:
            attention = SharedAttention(c, self.w, f"{p}attn.", i, self.tp)
            return DelayedBlock(c, self.w, p, experts, c.num_experts_per_tok, attention, tp=self.tp)
        return Block(c, self.w, p, experts, c.compress_ratios[i], c.is_hash_layer(i), c.num_experts_per_tok,
                     tp=self.tp)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint | SyntheticCheckpoint, device="cpu", dtype=torch.float32,
                        tp: TensorParallel = SINGLE) -> "Model":
        tp.check(ckpt.config)  # before any weight is read
        tp.check_same("config and checkpoint tensors",
                      repr(ckpt.config) + "".join(f"{s.name}{s.shape}{s.fmt}" for s in ckpt.specs))
        ckpt.validate()
        _check_fits(ckpt, device, dtype, tp)
        return cls(ckpt.config, read_weights(ckpt, "model", device, dtype, tp), device, dtype, ckpt, tp)

    def close(self) -> None:
        """Nothing to release in one process (`ranks.LeadingModel.close` stops the other ranks)."""

    def make_cache(self, num_slots: int, max_context: int, max_step_rows: int = 8) -> DecodeCache:
        """Decode state for `num_slots` requests of up to `max_context` positions; a step may
        hold up to `max_step_rows` rows of one request that a later step rewinds."""
        return DecodeCache(self.config, list(self.config.compress_ratios), num_slots, max_context,
                           max_step_rows, self.device, self.dtype)

    @torch.no_grad()
    def step(self, cache: DecodeCache, tokens, positions, slots, return_hidden: bool = False):
        """fp32 logits [N, vocab]; with `return_hidden`, also the DSpark draft's input features
        [N, len(dspark_target_layer_ids) * hidden]: per target layer, the mean over the hc
        streams of the residual after that layer (V4.1: entering it)."""
        tokens, positions, slots = (torch.as_tensor(t, dtype=torch.long, device=self.device)
                                    for t in (tokens, positions, slots))
        groups = self.group_rows(cache, tokens, positions, slots)
        streams = self.embed(tokens)
        targets = (self.config.dspark_target_layer_ids or ()) if return_hidden else ()
        captured = {}
        if self.config.is_v41:
            streams, pre = self._delayed_blocks(cache, streams, tokens, positions, groups, targets, captured)
            logits = self.logits(streams, pre)
        else:
            for i, (block, layer_cache) in enumerate(zip(self.blocks, cache.layers)):
                streams = block(streams, tokens, positions, groups, layer_cache)
                if i in targets:
                    captured[i] = streams.mean(dim=1)
            logits = self.logits(streams)
        if not return_hidden:
            return logits
        return logits, torch.cat([captured[i] for i in targets], dim=-1)

    def _delayed_blocks(self, cache: DecodeCache, streams, tokens, positions, groups, targets, captured):
        """V4.1's blocks: (the final streams, the last block's FFN pre). A target layer's
        features are captured as the streams enter it, after its Engram (the official code's
        order; vLLM's is before it, which no released layout distinguishes)."""
        share = StepShare(cache.layers)
        pre = entry_pre(len(tokens), self.config.hc_mult, self.device)
        ngrams = self._ngrams(cache, tokens, groups) if self.engrams else None
        for i, (block, layer_cache) in enumerate(zip(self.blocks, cache.layers)):
            if i in self.engrams:
                streams = self.engrams[i](streams, ngrams)
            if i in targets:
                captured[i] = streams.mean(dim=1)
            streams, pre = block(streams, tokens, positions, groups, layer_cache, pre, share=share)
        if ngrams is not None:
            for g in groups:
                cache.tokens.write(g.slot, g.positions, {"id": tokens[g.index, None]})
        return streams, pre

    def _ngrams(self, cache: DecodeCache, tokens: torch.Tensor, groups: list[RequestRows]) -> torch.Tensor:
        """The rows' compressed n-gram ids [N, engram_max_ngram_size] (column s: the token s
        positions back; -1 before the sequence start), from the step's rows and the request's
        earlier tokens in the cache (pad rows: no history)."""
        n = self.config.engram_max_ngram_size
        history = torch.full((len(tokens), n - 1), -1, dtype=torch.long, device=self.device)
        for g in groups:
            p0 = int(g.positions[0])
            before = torch.arange(p0 - n + 1, p0, device=self.device)
            old, valid = cache.tokens.read(g.slot, before)
            lost = ~valid & (before >= 0)
            if lost.any():
                raise RuntimeError(f"slot {g.slot}: the token ids of positions {before[lost].tolist()} are not in "
                                   "the cache: a request's steps must follow one another")
            known = torch.cat([torch.where(valid, old["id"][:, 0], -1), tokens[g.index]])  # positions p0 - n + 1 ..
            rows = torch.arange(len(g.index), device=self.device)
            for s in range(1, n):
                history[g.index, s - 1] = known[rows + n - 1 - s]
        return ngram_ids(self.token_map, tokens, history)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding broadcast to the hc streams [N, hc, d] (layer 0's settled residual)."""
        if self.tp.size == 1:
            streams = F.embedding(tokens, self.w["embed"]).unsqueeze(1)
        else:  # this rank's vocabulary rows; the other rows embed to zeros here
            mine = self.tp.part(self.config.vocab_size)
            held = (tokens >= mine.start) & (tokens < mine.stop)
            rows = F.embedding(torch.where(held, tokens - mine.start, 0), self.w["embed"])
            streams = self.tp.reduce(rows * held.unsqueeze(-1)).unsqueeze(1)
        return streams.expand(-1, self.config.hc_mult, -1).contiguous()

    def draft(self) -> "Draft":
        """The DSpark draft of this checkpoint, loaded on first use; a checkpoint without one
        raises CheckpointError naming the first missing tensor."""
        if self._draft is None:
            from .draft import Draft

            self.checkpoint.validate(require_draft=True)
            self._draft = Draft(self, read_weights(self.checkpoint, "draft", self.device, self.dtype, self.tp))
        return self._draft

    def replace_experts(self, layer: int, experts) -> None:
        """Serve layer's routed experts from `experts` from now on: any object whose `expert(e)`
        gives expert e's (w1, w2, w3) in the compute dtype, holding the same weights (say, a copy
        in another layout that other code reads too, so that the weights are held once). The
        layer's own bank is released."""
        self.blocks[layer].moe.experts = experts

    def logits(self, streams: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the final streams: V4 merges them with hc_head, V4.1 collapses them
        with the last block's FFN pre `pre`."""
        c, w = self.config, self.w
        if pre is not None:
            return self.lm_head(collapse(streams, pre))
        x = hc_head(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"],
                    hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        return self.lm_head(x)

    def lm_head(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Final RMSNorm (the model's, or a draft stage's) and the shared lm_head, in fp32."""
        x = rms_norm(x, self.w["norm"] if norm_weight is None else norm_weight, self.config.rms_norm_eps)
        return self.tp.gather(self.fp32_linear(x, self.w["head"]))  # this rank's vocabulary rows, then every rank's

    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """F.linear(x.float(), weight.float()) for x and weight in the model's dtype: with an fp32-output
        GEMM, the same exact products and fp32 sums without an fp32 copy of the weight (the
        lm_head's is 2 GB at v4-flash sizes)."""
        if self._fp32_output_gemm and x.dtype == weight.dtype == self.dtype:
            return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        return F.linear(x.float(), weight.float())

    def score(self, token_ids) -> torch.Tensor:
        """fp32 logits [T, vocab] of a full prefill of one sequence."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"score takes a non-empty 1-D sequence of token ids, got shape {tuple(tokens.shape)}")
        n = tokens.numel()
        cache = self.make_cache(num_slots=1, max_context=n, max_step_rows=1)
        return self.step(cache, tokens, torch.arange(n), torch.zeros(n, dtype=torch.long))

    def group_rows(self, cache: DecodeCache, tokens, positions, slots) -> list[RequestRows]:
        """Check a step's rows (1-D tokens, positions, slots of one length; ids, slots and
        positions in range; each request's rows consecutive positions in row order) and group
        them by request: one RequestRows a live slot, pad rows (slot -1) in none. Raises
        ValueError naming the first bad row."""
        if not (tokens.dim() == positions.dim() == slots.dim() == 1) or not (
                tokens.shape == positions.shape == slots.shape) or tokens.numel() == 0:
            raise ValueError("tokens, positions and slots must be 1-D and of the same non-zero length, got "
                             f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(slots.shape)}")
        _check_range("token id", tokens, 0, self.config.vocab_size)
        _check_range("slot", slots, -1, cache.num_slots)
        _check_range("position", positions, 0, cache.max_context)
        groups = []
        for slot in slots.unique().tolist():
            if slot < 0:
                continue
            index = (slots == slot).nonzero(as_tuple=True)[0]
            pos = positions[index]
            if not torch.equal(pos, pos[0] + torch.arange(len(pos), device=pos.device)):
                raise ValueError(f"rows of slot {slot} have positions {pos.tolist()}; a request's rows "
                                 "in one step must be consecutive positions in row order")
            groups.append(RequestRows(slot, index, pos))
        return groups


def _tokenizer_file(checkpoint) -> Path | None:
    """The checkpoint directory's tokenizer.json, if it has one (Engram's token map reads it)."""
    path = Path(str(getattr(checkpoint, "path", ""))) / "tokenizer.json"
    return path if checkpoint is not None and path.is_file() else None


def has_fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm can multiply `dtype` operands on `device` into an fp32 result
    (`out_dtype`: CUDA, bf16 / fp16, torch >= 2.8). The lm_head then reads its bf16 weight once
    (1 GB at v4-flash sizes) instead of converting it to fp32 on every call. Tried once here,
    never inside a CUDA-graph capture."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    probe = torch.ones(2, 16, dtype=dtype, device=device)
    try:
        return torch.mm(probe, probe.t(), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _check_fits(ckpt, device, dtype, tp: TensorParallel) -> None:
    """Refuse, before reading anything, weights that cannot fit where they are to live (a
    tensor-parallel rank: its experts, and the other tensors whole: an upper bound)."""
    specs = [s for s in ckpt.specs if s.group == "model" and tp.holds(s.name, ckpt.config)]
    need = resident_bytes(specs, dtype)
    free = free_memory(device)
    if need > free:
        raise MemoryError(
            f"{ckpt.path}: the weights need {_gib(need)} on {device} as loaded "
            f"({str(dtype).removeprefix('torch.')}), {_gib(free)} is free. Use fewer layers, "
            f"e.g. `monodecode make-checkpoint --preset NAME --layers 2 --out DIR`, or another device.")
    tables = sum(s.nbytes() for s in specs if s.role == "hashed")  # Engram: host memory, as stored
    host = free_memory("cpu") - (need if torch.device(device).type == "cpu" else 0)
    if tables > host:
        raise MemoryError(f"{ckpt.path}: the Engram tables need {_gib(tables)} of host memory, {_gib(max(host, 0))} "
                          "is free beside the other weights")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_range(what: str, values: torch.Tensor, low: int, high: int) -> None:
    bad = (values < low) | (values >= high)
    if bad.any():
        row = int(bad.nonzero()[0])
        raise ValueError(f"row {row}: {what} {int(values[row])} is outside [{low}, {high})")


def load_model(source, *, device="cpu", dtype=torch.float32, seed: int = 0, tp: TensorParallel = SINGLE,
               overrides: dict | None = None) -> Model:
    """The per-op model of a checkpoint directory, or of a preset name (deterministic random
    weights built in memory; `overrides`: config fields changed, e.g. fewer layers); under tensor
    parallelism, rank `tp`'s part of it."""
    if str(source) in PRESETS:
        return Model.from_checkpoint(SyntheticCheckpoint(preset(str(source), **(overrides or {})), seed), device, dtype,
                                     tp=tp)
    if overrides:
        raise ValueError(f"config overrides ({', '.join(overrides)}) apply to presets only, not to the checkpoint "
                         f"{source}")
    return Model.from_checkpoint(Checkpoint(source), device, dtype, tp=tp)
