"""The mono kernels' views of one decoder layer's weights, checked once at build.

The kernels read raw pointers: a tensor of the wrong shape, dtype or layout is read as garbage, it
does not fault. So every tensor a kernel reads is checked here, once, before anything is compiled
or captured: shape (from the checkpoint's tensor table), dtype, contiguity and 16-byte alignment.

What the kernels read, per layer:
- dense FP8 matrices (`wq_a`, `wkv`, `wq_b`, `wo_a`, `wo_b`, the shared expert's `w1`/`w2`/`w3`) in
  the checkpoint's format: e4m3 codes as uint8 [N, K] and UE8M0 block scales as uint8
  [ceil(N / b), ceil(K / b)]. The per-op path holds these dequantized to the compute dtype, so the
  codes are read again from the checkpoint: an extra copy, FP8-sized, counted by `nbytes`.
- the routed experts stacked per matrix (`experts.ExpertWeights`): the checkpoint's MXFP4 bytes,
  the codes permuted into the fragment order (`stack_experts`). The per-op path then reads its
  experts from the stack too (`StackedExperts`, handed to `Model.replace_experts`), so the
  experts are held once.
- fp32 norm weights, mHC parameters, sinks and router bias, the bf16 router gate, the int64 hash
  table, and the RoPE inverse frequencies (fp32): the per-op path's own tensors; on a compressed
  layer, its compressor's fp32 `ape` and norm, also its own, and on a CSA layer its indexer's
  compressor likewise and (an FP8 copy, as above) its indexer's `wq_b`.
- a compressed layer's bf16 projections of x stacked into one matrix (`stack_projections`): its
  compressor's `wkv` and `wgate`, and on a CSA layer its indexer compressor's and the indexer's
  `weights_proj`, so that K1 runs them as one GEMV. The per-op path then reads those weights
  as views of the stack (`Attention.share_weights`), so they too are held once.
Under tensor parallelism a rank's views are its slices (the FP8 matrices cut as the per-op ones,
`TensorParallel.shard_fp8`; its own routed experts) and are checked against its `RankSizes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import formats
from ..config import CSA_RATIO
from ..model.parallel import SINGLE, RankSizes, TensorParallel
from ..model.rope import layer_frequencies
from . import experts as X

ALIGN = 16  # bytes: the kernels issue 16-byte vector loads


class WeightCheckError(ValueError):
    """A weight the mono kernels would read has the wrong shape, dtype or layout."""


class CompressorWeights(NamedTuple):
    """A compressed layer's compressor as the kernels read it (the per-op path's own tensors; its
    wkv and wgate are rows of `LayerWeights.projections`)."""

    ratio: int
    ape: torch.Tensor  # fp32 [ratio, C * D] (C = 2 halves where the windows overlap, else 1)
    norm: torch.Tensor  # fp32 [D]

    @property
    def halves(self) -> int:
        return compressor_halves(self.ratio)


def compressor_halves(ratio: int) -> int:
    """A compressor's projection halves C: 2 where its windows overlap (CSA), else 1."""
    return 2 if ratio == CSA_RATIO else 1


class IndexerWeights(NamedTuple):
    """A CSA layer's lightning indexer as the kernels read it: its own compressor (head dim DI) and
    the FP8 `wq_b` of its queries on the shared qr (a copy for the kernels); its bf16
    `weights_proj` is rows of `LayerWeights.projections`."""

    compressor: CompressorWeights
    wq_b: Fp8Matrix  # [HI * DI, q_lora]


class Fp8Matrix(NamedTuple):
    """A dense FP8 weight as the kernels take it (a pair of pointers)."""

    codes: torch.Tensor  # uint8 [N, K], e4m3 bit patterns
    scales: torch.Tensor  # uint8 [ceil(N / b), ceil(K / b)], E8M0 codes


@dataclass
class LayerWeights:
    """Kernel views of one layer."""

    hc_attn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn, base, scale (fp32)
    hc_ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor  # bf16 [E, d]
    route_bias: torch.Tensor | None  # fp32 [E] (bias-routed layers)
    tid2eid: torch.Tensor | None  # int64 [vocab, k] (hash-routed layers)
    shared: tuple[Fp8Matrix, Fp8Matrix] | None  # w1 and w3 stacked [2 I, d] (`stack_rows`), w2
    experts: X.ExpertWeights
    wqkv_a: Fp8Matrix  # wq_a and wkv stacked [q_lora + D, d] (`stack_rows`)
    wq_b: Fp8Matrix
    wo_a: Fp8Matrix
    wo_b: Fp8Matrix
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    attn_sink: torch.Tensor
    rope_freqs: torch.Tensor  # the compressed frequencies on a compressed layer
    compressor: CompressorWeights | None  # a compressed layer's
    indexer: IndexerWeights | None = None  # a CSA layer's
    projections: torch.Tensor | None = None  # a compressed layer's bf16 [projection_rows, d] (`stack_projections`)

    def nbytes_extra(self) -> int:
        """Bytes held only for the kernels (the FP8 codes and scales; all else is shared)."""
        matrices = [self.wqkv_a, self.wq_b, self.wo_a, self.wo_b, *(self.shared or ()),
                    self.indexer.wq_b if self.indexer else None]
        return sum(m.codes.numel() + m.scales.numel() for m in matrices if m is not None)


def projection_names(ratio: int) -> list[str]:
    """The bf16 projections of x a compressed layer stacks, in their order (names after `attn.`):
    its compressor's wkv and wgate, then on a CSA layer its indexer compressor's and weights_proj."""
    names = ["compressor.wkv", "compressor.wgate"]
    if ratio == CSA_RATIO:
        names += ["indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.weights_proj"]
    return names


def projection_rows(config, ratio: int) -> list[int]:
    """Rows of each of `projection_names(ratio)`: C D for a compressor's (C = 2 halves where its
    windows overlap), 2 DI for the indexer compressor's, HI for weights_proj."""
    cw = compressor_halves(ratio) * config.head_dim
    rows = [cw, cw]
    if ratio == CSA_RATIO:
        rows += [2 * config.index_head_dim] * 2 + [config.index_n_heads]
    return rows


def stack_projections(w: dict[str, torch.Tensor], config, attention, prefix: str, ratio: int) -> torch.Tensor:
    """A compressed layer's projections of x (`projection_names`, each checked first) as one bf16
    matrix, their rows one after another; the per-op weights `w` and the layer's `attention` read
    views of it from now on, so the originals are let go."""
    a = f"{prefix}attn."
    names, rows = projection_names(ratio), projection_rows(config, ratio)
    for name, n in zip(names, rows):
        _check(a + name, w[a + name], (n, config.hidden_size), torch.bfloat16)
    stack = torch.cat([w[a + n] for n in names])
    views = dict(zip(names, stack.split(rows)))
    w.update({a + n: v for n, v in views.items()})
    attention.share_weights(views)
    return stack


def fp8_names(prefix: str, shared: bool, indexed: bool = False) -> list[str]:
    """The layer's FP8 matrices the kernels read (names without `.weight`); `indexed`: a CSA
    layer's, with its indexer's `wq_b`."""
    names = [f"{prefix}attn.{m}" for m in ("wq_a", "wkv", "wq_b", "wo_a", "wo_b")]
    if indexed:
        names.append(f"{prefix}attn.indexer.wq_b")
    if shared:
        names += [f"{prefix}ffn.shared_experts.{m}" for m in ("w1", "w2", "w3")]
    return names


def read_fp8(checkpoint, names: list[str], device, tp: TensorParallel = SINGLE) -> dict[str, Fp8Matrix]:
    """The checkpoint's own e4m3 codes and UE8M0 scales of these matrices, as uint8: rank `tp`'s
    slices of those the ranks split (`TensorParallel.shard_fp8`), cut on the host."""
    stored = [f"{n}.{part}" for n in names for part in ("weight", "scale")]
    raw = dict(checkpoint.tensors(stored, desc="loading fp8 weights for the mono kernels"))
    out = {}
    for name in names:
        codes, scales = raw[f"{name}.weight"], raw[f"{name}.scale"]
        if codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
            raise WeightCheckError(f"{name}: the mono kernels read FP8 e4m3 weights with UE8M0 scales, the "
                                   f"checkpoint holds {codes.dtype} / {scales.dtype}")
        codes, scales = tp.shard_fp8(name, codes.view(torch.uint8), scales.view(torch.uint8), checkpoint.config)
        out[name] = Fp8Matrix(codes.to(device).contiguous(), scales.to(device).contiguous())
    return out


class StackedExperts:
    """A layer's routed experts for the per-op path (`expert(e)`: w1, w2, w3 dequantized to the
    compute dtype, as `model.weights.ExpertBank` gives them), read from the kernels' stack, whose
    expert i is expert `first` + i (a tensor-parallel rank stacks its own range)."""

    def __init__(self, stack: X.ExpertWeights, dtype: torch.dtype, first: int = 0):
        self.stack, self.dtype, self.first = stack, dtype, first

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(formats.dequantize_mxfp4(*m, dtype=self.dtype)
                     for m in self.stack.checkpoint_tensors(e - self.first))


def stack_experts(bank, replace) -> X.ExpertWeights:
    """Stack a block's MXFP4 experts (`bank`) for the kernels, in the fragment order, and serve
    the per-op path's experts from the stack from now on (`replace`: `Model.replace_experts` or
    `Draft.replace_experts` for that block), so the bytes are held once. A block stacked before
    (by an earlier runner of the same model) keeps its stack."""
    if isinstance(bank, StackedExperts):
        return bank.stack
    stack = X.stack(list(zip(bank.w1, bank.w2, bank.w3)))
    replace(StackedExperts(stack, bank.dtype, bank.first))
    return stack


def stack_rows(*matrices: Fp8Matrix) -> Fp8Matrix:
    """FP8 matrices of the same K as one: their rows one after another, their scale blocks
    likewise (each one's rows a multiple of the block: `refusals` checks the sizes). Two GEMVs
    on the same input then run as one: one copy of the GEMV loop in a kernel's code instead of
    two (K1's wq_a and wkv, K2's shared w1 and w3)."""
    return Fp8Matrix(torch.cat([m.codes for m in matrices]), torch.cat([m.scales for m in matrices]))


def layer_weights(w: dict[str, torch.Tensor], sizes: RankSizes, prefix: str, block, replace_experts,
                  fp8: dict[str, Fp8Matrix], ratio: int = 0) -> LayerWeights:
    """Kernel views of the block whose names start with `prefix` (`layers.{i}.`, or a draft
    stage's `mtp.{k}.`) in the per-op weights `w`, `sizes` this rank's sizes of it (a draft
    stage's: its own experts); `replace_experts` hands the per-op path the stacked experts
    (`stack_experts`); `ratio` the layer's compression ratio (0: a window layer)."""
    c, p = sizes.config, prefix
    a = f"{p}attn."
    shared = None
    if c.n_shared_experts:
        w1, w2, w3 = (fp8[f"{p}ffn.shared_experts.{m}"] for m in ("w1", "w2", "w3"))
        shared = (stack_rows(w1, w3), w2)
    projections = stack_projections(w, c, block.attention, p, ratio) if ratio else None  # before the views are read
    lw = LayerWeights(
        hc_attn=tuple(w[f"{p}hc_attn_{s}"] for s in ("fn", "base", "scale")),
        hc_ffn=tuple(w[f"{p}hc_ffn_{s}"] for s in ("fn", "base", "scale")),
        attn_norm=w[f"{p}attn_norm"], ffn_norm=w[f"{p}ffn_norm"],
        gate=w[f"{p}ffn.gate"].to(torch.bfloat16).contiguous(),
        route_bias=block.moe.bias, tid2eid=block.moe.tid2eid,
        shared=shared, experts=stack_experts(block.moe.experts, replace_experts),
        wqkv_a=stack_rows(fp8[f"{a}wq_a"], fp8[f"{a}wkv"]), wq_b=fp8[f"{a}wq_b"], wo_a=fp8[f"{a}wo_a"],
        wo_b=fp8[f"{a}wo_b"], q_norm=w[f"{a}q_norm"], kv_norm=w[f"{a}kv_norm"], attn_sink=w[f"{a}attn_sink"],
        rope_freqs=layer_frequencies(c, compressed=ratio > 0).to(w[f"{p}attn_norm"].device).contiguous(),
        compressor=_compressor(w, f"{a}compressor.", ratio) if ratio else None, projections=projections,
    )
    if ratio == CSA_RATIO:
        i = f"{a}indexer."
        lw.indexer = IndexerWeights(_compressor(w, f"{i}compressor.", ratio), fp8[f"{i}wq_b"])
    check_layer(sizes, p, lw)
    return lw


def _compressor(w: dict[str, torch.Tensor], prefix: str, ratio: int) -> CompressorWeights:
    return CompressorWeights(ratio, w[f"{prefix}ape"], w[f"{prefix}norm"])


def check_layer(sizes: RankSizes, prefix: str, lw: LayerWeights) -> None:
    """Shape, dtype, contiguity and alignment of every tensor the kernels read: this rank's slices
    (`sizes`) of the split ones, its own routed experts, the router over all of them."""
    c = sizes.config
    d, hc, heads, hd = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim
    mix = (2 + hc) * hc
    inter, n_exp, held = c.moe_intermediate_size, c.n_routed_experts, len(sizes.experts)
    block = c.fp8_block or (128, 128)
    p = prefix
    expect = {
        "hc_attn_fn": (lw.hc_attn[0], (mix, hc * d), torch.float32),
        "hc_attn_base": (lw.hc_attn[1], (mix,), torch.float32),
        "hc_attn_scale": (lw.hc_attn[2], (3,), torch.float32),
        "hc_ffn_fn": (lw.hc_ffn[0], (mix, hc * d), torch.float32),
        "hc_ffn_base": (lw.hc_ffn[1], (mix,), torch.float32),
        "hc_ffn_scale": (lw.hc_ffn[2], (3,), torch.float32),
        "attn_norm": (lw.attn_norm, (d,), torch.float32),
        "ffn_norm": (lw.ffn_norm, (d,), torch.float32),
        "ffn.gate": (lw.gate, (n_exp, d), torch.bfloat16),
        "ffn.experts.w1 codes": (lw.experts.w1[0], (held, inter, d // 2), torch.uint8),
        "ffn.experts.w1 scales": (lw.experts.w1[1], (held, inter, d // 32), torch.uint8),
        "ffn.experts.w3 codes": (lw.experts.w3[0], (held, inter, d // 2), torch.uint8),
        "ffn.experts.w3 scales": (lw.experts.w3[1], (held, inter, d // 32), torch.uint8),
        "ffn.experts.w2 codes": (lw.experts.w2[0], (held, d, inter // 2), torch.uint8),
        "ffn.experts.w2 scales": (lw.experts.w2[1], (held, d, inter // 32), torch.uint8),
    }
    if lw.route_bias is not None:
        expect["ffn.gate.bias"] = (lw.route_bias, (n_exp,), torch.float32)
    if lw.tid2eid is not None:
        expect["ffn.gate.tid2eid"] = (lw.tid2eid, (c.vocab_size, c.num_experts_per_tok), torch.int64)
    fp8 = {}
    if lw.shared is not None:
        fp8.update({f"ffn.shared_experts.{m}": (t, s) for m, t, s in
                    zip(("w1 and w3", "w2"), lw.shared, ((2 * sizes.shared_inter, d), (d, sizes.shared_inter)))})
    fp8.update({"attn.wq_a and wkv": (lw.wqkv_a, (c.q_lora_rank + hd, d)),
                "attn.wq_b": (lw.wq_b, (heads * hd, c.q_lora_rank)),
                "attn.wo_a": (lw.wo_a, (c.o_groups * c.o_lora_rank, heads * hd // c.o_groups)),
                "attn.wo_b": (lw.wo_b, (d, c.o_groups * c.o_lora_rank))})
    expect.update({
        "attn.q_norm": (lw.q_norm, (c.q_lora_rank,), torch.float32),
        "attn.kv_norm": (lw.kv_norm, (hd,), torch.float32),
        "attn.attn_sink": (lw.attn_sink, (heads,), torch.float32),
        "attn rope frequencies": (lw.rope_freqs, (c.qk_rope_head_dim // 2,), torch.float32),
    })
    if lw.compressor is not None:
        expect.update(_compressor_expected("attn.compressor.", lw.compressor, hd))
        rows = sum(projection_rows(c, lw.compressor.ratio))
        expect["attn projections (stacked)"] = (lw.projections, (rows, d), torch.bfloat16)
    if lw.indexer is not None:
        hi, di = c.index_n_heads, c.index_head_dim
        expect.update(_compressor_expected("attn.indexer.compressor.", lw.indexer.compressor, di))
        fp8["attn.indexer.wq_b"] = (lw.indexer.wq_b, (hi * di, c.q_lora_rank))
    for name, (matrix, shape) in fp8.items():
        grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
        expect[f"{name}.weight"] = (matrix.codes, shape, torch.uint8)
        expect[f"{name}.scale"] = (matrix.scales, grid, torch.uint8)
    for name, (tensor, shape, dtype) in expect.items():
        _check(f"{p}{name}", tensor, shape, dtype)


def _compressor_expected(name: str, comp: CompressorWeights, D: int) -> dict:
    return {f"{name}ape": (comp.ape, (comp.ratio, comp.halves * D), torch.float32),
            f"{name}norm": (comp.norm, (D,), torch.float32)}


def check_cache(config, cache) -> None:
    """The rings the kernels read and write (each layer's window; a compressed layer's source ring
    and entries): bf16 rows, int64 positions, contiguous, aligned, on the kernels' shapes."""
    hd = config.head_dim
    for i, layer in enumerate(cache.layers):
        ring = layer.window
        slots, size = ring.pos.shape
        _check(f"cache layer {i} window kv", ring.data["kv"], (slots, size, hd), torch.bfloat16)
        _check(f"cache layer {i} window positions", ring.pos, (slots, size), torch.int64)
        compressed = (("compressor", "source", "entries", hd),
                      ("indexer compressor", "index_source", "index_entries", config.index_head_dim))
        for what, ring_name, entries_name, width in compressed:
            source = getattr(layer, ring_name, None)  # (a draft stage's cache has no compressor)
            if source is None:
                continue
            span, cw = source.size, source.data["kv"].shape[-1]
            for part in ("kv", "gate"):
                _check(f"cache layer {i} {what} source {part}", source.data[part], (slots, span, cw), torch.bfloat16)
            _check(f"cache layer {i} {what} source positions", source.pos, (slots, span), torch.int64)
            entries = getattr(layer, entries_name)
            _check(f"cache layer {i} {what} entries", entries, (slots, entries.shape[1], width), torch.bfloat16)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    problems = []
    if tuple(t.shape) != tuple(shape):
        problems.append(f"shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != dtype:
        problems.append(f"dtype {t.dtype}, expected {dtype}")
    if not t.is_contiguous():
        problems.append("not contiguous")
    if t.data_ptr() % ALIGN:
        problems.append(f"address not {ALIGN}-byte aligned")
    if problems:
        raise WeightCheckError(f"{name}: " + "; ".join(problems))
