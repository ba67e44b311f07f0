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
2 wq_a|wkv  gemv_stage (FP8)   (ceil(q_lora/BN_QA) + ceil(D/BN_KV)) x -> qr_raw, kv_raw (bf16)
                               * SPLIT_D
3 norms     norm_rope_kv_task  2R                              qr_raw -> qr = q_norm(qr_raw); kv_raw ->
                                                               kv_norm, RoPE -> the KV ring (not for
                                                               pad rows, slot < 0)
4 wq_b      gemv_stage (FP8)   ceil(H*D/BN_QB) * SPLIT_Q       qr -> q_raw (K2's attend normalises and
                                                               rotates the heads as it loads them)
Without owed output (layer 0: the embedding is the settled residual) stage 0 only computes the
partials and `streams` is `residual`. K2 reads q_raw, the ring and the attention site's post/comb,
after this launch ends (stream order).
Waits: a grid barrier after each stage but the last; an expired wait names the stage (STAGES).
Rounding points: the per-op path's (bf16 after each projection, norm and RoPE; fp32 mixes).
Scratch: `Scratch` of the step's width; the ring is the layer's `LayerCache.window`; the split
GEMVs' slice sums and tickets (the runner's: `dense_stages` sizes them).
Arguments: `K1Args` (pointers and runtime scalars) and `K1Meta` (compile-time constants), by name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import attention as A
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
    wq_a: Fp8Matrix
    wkv: Fp8Matrix
    qr_raw: torch.Tensor
    kv_raw: torch.Tensor
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    qr: torch.Tensor
    ring_kv: torch.Tensor
    ring_pos: torch.Tensor
    ring_size: int
    freqs: torch.Tensor
    wq_b: Fp8Matrix
    q_raw: torch.Tensor
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
    BN_QA: int
    BN_KV: int
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

    q_tasks = tl.cdiv(a.q_lora, m.BN_QA) * m.SPLIT_D
    gemv_stage(pid, grid, 0, a.x, a.d, a.rows, a.wq_a.codes, a.wq_a.scales, a.qr_raw, a.q_lora, a.q_lora, a.d, 0,
               a.sums, a.tickets, 0, m.SB, m.BN_QA, m.BK_D, m.SPLIT_D, m.BR, True, m.FAST, m.DENSE_STAGES)
    gemv_stage(pid, grid, q_tasks, a.x, a.d, a.rows, a.wkv.codes, a.wkv.scales, a.kv_raw, m.D, m.D, a.d, 0,
               a.sums + split_sums_of(a.q_lora, m.BN_QA, m.SPLIT_D, m.BR),
               a.tickets + split_tickets_of(a.q_lora, m.BN_QA, m.SPLIT_D), 0, m.SB, m.BN_KV, m.BK_D, m.SPLIT_D, m.BR,
               True, m.FAST, m.DENSE_STAGES)
    barrier(a.sync, epoch, 2, BARRIERS, m.TIMELINE, m.FAST)

    for t in range(pid, 2 * a.rows, grid):
        A.norm_rope_kv_task(t, a.qr_raw, a.q_lora, a.q_norm, a.qr, a.kv_raw, m.D, a.kv_norm, a.positions, a.slots,
                            a.freqs, a.ring_kv, a.ring_pos, a.ring_size, a.q_lora, m.D, m.RD, a.norm_eps, m.BQ, m.D)
    barrier(a.sync, epoch, 3, BARRIERS, m.TIMELINE, m.FAST)

    gemv_stage(pid, grid, 0, a.qr, a.q_lora, a.rows, a.wq_b.codes, a.wq_b.scales, a.q_raw, a.heads * m.D,
               a.heads * m.D, a.q_lora, 0, a.sums, a.tickets, 0, m.SB, m.BN_QB, m.BK_Q, m.SPLIT_Q,
               m.BR, True, m.FAST, m.DENSE_STAGES)
    end_launch(a.sync, epoch, BARRIERS, m.TIMELINE)


def dense_stages(runner, rows: int):
    """K1's dense GEMV stages at `rows` rows, each a list of (N, (BN, BK, SPLIT)): wq_a | wkv, wq_b."""
    c = runner.config
    d, q_lora, hd = c.hidden_size, c.q_lora_rank, c.head_dim
    qa, kv = runner.gemv_blocks("k1", q_lora, d, rows), runner.gemv_blocks("k1", hd, d, rows)
    qb = runner.gemv_blocks("k1", c.num_attention_heads * hd, q_lora, rows)
    return [[(q_lora, qa), (hd, kv)], [(c.num_attention_heads * hd, qb)]]


def launch(runner, s, lw, cache, cur: int, owed) -> int:
    """K1 of one layer on scratch `s`; returns the index of s.streams holding the settled residual.
    `owed`: the previous layer's FFN output and its site's post / comb mixes (`Scratch.owed`),
    folded into the residual first, or None (nothing owed: the first layer)."""
    c = runner.config
    residual = s.streams[cur]
    ring = cache.window
    d, q_lora, heads, hd = c.hidden_size, c.q_lora_rank, c.num_attention_heads, c.head_dim
    [(_, (bn_qa, bk_qa, split_d)), (_, (bn_kv, bk_kv, _))], [(_, (bn_qb, bk_q, split_q))] = \
        dense_stages(runner, s.rows)
    bk_d = min(bk_qa, bk_kv)  # one K step for the stage's two matrices (they share x and its slices)
    owed_y, owed_post, owed_comb = s.owed() if owed is None else owed  # (not read when nothing is owed)
    args = K1Args(
        sync=runner.sync_args("k1"), rows=s.rows, positions=s.positions, slots=s.slots,
        residual=residual, owed_y=owed_y, owed_post=owed_post, owed_comb=owed_comb,
        streams=residual if owed is None else s.streams[1 - cur], partials=s.partials,
        hc_fn=lw.hc_attn[0], hc_base=lw.hc_attn[1], hc_scale=lw.hc_attn[2], attn_norm=lw.attn_norm,
        post=s.post_attn, comb=s.comb_attn, x=s.x, wq_a=lw.wq_a, wkv=lw.wkv, qr_raw=s.qr_raw, kv_raw=s.kv_raw,
        q_norm=lw.q_norm, kv_norm=lw.kv_norm, qr=s.qr, ring_kv=ring.data["kv"], ring_pos=ring.pos,
        ring_size=ring.size, freqs=lw.rope_freqs, wq_b=lw.wq_b, q_raw=s.q_raw,
        sums=runner.split_sums, tickets=runner.split_tickets,
        d=d, q_lora=q_lora, heads=heads, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps,
        sinkhorn_iters=c.hc_sinkhorn_iters,
    )
    rb, chunk, cb, bd = HC.seam_blocks(runner.shape.k1_warps, d, s.rows, runner.grids["k1"], runner.shape.fold_rows)
    meta = K1Meta(
        HC=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=rb, CHUNK=chunk, CB=cb, BD=bd,
        HAS_OWED=owed is not None, SB=c.fp8_block[0], BN_QA=bn_qa, BN_KV=bn_kv, BN_QB=bn_qb, BK_D=bk_d, BK_Q=bk_q,
        SPLIT_D=split_d, SPLIT_Q=split_q, DENSE_STAGES=runner.shape.dense_stages,
        BR=row_block(s.rows), D=hd, RD=c.qk_rope_head_dim, BQ=triton.next_power_of_2(q_lora),
        FAST=runner.fast, TIMELINE=runner.timeline,
    )
    runner.launch(_k1, "K1", "k1", args, meta=meta)
    return cur if owed is None else 1 - cur
