"""K2: the attention back, the FFN seam and the MoE of a layer, one persistent launch.

Grid and task placement as K1 (k1.py): one co-resident program per SM (grid (1,) under the
interpreter), program p takes tasks p, p + grid, ... of each stage, a grid barrier between stages.

Stages (R rows, P = R * k picks; task counts)                    reads -> writes
0 attend    attention.attend_task  R * ceil(H/HB)     q, the KV ring, sinks -> o (inverse RoPE;
                                                      zero for pad rows)
1 wo_a      gemv_task, grouped     ceil(G*o_lora/BN_OA) o -> z
2 wo_b      gemv_task              ceil(d/BN_OB)      z -> attn_out
3 fold      hc.fold_task           as in K1           residual, attn_out, the attention site's
                                                      post/comb (K1) -> streams, partials (hc_ffn_fn)
4 settle    hc.settle_task         R                  -> post/comb of the FFN site (owed to the next
                                                      layer), x = ffn_norm(collapse)
5 gate|w1|w3 gemv_task             ceil(E/BN_G) + 2 ceil(I/BN_SH)  x -> logits (fp32), shared gate/up
6 route|swiglu route_task, shared_swiglu_task   R + R*ceil(I/SWB)   -> ids, weights; shared h
7 group|w2  group_task, gemv_task  1 + ceil(d/BN_S2)  ids -> order/experts/counts; h -> shared_out
8 up        experts.up_task        P * (I/BNE) * 2    x -> gate/up of each pick
9 swiglu    experts.swiglu_task    P * (I/SWB)        -> h of each pick (routing weight applied)
10 down     experts.down_task      P * (d/BNE)        -> per-pick outputs
11 combine  combine_task           R * ceil(d/CBL)    per-pick outputs (top-k order) + shared -> y
The `ffn` variant (ATTENTION False, for layers whose attention ran per-op) starts at stage 3 with
nothing to fold: the streams it reads are already settled. y, post and comb of the FFN site are
owed to the next layer's K1 (or the runner's final fold). Pad rows (slot < 0) route to no expert
(ids -1), so their y holds the shared expert's output only; nothing reads a pad row's result.
Waits: a grid barrier after every stage but the last (11; 8 in the `ffn` variant), so a stage
reads only what finished stages wrote; an expired wait names the stage it waited on (STAGES,
FFN_STAGES). Rounding points: those of each stage module (bf16 where the per-op path rounds;
fp32 mixes, router scores and accumulations; each pick's expert output rounded to bf16).
Scratch: `Scratch` of the step's width; the KV ring is the layer's `LayerCache.window`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import attention as A
from . import experts as X
from . import hc as HC
from . import router as RT
from .gemv import gemv_task, row_block, weight_operand
from .plan import MAX_ROWS
from .sync import finish_launch, grid_barrier, launch_epoch, stamp

_FFN_PARTS = ["fold", "settle", "gate|shared w1|w3", "route|shared swiglu", "group|shared w2", "expert up",
              "expert swiglu", "expert down", "combine"]
STAGES = ["k2 attend", "k2 wo_a", "k2 wo_b"] + [f"k2 {name}" for name in _FFN_PARTS]
FFN_STAGES = [f"ffn {name}" for name in _FFN_PARTS]
SWB = 1024  # intermediate columns of a SwiGLU task
CBL = 1024  # hidden columns of a combine task


@triton.jit
def _ffn_stages(sync_ptr, epoch, max_polls, timeline_ptr, b0, NB: tl.constexpr, pid, grid, R,
                tokens_ptr, slots_ptr, res_ptr, attn_out_ptr, attn_post_ptr, attn_comb_ptr, streams_ptr, part_ptr,
                fn_ptr, base_ptr, scale_ptr, ffn_norm_ptr, post_ptr, comb_ptr, x_ptr,
                gate_ptr, bias_ptr, tid2eid_ptr, logits_ptr, ids_ptr, rw_ptr, order_ptr, experts_ptr, counts_ptr,
                sw1_ptr, sw1_s, sw2_ptr, sw2_s, sw3_ptr, sw3_s, sgate_ptr, sup_ptr, sh_ptr, sout_ptr,
                w1_codes, w1_scales, w2_codes, w2_scales, w3_codes, w3_scales, gu_ptr, h_ptr, per_pick_ptr, y_ptr,
                d, E, I, TOPK, hc_eps, norm_eps, sinkhorn_iters, route_scale, limit,
                HC_: tl.constexpr, MIXP: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
                BD: tl.constexpr, FOLD: tl.constexpr, SB: tl.constexpr, BN_G: tl.constexpr, BN_SH: tl.constexpr,
                BN_S2: tl.constexpr, BK_D: tl.constexpr,
                BK_I: tl.constexpr, BR: tl.constexpr, HASH: tl.constexpr, SHARED: tl.constexpr,
                BE: tl.constexpr, BTOPK: tl.constexpr, BP: tl.constexpr, ROWS_E: tl.constexpr, BNE: tl.constexpr,
                BKE_D: tl.constexpr, BKE_I: tl.constexpr,
                SWB_: tl.constexpr, CBL_: tl.constexpr, FAST: tl.constexpr, FAST_EXPERTS: tl.constexpr,
                TIMELINE: tl.constexpr, GNS: tl.constexpr, ENS: tl.constexpr,
                ETMA: tl.constexpr, EFRAG: tl.constexpr, GTMA: tl.constexpr, EDIAG: tl.constexpr):
    """Stages 3..11 (the FFN part); barriers b0, b0 + 1, ... of NB in this launch."""
    for t in range(pid, tl.cdiv(R, RB) * tl.cdiv(d, CHUNK), grid):
        HC.fold_task(t, R, d, res_ptr, attn_out_ptr, d, attn_post_ptr, attn_comb_ptr, streams_ptr, fn_ptr, part_ptr,
                     HC_, MIXP, RB, CHUNK, FOLD)
    grid_barrier(sync_ptr, epoch, b0, NB, max_polls, timeline_ptr, TIMELINE)

    for t in range(pid, R, grid):
        HC.settle_task(t, d, streams_ptr, part_ptr, base_ptr, scale_ptr, ffn_norm_ptr, post_ptr, comb_ptr, x_ptr,
                       hc_eps, norm_eps, sinkhorn_iters, HC_, CHUNK, CB, BD)
    grid_barrier(sync_ptr, epoch, b0 + 1, NB, max_polls, timeline_ptr, TIMELINE)

    e_tasks = tl.cdiv(E, BN_G)
    i_tasks = tl.cdiv(I, BN_SH)
    n5 = e_tasks
    if SHARED:
        n5 += 2 * i_tasks
    for t in range(pid, n5, grid):
        if t < e_tasks:
            gemv_task(t, x_ptr, d, R, gate_ptr, gate_ptr, logits_ptr, E, E, d, 0,
                      1, SB, BN_G, BK_D, BR, False, FAST, GNS, GTMA)
        elif t < e_tasks + i_tasks:
            gemv_task(t - e_tasks, x_ptr, d, R, sw1_ptr, sw1_s, sgate_ptr, I, I, d, 0,
                      0, SB, BN_SH, BK_D, BR, True, FAST, GNS, GTMA)
        else:
            gemv_task(t - e_tasks - i_tasks, x_ptr, d, R, sw3_ptr, sw3_s, sup_ptr, I, I, d, 0,
                      0, SB, BN_SH, BK_D, BR, True, FAST, GNS, GTMA)
    grid_barrier(sync_ptr, epoch, b0 + 2, NB, max_polls, timeline_ptr, TIMELINE)

    n6 = R
    if SHARED:
        n6 += R * tl.cdiv(I, SWB_)
    for t in range(pid, n6, grid):
        if t < R:
            RT.route_task(t, logits_ptr, E, slots_ptr, bias_ptr, tokens_ptr, tid2eid_ptr, ids_ptr, rw_ptr,
                          E, TOPK, route_scale, BE, BTOPK, HASH, FAST)
        else:
            RT.shared_swiglu_task(t - R, sgate_ptr, sup_ptr, I, sh_ptr, I, limit, SWB_, FAST)
    grid_barrier(sync_ptr, epoch, b0 + 3, NB, max_polls, timeline_ptr, TIMELINE)

    n7 = 1
    if SHARED:
        n7 += tl.cdiv(d, BN_S2)
    for t in range(pid, n7, grid):
        if t == 0:
            RT.group_task(ids_ptr, order_ptr, experts_ptr, counts_ptr, R * TOPK, BP, ROWS_E)
        else:
            gemv_task(t - 1, sh_ptr, I, R, sw2_ptr, sw2_s, sout_ptr, d, d, I, 0,
                      0, SB, BN_S2, BK_I, BR, True, FAST, GNS, GTMA)
    grid_barrier(sync_ptr, epoch, b0 + 4, NB, max_polls, timeline_ptr, TIMELINE)

    P = R * TOPK
    X.up_stage(pid, grid, P, x_ptr, gu_ptr, counts_ptr, order_ptr, experts_ptr, w1_codes, w1_scales, w3_codes,
               w3_scales, d, I, TOPK, BNE, BKE_D, ROWS_E, FAST_EXPERTS, ENS, ETMA, EFRAG, EDIAG)
    grid_barrier(sync_ptr, epoch, b0 + 5, NB, max_polls, timeline_ptr, TIMELINE)

    sw_blocks = tl.cdiv(I, SWB_)
    for t in range(pid, P * sw_blocks, grid):
        X.swiglu_task(t // sw_blocks, t % sw_blocks, gu_ptr, rw_ptr, h_ptr, I, limit, SWB_, FAST_EXPERTS)
    grid_barrier(sync_ptr, epoch, b0 + 6, NB, max_polls, timeline_ptr, TIMELINE)

    X.down_stage(pid, grid, P, h_ptr, per_pick_ptr, counts_ptr, order_ptr, experts_ptr, w2_codes, w2_scales, d, I,
                 BNE, BKE_I, ROWS_E, FAST_EXPERTS, ENS, ETMA, EFRAG, EDIAG)
    grid_barrier(sync_ptr, epoch, b0 + 7, NB, max_polls, timeline_ptr, TIMELINE)

    c_blocks = tl.cdiv(d, CBL_)
    for t in range(pid, R * c_blocks, grid):
        RT.combine_task(t, per_pick_ptr, ids_ptr, sout_ptr, y_ptr, d, TOPK, CBL_, SHARED, FAST)


@triton.jit
def _k2(sync_ptr, max_polls, timeline_ptr, R, tokens_ptr, positions_ptr, slots_ptr,
        q_ptr, o_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr, freqs_ptr, window, attn_scale,
        woa_ptr, woa_s, z_ptr, wob_ptr, wob_s,
        res_ptr, attn_out_ptr, attn_post_ptr, attn_comb_ptr, streams_ptr, part_ptr,
        fn_ptr, base_ptr, scale_ptr, ffn_norm_ptr, post_ptr, comb_ptr, x_ptr,
        gate_ptr, bias_ptr, tid2eid_ptr, logits_ptr, ids_ptr, rw_ptr, order_ptr, experts_ptr, counts_ptr,
        sw1_ptr, sw1_s, sw2_ptr, sw2_s, sw3_ptr, sw3_s, sgate_ptr, sup_ptr, sh_ptr, sout_ptr,
        w1_codes, w1_scales, w2_codes, w2_scales, w3_codes, w3_scales, gu_ptr, h_ptr, per_pick_ptr, y_ptr,
        d, heads, o_groups, o_lora, E, I, TOPK, hc_eps, norm_eps, sinkhorn_iters, route_scale, limit,
        ATTENTION: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, HB: tl.constexpr, KW: tl.constexpr,
        BDA: tl.constexpr,
        HC_: tl.constexpr, MIXP: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
        BD: tl.constexpr, SB: tl.constexpr, BN_OA: tl.constexpr, BN_OB: tl.constexpr, BN_G: tl.constexpr,
        BN_SH: tl.constexpr, BN_S2: tl.constexpr, BK_D: tl.constexpr, BK_I: tl.constexpr,
        BK_O: tl.constexpr, BK_Z: tl.constexpr, BR: tl.constexpr, HASH: tl.constexpr, SHARED: tl.constexpr,
        BE: tl.constexpr, BTOPK: tl.constexpr, BP: tl.constexpr, ROWS_E: tl.constexpr, BNE: tl.constexpr,
        BKE_D: tl.constexpr, BKE_I: tl.constexpr,
        SWB_: tl.constexpr, CBL_: tl.constexpr, FAST: tl.constexpr, FAST_EXPERTS: tl.constexpr,
        TIMELINE: tl.constexpr, GNS: tl.constexpr, ENS: tl.constexpr,
        ETMA: tl.constexpr, EFRAG: tl.constexpr, GTMA: tl.constexpr, EDIAG: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = launch_epoch(sync_ptr)
    stamp(timeline_ptr, 0, TIMELINE)
    NB: tl.constexpr = 11 if ATTENTION else 8
    b0 = 0
    if ATTENTION:
        for t in range(pid, R * tl.cdiv(heads, HB), grid):
            A.attend_task(t, q_ptr, o_ptr, positions_ptr, slots_ptr, ring_kv_ptr, ring_pos_ptr, ring_size, sink_ptr,
                          freqs_ptr, heads, D, RD, window, attn_scale, HB, KW, BDA, FAST)
        grid_barrier(sync_ptr, epoch, 0, NB, max_polls, timeline_ptr, TIMELINE)
        z_width = o_groups * o_lora
        for t in range(pid, tl.cdiv(z_width, BN_OA), grid):
            gemv_task(t, o_ptr, heads * D, R, woa_ptr, woa_s, z_ptr, z_width, z_width, heads * D // o_groups, o_lora,
                      0, SB, BN_OA, BK_O, BR, True, FAST, GNS, GTMA)
        grid_barrier(sync_ptr, epoch, 1, NB, max_polls, timeline_ptr, TIMELINE)
        for t in range(pid, tl.cdiv(d, BN_OB), grid):
            gemv_task(t, z_ptr, z_width, R, wob_ptr, wob_s, attn_out_ptr, d, d, z_width, 0,
                      0, SB, BN_OB, BK_Z, BR, True, FAST, GNS, GTMA)
        grid_barrier(sync_ptr, epoch, 2, NB, max_polls, timeline_ptr, TIMELINE)
        b0 = 3
    _ffn_stages(sync_ptr, epoch, max_polls, timeline_ptr, b0, NB, pid, grid, R,
                tokens_ptr, slots_ptr, res_ptr, attn_out_ptr, attn_post_ptr, attn_comb_ptr, streams_ptr, part_ptr,
                fn_ptr, base_ptr, scale_ptr, ffn_norm_ptr, post_ptr, comb_ptr, x_ptr,
                gate_ptr, bias_ptr, tid2eid_ptr, logits_ptr, ids_ptr, rw_ptr, order_ptr, experts_ptr, counts_ptr,
                sw1_ptr, sw1_s, sw2_ptr, sw2_s, sw3_ptr, sw3_s, sgate_ptr, sup_ptr, sh_ptr, sout_ptr,
                w1_codes, w1_scales, w2_codes, w2_scales, w3_codes, w3_scales, gu_ptr, h_ptr, per_pick_ptr, y_ptr,
                d, E, I, TOPK, hc_eps, norm_eps, sinkhorn_iters, route_scale, limit,
                HC_, MIXP, RB, CHUNK, CB, BD, ATTENTION, SB, BN_G, BN_SH, BN_S2, BK_D, BK_I, BR, HASH, SHARED,
                BE, BTOPK, BP, ROWS_E, BNE, BKE_D, BKE_I, SWB_, CBL_, FAST, FAST_EXPERTS, TIMELINE, GNS, ENS, ETMA,
                EFRAG, GTMA, EDIAG)
    stamp(timeline_ptr, 2 * NB + 1, TIMELINE)
    finish_launch(sync_ptr, epoch)


def launch(runner, s, lw, cache, cur: int, attention: bool) -> int:
    """K2 (`attention`) or its `ffn` variant of one layer on scratch `s`, the settled residual in
    s.streams[cur]; returns the index of s.streams holding the residual the owed output folds into."""
    c = runner.config
    res = s.streams[cur]
    streams = s.streams[1 - cur] if attention else res
    sb = c.fp8_block[0]
    shape = runner.shape
    inter, d, hd = c.moe_intermediate_size, c.hidden_size, c.head_dim
    z_width, o_in = c.o_groups * c.o_lora_rank, c.num_attention_heads * hd // c.o_groups
    bn_oa, bk_o = runner.gemv_blocks(z_width, o_in, group_rows=c.o_lora_rank)
    bn_ob, bk_z = runner.gemv_blocks(d, z_width)
    bn_g, bk_d = runner.gemv_blocks(c.n_routed_experts, d, fp8=False)
    bn_sh, _ = runner.gemv_blocks(inter, d)
    bn_s2, bk_i = runner.gemv_blocks(d, inter)
    tma = bool(shape.gemv_tma)
    sw1, sw2, sw3 = lw.shared if lw.shared is not None else (lw.wq_a,) * 3  # unread (SHARED False): any FP8 matrix
    shared = (weight_operand(sw1.codes, tma, bn_sh, bk_d), sw1.scales, weight_operand(sw2.codes, tma, bn_s2, bk_i),
              sw2.scales, weight_operand(sw3.codes, tma, bn_sh, bk_d), sw3.scales)
    if attention:
        ring = cache.window
        attn = (s.q, s.o, ring.data["kv"], ring.pos, ring.size, lw.attn_sink, lw.rope_freqs, c.sliding_window,
                hd ** -0.5, weight_operand(lw.wo_a.codes, tma, bn_oa, bk_o), lw.wo_a.scales, s.z,
                weight_operand(lw.wo_b.codes, tma, bn_ob, bk_z), lw.wo_b.scales)
    else:  # unread: the attention stages are compiled out
        attn = (s.q, s.o, s.q, s.slots, 1, s.logits, s.logits, 1, 1.0, s.q, s.q, s.z, s.q, s.q)
    routing = lw.tid2eid if lw.tid2eid is not None else lw.route_bias
    ex = lw.experts
    bne, bke_d, bke_i = min(shape.expert_block_n, inter, d), min(shape.expert_block_k, d), min(shape.expert_block_k, inter)
    w1, w3 = (X.codes_operand(m, ex.fragments, bool(shape.expert_tma), bne, bke_d) for m in (ex.w1, ex.w3))
    w2 = X.codes_operand(ex.w2, ex.fragments, bool(shape.expert_tma), bne, bke_i)
    kind = "k2" if attention else "ffn"
    runner.launch(_k2, "K2" if attention else "K2 (ffn)",
        runner.sync[kind].words, runner.max_polls, runner.timeline_buffer(kind), s.rows, s.tokens, s.positions, s.slots,
        *attn,
        res, s.attn_out, s.post_attn, s.comb_attn, streams, s.partials,
        *lw.hc_ffn, lw.ffn_norm, s.post_ffn, s.comb_ffn, s.x,
        weight_operand(lw.gate, tma, bn_g, bk_d), routing, routing, s.logits, s.ids, s.route_weights, s.order,
        s.experts, s.counts, *shared,
        s.shared_gate, s.shared_up, s.shared_h, s.shared_out,
        *w1, *w2, *w3, s.gate_up, s.h, s.per_pick, s.y,
        d, c.num_attention_heads, c.o_groups, c.o_lora_rank, c.n_routed_experts, inter, c.num_experts_per_tok,
        c.hc_eps, c.rms_norm_eps, c.hc_sinkhorn_iters, c.routed_scaling_factor, c.swiglu_limit,
        ATTENTION=attention, D=hd, RD=c.qk_rope_head_dim, HB=A.HB, KW=A.window_keys(c.sliding_window),
        BDA=A.BD,
        HC_=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=HC.RB, CHUNK=HC.CHUNK, CB=HC.CB, BD=min(HC.BD, d),
        SB=sb, BN_OA=bn_oa, BN_OB=bn_ob, BN_G=bn_g, BN_SH=bn_sh, BN_S2=bn_s2, BK_D=bk_d, BK_I=bk_i, BK_O=bk_o,
        BK_Z=bk_z,
        BR=row_block(s.rows), HASH=lw.tid2eid is not None, SHARED=lw.shared is not None,
        BE=triton.next_power_of_2(c.n_routed_experts), BTOPK=triton.next_power_of_2(c.num_experts_per_tok),
        ROWS_E=X.ROWS, BP=triton.next_power_of_2(MAX_ROWS * c.num_experts_per_tok),  # one build for all widths
        BNE=bne, BKE_D=bke_d, BKE_I=bke_i, SWB_=min(SWB, inter), CBL_=min(CBL, d),
        FAST=runner.fast, FAST_EXPERTS=runner.fast and ex.supports_fast_decode(),
        TIMELINE=runner.timeline, GNS=shape.gemv_stages, ENS=shape.expert_stages,
        ETMA=bool(shape.expert_tma), EFRAG=ex.fragments, GTMA=tma, EDIAG=runner.expert_diagonal,
    )
    return 1 - cur if attention else cur
