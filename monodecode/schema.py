"""The checkpoint's tensor table: every tensor a DeepSeek-V4 checkpoint holds, with its shape and
storage format, derived from a ModelConfig.

Names are the official ones (`layers.{i}.attn.wq_a.weight`, `mtp.{k}.*`, `embed.weight`, ...).
Formats:
- `fp8`: `NAME.weight` float8_e4m3fn [out, in] plus `NAME.scale` float8_e8m0fnu, one per block of
  `quantization_config.weight_block_size` (partial edge blocks allowed).
- `mxfp4`: `NAME.weight` int8 [out, in / 2] (two e2m1 codes a byte, low nibble first) plus
  `NAME.scale` float8_e8m0fnu [out, in / 32].
- `bf16` / `fp32`: plain floating tensors (any float dtype is accepted on read; these are the
  dtypes the writer uses). `int`: integer tables (`tid2eid`).
An unquantized checkpoint (no `quantization_config`) stores fp8/mxfp4 tensors as plain floats.

The same table drives the reader's checks, the synthetic writer and the byte counts of `inspect`.

DeepSeek-V4.1 (`config.is_v41`) differs in these tensors (names as its checkpoints spell them, as
DeepSeek's V4.1 `inference/model.py` and vLLM's loader read them):
- only the KV-source layers hold `attn.compressor.*` (wkv, norm; and wgate at ratio 2), plus the
  index keys' `attn.indexer.wk` / `attn.indexer.k_norm`, applied to the compressed KV;
- only the index-source layers hold `attn.indexer.wq_b` / `attn.indexer.weights_proj`;
- `layers.{i}.engram.*` on the Engram layers: the table `embed` (FP8 rows with one UE8M0 scale per
  32 values), `wkv`, `q_weight`, `k_weight`;
- `ffn.gate.bias_vl`, the routing bias of image tokens, on every block, draft stages too (role
  "vision": stored, never used here);
- no `hc_head_*`, neither at the top level nor on the last draft stage, the Markov head is
  `markov_head.embed` / `markov_head.head`, and the confidence head's `proj` is bf16.
The vision tower's tensors (`vision.*`, `aligner.*`) are not described: the text model only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import v41
from .config import ModelConfig

QUANTIZED_FORMATS = ("fp8", "mxfp4")
E2M1_PER_BYTE = 2
MXFP4_GROUP = 32


@dataclass(frozen=True)
class TensorSpec:
    name: str  # without the `.weight` suffix for fp8/mxfp4 weights; full name otherwise
    shape: tuple[int, ...]
    fmt: str  # fp8 | mxfp4 | bf16 | fp32 | int
    group: str  # "model" or "draft" (the DSpark tensors, optional in a checkpoint)
    # dense | expert | embed (one row read a token) | table (one row a token) | hashed (one row
    # a token per Engram hash column) | vision (read for image tokens only: never, here)
    role: str = "dense"
    fp8_block: tuple[int, int] = (128, 128)

    @property
    def quantized(self) -> bool:
        return self.fmt in QUANTIZED_FORMATS

    def stored(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{stored name: (shape, storage kind)} of the tensors this entry puts in a file."""
        if self.fmt == "fp8":
            rows, cols = self.shape
            b0, b1 = self.fp8_block
            return {
                f"{self.name}.weight": (self.shape, "e4m3"),
                f"{self.name}.scale": ((math.ceil(rows / b0), math.ceil(cols / b1)), "e8m0"),
            }
        if self.fmt == "mxfp4":
            *lead, k = self.shape
            return {
                f"{self.name}.weight": ((*lead, k // E2M1_PER_BYTE), "packed"),
                f"{self.name}.scale": ((*lead, k // MXFP4_GROUP), "e8m0"),
            }
        return {self.name: (self.shape, self.fmt)}

    def nbytes(self) -> int:
        return sum(math.prod(shape) * STORAGE_ITEMSIZE[kind] for shape, kind in self.stored().values())


STORAGE_ITEMSIZE = {"e4m3": 1, "e8m0": 1, "packed": 1, "bf16": 2, "fp32": 4, "int": 4}
STORAGE_DTYPES = {
    "e4m3": (torch.float8_e4m3fn,),
    "e8m0": (torch.float8_e8m0fnu,),
    "packed": (torch.int8, torch.uint8),
    "bf16": (torch.bfloat16, torch.float16, torch.float32),
    "fp32": (torch.float32, torch.bfloat16, torch.float16),
    "int": (torch.int32, torch.int64),
}


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint, the target model first, then the DSpark draft."""
    b = _Builder(config)
    d, v = config.hidden_size, config.vocab_size
    b.add("embed.weight", (v, d), "bf16", role="embed")
    for i, ratio in enumerate(config.compress_ratios):
        b.block(f"layers.{i}.", ratio, hash_routed=config.is_hash_layer(i),
                n_experts=config.n_routed_experts, group="model", layer=i)
    b.add("norm.weight", (d,), "bf16")
    if config.has_hc_head:
        b.hc_head("")
    b.add("head.weight", (v, d), "bf16")
    if config.has_dspark:
        b.draft()
    return b.specs


class _Builder:
    def __init__(self, config: ModelConfig):
        self.c = config
        self.specs: list[TensorSpec] = []
        self.group = "model"
        self.block_size = config.fp8_block or (128, 128)

    def add(self, name: str, shape: tuple[int, ...], fmt: str, role: str = "dense",
            fp8_block: tuple[int, int] | None = None) -> None:
        if fmt in QUANTIZED_FORMATS and self.c.quantization_config is None:
            fmt = "bf16"
        if fmt == "mxfp4" and not self.c.experts_fp4:
            fmt = "fp8"
        self.specs.append(TensorSpec(name, shape, fmt, self.group, role, fp8_block or self.block_size))

    def linear(self, name: str, out_features: int, in_features: int, fmt: str = "fp8",
               role: str = "dense", fp8_block: tuple[int, int] | None = None) -> None:
        if fmt in QUANTIZED_FORMATS and self.c.quantization_config is not None:
            self.add(name, (out_features, in_features), fmt, role, fp8_block)
        else:
            self.add(f"{name}.weight", (out_features, in_features), fmt, role)

    def norm(self, name: str, width: int) -> None:
        self.add(f"{name}.weight", (width,), "bf16")

    def block(self, p: str, ratio: int, *, hash_routed: bool, n_experts: int, group: str,
              layer: int | None = None) -> None:
        """One decoder block; `layer` is its index in the target model (None: a draft stage)."""
        self.group = group
        c = self.c
        d, mix = c.hidden_size, (2 + c.hc_mult) * c.hc_mult
        for site in ("attn", "ffn"):
            self.add(f"{p}hc_{site}_fn", (mix, c.hc_mult * d), "fp32")
            self.add(f"{p}hc_{site}_base", (mix,), "fp32")
            self.add(f"{p}hc_{site}_scale", (3,), "fp32")
        if layer is not None and c.is_engram_layer(layer):
            self.engram(f"{p}engram.", layer)
        self.norm(f"{p}attn_norm", d)
        if c.is_v41:
            self.attention_v41(f"{p}attn.", layer)
        else:
            self.attention(f"{p}attn.", ratio)
        self.norm(f"{p}ffn_norm", d)
        self.moe(f"{p}ffn.", hash_routed, n_experts, image_bias=c.is_v41)

    def attention_core(self, p: str) -> None:
        """What every layer's attention holds, V4 and V4.1 alike: q/kv projections, the window
        KV's norm, the grouped output and the sink."""
        c = self.c
        d, heads, hd = c.hidden_size, c.num_attention_heads, c.head_dim
        self.linear(f"{p}wq_a", c.q_lora_rank, d)
        self.norm(f"{p}q_norm", c.q_lora_rank)
        self.linear(f"{p}wq_b", heads * hd, c.q_lora_rank)
        self.linear(f"{p}wkv", hd, d)
        self.norm(f"{p}kv_norm", hd)
        self.linear(f"{p}wo_a", c.o_groups * c.o_lora_rank, heads * hd // c.o_groups)
        self.linear(f"{p}wo_b", d, c.o_groups * c.o_lora_rank)
        self.add(f"{p}attn_sink", (heads,), "fp32")

    def attention_v41(self, p: str, layer: int | None) -> None:
        """V4.1: the compressor (and the index keys made from its output) only on KV sources, the
        indexer's queries and weights only on index sources; other layers read theirs."""
        c = self.c
        d, hd = c.hidden_size, c.head_dim
        self.attention_core(p)
        if layer is None or c.compress_ratios[layer] == 0:
            return
        if c.kv_source_of(layer) == layer:
            # One compressed entry per `ratio` positions, pooled by a softmax gate at ratio 2; at
            # ratio 1 a plain projection (no wgate). No `ape` and no overlapping windows.
            self.linear(f"{p}compressor.wkv", hd, d, fmt="bf16")
            if c.compress_ratios[layer] > 1:
                self.linear(f"{p}compressor.wgate", hd, d, fmt="bf16")
            self.norm(f"{p}compressor.norm", hd)
            self.linear(f"{p}indexer.wk", c.index_head_dim, hd, fmt="bf16")
            self.norm(f"{p}indexer.k_norm", c.index_head_dim)
        if c.index_source_of(layer) == layer:
            self.linear(f"{p}indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            self.linear(f"{p}indexer.weights_proj", c.index_n_heads, d, fmt="bf16")

    def engram(self, p: str, layer: int) -> None:
        """V4.1's Engram: the hashed table (FP8 rows, one scale per 32 values), the projection of
        the gathered rows to one key per hc stream and a shared value, and the gate's weights.
        Names as DeepSeek's V4.1 checkpoints spell them."""
        c = self.c
        d, width = c.hidden_size, c.engram_head_dim
        rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
        self.linear(f"{p}embed", rows, width, role="hashed", fp8_block=(1, v41.ENGRAM_SCALE_GROUP))
        self.linear(f"{p}wkv", d * (c.hc_mult + 1), c.engram_hash_columns * width)
        self.add(f"{p}q_weight", (c.hc_mult, d), "bf16")
        self.add(f"{p}k_weight", (c.hc_mult, d), "bf16")

    def attention(self, p: str, ratio: int) -> None:
        c = self.c
        d, hd = c.hidden_size, c.head_dim
        self.attention_core(p)
        if ratio == 0:
            return
        overlap = 2 if ratio == 4 else 1
        self.compressor(f"{p}compressor.", ratio, overlap, hd)
        if ratio == 4:
            self.linear(f"{p}indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            self.linear(f"{p}indexer.weights_proj", c.index_n_heads, d, fmt="bf16")
            self.compressor(f"{p}indexer.compressor.", ratio, overlap, c.index_head_dim)

    def compressor(self, p: str, ratio: int, overlap: int, width: int) -> None:
        d = self.c.hidden_size
        self.linear(f"{p}wkv", overlap * width, d, fmt="bf16")
        self.linear(f"{p}wgate", overlap * width, d, fmt="bf16")
        self.add(f"{p}ape", (ratio, overlap * width), "fp32")
        self.norm(f"{p}norm", width)

    def moe(self, p: str, hash_routed: bool, n_experts: int, image_bias: bool = False) -> None:
        c = self.c
        d, inter = c.hidden_size, c.moe_intermediate_size
        self.add(f"{p}gate.weight", (n_experts, d), "bf16")
        if hash_routed:
            topk = c.num_experts_per_tok
            self.add(f"{p}gate.tid2eid", (c.vocab_size, topk), "int", role="table")
        else:
            self.add(f"{p}gate.bias", (n_experts,), "fp32")
        if image_bias:  # V4.1 routes image tokens with their own bias (its draft stages hold one too)
            self.add(f"{p}gate.bias_vl", (n_experts,), "fp32", role="vision")
        for e in range(n_experts):
            self.linear(f"{p}experts.{e}.w1", inter, d, "mxfp4", role="expert")
            self.linear(f"{p}experts.{e}.w2", d, inter, "mxfp4", role="expert")
            self.linear(f"{p}experts.{e}.w3", inter, d, "mxfp4", role="expert")
        if c.n_shared_experts:
            self.linear(f"{p}shared_experts.w1", inter, d)
            self.linear(f"{p}shared_experts.w2", d, inter)
            self.linear(f"{p}shared_experts.w3", inter, d)

    def hc_head(self, p: str) -> None:
        c = self.c
        self.add(f"{p}hc_head_fn", (c.hc_mult, c.hc_mult * c.hidden_size), "fp32")
        self.add(f"{p}hc_head_base", (c.hc_mult,), "fp32")
        self.add(f"{p}hc_head_scale", (1,), "fp32")

    def draft(self) -> None:
        """DSpark: `mtp.{k}` window-only blocks, main_proj on stage 0, heads on the last stage."""
        c = self.c
        d, last = c.hidden_size, f"mtp.{c.num_nextn_predict_layers - 1}."
        self.group = "draft"
        self.linear("mtp.0.main_proj", d, len(c.dspark_target_layer_ids) * d)
        self.norm("mtp.0.main_norm", d)
        for k in range(c.num_nextn_predict_layers):
            self.block(f"mtp.{k}.", 0, hash_routed=False, n_experts=c.draft_n_routed_experts,
                       group="draft")
        self.norm(f"{last}norm", d)
        if c.has_hc_head:
            self.hc_head(last)
        rank = c.dspark_markov_rank
        w1, w2 = c.markov_tensor_names
        self.add(f"{last}markov_head.{w1}.weight", (c.vocab_size, rank), "bf16", role="embed")
        self.add(f"{last}markov_head.{w2}.weight", (c.vocab_size, rank), "bf16")
        self.add(f"{last}confidence_head.proj.weight", (1, d + rank), "bf16" if c.is_v41 else "fp32")


def layer_of(name: str) -> str:
    """'layers.3' / 'mtp.1' / '' (top level) for a tensor name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") and len(parts) > 2 else ""


def step_bytes(config: ModelConfig, specs: list[TensorSpec], prefix: str, rows: int = 1,
               tp=None) -> tuple[int, int]:
    """(dense, expert) weight bytes one decode step of `rows` tokens reads from the tensors under
    `prefix`: every dense tensor once, one row of the embedding-like tables per token, and the
    routed experts of `rows` tokens with distinct picks (top-k each, capped at all experts).
    With `tp` (model.parallel.TensorParallel) the bytes one rank reads: its slices of the split
    layer weights, and picks among its own experts (capped at those)."""
    dense = 0
    per_expert: dict[str, int] = {}
    for s in specs:
        if not s.name.startswith(prefix):
            continue
        share = 1.0 if tp is None else tp.held_share(s.name, s.shape, config)
        if share == 0:
            continue
        if s.role == "expert":
            expert = s.name.split(".experts.")[1].split(".")[0]
            per_expert[expert] = per_expert.get(expert, 0) + s.nbytes()
        elif s.role in ("embed", "table"):
            dense += rows * s.nbytes() // s.shape[0]
        elif s.role == "hashed":  # an Engram table: one row a hash column, per token
            dense += rows * config.engram_hash_columns * s.nbytes() // s.shape[0]
        elif s.role == "vision":
            continue
        else:
            dense += int(s.nbytes() * share)
    if not per_expert:
        return dense, 0
    topk = config.num_experts_per_tok if prefix.startswith("layers.") else config.draft_num_experts_per_tok
    picks = min(rows * topk, len(per_expert))
    return dense, picks * max(per_expert.values())
