"""K1: the attention seam and front of a `whole` layer, one persistent launch.

Grid: one program per SM (`MonoRunner.grid`), all co-resident (a cooperative launch: the driver
refuses a grid that cannot be); under Triton's interpreter grid (1,), one program doing every
task in order. Program p takes tasks p, p + grid, ... of each stage; a grid barrier (sync.py)
separates consecutive stages, so a task only reads what earlier stages wrote.

Stages (R rows; task counts)                                    reads -> writes
0 fold      hc.fold_task       ceil(R/RB) * ceil(d/CHUNK)      streams_in, owed y/post/comb (the
                                                               previous layer's FFN) -> streams_out,
                                                               mix partials (hc_attn_fn)
1 settle    hc.settle_task     R                               partials, streams -> post/comb of the
                                                               attention site, x = attn_norm(collapse)
2 wq_a|wkv  gemv_task (FP8)    ceil(q_lora/BN_QA) + ceil(D/BN_KV)  x -> qr_raw, kv_raw (bf16)
3 norms     norm_rope_kv_task  2R                              qr_raw -> qr = q_norm(qr_raw); kv_raw ->
                                                               kv_norm, RoPE -> the KV ring (not for
                                                               pad rows, slot < 0)
4 wq_b      gemv_task (FP8)    ceil(H*D/BN_QB)                 qr -> q_raw
5 heads     q_heads_task       R * H                           q_raw -> q = RoPE(rms_norm(head))
Without owed output (layer 0: the embedding is the settled residual) stage 0 only computes the
partials and streams_out is streams_in. K2 reads q, the ring and the attention site's post/comb,
after this launch ends (stream order).
Rounding points: the per-op path's (bf16 after each projection, norm and RoPE; fp32 mixes).
Scratch: `Scratch` of the step's width; the ring is the layer's `LayerCache.window`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import attention as A
from . import hc as HC
from .gemv import gemv_task, row_block, weight_operand
from .sync import finish_launch, grid_barrier, launch_epoch, stamp

STAGES = ["k1 fold", "k1 settle", "k1 wq_a|wkv", "k1 q/kv norm, rope, kv write", "k1 wq_b", "k1 q heads"]
BARRIERS = tl.constexpr(len(STAGES) - 1)


@triton.jit
def _k1(sync_ptr, max_polls, timeline_ptr, R, positions_ptr, slots_ptr,
        res_ptr, owed_ptr, owed_post_ptr, owed_comb_ptr, streams_ptr, part_ptr,
        fn_ptr, base_ptr, scale_ptr, attn_norm_ptr, post_ptr, comb_ptr, x_ptr,
        wqa_ptr, wqa_s_ptr, wkv_ptr, wkv_s_ptr, qr_raw_ptr, kv_raw_ptr,
        q_norm_ptr, kv_norm_ptr, qr_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, freqs_ptr,
        wqb_ptr, wqb_s_ptr, q_raw_ptr, q_ptr,
        d, q_lora, heads, hc_eps, norm_eps, sinkhorn_iters,
        HC_: tl.constexpr, MIXP: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
        BD: tl.constexpr, HAS_OWED: tl.constexpr, SB: tl.constexpr, BN_QA: tl.constexpr, BN_KV: tl.constexpr,
        BN_QB: tl.constexpr, BK_D: tl.constexpr, BK_Q: tl.constexpr, BR: tl.constexpr, D: tl.constexpr,
        RD: tl.constexpr, BQ: tl.constexpr,
        FAST: tl.constexpr, TIMELINE: tl.constexpr, GNS: tl.constexpr, GTMA: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = launch_epoch(sync_ptr)
    stamp(timeline_ptr, 0, TIMELINE)

    for t in range(pid, tl.cdiv(R, RB) * tl.cdiv(d, CHUNK), grid):
        HC.fold_task(t, R, d, res_ptr, owed_ptr, d, owed_post_ptr, owed_comb_ptr, streams_ptr, fn_ptr, part_ptr,
                     HC_, MIXP, RB, CHUNK, HAS_OWED)
    grid_barrier(sync_ptr, epoch, 0, BARRIERS, max_polls, timeline_ptr, TIMELINE)

    for t in range(pid, R, grid):
        HC.settle_task(t, d, streams_ptr, part_ptr, base_ptr, scale_ptr, attn_norm_ptr, post_ptr, comb_ptr, x_ptr,
                       hc_eps, norm_eps, sinkhorn_iters, HC_, CHUNK, CB, BD)
    grid_barrier(sync_ptr, epoch, 1, BARRIERS, max_polls, timeline_ptr, TIMELINE)

    q_tasks = tl.cdiv(q_lora, BN_QA)
    for t in range(pid, q_tasks + tl.cdiv(D, BN_KV), grid):
        if t < q_tasks:
            gemv_task(t, x_ptr, d, R, wqa_ptr, wqa_s_ptr, qr_raw_ptr, q_lora, q_lora, d, 0,
                      0, SB, BN_QA, BK_D, BR, True, FAST, GNS, GTMA)
        else:
            gemv_task(t - q_tasks, x_ptr, d, R, wkv_ptr, wkv_s_ptr, kv_raw_ptr, D, D, d, 0,
                      0, SB, BN_KV, BK_D, BR, True, FAST, GNS, GTMA)
    grid_barrier(sync_ptr, epoch, 2, BARRIERS, max_polls, timeline_ptr, TIMELINE)

    for t in range(pid, 2 * R, grid):
        A.norm_rope_kv_task(t, qr_raw_ptr, q_lora, q_norm_ptr, qr_ptr, kv_raw_ptr, D, kv_norm_ptr,
                            positions_ptr, slots_ptr, freqs_ptr, ring_kv_ptr, ring_pos_ptr, ring_size,
                            q_lora, D, RD, norm_eps, BQ, D)
    grid_barrier(sync_ptr, epoch, 3, BARRIERS, max_polls, timeline_ptr, TIMELINE)

    for t in range(pid, tl.cdiv(heads * D, BN_QB), grid):
        gemv_task(t, qr_ptr, q_lora, R, wqb_ptr, wqb_s_ptr, q_raw_ptr, heads * D, heads * D, q_lora, 0,
                  0, SB, BN_QB, BK_Q, BR, True, FAST, GNS, GTMA)
    grid_barrier(sync_ptr, epoch, 4, BARRIERS, max_polls, timeline_ptr, TIMELINE)

    for t in range(pid, R * heads, grid):
        A.q_heads_task(t, q_raw_ptr, heads * D, q_ptr, positions_ptr, freqs_ptr, heads, D, RD, norm_eps, D)
    stamp(timeline_ptr, 2 * BARRIERS + 1, TIMELINE)
    finish_launch(sync_ptr, epoch)


def launch(runner, s, lw, cache, cur: int, owed: bool) -> int:
    """K1 of one layer on scratch `s`; returns the index of s.streams holding the settled residual."""
    c = runner.config
    res = s.streams[cur]
    streams = s.streams[1 - cur] if owed else res
    ring = cache.window
    sb = c.fp8_block[0]
    d, q_lora, heads, hd = c.hidden_size, c.q_lora_rank, c.num_attention_heads, c.head_dim
    bn_qa, bk_d = runner.gemv_blocks(q_lora, d)
    bn_kv, _ = runner.gemv_blocks(hd, d)
    bn_qb, bk_q = runner.gemv_blocks(heads * hd, q_lora)
    tma = bool(runner.shape.gemv_tma)
    runner.launch(_k1, "K1",
        runner.sync["k1"].words, runner.max_polls, runner.timeline_buffer("k1"), s.rows, s.positions, s.slots,
        res, s.y, s.post_ffn, s.comb_ffn, streams, s.partials,
        *lw.hc_attn, lw.attn_norm, s.post_attn, s.comb_attn, s.x,
        weight_operand(lw.wq_a.codes, tma, bn_qa, bk_d), lw.wq_a.scales, weight_operand(lw.wkv.codes, tma, bn_kv, bk_d),
        lw.wkv.scales, s.qr_raw, s.kv_raw,
        lw.q_norm, lw.kv_norm, s.qr, ring.data["kv"], ring.pos, ring.size, lw.rope_freqs,
        weight_operand(lw.wq_b.codes, tma, bn_qb, bk_q), lw.wq_b.scales, s.q_raw, s.q,
        c.hidden_size, c.q_lora_rank, c.num_attention_heads, c.hc_eps, c.rms_norm_eps, c.hc_sinkhorn_iters,
        HC_=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=HC.RB, CHUNK=HC.CHUNK, CB=HC.CB, BD=min(HC.BD, c.hidden_size),
        HAS_OWED=owed, SB=sb, BN_QA=bn_qa, BN_KV=bn_kv, BN_QB=bn_qb, BK_D=bk_d, BK_Q=bk_q, BR=row_block(s.rows),
        D=c.head_dim, RD=c.qk_rope_head_dim, BQ=triton.next_power_of_2(c.q_lora_rank),
        FAST=runner.fast, TIMELINE=runner.timeline, GNS=runner.shape.gemv_stages, GTMA=tma,
    )
    return 1 - cur if owed else cur
