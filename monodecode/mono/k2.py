"""K2 and K3: the attention back, the FFN seam and the MoE of a layer, two persistent launches.

Grid and task placement as K1 (k1.py): K2 of `LaunchShape.k2_programs_per_sm` co-resident
programs a SM, K3 of `expert_programs_per_sm` (grid (1,) under the interpreter); program p takes
tasks p, p + grid, ... of each stage, a grid barrier between stages. K2 runs stages 0-6; K3
(`_k3`, the `k3` sync family: its own epoch and barriers) runs stages 7-10 after K2 has ended
(stream order). Why two launches: K2's dense stages and attention hold 255 registers a thread, so
one program of 8 warps fills a SM, while the expert stages fit in 128 (`LaunchShape.expert_registers`):
K3 runs two programs a SM, twice the expert weight loads in flight.

Stages (R rows, P = R * k picks; task counts)                    reads -> writes
K2:
0 attend    attention.attend_task  R * ceil(H/HB)     q_raw (normalised, RoPE), the KV ring, on a
                                   * (SPLITS x        compressed layer (RATIO > 0) its visible
                                   SPLIT_PARTS        entries (HCA) or those K1 selected (CSA,
                                   + PARTS)           TOPK > 0; logits parked in `park`; SPLITS
                                                      entry splits a pair, each over SPLIT_PARTS
                                                      tasks, their partials combined by the
                                                      pair's window tasks), sinks
                                                      -> o (inverse RoPE; zero for pad rows); a
                                                      pair's output chunks over PARTS window
                                                      tasks, each with the whole softmax
1 wo_a      gemv_stage, grouped    ceil(G*o_lora/BN_OA) * SPLIT_O   o -> z
2 wo_b      gemv_stage             ceil(d/BN_OB) * SPLIT_Z  z -> attn_out
3 fold      hc.fold_task           as in K1           residual, attn_out, the attention site's
                                                      post/comb (K1) -> streams, partials (hc_ffn_fn)
4 settle    hc.settle_task         2R                 -> post/comb of the FFN site (owed to the next
                                                      layer), x = ffn_norm(collapse)
5 gate|w1|w3 gemv_stage            ceil(E/BN_G) * SPLIT_G       x -> logits (fp32), shared gate/up
                                   + ceil(2I/BN_SH) * SPLIT_D   (w1 and w3 stacked: one GEMV)
6 route, group route_task (the last  R                  -> ids, weights; order/experts/counts
  | w2        to arrive groups),    + ceil(d/BN_S2) * SPLIT_I   shared gate/up -> shared_out (the
            gemv_stage (SWIGLU)                                 SwiGLU taken as w2 loads its x)
K3:
7 up       experts.up_task        P * (I/BNE) * 2    x -> gate/up of each pick
8 swiglu   experts.swiglu_task    P * (I/SWB)        -> h of each pick (routing weight applied)
9 down     experts.down_task      P * (d/BNE)        -> per-pick outputs
10 combine combine_task           R * ceil(d/CBL)    per-pick outputs (top-k order) + shared -> y
y, post and comb of the FFN site are owed to the next layer's K1 (or the runner's final fold).
Pad rows (slot < 0) route to no expert (ids -1), so their y holds the shared expert's output only;
nothing reads a pad row's result.
Tensor parallelism (runner.tp, WORLD ranks; docs/ARCHITECTURE.md): a rank's heads, o groups and
shared-expert slice (the runner's `RankSizes`), its own routed experts (ids local to them, -1
for another rank's: `router.route_task`). `attn_out` (this rank's o groups) and K3's `y` (this
rank's experts and shared slice) are partial sums, summed over the ranks inside the launches by
a stage more in each (peers.py: "attention sum over ranks" after wo_b, "output sum over ranks"
after the combine, each after a grid barrier; the ranks' waits on each other bounded as any).
Waits: a grid barrier after every stage of a launch but its last (K2 6, K3 3; one more each
under tensor parallelism), so a stage reads only what finished stages wrote; an expired wait
names the stage it waited on (`stage_names`). Inside stage 6 the route tasks count their arrivals at a ticket (the step's
`Scratch.route_ticket`, 0 between launches), and the last one groups the picks: it waits on
nothing, it only finds out that it is last. Inside stage 0 a compressed layer's window tasks
wait (bounded, naming attend) at their pair's ticket (`Scratch.attend_tickets`, 0 between
launches) for the SPLITS entry splits numbered before them, which wait on nothing; the last of
a pair's PARTS window tasks to finish takes the ticket back down (`attend_entries.release_splits`).
Rounding points: those of each stage module (bf16 where the per-op path rounds; fp32 mixes,
router scores and accumulations; each pick's expert output rounded to bf16).
Scratch: the runner's peer memory under tensor parallelism (`FfnArgs.attn_sums`, `out_sums`);
`Scratch` of the step's width (on a compressed layer also its attend park,
`Scratch.park`, its entry splits' partials and tickets, and on a CSA layer K1's selection); the KV
ring is the layer's
`LayerCache.window` (a compressed layer's entries `LayerCache.entries`, read);
the split GEMVs' slice sums and tickets (the runner's: `dense_stages` sizes them); the route
ticket.
Arguments, by name: `K2Attention`, `FfnArgs` and `K2Meta`; K3 the same `FfnArgs` with its own
sync, and `K3Meta`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import attend_entries as AE
from . import attention as A
from . import experts as X
from . import hc as HC
from . import router as RT
from .gemv import gemv_stage, split_sums_of, split_tickets_of
from .gemv_tiles import row_block
from .peers import PeerMemory, PeerSite, peer_sum_stage
from .sync import SyncArgs, barrier, begin_launch, end_launch
from .weights import Fp8Matrix

_FRONT_PARTS = ["fold", "settle", "gate|shared w1|w3", "route, group|shared w2"]
_EXPERT_PARTS = ["expert up", "expert swiglu", "expert down", "combine"]
_ATTENTION_PARTS = ["attend", "wo_a", "wo_b"]


def stage_names(family: str, ranks: int = 1) -> list[str]:
    """The stages of a launch of `family` ("k2", "k3") over `ranks` tensor-parallel ranks."""
    if family == "k3":
        return [f"k3 {name}" for name in _EXPERT_PARTS + ["output sum over ranks"] * (ranks > 1)]
    return [f"k2 {name}" for name in _ATTENTION_PARTS + ["attention sum over ranks"] * (ranks > 1) + _FRONT_PARTS]


class PeerSites(NamedTuple):
    """Where K2 sums the attention output and K3 the FFN output over tensor-parallel ranks (None
    at one rank)."""

    attention: PeerSite | None
    output: PeerSite | None


def peer_sites(tp, device, d: int) -> PeerSites:
    """The runner's sites, in peer memory every rank allocates now (a collective) if tp.size > 1."""
    if tp.size == 1:
        return PeerSites(None, None)
    memory = PeerMemory.allocate(tp, device, [d, d])
    return PeerSites(memory.site(0), memory.site(1))


SWB = 1024  # intermediate columns of a SwiGLU task
CBL = 1024  # hidden columns of a combine task


class K2Attention(NamedTuple):
    """What the attention stages (0-2) read and write; they write `FfnArgs.attn_out`."""

    q_raw: torch.Tensor  # [R, H * D] the wq_b GEMV's heads, before their norm and rope
    o: torch.Tensor
    ring_kv: torch.Tensor
    ring_pos: torch.Tensor
    ring_size: int
    sink: torch.Tensor
    freqs: torch.Tensor
    window: int
    scale: float  # head_dim ** -0.5
    norm_eps: float  # the heads' rms_norm
    wo_a: Fp8Matrix
    z: torch.Tensor
    wo_b: Fp8Matrix
    heads: int
    o_groups: int
    o_lora: int
    entries: torch.Tensor  # a compressed layer's entries [S, n_entries, D] (RATIO > 0; else unread)
    n_entries: int
    park: torch.Tensor  # fp32, park_stride a task: each attend task's entry logits (Scratch.park)
    park_stride: int
    selected: torch.Tensor  # a CSA layer's entries a row attends (int64 [R, TOPK], -1: none; K1's top-k)
    partials: torch.Tensor  # the entry splits' outputs and stats for their window tasks (fp32; SPLITS > 0)
    tickets: torch.Tensor  # int32 [2, pairs], 0 between launches: entry splits' signals, window tasks' arrivals


class FfnArgs(NamedTuple):
    """What the FFN stages (3-10) read and write."""

    sync: SyncArgs
    rows: int
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    residual: torch.Tensor  # [R, hc, d] the settled residual before the attention output
    attn_out: torch.Tensor  # the attention output and its site's post / comb mixes (read with FOLD)
    attn_post: torch.Tensor
    attn_comb: torch.Tensor
    streams: torch.Tensor  # [R, hc, d] the residual after the fold (the residual itself without FOLD)
    partials: torch.Tensor
    hc_fn: torch.Tensor
    hc_base: torch.Tensor
    hc_scale: torch.Tensor
    ffn_norm: torch.Tensor
    post: torch.Tensor  # the FFN site's mixes, owed to the next layer
    comb: torch.Tensor
    x: torch.Tensor
    gate: torch.Tensor  # bf16 [E, d]
    route_bias: torch.Tensor | None  # fp32 [E] (bias-routed layers)
    tid2eid: torch.Tensor | None  # int64 [vocab, k] (hash-routed layers)
    logits: torch.Tensor
    ids: torch.Tensor
    route_weights: torch.Tensor
    order: torch.Tensor
    experts: torch.Tensor
    counts: torch.Tensor
    shared: tuple[Fp8Matrix, Fp8Matrix] | None  # w1 and w3 stacked, w2 of the shared expert
    shared_gate_up: torch.Tensor  # [R, 2 I]: w1's outputs (the gate), then w3's (the up)
    shared_out: torch.Tensor
    shared_inter: int  # the shared expert's intermediate this rank holds (I / tensor parallel size)
    first_expert: int  # this rank's routed experts: global ids first_expert .. + held_experts - 1
    held_experts: int
    route_ticket: torch.Tensor  # int32 [1], 0 between launches: route tasks' arrivals (router.group_when_routed)
    w1: tuple[torch.Tensor, torch.Tensor]  # the routed experts: (fragment halves int16, scale codes)
    w2: tuple[torch.Tensor, torch.Tensor]
    w3: tuple[torch.Tensor, torch.Tensor]
    gate_up: torch.Tensor
    h: torch.Tensor
    per_pick: torch.Tensor
    y: torch.Tensor
    sums: torch.Tensor  # the split GEMVs' slice sums and tickets (gemv.py)
    tickets: torch.Tensor
    attn_sums: PeerSite | None  # under tensor parallelism, the sites where attn_out and y are summed
    out_sums: PeerSite | None
    d: int
    n_experts: int  # the router's (all ranks' experts)
    inter: int  # a routed expert's intermediate
    topk: int
    hc_eps: float
    norm_eps: float
    sinkhorn_iters: int
    route_scale: float
    limit: float


class K2Meta(NamedTuple):
    WORLD: int  # tensor-parallel ranks (1: none)
    B: int  # the launch's grid barriers (len(stage_names) - 1)
    D: int  # head_dim
    RD: int  # rope dims of a head
    HB: int  # heads of an attend task
    KW: int  # window keys, padded to a power of two
    BDA: int  # head dims an attend task takes at once
    BLOCK: int  # the DSpark draft's block rows (attention.attend_task), 0 for a causal window
    RATIO: int  # a compressed layer's compression ratio (its entries attended), 0 for a window layer
    TOPK: int  # a CSA layer's entries a row attends (its selection list), 0: every visible one (HCA)
    SPLITS: int  # a compressed layer's entry splits a pair (attend_entries.entry_splits), 0: the window task's own
    PARTS: int  # window tasks a pair, each its share of the output chunks (attention.output_parts)
    SPLIT_PARTS: int  # tasks an entry split, each its share of the split's channels (attention.compressed_layout)
    HC: int
    MIXP: int
    RB: int
    CHUNK: int
    CB: int
    BD: int
    SB: int
    BN_OA: int
    BN_OB: int
    BN_G: int
    BN_SH: int
    BN_S2: int
    BK_G: int  # GEMV K steps of the router gate, then over the hidden size, the intermediate, o and z
    BK_D: int
    BK_I: int
    BK_O: int
    BK_Z: int
    SPLIT_G: int  # GEMV slices of the same
    SPLIT_D: int
    SPLIT_I: int
    SPLIT_O: int
    SPLIT_Z: int
    DENSE_STAGES: int  # K steps a dense stage's pipeline holds in flight (LaunchShape.dense_stages)
    BR: int
    HASH: bool
    SHARED: bool
    BE: int  # experts padded to a power of two
    BTOPK: int
    BP: int  # picks of the row block's widest step, padded
    ROWS_E: int  # rows of an expert task
    FAST: bool
    TIMELINE: bool


class K3Meta(NamedTuple):
    """K3's compile-time constants: nothing that depends on the step's width, so that one build
    serves every width and every kind of layer."""

    WORLD: int  # tensor-parallel ranks (1: none)
    B: int  # the launch's grid barriers (len(stage_names) - 1)
    SHARED: bool
    BNE: int  # expert tiles: outputs, K steps over d and over I
    BKE_D: int
    BKE_I: int
    EDIAG: bool  # tasks of one or two rows take the diagonal loop
    SWB: int
    CBL: int
    FAST: bool
    FAST_EXPERTS: bool  # FAST and the experts' scales fit the fast decode
    TIMELINE: bool


@triton.jit
def _front_stages(f, m, epoch, b0, NB: tl.constexpr, pid, grid):
    """Stages 3..6 (the FFN seam, the router and the shared expert); barriers b0 .. b0 + 2 of NB."""
    R = f.rows
    for t in range(pid, tl.cdiv(R, m.RB) * tl.cdiv(f.d, m.CHUNK), grid):
        HC.fold_task(t, R, f.d, f.residual, f.attn_out, f.d, f.attn_post, f.attn_comb, f.streams, f.hc_fn,
                     f.partials, m.HC, m.MIXP, m.RB, m.CHUNK, True)
    barrier(f.sync, epoch, b0, NB, m.TIMELINE, m.FAST)

    for t in range(pid, 2 * R, grid):  # hc.settle_tasks: a collapse and a mix task a row
        HC.settle_task(t, R, f.d, f.streams, f.partials, f.hc_base, f.hc_scale, f.ffn_norm, f.post, f.comb, f.x,
                       f.hc_eps, f.norm_eps, f.sinkhorn_iters, m.HC, m.CHUNK, m.CB, m.BD)
    barrier(f.sync, epoch, b0 + 1, NB, m.TIMELINE, m.FAST)

    # the router gate (bf16 weights, fp32 logits), then the shared expert's stacked w1 | w3 on the programs after it
    gemv_stage(pid, grid, 0, f.x, f.d, R, f.gate, f.gate, f.logits, f.n_experts, f.n_experts, f.d, 0, f.sums,
               f.tickets, 1, m.SB, m.BN_G, m.BK_G, m.SPLIT_G, m.BR, False, m.FAST, m.DENSE_STAGES)
    if m.SHARED:
        first = tl.cdiv(f.n_experts, m.BN_G) * m.SPLIT_G
        sums = f.sums + split_sums_of(f.n_experts, m.BN_G, m.SPLIT_G, m.BR)
        tickets = f.tickets + split_tickets_of(f.n_experts, m.BN_G, m.SPLIT_G)
        gemv_stage(pid, grid, first, f.x, f.d, R, f.shared[0].codes, f.shared[0].scales, f.shared_gate_up,
                   2 * f.shared_inter, 2 * f.shared_inter, f.d, 0, sums, tickets, 0, m.SB, m.BN_SH, m.BK_D, m.SPLIT_D,
                   m.BR, True, m.FAST, m.DENSE_STAGES)
    barrier(f.sync, epoch, b0 + 2, NB, m.TIMELINE, m.FAST)

    # the router, the last route task grouping the picks; the shared expert's w2 of the SwiGLU of
    # its gate and up on the programs after the route tasks
    for t in range(pid, R, grid):
        RT.route_task(t, f.logits, f.n_experts, f.slots, f.route_bias, f.tokens, f.tid2eid, f.ids, f.route_weights,
                      f.n_experts, f.topk, f.route_scale, f.first_expert, f.held_experts, m.BE, m.BTOPK, m.HASH,
                      m.FAST)
        RT.group_when_routed(f.route_ticket, R, f.ids, f.order, f.experts, f.counts, R * f.topk, m.BP, m.ROWS_E)
    if m.SHARED:
        gemv_stage(pid, grid, R, f.shared_gate_up, 2 * f.shared_inter, R, f.shared[1].codes, f.shared[1].scales,
                   f.shared_out, f.d, f.d, f.shared_inter, 0, f.sums, f.tickets, 0, m.SB, m.BN_S2, m.BK_I, m.SPLIT_I,
                   m.BR, True, m.FAST, m.DENSE_STAGES, f.shared_gate_up + f.shared_inter, f.limit, True)


@triton.jit
def _expert_stages(f, m, epoch, b0, NB: tl.constexpr, pid, grid):
    """Stages 7..10 (the routed experts and the combine; then, under tensor parallelism, y's sum
    over the ranks); barriers b0, b0 + 1, b0 + 2 (and b0 + 3) of NB."""
    R = f.rows
    P = R * f.topk
    X.up_stage(pid, grid, P, f.x, f.gate_up, f.counts, f.order, f.experts, f.w1[0], f.w1[1], f.w3[0], f.w3[1],
               f.d, f.inter, f.topk, m.BNE, m.BKE_D, m.FAST_EXPERTS, m.EDIAG)
    barrier(f.sync, epoch, b0, NB, m.TIMELINE, m.FAST)

    X.swiglu_stage(pid, grid, P, f.gate_up, f.route_weights, f.h, f.inter, f.limit, m.SWB, m.FAST_EXPERTS)
    barrier(f.sync, epoch, b0 + 1, NB, m.TIMELINE, m.FAST)

    X.down_stage(pid, grid, P, f.h, f.per_pick, f.counts, f.order, f.experts, f.w2[0], f.w2[1], f.d, f.inter,
                 m.BNE, m.BKE_I, m.FAST_EXPERTS, m.EDIAG)
    barrier(f.sync, epoch, b0 + 2, NB, m.TIMELINE, m.FAST)

    for t in range(pid, R * tl.cdiv(f.d, m.CBL), grid):
        RT.combine_task(t, f.per_pick, f.ids, f.shared_out, f.y, f.d, f.topk, m.CBL, m.SHARED, m.FAST)
    if m.WORLD > 1:  # y holds this rank's experts and shared slice: sum it over the ranks
        barrier(f.sync, epoch, b0 + 3, NB, m.TIMELINE, m.FAST)
        peer_sum_stage(pid, grid, f.out_sums, f.y, f.y, f.d, R, f.d, f.sync, epoch, b0 + 4, m.WORLD, m.FAST)


@triton.jit
def _k2(a, f, m):
    """Stages 0-6, under tensor parallelism with the attention output's sum over the ranks after
    stage 2; barrier k follows stage k, the launch's last stage has none."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = begin_launch(f.sync, m.TIMELINE)
    _attention_stages(a, f, m, epoch, m.B, pid, grid)
    barrier(f.sync, epoch, 2, m.B, m.TIMELINE, m.FAST)
    if m.WORLD > 1:  # attn_out holds this rank's o groups: sum it over the ranks
        peer_sum_stage(pid, grid, f.attn_sums, f.attn_out, f.attn_out, f.d, f.rows, f.d, f.sync, epoch, 3, m.WORLD,
                       m.FAST)
        barrier(f.sync, epoch, 3, m.B, m.TIMELINE, m.FAST)
    _front_stages(f, m, epoch, m.B - 3, m.B, pid, grid)
    end_launch(f.sync, epoch, m.B, m.TIMELINE)


@triton.jit
def _attention_stages(a, f, m, epoch, NB: tl.constexpr, pid, grid):
    """Stages 0..2 (attend, wo_a, wo_b); barriers 0 and 1 of NB."""
    for t in range(pid, f.rows * tl.cdiv(a.heads, m.HB) * (m.SPLITS * m.SPLIT_PARTS + m.PARTS), grid):
        A.attend_task(t, a.q_raw, a.o, f.positions, f.slots, a.ring_kv, a.ring_pos, a.ring_size, a.sink,
                      a.freqs, a.heads, m.D, m.RD, a.window, a.scale, a.norm_eps, a.entries, a.n_entries, a.park,
                      a.park_stride, a.selected, f.rows, a.partials, a.tickets, f.sync.words, f.sync.max_polls, m.HB,
                      m.KW, m.BDA, m.BLOCK, m.FAST, m.RATIO, AE.KE, m.TOPK, m.SPLITS, m.PARTS, m.SPLIT_PARTS, 0)
    barrier(f.sync, epoch, 0, NB, m.TIMELINE, m.FAST)
    z_width = a.o_groups * a.o_lora
    gemv_stage(pid, grid, 0, a.o, a.heads * m.D, f.rows, a.wo_a.codes, a.wo_a.scales, a.z, z_width, z_width,
               a.heads * m.D // a.o_groups, a.o_lora, f.sums, f.tickets, 0, m.SB, m.BN_OA, m.BK_O, m.SPLIT_O,
               m.BR, True, m.FAST, m.DENSE_STAGES)
    barrier(f.sync, epoch, 1, NB, m.TIMELINE, m.FAST)
    gemv_stage(pid, grid, 0, a.z, z_width, f.rows, a.wo_b.codes, a.wo_b.scales, f.attn_out, f.d, f.d, z_width,
               0, f.sums, f.tickets, 0, m.SB, m.BN_OB, m.BK_Z, m.SPLIT_Z, m.BR, True, m.FAST, m.DENSE_STAGES)


@triton.jit
def _k3(f, m):
    """Stages 7-10 (the routed experts and the combine), after K2."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    epoch = begin_launch(f.sync, m.TIMELINE)
    _expert_stages(f, m, epoch, 0, m.B, pid, grid)
    end_launch(f.sync, epoch, m.B, m.TIMELINE)


def dense_stages(runner, rows: int):
    """K2's dense GEMV stages at `rows` rows, each a list of (N, (BN, BK, SPLIT)): wo_a, wo_b,
    gate | w1 w3 (stacked), w2."""
    c = runner.config
    inter, d = runner.sizes.shared_inter, c.hidden_size
    z_width, o_in = c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups
    oa = runner.gemv_blocks("k2", z_width, o_in, rows, group_rows=c.o_lora_rank)
    ob = runner.gemv_blocks("k2", d, z_width, rows)
    g = runner.gemv_blocks("k2", c.n_routed_experts, d, rows, fp8=False)
    sh = runner.gemv_blocks("k2", 2 * inter, d, rows)
    s2 = runner.gemv_blocks("k2", d, inter, rows)
    return [[(z_width, oa)], [(d, ob)], [(c.n_routed_experts, g), (2 * inter, sh)], [(d, s2)]]


def launch(runner, s, lw, cache, cur: int) -> int:
    """K2 of one layer on scratch `s`, the settled residual in s.streams[cur], then K3; returns
    the index of s.streams holding the residual the owed output folds into."""
    c = runner.config
    residual = s.streams[cur]
    inter, d, hd = c.moe_intermediate_size, c.hidden_size, c.head_dim
    rows = s.rows
    [[(_, (bn_oa, bk_o, split_o))], [(_, (bn_ob, bk_z, split_z))],
     [(_, (bn_g, bk_g, split_g)), (_, (bn_sh, bk_d, split_d))], [(_, (bn_s2, bk_i, split_i))]] = \
        dense_stages(runner, rows)
    shape, ex = runner.shape, lw.experts
    window = c.sliding_window + runner.draft_block  # a draft block's rows see the whole block too
    ring = cache.window
    hb, bda, splits, parts, split_parts = _attend_layout(lw, cache, rows, c.num_attention_heads, hd, c.index_topk,
                                                         runner.grids["k2"], shape)
    entries, n_entries, park, park_stride = _entries(lw, cache, s, c.index_topk, hb,
                                                     A.attend_tasks(rows, c.num_attention_heads, hb, splits, parts,
                                                                    split_parts))
    attn = K2Attention(
        q_raw=s.q_raw, o=s.o, ring_kv=ring.data["kv"], ring_pos=ring.pos, ring_size=ring.size, sink=lw.attn_sink,
        freqs=lw.rope_freqs, window=window, scale=hd ** -0.5, norm_eps=c.rms_norm_eps, wo_a=lw.wo_a, z=s.z,
        wo_b=lw.wo_b, heads=c.num_attention_heads, o_groups=c.o_groups, o_lora=c.o_lora_rank, entries=entries,
        n_entries=n_entries, park=park, park_stride=park_stride, selected=s.selected,
        partials=s.attend_partials(AE.split_partials(rows, c.num_attention_heads, hd, splits, hb)),
        tickets=s.attend_tickets)
    ffn = FfnArgs(
        sync=runner.sync_args("k2"), rows=s.rows, tokens=s.tokens, positions=s.positions, slots=s.slots,
        residual=residual, attn_out=s.attn_out, attn_post=s.post_attn, attn_comb=s.comb_attn,
        streams=s.streams[1 - cur], partials=s.partials,
        hc_fn=lw.hc_ffn[0], hc_base=lw.hc_ffn[1], hc_scale=lw.hc_ffn[2], ffn_norm=lw.ffn_norm,
        post=s.post_ffn, comb=s.comb_ffn, x=s.x, gate=lw.gate, route_bias=lw.route_bias, tid2eid=lw.tid2eid,
        logits=s.logits, ids=s.ids, route_weights=s.route_weights, order=s.order, experts=s.experts,
        counts=s.counts, shared=lw.shared, shared_gate_up=s.shared_gate_up,
        shared_out=s.shared_out, shared_inter=runner.sizes.shared_inter, first_expert=runner.sizes.experts.start,
        held_experts=len(runner.sizes.experts), route_ticket=s.route_ticket, w1=(ex.w1[0].view(torch.int16), ex.w1[1]),
        w2=(ex.w2[0].view(torch.int16), ex.w2[1]), w3=(ex.w3[0].view(torch.int16), ex.w3[1]), gate_up=s.gate_up,
        h=s.h, per_pick=s.per_pick, y=s.y,
        sums=runner.split_sums, tickets=runner.split_tickets, attn_sums=runner.peer_sites.attention,
        out_sums=runner.peer_sites.output, d=d, n_experts=c.n_routed_experts, inter=inter, topk=c.num_experts_per_tok, hc_eps=c.hc_eps,
        norm_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters, route_scale=c.routed_scaling_factor,
        limit=c.swiglu_limit)
    rb, chunk, cb, bd = HC.seam_blocks(shape.k2_warps, d, s.rows, runner.grids["k2"], shape.fold_rows,
                                       shape.settle_columns)
    meta = K2Meta(
        WORLD=runner.tp.size, B=len(stage_names("k2", runner.tp.size)) - 1, D=hd, RD=c.qk_rope_head_dim, HB=hb,
        KW=A.window_keys(window), BDA=bda,
        BLOCK=runner.draft_block, RATIO=lw.compressor.ratio if lw.compressor else 0,
        TOPK=c.index_topk if lw.indexer else 0, SPLITS=splits, PARTS=parts, SPLIT_PARTS=split_parts,
        HC=c.hc_mult, MIXP=HC.mix_pad(c.hc_mult), RB=rb, CHUNK=chunk, CB=cb, BD=bd,
        SB=c.fp8_block[0], BN_OA=bn_oa, BN_OB=bn_ob, BN_G=bn_g, BN_SH=bn_sh, BN_S2=bn_s2, BK_G=bk_g, BK_D=bk_d,
        BK_I=bk_i, BK_O=bk_o, BK_Z=bk_z, SPLIT_G=split_g, SPLIT_D=split_d, SPLIT_I=split_i, SPLIT_O=split_o,
        SPLIT_Z=split_z, DENSE_STAGES=shape.dense_stages,
        BR=row_block(s.rows), HASH=lw.tid2eid is not None, SHARED=lw.shared is not None,
        BE=triton.next_power_of_2(c.n_routed_experts), BTOPK=triton.next_power_of_2(c.num_experts_per_tok),
        BP=max(16, triton.next_power_of_2(row_block(rows) * c.num_experts_per_tok)),  # a build serves a row block
        ROWS_E=X.ROWS, FAST=runner.fast,
        TIMELINE=runner.timeline)
    runner.launch(_k2, "K2", "k2", attn, ffn, meta=meta)
    # K3 reads neither routing table: without them one build serves hash- and bias-routed layers
    k3_args = ffn._replace(sync=runner.sync_args("k3"), route_bias=None, tid2eid=None)
    runner.launch(_k3, "K3", "k3", k3_args, meta=K3Meta(
        WORLD=runner.tp.size, B=len(stage_names("k3", runner.tp.size)) - 1, SHARED=meta.SHARED, BNE=min(shape.expert_block_n, inter, d), BKE_D=min(shape.expert_block_k, d),
        BKE_I=min(shape.expert_block_k, inter), EDIAG=X.takes_diagonal(shape.expert_block_k, d, inter),
        SWB=min(SWB, inter), CBL=min(CBL, d), FAST=runner.fast, FAST_EXPERTS=runner.fast and ex.supports_fast_decode(),
        TIMELINE=runner.timeline))
    return 1 - cur


def _attend_layout(lw, cache, rows: int, heads: int, hd: int, topk: int, programs: int,
                   shape) -> tuple[int, int, int, int, int]:
    """Attend's (heads a task, channels a chunk, entry splits, output parts, split parts) a pair on
    this layer: the tile `attention.attend_tile` (the launch shape's `attend_heads`, `attend_chunk`
    or the automatic ones), splits and parts the launch shape's (`attend_splits`, `attend_parts`,
    no more parts than the chunks a head has) or, at 0, as many as fill the programs: a window
    layer's parts `attention.output_parts`, a compressed layer's all three
    `attention.compressed_layout` (split parts 1 where the shape fixes the splits)."""
    hb, bd = A.attend_tile(rows, heads, hd, programs, selecting=lw.indexer is not None,
                           compressed=lw.compressor is not None, task_heads=shape.attend_heads,
                           chunk=shape.attend_chunk)
    parts = min(shape.attend_parts, hd // bd)
    if lw.compressor is None:
        return hb, bd, 0, parts or A.output_parts(rows, heads, hd, programs, hb, bd), 1
    entries = topk if lw.indexer else cache.entries.shape[1]
    splits, parts, split_parts = A.compressed_layout(rows, heads, hd, entries, programs, parts, hb, bd)
    if shape.attend_splits:
        return hb, bd, shape.attend_splits, parts, 1
    return hb, bd, splits, parts, split_parts


def _entries(lw, cache, s, topk: int, hb: int, tasks: int):
    """(entries, n_entries, park, park_stride) of K2Attention: a compressed layer's entries and
    its attend tasks' park (hb heads x the entries a row can attend, all of them on an HCA layer,
    `topk` on a CSA layer, rounded up to KE, fp32, a task); on a window layer the ring in their
    place (not read: RATIO 0)."""
    kv = cache.window.data["kv"]
    if lw.compressor is None:
        return kv, 0, kv, 0
    n_entries = cache.entries.shape[1]
    stride = hb * triton.cdiv(topk if lw.indexer else n_entries, AE.KE) * AE.KE
    park = s.park(tasks, stride)
    return (cache.entries if n_entries else kv), n_entries, park, stride
