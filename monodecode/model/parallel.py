"""Tensor parallelism of the per-op model: which part of each weight a rank holds, and the
reductions that put the parts back together.

Rank r of N (contiguous ranges; `TensorParallel.check` refuses an N that does not divide them):
- attention: heads r H/N .. (r + 1) H/N - 1: their rows of `wq_b` and their `attn_sink`, the
  `o_groups / N` groups those heads feed (`wo_a`'s rows: group g holds heads g H/G ..), and the
  columns of `wo_b` that read those groups' z. Its `wo_b` output is a partial sum (`reduce`).
  The rest of the attention (wq_a, the shared K=V head, norms, compressor, indexer) is whole on
  every rank: it is small, and every rank then writes the same cache.
- MoE: routed experts r E/N .. (the others are never read: experts are the bulk of the bytes),
  the shared expert's intermediate slice (rows of w1 and w3, columns of w2); the router whole,
  so every rank picks the same experts. The MoE output is a partial sum (`reduce`).
  By expert rather than by intermediate slice: a rank then reads whole experts, and a step's
  picks spread over the ranks (the per-op path loops over picked experts).
- embedding: vocab rows r V/N ..; a token outside them embeds to zeros, so `reduce` is exact.
- lm_head: vocab rows r V/N ..; the logits are `gather`ed along the vocabulary.
- mHC, norms, hc_head and everything else: whole (DeepSeek-V4.1's compressors, index keys,
  indexers and Engram too: each rank holds the Engram tables in its host memory, which at
  V4.1-Flash sizes, ~200 GB a rank, wants one copy a host instead: not built).
The DSpark draft's blocks (`mtp.k.`) are split the same way (its routed experts by its own
count); its Markov and confidence heads are whole.

Reductions: each rank gathers every rank's part and sums them in rank order, in fp32, so all
ranks hold bit-identical results whatever the collective's own order. A partial sum is in the
compute dtype (F.linear's output) before it is summed: in bf16 the reduction rounds each rank's
part once more than one rank would.

`SINGLE` is the one-rank case (no process group): its reduce and gather return their input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group; None: the default group

    @classmethod
    def from_process_group(cls, group=None) -> "TensorParallel":
        """This process's place in an initialised torch.distributed group (the world by default)."""
        if not dist.is_initialized():
            raise RuntimeError("tensor parallelism needs torch.distributed initialised (init_process_group) first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def check(self, config: ModelConfig) -> None:
        """Refuse a world size that does not divide what the ranks split, naming the numbers."""
        n = self.size
        need = {"attention heads": config.num_attention_heads, "o_groups": config.o_groups,
                "routed experts": config.n_routed_experts, "vocabulary": config.vocab_size}
        if config.has_dspark:
            need["draft's routed experts"] = config.draft_n_routed_experts
        if config.n_shared_experts:
            need["shared expert intermediate size"] = config.moe_intermediate_size
        bad = [f"{what} {count}" for what, count in need.items() if count % n]
        if bad:
            raise ValueError(f"tensor parallel size {n} must divide the {', '.join(bad)} of this model")

    def check_same(self, what: str, value: str) -> None:
        """Raise unless every rank holds the same `value` (say, the config and the checkpoint's
        tensor table): ranks must load the same model."""
        values = self.every_ranks_value(value)
        for rank, other in enumerate(values):
            if other != values[0]:
                raise ValueError(f"tensor parallel ranks disagree on the {what}: rank {rank} differs from rank 0")

    def every_ranks_value(self, value) -> list:
        """Every rank's `value` (a picklable object), in rank order."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def part(self, total: int) -> range:
        """This rank's contiguous share of `total` (heads, groups, experts, vocabulary rows)."""
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's x, in rank order in fp32, in x's dtype."""
        if self.size == 1:
            return x
        parts = self._every_ranks(x)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(x.dtype)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        return x if self.size == 1 else torch.cat(self._every_ranks(x), dim=dim)

    def _every_ranks(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    # --- which part of a checkpoint tensor this rank holds ----------------------------------------
    def holds(self, name: str, config: ModelConfig) -> bool:
        """Whether this rank reads tensor `name` (schema name) at all: not another rank's expert."""
        found = _EXPERT.search(name)
        if self.size == 1 or not found:
            return True
        experts = config.draft_n_routed_experts if found[1] == "mtp" else config.n_routed_experts
        return int(found[2]) in self.part(experts)

    def held_share(self, name: str, shape: tuple[int, ...], config: ModelConfig) -> float:
        """The share of layer weight `name` (schema name, of `shape`) this rank reads: 1 where it
        holds the whole, its slice's share where it holds a slice, 0 for another rank's expert."""
        if not self.holds(name, config):
            return 0.0
        cut = self._cut(name, config)
        return 1.0 if cut is None else (cut[2] - cut[1]) / shape[cut[0]]

    def shard(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's slice of weight `name` (schema name without `.weight`), converted."""
        cut = self._cut(name, config)
        if cut is None:
            return self._vocab_rows(name, tensor, config)
        dim, start, stop = cut
        return _own(tensor.narrow(dim, start, stop - start))

    def shard_fp8(self, name: str, codes: torch.Tensor, scales: torch.Tensor,
                  config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of FP8 matrix `name` as the checkpoint stores it (e4m3 codes [N, K],
        block scales [N / b, K / b]): the rows or columns `shard` cuts, and their scale blocks.
        Raises ValueError where the cut is not on block boundaries (`fp8_refusals`)."""
        cut = self._cut(name, config)
        if cut is None:
            return codes, scales
        dim, start, stop = cut
        block = config.fp8_block[dim]
        if start % block or stop % block:
            raise ValueError(f"{name}: tensor parallel size {self.size} cuts it at {start}..{stop}, "
                             f"not on its FP8 blocks of {block}")
        return (_own(codes.narrow(dim, start, stop - start)),
                _own(scales.narrow(dim, start // block, (stop - start) // block)))

    def fp8_refusals(self, config: ModelConfig) -> list[str]:
        """Why this rank cannot slice the FP8 matrices that the mono kernels read (`shard_fp8`):
        each split whose slice is not a whole number of FP8 blocks."""
        if self.size == 1 or config.fp8_block is None:
            return []
        reasons = []
        for leaf, what in _FP8_CUTS.items():
            dim, start, stop = self._cut(f"layers.0.{leaf}", config)
            block = config.fp8_block[dim]
            if (stop - start) % block:
                reasons.append(f"tensor parallel size {self.size} gives each rank {stop - start} {what}, not a "
                               f"multiple of the FP8 block {block} that the kernels read scales by")
        return reasons

    def _cut(self, name: str, config: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop): the rows (dim 0) or columns (dim 1) of layer weight `name` this rank
        holds; None where it holds the whole (or the vocabulary rows: `_vocab_rows`)."""
        if self.size == 1 or not name.startswith(("layers.", "mtp.")):
            return None
        c = config
        units = {"attn.wq_b": (0, c.num_attention_heads, c.head_dim), "attn.attn_sink": (0, c.num_attention_heads, 1),
                 "attn.wo_a": (0, c.o_groups, c.o_lora_rank), "attn.wo_b": (1, c.o_groups, c.o_lora_rank),
                 "ffn.shared_experts.w1": (0, c.moe_intermediate_size, 1),
                 "ffn.shared_experts.w3": (0, c.moe_intermediate_size, 1),
                 "ffn.shared_experts.w2": (1, c.moe_intermediate_size, 1)}.get(name.split(".", 2)[2])
        if units is None:
            return None
        dim, total, per_unit = units
        held = self.part(total)
        return dim, held.start * per_unit, held.stop * per_unit

    def rank_sizes(self, config: ModelConfig) -> "RankSizes":
        """The sizes this rank's kernels run (`RankSizes`)."""
        return RankSizes(config.replace(num_attention_heads=config.num_attention_heads // self.size,
                                        o_groups=config.o_groups // self.size),
                         config.moe_intermediate_size // self.size, self.part(config.n_routed_experts))

    def _vocab_rows(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        if self.size > 1 and name in ("embed", "head"):
            rows = self.part(config.vocab_size)
            return _own(tensor[rows.start:rows.stop])
        return tensor


def _own(part: torch.Tensor) -> torch.Tensor:
    """A slice in storage of its own: it does not keep the whole tensor alive, and it starts
    aligned (the mono kernels' 16-byte loads), which a view at an offset need not."""
    return part.clone(memory_format=torch.contiguous_format)


class RankSizes(NamedTuple):
    """What one rank's mono kernels size by (`TensorParallel.rank_sizes`). The per-op model keeps
    the whole config; the kernels read this rank's slices as if they were a model of their own."""

    config: ModelConfig  # this rank's attention heads and o groups; all else (the router's experts too) whole
    shared_inter: int  # this rank's slice of the shared expert's intermediate (a routed expert's stays whole)
    experts: range  # the routed experts this rank holds (global ids)


SINGLE = TensorParallel()
# the FP8 matrices the kernels read that the ranks split (`_cut`), by what a rank's slice counts
_FP8_CUTS = {"attn.wq_b": "rows of wq_b (its heads)", "attn.wo_a": "rows of wo_a (its o groups)",
             "ffn.shared_experts.w1": "rows of the shared expert's w1 / w3 (its intermediate)"}
_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")
