"""What the mono kernels take and why they would not: every V4 layer kind (window, CSA, HCA) as
K1 + K2 + K3 (docs/ARCHITECTURE.md), steps of up to MAX_ROWS rows, and the refusals:
configuration-level reasons the kernels cannot run at all; `mono="auto"` logs each and runs
per-op, `mono="on"` raises them.
"""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig
from .fragments import FRAGMENT_GROUP

MAX_ROWS = 48  # the widest decode step the kernels take; wider steps run per-op


class MonoRefused(RuntimeError):
    """The mono kernels cannot run this model here; `reasons` lists why, the message all of them."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("the mono kernels cannot run this model here: " + "; ".join(self.reasons))


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU, one program after another (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def task_grid(n_tasks: int) -> tuple[int]:
    """A standalone launch's grid: a program a task; one program for all under the interpreter,
    which runs programs in turn."""
    return (1,) if interpreted() else (n_tasks,)


def fast_dots(x: torch.Tensor) -> bool:
    """Whether kernels on x's device take tensor-core dots of bf16 (and, in the dense GEMVs, FP8)
    operands (constexpr FAST): NVIDIA GPUs; elsewhere fp32 operands in IEEE precision (the
    interpreter's bf16 dot is wrong, and it has no fp8)."""
    return x.is_cuda and torch.version.cuda is not None


def refusals(config: ModelConfig, device: torch.device, dtype: torch.dtype, interpreter: bool = False) -> list[str]:
    """Every reason the kernels cannot run this configuration on this device (empty: they can);
    `interpreter`: as if Triton's interpreter were on."""
    c, reasons = config, []
    if c.is_v41:
        reasons.append(
            "DeepSeek-V4.1 is not built in the kernels: they implement V4's layer (the current sub-block's "
            "mHC pre-mix, hc_head, a compressor and indexer on every compressed layer), not V4.1's delayed "
            "pre-mix, cross-layer KV and index sources, ratio-1/2 compressors, candidate filter or Engram. "
            "(Its FP8 weights' 32x32 scale blocks are not what stops them: the kernels read square "
            "power-of-two blocks >= 16, and the tiny preset's are 32x32.)")
    if device.type == "cuda":
        if torch.version.cuda is None:
            reasons.append("the kernels' fast paths use NVIDIA PTX; this GPU is not NVIDIA")
    elif not (interpreter or interpreted()):
        reasons.append(f"device {device} is not a GPU (set TRITON_INTERPRET=1 to run the kernels "
                       "on the CPU under Triton's interpreter, slowly, for tests)")
    if dtype != torch.bfloat16:
        reasons.append(f"the kernels keep activations and caches in bfloat16; the model is {dtype}")
    block = c.fp8_block
    if block is None:
        reasons.append("the kernels read FP8 block-scaled dense weights; this checkpoint is unquantized")
    elif block[0] != block[1] or block[0] % 16 or block[0] & (block[0] - 1):
        reasons.append(f"FP8 blocks must be square powers of two >= 16, got {tuple(block)}")
    if not c.experts_fp4:
        reasons.append("the kernels read MXFP4 routed experts; this checkpoint's experts are not MXFP4")
    if c.hc_mult & (c.hc_mult - 1):
        reasons.append(f"hc_mult must be a power of two, got {c.hc_mult}")
    for name in ("hidden_size", "head_dim", "q_lora_rank", "moe_intermediate_size", "o_lora_rank"):
        value = getattr(c, name)
        if block is not None and value % block[0]:
            reasons.append(f"{name}={value} is not a multiple of the FP8 block {block[0]}")
    if c.head_dim & (c.head_dim - 1):
        reasons.append(f"head_dim must be a power of two, got {c.head_dim}")
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(c, name) % FRAGMENT_GROUP:
            reasons.append(f"{name}={getattr(c, name)} is not a multiple of {FRAGMENT_GROUP}, the column group of "
                           "the routed experts' fragment order")
        elif not _tiles(getattr(c, name), 256):
            reasons.append(f"{name}={getattr(c, name)} is not a multiple of the expert stage's tile "
                           "(min(256, itself), a power of two)")
    if c.index_topk & (c.index_topk - 1):
        reasons.append(f"index_topk must be a power of two (the indexer's selection list), got {c.index_topk}")
    if MAX_ROWS * c.num_experts_per_tok > 512:
        reasons.append(f"{c.num_experts_per_tok} experts a token is over the expert grouping's 512 picks")
    return reasons


def _tiles(n: int, tile: int) -> bool:
    """Whether n splits into tiles of min(tile, n), a power of two."""
    t = min(tile, n)
    return t & (t - 1) == 0 and n % t == 0
