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
1 settle    hc.settle_task     2R                              partials, streams -> post/comb of the
                                                               attention site, x = attn_norm(collapse)
2 wq_a|wkv  gemv_stage (FP8)   ceil((q_lora+D)/BN_QKV)         x -> qkv_raw (bf16): wq_a and wkv
                               * SPLIT_D                       stacked (weights.stack_rows), one GEMV
  (CSA/HCA) gemv_stage (bf16)  + ceil(NP/BN_P) * SPLIT_P       x -> proj [R, NP]: the projections of x
                                                               stacked (weights.stack_projections), one
                                                               GEMV: the compressor's wkv(x) and wgate(x)
                                                               (comp.source_kv / source_gate, column views),
                                                               on a CSA layer then the indexer compressor's
                                                               and index.weights = weights_proj(x)
3 norms     norm_rope_kv_task  2R                              qkv_raw -> qr = q_norm(its first q_lora
                                                               columns); the other D -> kv_norm, RoPE ->
                                                               the KV ring (not for pad rows, slot < 0)
  (CSA/HCA) source_write_task  + R (CSA: + 2R)                 a compressor's projections -> its
                                                               source ring (compress.py)
4 wq_b      gemv_stage (FP8)   ceil(H*D/BN_QB) * SPLIT_Q       qr -> q_raw (K2's attend normalises and
                                                               rotates the heads as it loads them)
  (CSA)     gemv_stage (FP8)   + ceil(HI DI/BN_IQ) * SPLIT_IQ  qr -> index.q (the indexer's wq_b)
  (CSA/HCA) emit_task          + R (CSA: + 2R)                 a source ring -> the entry a row
                                                               completes (compress.py)
5 (CSA) scores  score_task     R T: each row's blocks of KE    index.q, index.weights, the index
                               of the step's most visible      entries -> index.scores (indexer.py;
                               entries in T runs (score_layout: none for a row that keeps all its
                               one round of the programs)      entries: at most TOPK visible)
6-9 (CSA) top-k digits  select_pass_task  R B               index.scores -> index.hist: the digits
                                                               of each selecting row's k-th largest
                                                               score (B = ceil(the step's most visible
                                                               entries / BE); indexer.py)
10 (CSA) top-k counts   select_count_task  R B             -> index.counts: a block's keys above
                                                               and at the k-th
11 (CSA) top-k writes   select_write_task  R B             -> index.selected (TOPK entry ids a row, in
                                                               entry order, then -1; a row that keeps
                                                               all its entries: 0 .. visible - 1)
Without owed output (layer 0: the embedding is the settled residual) stage 0 only computes the
partials and `streams` is `residual`. K2 reads q_raw, the ring and the attention site's post/comb,
after this launch ends (stream order), and on a compressed layer (RATIO > 0) the compressed
entries, on a CSA layer those of its selection. A window, an HCA and a CSA layer are three builds
(RATIO, INDEXED compile-time constants); a CSA layer's K1 has seven barriers more, and since a
barrier's target counts a family's barriers a launch (sync.py), it is a sync family of its own,
"k1c" (`stage_names`). Its first stage also clears the top-k's digit histograms.
Waits: a grid barrier after each stage but the last; an expired wait names the stage. In a step
where no row selects (every row sees at most TOPK entries) the programs pass the barriers
before the top-k's digit passes, counts and writes without waiting (`pass_barriers`: all of them
alike, as every program reads the same positions; one relaxed increment counts the six) and run
only the writes (of rows that keep every entry).
Rounding points: the per-op path's (bf16 after each projection, norm and RoPE; fp32 mixes; the
compressor's, compress.py; the indexer's, indexer.py).
Scratch: `Scratch` of the step's width (on a compressed layer also its projections; on a CSA
layer the indexer's weights, queries, scores (`Scratch.scores`, by the cache's entries) and
selection); the rings are the layer's `LayerCache.window` and, on a compressed layer,
`LayerCache.source` (and `index_source`), written into `LayerCache.entries` (and
`index_entries`); the split GEMVs' slice sums and tickets (the runner's: `dense_stages` sizes
them).
Arguments: `K1Args` (pointers and runtime scalars; a compressor's as `CompressorArgs`, the
indexer's as `IndexArgs`) and `K1Meta` (compile-time constants), by name. A compressor's
span and entry count sit at the first level of `K1Args`, not in its `CompressorArgs`: Triton 3.6
specialises an int argument of 1 to a constant and lost that constant (None in the kernel) in
`CompressorArgs`, so a cache of one compressed entry failed to compile. (The one int nested
deeper, `SyncArgs.max_polls`, is never 1.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..config import CSA_RATIO
from . import attention as A
from . import compress as C
from . import hc as HC
from . import indexer as I
from .gemv import gemv_stage, split_sums_of, split_tickets_of
from .gemv_tiles import row_block
from .sync import SyncArgs, barrier, begin_launch, end_launch, pass_barriers
from .weights import Fp8Matrix, projection_names, projection_rows

STAGES = ["k1 fold", "k1 settle", "k1 wq_a|wkv", "k1 q/kv norm, rope, kv write", "k1 wq_b"]
INDEXED_STAGES = STAGES + ["k1 index scores"] + [f"k1 top-k digit {i + 1}" for i in range(I.SELECT_LEVELS)] + [
    "k1 top-k counts", "k1 top-k writes"]  # a CSA layer's K1: its own family, "k1c"


def stage_names(family: str) -> list[str]:
    """The stages of a launch of `family` ("k1": window and HCA layers, "k1c": CSA layers)."""
    return {"k1": STAGES, "k1c": INDEXED_STAGES}[family]


class CompressorArgs(NamedTuple):
    """A compressor's weights, projections and caches (compress.py): the layer's (head dim D) or
    its indexer's (DI)."""

    source_kv: torch.Tensor  # [R, C D] wkv(x), wgate(x): column views of K1Args.proj (its row stride)
    source_gate: torch.Tensor
    src_kv: torch.Tensor  # the source ring (PositionRing: [S, span, C D], pos [S, span])
    src_gate: torch.Tensor
    src_pos: torch.Tensor  # (the ring's span and the entries' count are K1Args': the module docstring)
    ape: torch.Tensor  # fp32 [ratio, C D]
    norm: torch.Tensor  # fp32 [D]
    entries: torch.Tensor  # bf16 [S, n_entries, D]


class IndexArgs(NamedTuple):
    """A CSA layer's lightning indexer (indexer.py): its compressor, query and weight GEMVs, the
    scores of every visible index entry, the top-k selection K2's attend reads."""

    comp: CompressorArgs
    weights: torch.Tensor  # [R, HI] bf16: weights_proj(x), a column view of K1Args.proj
    wq_b: Fp8Matrix  # [HI DI, q_lora]
    q: torch.Tensor  # [R, HI DI] bf16: wq_b(qr), before its RoPE
    scores: torch.Tensor  # fp32 [R, K1Args.index_entries]
    hist: torch.Tensor  # int32 [R, 5, 256]: the top-k's digit histograms (cleared by stage 0), kept digits
    counts: torch.Tensor  # int32: the top-k's block counts (indexer.select_counts)
    selected: torch.Tensor  # int64 [R, TOPK]: entry ids, then -1
    weights_scale: float  # HI^-0.5
    score_scale: float  # DI^-0.5


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
    projections: torch.Tensor  # a compressed layer's stacked bf16 projections [NP, d] (RATIO > 0; else unread)
    proj: torch.Tensor  # [R, proj_stride] bf16: their outputs (the first NP columns)
    n_proj: int  # NP
    proj_stride: int
    comp: CompressorArgs  # a compressed layer's compressor (RATIO > 0; else unread)
    index: IndexArgs  # a CSA layer's indexer (INDEXED; else unread)
    span: int  # the compressor's source ring span and entries a slot, then its indexer's (0: none)
    n_entries: int
    index_span: int
    index_entries: int
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
    BR: int  # rows padded to the dots' block (gemv_tiles.row_block)
    D: int  # head_dim
    RD: int  # rope dims of a head
    BQ: int  # q_lora padded to a power of two
    RATIO: int  # the compression ratio of an HCA layer, 0 for a window layer
    HALVES: int  # the compressor's halves C (2 where its windows overlap)
    BN_P: int  # the stacked projections' GEMV blocks
    BK_P: int
    SPLIT_P: int
    ESB: int  # the emission's slots a block (compress.SB)
    COMPRESSORS: int  # 0 (window), 1 (HCA), 2 (CSA: the layer's and the indexer's)
    INDEXED: bool  # a CSA layer: the indexer's GEMVs, emissions, scores and top-k (seven stages more)
    B: int  # the launch's grid barriers (len(stage_names) - 1)
    BN_IQ: int  # the indexer's wq_b's
    BK_IQ: int
    SPLIT_IQ: int
    HI: int  # index heads, index head dim, heads padded to a power of two (>= 16)
    DI: int
    BH: int
    TOPK: int  # the entries a row keeps (a power of two)
    KE: int  # entries of a score block (indexer.KE)
    BE: int  # the selection's entries a block
    FAST: bool  # the NVIDIA paths (bf16 / fp8 dots, PTX)
    TIMELINE: bool


@triton.jit
def _k1(a, m):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = begin_launch(a.sync, m.TIMELINE)

    for t in range(pid, tl.cdiv(a.rows, m.RB) * tl.cdiv(a.d, m.CHUNK), grid):
        HC.fold_task(t, a.rows, a.d, a.residual, a.owed_y, a.d, a.owed_post, a.owed_comb, a.streams, a.hc_fn,
                     a.partials, m.HC, m.MIXP, m.RB, m.CHUNK, m.HAS_OWED)
    if m.INDEXED:
        I.clear_select_hist(pid, grid, a.rows, a.index.hist)
    barrier(a.sync, epoch, 0, m.B, m.TIMELINE, m.FAST)

    for t in range(pid, 2 * a.rows, grid):  # hc.settle_tasks: a collapse and a mix task a row
        HC.settle_task(t, a.rows, a.d, a.streams, a.partials, a.hc_base, a.hc_scale, a.attn_norm, a.post, a.comb, a.x,
                       a.hc_eps, a.norm_eps, a.sinkhorn_iters, m.HC, m.CHUNK, m.CB, m.BD)
    barrier(a.sync, epoch, 1, m.B, m.TIMELINE, m.FAST)

    qkv = a.q_lora + m.D
    gemv_stage(pid, grid, 0, a.x, a.d, a.rows, a.wqkv_a.codes, a.wqkv_a.scales, a.qkv_raw, qkv, qkv, a.d, 0,
               a.sums, a.tickets, 0, m.SB, m.BN_QKV, m.BK_D, m.SPLIT_D, m.BR, True, m.FAST, m.DENSE_STAGES)
    if m.RATIO > 0:  # the stacked projections (bf16 weights) on the programs after wq_a|wkv's tasks
        first, sums, tickets = _next_gemv(0, a.sums, a.tickets, qkv, m.BN_QKV, m.SPLIT_D, m.BR)
        gemv_stage(pid, grid, first, a.x, a.d, a.rows, a.projections, a.projections, a.proj, a.proj_stride,
                   a.n_proj, a.d, 0, sums, tickets, 1, m.SB, m.BN_P, m.BK_P, m.SPLIT_P, m.BR, True, m.FAST,
                   m.DENSE_STAGES)
    barrier(a.sync, epoch, 2, m.B, m.TIMELINE, m.FAST)

    norm_tasks = 2 * a.rows
    for t in range(pid, norm_tasks + a.rows * m.COMPRESSORS, grid):  # a source-ring write a row and compressor
        if t < norm_tasks:
            A.norm_rope_kv_task(t, a.qkv_raw, qkv, a.q_norm, a.qr, a.qkv_raw + a.q_lora, qkv, a.kv_norm,
                                a.positions, a.slots, a.freqs, a.ring_kv, a.ring_pos, a.ring_size, a.q_lora, m.D,
                                m.RD, a.norm_eps, m.BQ, m.D)
        elif t < norm_tasks + a.rows:
            _source_write(t - norm_tasks, a, a.comp, a.span, m.HALVES * m.D, m.D)
        else:
            _source_write(t - norm_tasks - a.rows, a, a.index.comp, a.index_span, 2 * m.DI, m.DI)
    barrier(a.sync, epoch, 3, m.B, m.TIMELINE, m.FAST)

    gemv_stage(pid, grid, 0, a.qr, a.q_lora, a.rows, a.wq_b.codes, a.wq_b.scales, a.q_raw, a.heads * m.D,
               a.heads * m.D, a.q_lora, 0, a.sums, a.tickets, 0, m.SB, m.BN_QB, m.BK_Q, m.SPLIT_Q,
               m.BR, True, m.FAST, m.DENSE_STAGES)
    if m.INDEXED:  # the indexer's queries on the same qr, on the programs after wq_b's tasks
        first, sums, tickets = _next_gemv(0, a.sums, a.tickets, a.heads * m.D, m.BN_QB, m.SPLIT_Q, m.BR)
        gemv_stage(pid, grid, first, a.qr, a.q_lora, a.rows, a.index.wq_b.codes, a.index.wq_b.scales, a.index.q,
                   m.HI * m.DI, m.HI * m.DI, a.q_lora, 0, sums, tickets, 0, m.SB, m.BN_IQ, m.BK_IQ, m.SPLIT_IQ,
                   m.BR, True, m.FAST, m.DENSE_STAGES)
    if m.RATIO > 0:  # the entries the step's rows complete (their source rows written a stage earlier)
        for t in range(pid, a.rows * m.COMPRESSORS, grid):
            if t < a.rows:
                _emit(t, a, a.comp, a.span, a.n_entries, m.D, m.RD, m.RATIO, m.HALVES, m.ESB)
            else:
                _emit(t - a.rows, a, a.index.comp, a.index_span, a.index_entries, m.DI, m.RD, m.RATIO, m.HALVES, m.ESB)
    if m.INDEXED:
        ix = a.index
        span = I.visible_span(a.rows, a.index_entries, a.positions, a.slots, m.RATIO)
        blocks, selects = tl.cdiv(span, m.BE), span > m.TOPK
        barrier(a.sync, epoch, 4, m.B, m.TIMELINE, m.FAST)
        I.score_stage(pid, grid, grid, a.rows, span, ix.q, ix.weights, a.proj_stride, a.positions, a.slots, a.freqs,
                      ix.comp.entries, a.index_entries, ix.scores, m.HI, m.RD, ix.score_scale, ix.weights_scale,
                      m.RATIO, m.BH, m.DI, m.KE, m.FAST, m.TOPK)
        for stage in tl.static_range(I.SELECT_STAGES):
            if selects:
                barrier(a.sync, epoch, 5 + stage, m.B, m.TIMELINE, m.FAST)
            elif stage == 0:
                pass_barriers(a.sync, 5, I.SELECT_STAGES, m.TIMELINE)
            if selects or stage == I.SELECT_STAGES - 1:  # the writes: also a row's that keeps every entry
                I.select_stage(pid, grid, stage, a.rows, blocks, ix.scores, a.index_entries, ix.hist, ix.counts,
                               ix.selected, a.positions, a.slots, m.RATIO, m.TOPK, m.BE)
    end_launch(a.sync, epoch, m.B, m.TIMELINE)


@triton.jit
def _next_gemv(first, sums, tickets, N, BN: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr):
    """(first task, slice sums, tickets) of the GEMV after one of N outputs in the same stage."""
    return (first + tl.cdiv(N, BN) * SPLIT, sums + split_sums_of(N, BN, SPLIT, BR),
            tickets + split_tickets_of(N, BN, SPLIT))


@triton.jit
def _source_write(r, a, comp, span, CW, BLOCK: tl.constexpr):
    C.source_write_task(r, a.positions, a.slots, comp.source_kv, comp.source_gate, a.proj_stride, comp.src_kv,
                        comp.src_gate, comp.src_pos, span, CW, BLOCK)


@triton.jit
def _emit(r, a, comp, span, n_entries, D: tl.constexpr, RD, RATIO: tl.constexpr, HALVES: tl.constexpr,
          ESB: tl.constexpr):
    C.emit_task(r, a.positions, a.slots, comp.src_kv, comp.src_gate, comp.src_pos, span, comp.ape,
                comp.norm, a.freqs, comp.entries, n_entries, D, RD, a.norm_eps, RATIO, HALVES, ESB, D)


def dense_stages(runner, rows: int):
    """K1's dense GEMV stages at `rows` rows, each a list of (N, (BN, BK, SPLIT)), of every kind of
    layer the runner runs (`split_needs` sizes the split GEMVs' scratch for the largest)."""
    return [stage for ratio in sorted(set(runner.ratios)) for stage in layer_stages(runner, rows, ratio)]


def layer_stages(runner, rows: int, ratio: int):
    """A layer's two dense K1 stages at `rows` rows, as `dense_stages`: wq_a and wkv stacked, then
    on a compressed layer (`ratio` > 0) its stacked bf16 projections (`weights.projection_names`);
    then wq_b and on a CSA layer the indexer's wq_b."""
    c = runner.config
    d, q_lora, hd = c.hidden_size, c.q_lora_rank, c.head_dim

    def gemv(N: int, K: int, fp8: bool = True):
        return N, runner.gemv_blocks("k1", N, K, rows, fp8=fp8)

    front, back = [gemv(q_lora + hd, d)], [gemv(c.num_attention_heads * hd, q_lora)]
    if ratio:
        front.append(gemv(sum(projection_rows(c, ratio)), d, fp8=False))
    if ratio == CSA_RATIO:
        back.append(gemv(c.index_n_heads * c.index_head_dim, q_lora))
    return [front, back]


def launch(runner, s, lw, cache, cur: int, owed) -> int:
    """K1 of one layer on scratch `s`; returns the index of s.streams holding the settled residual.
    `owed`: the previous layer's FFN output and its site's post / comb mixes (`Scratch.owed`),
    folded into the residual first, or None (nothing owed: the first layer)."""
    c = runner.config
    residual = s.streams[cur]
    ring = cache.window
    d, q_lora, heads, hd = c.hidden_size, c.q_lora_rank, c.num_attention_heads, c.head_dim
    ratio = lw.compressor.ratio if lw.compressor else 0
    indexed = lw.indexer is not None
    family = "k1c" if indexed else "k1"
    front, back = layer_stages(runner, s.rows, ratio)
    unused = (1, 1, 1)
    (bn_qkv, bk_d, split_d), (bn_qb, bk_q, split_q) = front[0][1], back[0][1]
    (n_proj, (bn_p, bk_p, split_p)) = front[1] if ratio else (0, unused)
    bn_iq, bk_iq, split_iq = back[1][1] if indexed else unused
    columns = _projection_columns(c, ratio, s.proj)
    owed_y, owed_post, owed_comb = s.owed() if owed is None else owed  # (not read when nothing is owed)
    args = K1Args(
        sync=runner.sync_args(family), rows=s.rows, positions=s.positions, slots=s.slots,
        residual=residual, owed_y=owed_y, owed_post=owed_post, owed_comb=owed_comb,
        streams=residual if owed is None else s.streams[1 - cur], partials=s.partials,
        hc_fn=lw.hc_attn[0], hc_base=lw.hc_attn[1], hc_scale=lw.hc_attn[2], attn_norm=lw.attn_norm,
        post=s.post_attn, comb=s.comb_attn, x=s.x, wqkv_a=lw.wqkv_a, qkv_raw=s.qkv_raw,
        q_norm=lw.q_norm, kv_norm=lw.kv_norm, qr=s.qr, ring_kv=ring.data["kv"], ring_pos=ring.pos,
        ring_size=ring.size, freqs=lw.rope_freqs, wq_b=lw.wq_b, q_raw=s.q_raw,
        projections=s.proj if lw.projections is None else lw.projections, proj=s.proj, n_proj=n_proj,
        proj_stride=s.proj.stride(0),
        comp=_compressor(lw.compressor, cache, "source", "entries", *columns[:2]),
        index=_indexer(lw, cache, s, c, *columns[2:]),
        span=_span(lw.compressor, cache, "source"), n_entries=_entries(lw.compressor, cache, "entries"),
        index_span=_span(lw.indexer and lw.indexer.compressor, cache, "index_source"),
        index_entries=_entries(lw.indexer and lw.indexer.compressor, cache, "index_entries"),
        sums=runner.split_sums, tickets=runner.split_tickets,
        d=d, q_lora=q_lora, heads=heads, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps,
        sinkhorn_iters=c.hc_sinkhorn_iters,
    )
    rb, chunk, cb, bd = HC.seam_blocks(runner.shape.k1_warps, d, s.rows, runner.grids[family],
                                       runner.shape.fold_rows, runner.shape.settle_columns)
    meta = K1Meta(
        HC=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=rb, CHUNK=chunk, CB=cb, BD=bd,
        HAS_OWED=owed is not None, SB=c.fp8_block[0], BN_QKV=bn_qkv, BN_QB=bn_qb, BK_D=bk_d, BK_Q=bk_q,
        SPLIT_D=split_d, SPLIT_Q=split_q, DENSE_STAGES=runner.shape.dense_stages,
        BR=row_block(s.rows), D=hd, RD=c.qk_rope_head_dim, BQ=triton.next_power_of_2(q_lora),
        RATIO=ratio, HALVES=lw.compressor.halves if lw.compressor else 1,
        BN_P=bn_p, BK_P=bk_p, SPLIT_P=split_p, ESB=min(C.SB, ratio) if ratio else C.SB,
        COMPRESSORS=(ratio > 0) + indexed, INDEXED=indexed, B=len(stage_names(family)) - 1,
        BN_IQ=bn_iq, BK_IQ=bk_iq, SPLIT_IQ=split_iq, HI=c.index_n_heads, DI=c.index_head_dim,
        BH=max(16, triton.next_power_of_2(c.index_n_heads)), TOPK=c.index_topk, KE=I.KE,
        BE=I.select_block(runner.shape.select_block, s.rows),
        FAST=runner.fast, TIMELINE=runner.timeline,
    )
    runner.launch(_k1, "K1 (CSA)" if indexed else "K1", family, args, meta=meta)
    return cur if owed is None else 1 - cur


def _projection_columns(c, ratio: int, proj: torch.Tensor) -> list[torch.Tensor]:
    """The stacked projections' outputs as column views of `proj` [R, P], in `projection_names`
    order (the compressor's kv and gate, the indexer compressor's, weights_proj); a layer
    without them (or without an indexer) gets `proj` itself in their place (not read)."""
    views, first = [], 0
    for n in projection_rows(c, ratio) if ratio else []:
        views.append(proj[:, first:first + n])
        first += n
    return views + [proj] * (len(projection_names(CSA_RATIO)) - len(views))


def _compressor(comp, cache, ring_name: str, entries_name: str, source_kv, source_gate) -> CompressorArgs:
    """CompressorArgs of a compressor (weights `comp`, its source ring and entries: the layer
    cache's `ring_name` and `entries_name`); without one (None) the window ring's tensors in their
    place (not read)."""
    if comp is None:
        ring = cache.window
        kv = ring.data["kv"]
        return CompressorArgs(source_kv, source_gate, kv, kv, ring.pos, kv, kv, kv)
    source, entries = getattr(cache, ring_name), getattr(cache, entries_name)
    return CompressorArgs(source_kv, source_gate, source.data["kv"], source.data["gate"], source.pos, comp.ape,
                          comp.norm, entries if entries.numel() else source.data["kv"])


def _span(comp, cache, ring_name: str) -> int:
    """The span of a compressor's source ring (0 without a compressor)."""
    return getattr(cache, ring_name).size if comp else 0


def _entries(comp, cache, entries_name: str) -> int:
    """The compressed entries a slot of a compressor's cache holds (0 without a compressor)."""
    return getattr(cache, entries_name).shape[1] if comp else 0


def _indexer(lw, cache, s, c, source_kv, source_gate, weights) -> IndexArgs:
    """IndexArgs of a CSA layer's indexer (its compressor's projections and weights_proj(x) the
    given columns of the stacked projections' outputs); on other layers stand-ins (not read)."""
    ix = lw.indexer
    comp = _compressor(ix.compressor if ix else None, cache, "index_source", "index_entries", source_kv, source_gate)
    if ix is None:
        kv = cache.window.data["kv"]
        return IndexArgs(comp, weights, Fp8Matrix(kv, kv), s.index_q, s.partials, s.select_hist, s.select_hist,
                         s.selected, 1.0, 1.0)
    n_entries = _entries(ix.compressor, cache, "index_entries")
    return IndexArgs(comp, weights, ix.wq_b, s.index_q, s.scores(n_entries), s.select_hist,
                     s.select_counts(n_entries), s.selected, c.index_n_heads ** -0.5, c.index_head_dim ** -0.5)
