"""K1: the attention seam and front of a `whole` layer, one persistent launch.

Grid: `LaunchShape.k1_programs_per_sm` programs a SM (`MonoRunner.grids`), all co-resident (a
cooperative launch: the driver refuses a grid that cannot be); under Triton's interpreter grid
(1,), one program doing every task in order. Program p takes tasks p, p + grid, ... of each
stage; a grid barrier (sync.py) separates consecutive stages, so a task only reads what earlier
stages wrote.

Stages (R rows; task counts)                                    reads -> writes
0 fold      hc.fold_task       ceil(R/RB) * ceil(d/CHUNK)      residual, owed y/post/comb (the
                                                               previous layer's FFN) -> streams,
                                                               mix partials (hc_attn_fn)
1 settle    hc.settle_task     R                               partials, streams -> post/comb of the
                                                               attention site, x = attn_norm(collapse)
2 wq_a|wkv  gemv_stage (FP8)   ceil((q_lora+D)/BN_QKV)         x -> qkv_raw (bf16): wq_a and wkv
                               * SPLIT_D                       stacked (weights.stack_rows), one GEMV
  (HCA) |   gemv_stage (bf16)  + 2 ceil(C D/BN_C) * SPLIT_C   x -> source_kv, source_gate: the
  compressor                                                   compressor's wkv(x), wgate(x)
3 norms     norm_rope_kv_task  2R                              qkv_raw -> qr = q_norm(its first q_lora
                                                               columns); the other D -> kv_norm, RoPE ->
                                                               the KV ring (not for pad rows, slot < 0)
  (HCA)     source_write_task  + R                             source_kv, source_gate -> the layer's
                                                               source ring (compress.py)
4 wq_b      gemv_stage (FP8)   ceil(H*D/BN_QB) * SPLIT_Q       qr -> q_raw (K2's attend normalises and
                                                               rotates the heads as it loads them)
  (HCA)     emit_task          + R                             the source ring -> the entry a row
                                                               completes (compress.py)
Without owed output (layer 0: the embedding is the settled residual) stage 0 only computes the
partials and `streams` is `residual`. K2 reads q_raw, the ring and the attention site's post/comb,
after this launch ends (stream order), and on an HCA layer (RATIO > 0) the compressed entries.
A window layer and an HCA layer are two builds (RATIO a compile-time constant).
Waits: a grid barrier after each stage but the last; an expired wait names the stage (STAGES).
Rounding points: the per-op path's (bf16 after each projection, norm and RoPE; fp32 mixes; the
compressor's, compress.py).
Scratch: `Scratch` of the step's width (on an HCA layer also `source_kv` / `source_gate`); the
rings are the layer's `LayerCache.window` and, on an HCA layer, `LayerCache.source`, written
into `LayerCache.entries`; the split GEMVs' slice sums and tickets (the runner's: `dense_stages`
sizes them).
Arguments: `K1Args` (pointers and runtime scalars) and `K1Meta` (compile-time constants), by name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import attention as A
from . import compress as C
from . import hc as HC
from .gemv import gemv_stage, row_block, split_sums_of, split_tickets_of
from .sync import SyncArgs, barrier, begin_launch, end_launch
from .weights import Fp8Matrix

STAGES = ["k1 fold", "k1 settle", "k1 wq_a|wkv", "k1 q/kv norm, rope, kv write", "k1 wq_b"]
BARRIERS = tl.constexpr(len(STAGES) - 1)


class K1Args(NamedTuple):
    sync: SyncArgs
    rows: int
    positions: torch.Tensor
    slots: torch.Tensor
    residual: torch.Tensor  # [R, hc, d] the streams the owed output folds into
    owed_y: torch.Tensor  # the previous layer's FFN output and its site's post / comb mixes
    owed_post: torch.Tensor
    owed_comb: torch.Tensor
    streams: torch.Tensor  # [R, hc, d] the settled residual (written when there is owed output)
    partials: torch.Tensor
    hc_fn: torch.Tensor
    hc_base: torch.Tensor
    hc_scale: torch.Tensor
    attn_norm: torch.Tensor
    post: torch.Tensor  # the attention site's mixes, for K2's fold
    comb: torch.Tensor
    x: torch.Tensor
    wqkv_a: Fp8Matrix  # wq_a and wkv stacked
    qkv_raw: torch.Tensor  # [R, q_lora + D]
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    qr: torch.Tensor
    ring_kv: torch.Tensor
    ring_pos: torch.Tensor
    ring_size: int
    freqs: torch.Tensor
    wq_b: Fp8Matrix
    q_raw: torch.Tensor
    # an HCA layer's compressor (RATIO > 0; on a window layer any tensors, unread)
    comp_wkv: torch.Tensor  # bf16 [C D, d]
    comp_wgate: torch.Tensor
    source_kv: torch.Tensor  # [R, C D] wkv(x), wgate(x)
    source_gate: torch.Tensor
    src_kv: torch.Tensor  # the layer's source ring (PositionRing: [S, span, C D], pos [S, span])
    src_gate: torch.Tensor
    src_pos: torch.Tensor
    src_span: int
    ape: torch.Tensor  # fp32 [ratio, C D]
    comp_norm: torch.Tensor  # fp32 [D]
    entries: torch.Tensor  # bf16 [S, n_entries, D]
    n_entries: int
    sums: torch.Tensor  # the split GEMVs' slice sums and tickets (gemv.py)
    tickets: torch.Tensor
    d: int
    q_lora: int
    heads: int
    hc_eps: float
    norm_eps: float
    sinkhorn_iters: int


class K1Meta(NamedTuple):
    HC: int  # hc_mult
    MIXP: int  # mix columns padded to a power of two
    RB: int  # rows of a fold task
    CHUNK: int  # hidden columns of a fold task
    CB: int  # fold chunks a settle task sums at once
    BD: int  # hidden columns a settle task normalises at once
    HAS_OWED: bool
    SB: int  # the FP8 scale block
    BN_QKV: int
    BN_QB: int
    BK_D: int  # GEMV K steps over the hidden size and over q_lora
    BK_Q: int
    SPLIT_D: int  # GEMV slices of the hidden size and of q_lora
    SPLIT_Q: int
    DENSE_STAGES: int  # K steps a dense stage's pipeline holds in flight (LaunchShape.dense_stages)
    BR: int  # rows padded to the dots' block (gemv.row_block)
    D: int  # head_dim
    RD: int  # rope dims of a head
    BQ: int  # q_lora padded to a power of two
    RATIO: int  # the compression ratio of an HCA layer, 0 for a window layer
    HALVES: int  # the compressor's halves C (2 where its windows overlap)
    BN_C: int  # the compressor GEMVs' blocks
    BK_C: int
    SPLIT_C: int
    ESB: int  # the emission's slots a block (compress.SB)
    FAST: bool  # the NVIDIA paths (bf16 / fp8 dots, PTX)
    TIMELINE: bool


@triton.jit
def _k1(a, m):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = begin_launch(a.sync, m.TIMELINE)

    for t in range(pid, tl.cdiv(a.rows, m.RB) * tl.cdiv(a.d, m.CHUNK), grid):
        HC.fold_task(t, a.rows, a.d, a.residual, a.owed_y, a.d, a.owed_post, a.owed_comb, a.streams, a.hc_fn,
                     a.partials, m.HC, m.MIXP, m.RB, m.CHUNK, m.HAS_OWED)
    barrier(a.sync, epoch, 0, BARRIERS, m.TIMELINE, m.FAST)

    for t in range(pid, a.rows, grid):
        HC.settle_task(t, a.d, a.streams, a.partials, a.hc_base, a.hc_scale, a.attn_norm, a.post, a.comb, a.x,
                       a.hc_eps, a.norm_eps, a.sinkhorn_iters, m.HC, m.CHUNK, m.CB, m.BD)
    barrier(a.sync, epoch, 1, BARRIERS, m.TIMELINE, m.FAST)

    qkv = a.q_lora + m.D
    gemv_stage(pid, grid, 0, a.x, a.d, a.rows, a.wqkv_a.codes, a.wqkv_a.scales, a.qkv_raw, qkv, qkv, a.d, 0,
               a.sums, a.tickets, 0, m.SB, m.BN_QKV, m.BK_D, m.SPLIT_D, m.BR, True, m.FAST, m.DENSE_STAGES)
    if m.RATIO > 0:  # the compressor's wkv and wgate (bf16 weights) on the programs after wq_a|wkv's tasks
        width = m.HALVES * m.D
        first = tl.cdiv(qkv, m.BN_QKV) * m.SPLIT_D
        sums = a.sums + split_sums_of(qkv, m.BN_QKV, m.SPLIT_D, m.BR)
        tickets = a.tickets + split_tickets_of(qkv, m.BN_QKV, m.SPLIT_D)
        gemv_stage(pid, grid, first, a.x, a.d, a.rows, a.comp_wkv, a.comp_wkv, a.source_kv, width, width, a.d, 0,
                   sums, tickets, 1, m.SB, m.BN_C, m.BK_C, m.SPLIT_C, m.BR, True, m.FAST, m.DENSE_STAGES)
        gemv_stage(pid, grid, first + tl.cdiv(width, m.BN_C) * m.SPLIT_C, a.x, a.d, a.rows, a.comp_wgate,
                   a.comp_wgate, a.source_gate, width, width, a.d, 0, sums + split_sums_of(width, m.BN_C, m.SPLIT_C,
                                                                                          m.BR),
                   tickets + split_tickets_of(width, m.BN_C, m.SPLIT_C), 1, m.SB, m.BN_C, m.BK_C, m.SPLIT_C, m.BR,
                   True, m.FAST, m.DENSE_STAGES)
    barrier(a.sync, epoch, 2, BARRIERS, m.TIMELINE, m.FAST)

    norm_tasks = 2 * a.rows
    for t in range(pid, norm_tasks + (a.rows if m.RATIO > 0 else 0), grid):
        if t < norm_tasks:
            A.norm_rope_kv_task(t, a.qkv_raw, qkv, a.q_norm, a.qr, a.qkv_raw + a.q_lora, qkv, a.kv_norm,
                                a.positions, a.slots, a.freqs, a.ring_kv, a.ring_pos, a.ring_size, a.q_lora, m.D,
                                m.RD, a.norm_eps, m.BQ, m.D)
        else:
            C.source_write_task(t - norm_tasks, a.positions, a.slots, a.source_kv, a.source_gate, a.src_kv,
                                a.src_gate, a.src_pos, a.src_span, m.HALVES * m.D, m.D)
    barrier(a.sync, epoch, 3, BARRIERS, m.TIMELINE, m.FAST)

    gemv_stage(pid, grid, 0, a.qr, a.q_lora, a.rows, a.wq_b.codes, a.wq_b.scales, a.q_raw, a.heads * m.D,
               a.heads * m.D, a.q_lora, 0, a.sums, a.tickets, 0, m.SB, m.BN_QB, m.BK_Q, m.SPLIT_Q,
               m.BR, True, m.FAST, m.DENSE_STAGES)
    if m.RATIO > 0:  # the entries the step's rows complete (their source rows written a stage earlier)
        for t in range(pid, a.rows, grid):
            C.emit_task(t, a.positions, a.slots, a.src_kv, a.src_gate, a.src_pos, a.src_span, a.ape, a.comp_norm,
                        a.freqs, a.entries, a.n_entries, m.D, m.RD, a.norm_eps, m.RATIO, m.HALVES, m.ESB, m.D)
    end_launch(a.sync, epoch, BARRIERS, m.TIMELINE)


def dense_stages(runner, rows: int):
    """K1's dense GEMV stages at `rows` rows, each a list of (N, (BN, BK, SPLIT)): wq_a and wkv
    stacked, then (when the runner has an HCA layer) the compressor's wkv | wgate, and wq_b."""
    c = runner.config
    d, q_lora, hd = c.hidden_size, c.q_lora_rank, c.head_dim
    qkv = runner.gemv_blocks("k1", q_lora + hd, d, rows)
    qb = runner.gemv_blocks("k1", c.num_attention_heads * hd, q_lora, rows)
    front = [(q_lora + hd, qkv)]
    width = source_width(runner)
    if width:
        comp = runner.gemv_blocks("k1", width, d, rows, fp8=False)
        front += [(width, comp), (width, comp)]
    return [front, [(c.num_attention_heads * hd, qb)]]


def source_width(runner) -> int:
    """The widest compressor projection (C D) of the runner's compressed layers taken whole, 0 if none."""
    return max((lw.compressor.halves * runner.config.head_dim for lw in runner.layers if lw.compressor), default=0)


def launch(runner, s, lw, cache, cur: int, owed) -> int:
    """K1 of one layer on scratch `s`; returns the index of s.streams holding the settled residual.
    `owed`: the previous layer's FFN output and its site's post / comb mixes (`Scratch.owed`),
    folded into the residual first, or None (nothing owed: the first layer)."""
    c = runner.config
    residual = s.streams[cur]
    ring = cache.window
    d, q_lora, heads, hd = c.hidden_size, c.q_lora_rank, c.num_attention_heads, c.head_dim
    front, [(_, (bn_qb, bk_q, split_q))] = dense_stages(runner, s.rows)
    (_, (bn_qkv, bk_d, split_d)) = front[0]
    bn_c, bk_c, split_c = front[1][1] if len(front) > 1 else (1, 1, 1)  # (unused without an HCA layer)
    owed_y, owed_post, owed_comb = s.owed() if owed is None else owed  # (not read when nothing is owed)
    args = K1Args(
        sync=runner.sync_args("k1"), rows=s.rows, positions=s.positions, slots=s.slots,
        residual=residual, owed_y=owed_y, owed_post=owed_post, owed_comb=owed_comb,
        streams=residual if owed is None else s.streams[1 - cur], partials=s.partials,
        hc_fn=lw.hc_attn[0], hc_base=lw.hc_attn[1], hc_scale=lw.hc_attn[2], attn_norm=lw.attn_norm,
        post=s.post_attn, comb=s.comb_attn, x=s.x, wqkv_a=lw.wqkv_a, qkv_raw=s.qkv_raw,
        q_norm=lw.q_norm, kv_norm=lw.kv_norm, qr=s.qr, ring_kv=ring.data["kv"], ring_pos=ring.pos,
        ring_size=ring.size, freqs=lw.rope_freqs, wq_b=lw.wq_b, q_raw=s.q_raw, **_compressor(lw, cache, s),
        sums=runner.split_sums, tickets=runner.split_tickets,
        d=d, q_lora=q_lora, heads=heads, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps,
        sinkhorn_iters=c.hc_sinkhorn_iters,
    )
    rb, chunk, cb, bd = HC.seam_blocks(runner.shape.k1_warps, d, s.rows, runner.grids["k1"], runner.shape.fold_rows,
                                       runner.shape.settle_columns)
    meta = K1Meta(
        HC=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=rb, CHUNK=chunk, CB=cb, BD=bd,
        HAS_OWED=owed is not None, SB=c.fp8_block[0], BN_QKV=bn_qkv, BN_QB=bn_qb, BK_D=bk_d, BK_Q=bk_q,
        SPLIT_D=split_d, SPLIT_Q=split_q, DENSE_STAGES=runner.shape.dense_stages,
        BR=row_block(s.rows), D=hd, RD=c.qk_rope_head_dim, BQ=triton.next_power_of_2(q_lora),
        RATIO=lw.compressor.ratio if lw.compressor else 0, HALVES=lw.compressor.halves if lw.compressor else 1,
        BN_C=bn_c, BK_C=bk_c, SPLIT_C=split_c, ESB=min(C.SB, lw.compressor.ratio) if lw.compressor else C.SB,
        FAST=runner.fast, TIMELINE=runner.timeline,
    )
    runner.launch(_k1, "K1", "k1", args, meta=meta)
    return cur if owed is None else 1 - cur


def _compressor(lw, cache, s) -> dict:
    """K1Args' compressor fields: an HCA layer's weights, its source ring and entries; on a window
    layer the window ring's tensors in their place (not read: RATIO 0)."""
    comp, ring = lw.compressor, cache.window
    if comp is None:
        kv = ring.data["kv"]
        return dict(comp_wkv=kv, comp_wgate=kv, source_kv=s.source_kv, source_gate=s.source_gate, src_kv=kv,
                    src_gate=kv, src_pos=ring.pos, src_span=ring.size, ape=lw.attn_norm, comp_norm=lw.attn_norm,
                    entries=kv, n_entries=0)
    source = cache.source
    return dict(comp_wkv=comp.wkv, comp_wgate=comp.wgate, source_kv=s.source_kv, source_gate=s.source_gate,
                src_kv=source.data["kv"], src_gate=source.data["gate"], src_pos=source.pos, src_span=source.size,
                ape=comp.ape, comp_norm=comp.norm, entries=cache.entries if cache.entries.numel() else ring.data["kv"],
                n_entries=cache.entries.shape[1])
