"""The device buffers of one step width: inputs, the residual streams, every stage's output.

One `Scratch` per width R (rows of a step), allocated before the width's first launch and never
shared with another width: a CUDA graph of width R captures these pointers.
Buffers are reused layer after layer (a layer's K1, K2 and K3 run in stream order, so a buffer is
free again once the stage that reads it has run); the residual streams ping-pong between two
buffers because a fold reads one and writes the other.
Activations bf16, mixes and accumulators fp32, as the stages' docstrings state.
"""

from __future__ import annotations

import torch

from ..config import CSA_RATIO, ModelConfig
from . import attention as A
from . import hc as HC
from . import indexer as I
from .weights import projection_rows


class Scratch:
    def __init__(self, config: ModelConfig, rows: int, device, poison: bool = False):
        c, r = config, rows
        d, hc, heads, hd = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim
        k, inter = c.num_experts_per_tok, c.moe_intermediate_size
        picks, mix = r * k, (2 + hc) * hc
        self.rows = r
        fill = float("nan") if poison else 0.0

        def f32(*shape):
            return torch.full(shape, fill, dtype=torch.float32, device=device)

        def bf16(*shape):
            return torch.full(shape, fill, dtype=torch.bfloat16, device=device)

        def i32(*shape):
            return torch.full(shape, -1, dtype=torch.int32, device=device)

        # the step's rows: tokens, positions and slots, the rows of one tensor so that one copy loads
        # them (`load_rows`); each padded to 16 bytes, so that each starts as aligned as a tensor of
        # its own would (Triton builds a kernel for its pointers' 16-byte alignment: odd widths would
        # otherwise build kernels of their own)
        self.rows_in = torch.tensor([[0], [0], [-1]], dtype=torch.long, device=device).repeat(1, r + r % 2)
        # their host side, pinned on a GPU so that `load_rows`' copy does not hold the host (a copy
        # from pageable memory waits for the driver to stage it); the copy's event guards its reuse
        on_gpu = self.rows_in.is_cuda
        self.rows_host = torch.zeros(self.rows_in.shape, dtype=torch.long, pin_memory=on_gpu)
        self.rows_copied = torch.cuda.Event() if on_gpu else None
        self.streams = (bf16(r, hc, d), bf16(r, hc, d))
        # mHC seams: fold partials, the attention site's mixes, the FFN site's (owed) mixes
        self.partials = f32(r, -(-d // HC.MIN_CHUNK), mix + 1)  # every fold chunk's partials fit
        self.post_attn, self.comb_attn = f32(r, hc), f32(r, hc, hc)
        self.post_ffn, self.comb_ffn = f32(r, hc), f32(r, hc, hc)
        self.x = bf16(r, d)  # the collapsed, normalised sub-block input
        # attention
        self.qkv_raw, self.qr = bf16(r, c.q_lora_rank + hd), bf16(r, c.q_lora_rank)  # qkv_raw: wq_a's, then wkv's
        self.q_raw, self.o = bf16(r, heads * hd), bf16(r, heads, hd)
        self.z, self.attn_out = bf16(r, c.o_groups * c.o_lora_rank), bf16(r, d)
        # a compressed layer's stacked projections of x (K1 reads its columns: the compressor's kv and gate,
        # before its source ring; on a CSA layer the indexer compressor's and weights_proj(x)), a CSA layer's
        # the widest
        self.proj = bf16(r, sum(projection_rows(c, CSA_RATIO)))
        self.parks: dict[int, torch.Tensor] = {}  # attend's parked entry logits, by floats
        self.split_partials: dict[int, torch.Tensor] = {}  # attend's entry splits' outputs, by floats
        # attend's entry splits' signals, then its window tasks' arrivals, a pair's each; 0 between launches
        self.attend_tickets = torch.zeros(2 * A.attend_tasks(r, heads), dtype=torch.int32, device=device)
        # a CSA layer's indexer: the wq_b output; the scores (`scores`, one buffer a cache's entries a
        # slot) and the selection
        self.index_q = bf16(r, c.index_n_heads * c.index_head_dim)
        self.index_scores: dict[int, torch.Tensor] = {}
        self.index_counts: dict[int, torch.Tensor] = {}
        self.select_hist = torch.zeros((r, I.HIST_ROWS, 256), dtype=torch.int32, device=device)
        self.selected = torch.full((r, c.index_topk), -1, dtype=torch.int64, device=device)  # K1 -> K2
        self.device = torch.device(device)
        # MoE
        self.logits = f32(r, c.n_routed_experts)
        self.ids, self.route_weights = i32(r, k), f32(r, k)
        self.order, self.experts, self.counts = i32(picks), i32(picks), i32(picks)
        # gate: inter columns, then up (a tensor-parallel rank uses 2 I / N of them: K2 passes the stride)
        self.shared_gate_up, self.shared_out = bf16(r, 2 * inter), bf16(r, d)
        self.route_ticket = torch.zeros(1, dtype=torch.int32, device=device)  # 0 between launches
        self.gate_up, self.h, self.per_pick = f32(picks, 2, inter), bf16(picks, inter), f32(picks, d)
        self.y = bf16(r, d)  # the FFN output, owed to the next layer's fold

    @property
    def tokens(self) -> torch.Tensor:
        return self.rows_in[0, :self.rows]

    @property
    def positions(self) -> torch.Tensor:
        return self.rows_in[1, :self.rows]

    @property
    def slots(self) -> torch.Tensor:
        return self.rows_in[2, :self.rows]

    def load_rows(self, rows: torch.Tensor) -> None:
        """The step's tokens, positions and slots (int64 [3, rows] on the host) in one copy (the
        padding columns stay 0)."""
        if self.rows_copied is not None:
            self.rows_copied.synchronize()  # the last step's copy has read the host buffer
        self.rows_host[:, :self.rows].copy_(rows)
        self.rows_in.copy_(self.rows_host, non_blocking=True)
        if self.rows_copied is not None:
            self.rows_copied.record()

    def owed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The FFN output and its site's post / comb mixes that the next layer's fold takes."""
        return self.y, self.post_ffn, self.comb_ffn

    def park(self, tasks: int, floats_a_task: int) -> torch.Tensor:
        """The parked logits of a compressed layer's attend tasks (fp32, `floats_a_task` for each of
        `tasks`), one buffer a size, made at its first use: a width's eager warm-up step, before
        any graph of it is captured."""
        floats = max(tasks * floats_a_task, 1)
        return self._first_use(self.parks, floats, "an attend park", (floats,))

    def attend_partials(self, floats: int) -> torch.Tensor:
        """The outputs and stats a compressed layer's attend entry splits keep for their window
        tasks (fp32, `floats`: attend_entries.split_partials), one buffer a size, made at its first use
        (as `park`)."""
        return self._first_use(self.split_partials, floats, "attend's split partials", (max(floats, 1),))

    def scores(self, n_entries: int) -> torch.Tensor:
        """The index scores of a CSA layer whose cache holds `n_entries` entries a slot (fp32
        [rows, n_entries]), one buffer a size, made at its first use (as `park`)."""
        return self._first_use(self.index_scores, n_entries, "index scores", (self.rows, max(n_entries, 1)))

    def select_counts(self, n_entries: int) -> torch.Tensor:
        """The top-k's block counts for a CSA layer whose cache holds `n_entries` entries a slot
        (int32, `indexer.select_counts` at the smallest block), one buffer a size (as `park`)."""
        values = I.select_counts(self.rows, n_entries, I.MIN_SELECT_BLOCK)
        return self._first_use(self.index_counts, n_entries, "top-k block counts", (values,)).view(torch.int32)

    def _first_use(self, buffers: dict, key: int, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        """buffers[key], an fp32 tensor of `shape` made now if it is not there yet: at a width's eager
        warm-up step, never first inside a CUDA graph capture (a clear error instead)."""
        if key not in buffers:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"mono: {what} first needed inside a CUDA graph capture")
            buffers[key] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return buffers[key]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self):
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, tuple):
                yield from value
            elif isinstance(value, dict):
                yield from value.values()
