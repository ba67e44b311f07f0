"""`monodecode inspect`'s report: a config's sizes and layer kinds, the tensor table by group,
and the bytes a decode step reads."""

from __future__ import annotations

import math
from collections import Counter

from .config import ModelConfig
from .schema import STORAGE_ITEMSIZE, step_bytes, tensor_specs

GiB, MiB = 2**30, 2**20


def describe_config(c: ModelConfig) -> str:
    lines = [
        "config",
        f"  hidden {c.hidden_size}, {c.num_hidden_layers} layers, vocab {c.vocab_size}",
        f"  attention: {c.num_attention_heads} heads x {c.head_dim} (rope {c.qk_rope_head_dim}), "
        f"one shared K=V head, q_lora {c.q_lora_rank}, output {c.o_groups} groups x {c.o_lora_rank}, "
        f"window {c.sliding_window}",
        *(_describe_v41_compression(c) if c.is_v41 else [
            f"  compressed: CSA ratio 4 with indexer top-{c.index_topk} ({c.index_n_heads} heads x "
            f"{c.index_head_dim}), HCA ratios {sorted({r for r in c.compress_ratios if r not in (0, 4)})}"]),
        f"  MoE: {c.n_routed_experts} routed experts, top-{c.num_experts_per_tok}, "
        f"{c.n_shared_experts} shared, intermediate {c.moe_intermediate_size}, "
        f"{c.scoring_func}, scale {c.routed_scaling_factor}, hash-routed layers: "
        f"{_ranges(range(c.num_hash_layers)) or 'none'}",
        f"  mHC: {c.hc_mult} streams, {c.hc_sinkhorn_iters} Sinkhorn iterations"
        + (", pre-mix delayed by one sub-block, no hc_head (final merge with the last FFN pre-mix)"
           if c.is_v41 else ""),
        *([f"  norm eps {c.rms_norm_eps:g}"] if c.is_v41 else []),  # V4.1's 1e-20, against V4's 1e-6
        f"  rope: theta {c.rope_theta:g}; compressed layers theta {c.compress_rope_theta:g}"
        + (f" with YaRN x{c.rope_scaling.factor:g} from {c.rope_scaling.original_max_position_embeddings}"
           if c.rope_scaling else ""),
    ]
    if c.has_dspark:
        lines.append(
            f"  DSpark draft: {c.num_nextn_predict_layers} stages, block {c.dspark_block_size}, "
            f"markov rank {c.dspark_markov_rank}, targets {list(c.dspark_target_layer_ids)}, "
            f"{c.draft_n_routed_experts} experts top-{c.draft_num_experts_per_tok}"
            + (" (reads the stream entering each target layer)" if c.dspark_captures_layer_input else "")
        )
    if c.quantization_config:
        b = c.fp8_block
        lines.append(f"  weights: FP8 e4m3 + UE8M0 per {b[0]}x{b[1]}, experts "
                     f"{'MXFP4 (e2m1 + E8M0 per 32)' if c.experts_fp4 else 'FP8'}")
    else:
        lines.append("  weights: unquantized")
    return "\n".join(lines) + "\n"


def _describe_v41_compression(c: ModelConfig) -> list[str]:
    ratios = sorted({r for r in c.compress_ratios if r})
    lines = [
        f"  compressed (DeepSeek-V4.1): ratios {ratios}, all sparse: indexer top-{c.index_topk} "
        f"({c.index_n_heads} heads x {c.index_head_dim})",
        f"  KV computed on layers {list(c.kv_source_layer_ids)}, indexers on layers "
        f"{list(c.index_source_layer_ids)}; the other compressed layers read the latest source at or below them",
    ]
    if c.candidate_source_layer_id is not None:
        users = [i for i in range(c.num_hidden_layers) if c.uses_candidates(i)]
        lines.append(f"  candidates: layer {c.candidate_source_layer_id} publishes {c.candidate_topk_blocks} blocks "
                     f"of {c.candidate_block_size} positions; the indexers of layers {users or 'none'} "
                     "score inside them")
    if c.engram_layer_ids:
        lines.append(
            f"  Engram on layers {list(c.engram_layer_ids)}: tables of {list(c.engram_num_embeddings)} rows x "
            f"{c.engram_head_dim}, {c.engram_hash_columns} rows a token (n-grams of 2..{c.engram_max_ngram_size}, "
            f"{c.engram_n_heads} heads each), {c.engram_compressed_vocab_size} token classes")
    return lines


def describe_layers(c: ModelConfig) -> str:
    if c.is_v41:
        return describe_v41_layers(c)
    lines = ["layers"]
    for kind in ("window", "csa", "hca"):
        ids = [i for i, k in enumerate(c.layer_kinds) if k == kind]
        if ids:
            lines.append(f"  {kind:<7} {len(ids):>3}  {_ranges(ids)}")
    return "\n".join(lines) + "\n"


def describe_v41_layers(c: ModelConfig) -> str:
    """One line a layer: its kind and ratio, the layers its compressed KV and its index come from,
    and what else it holds (an Engram, the candidate filter)."""
    lines = ["layers", f"  {'layer':>5}  {'kind':<7}{'ratio':>5}  {'KV from':>7}  {'index from':>10}  notes"]
    for i, (kind, ratio) in enumerate(zip(c.layer_kinds, c.compress_ratios)):
        kv, index = c.kv_source_of(i), c.index_source_of(i)
        lines.append(f"  {i:>5}  {kind:<7}{ratio:>5}  {_source(kv, i):>7}  {_source(index, i):>10}  "
                     + ", ".join(_layer_notes(c, i)))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _source(source: int | None, layer: int) -> str:
    return "-" if source is None else "itself" if source == layer else str(source)


def _layer_notes(c: ModelConfig, i: int) -> list[str]:
    notes = []
    if c.is_engram_layer(i):
        notes.append("Engram")
    if i == c.candidate_source_layer_id:
        notes.append(f"publishes {c.candidate_topk_blocks} candidate blocks")
    if c.uses_candidates(i):
        notes.append(f"indexer inside layer {c.candidate_source_layer_id}'s candidates")
    return notes


def describe_tensors(c: ModelConfig) -> str:
    count, size = Counter(), Counter()
    for spec in tensor_specs(c):
        for shape, kind in spec.stored().values():
            key = f"{spec.group}/{kind}"
            count[key] += 1
            size[key] += math.prod(shape) * STORAGE_ITEMSIZE[kind]
    lines = ["stored tensors by format (group/format: count, size)"]
    for key in sorted(count):
        lines.append(f"  {key:<14} {count[key]:>7}  {size[key] / GiB:10.3f} GiB")
    lines.append(f"  {'total':<14} {sum(count.values()):>7}  {sum(size.values()) / GiB:10.3f} GiB")
    return "\n".join(lines) + "\n"


def describe_step_bytes(c: ModelConfig, rows: int) -> str:
    specs = tensor_specs(c)
    width = 34 if c.is_v41 else 22  # V4.1's layer roles are longer
    lines = [f"weight bytes one decode step reads at {rows} row(s) (experts: top-"
             f"{c.num_experts_per_tok} a row, distinct picks)",
             f"  {'layer kind':<{width}} {'dense':>11} {'experts':>11} {'total':>11}"]
    seen = set()
    for i, kind in enumerate(c.layer_kinds):
        label = _v41_layer_role(c, i) if c.is_v41 else f"{kind}{' (hash-routed)' if c.is_hash_layer(i) else ''}"
        if label in seen:
            continue
        seen.add(label)
        dense, experts = step_bytes(c, specs, f"layers.{i}.", rows)
        lines.append(f"  {label:<{width}} {_size(dense)} {_size(experts)} {_size(dense + experts)}"
                     f"   e.g. layer {i}")
    top = sum(step_bytes(c, specs, p, rows)[0] for p in ("embed.", "norm.", "hc_head_", "head."))
    lines.append(f"  {'embed rows, head':<{width}} {_size(top)} {_size(0)} {_size(top)}")
    layers = [sum(step_bytes(c, specs, f"layers.{i}.", rows)) for i in range(c.num_hidden_layers)]
    lines.append(f"  {'whole target model':<{width}} {'':>11} {'':>11} {_size(top + sum(layers))}")
    return "\n".join(lines)


def _v41_layer_role(c: ModelConfig, i: int) -> str:
    """What a V4.1 layer holds beyond the common core, which sets what its step reads: e.g.
    "csa r2 KV+index source", "csa r1 reads both", "window + Engram"."""
    kind, ratio = c.layer_kinds[i], c.compress_ratios[i]
    if ratio == 0:
        label = kind
    else:
        owns = [name for name, source in (("KV", c.kv_source_of(i)), ("index", c.index_source_of(i)))
                if source == i]
        label = f"{kind} r{ratio} " + (f"{'+'.join(owns)} source" if owns else "reads both")
    return label + (" + Engram" if c.is_engram_layer(i) else "")


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:7.2f} {unit}"
    return f"{n:7d} B  "


def _ranges(ids) -> str:
    ids = list(ids)
    if len(ids) > 2 and all(b - a == ids[1] - ids[0] for a, b in zip(ids, ids[1:])):
        step = ids[1] - ids[0]
        return f"{ids[0]}-{ids[-1]}" + (f" step {step}" if step > 1 else "")
    return ", ".join(map(str, ids))


# --- `monodecode bench ...`: load generators against a running server (monodecode/bench/) ---
