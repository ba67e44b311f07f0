"""Weights of the per-op path, read from a checkpoint once.

Memory (documented choice): dense FP8 weights are dequantized at load to the compute dtype
(bf16: twice their checkpoint bytes; fp32: four times); the routed experts stay in MXFP4 (their
checkpoint bytes) and are dequantized on the fly, one expert at a time, for the experts a step
selects. DeepSeek-V4.1's Engram tables (hundreds of millions of rows, ~100 GB each as stored) stay
as stored, FP8 codes and scales, in host memory whatever the device: a step gathers its tokens'
rows there and dequantizes only those (model/engram.py). Norm weights, mHC parameters, sinks,
compressor position biases and router biases are kept in fp32 as the reference does. Unquantized checkpoints are cast to the compute dtype.

Keys are the schema's names without a `.weight` suffix (`layers.0.attn.wq_a`,
`layers.0.attn_norm`, `layers.0.hc_attn_fn`), whatever the checkpoint's format.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .. import formats
from ..checkpoint import Checkpoint
from ..schema import TensorSpec
from .parallel import SINGLE, TensorParallel

FP32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias", "_fn", "_base", "_scale")


@dataclass
class ExpertBank:
    """Routed experts of one block as the checkpoint stores them, one entry per expert held
    (experts `first`, `first` + 1, ...: a tensor-parallel rank holds a range of them): w1, w3
    [inter, d] and w2 [d, inter], each either MXFP4 (packed uint8 codes, E8M0 scales) or one
    tensor in the compute dtype. `expert(e)` dequantizes expert e for the step that picked it."""

    w1: list[tuple[torch.Tensor, ...]]
    w2: list[tuple[torch.Tensor, ...]]
    w3: list[tuple[torch.Tensor, ...]]
    dtype: torch.dtype
    first: int = 0

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = e - self.first
        return self._get(self.w1[i]), self._get(self.w2[i]), self._get(self.w3[i])

    def _get(self, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(stored) == 2:
            return formats.dequantize_mxfp4(*stored, self.dtype)
        return stored[0]


def read_weights(ckpt: Checkpoint, group: str, device, dtype,
                 tp: TensorParallel = SINGLE) -> dict[str, tuple[torch.Tensor, ...] | torch.Tensor]:
    """Every tensor of a schema group ("model" or "draft"), converted for the per-op path:
    dequantized FP8, (packed, scale) pairs for MXFP4, cast plain tensors; under tensor
    parallelism only what rank `tp` holds (other ranks' experts are not read, split tensors are
    cut as each is read: no rank holds the whole model)."""
    specs = [s for s in ckpt.specs if s.group == group and tp.holds(s.name, ckpt.config)]
    spec_of = {name: s for s in specs for name in s.stored()}
    pending: dict[str, torch.Tensor] = {}
    out = {}
    # Convert each tensor as soon as its pieces (weight and scale) are read, so that at most one
    # checkpoint-format copy of a tensor is alive next to the converted weights.
    for name, tensor in ckpt.tensors(list(spec_of), desc=f"loading {group} weights"):
        pending[name] = tensor
        spec = spec_of[name]
        if all(piece in pending for piece in spec.stored()):
            key = spec.name.removesuffix(".weight")
            out[key] = tp.shard(key, _convert(spec, pending, device, dtype), ckpt.config)
    return out


def resident_bytes(specs: list[TensorSpec], dtype: torch.dtype) -> int:
    """Bytes `read_weights` keeps for these specs: FP8 and plain tensors in the compute dtype
    (fp32 where the reference keeps fp32), MXFP4 experts as stored."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for spec in specs:
        if spec.role == "hashed":  # host memory, as stored
            continue
        if spec.fmt == "mxfp4":
            total += spec.nbytes()
        else:
            keep_fp32 = spec.fmt == "fp32" or spec.name.endswith(FP32_SUFFIXES) or spec.fmt == "int"
            total += math.prod(spec.shape) * (4 if keep_fp32 else itemsize)
    return total


def free_memory(device) -> int:
    """Bytes free on `device` now (host memory for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts the page cache that can be dropped (a checkpoint just written)
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def expert_bank(weights: dict, prefix: str, experts: range, dtype) -> ExpertBank:
    """The bank of experts `experts` (a contiguous range) of the block at `prefix`."""
    def matrices(matrix: str) -> list[tuple[torch.Tensor, ...]]:
        return [_as_tuple(weights[f"{prefix}experts.{e}.{matrix}"]) for e in experts]

    return ExpertBank(matrices("w1"), matrices("w2"), matrices("w3"), dtype, experts.start)


def _as_tuple(value) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _convert(spec: TensorSpec, raw: dict[str, torch.Tensor], device, dtype):
    if spec.role == "hashed":  # an Engram table: as stored, in host memory (codes and scales, or plain)
        return tuple(raw.pop(name) for name in spec.stored())
    if spec.fmt == "fp8":
        q, scale = raw.pop(f"{spec.name}.weight").to(device), raw.pop(f"{spec.name}.scale").to(device)
        return formats.dequantize_fp8_block(q, scale, spec.fp8_block, dtype)
    if spec.fmt == "mxfp4":
        return (raw.pop(f"{spec.name}.weight").to(device).view(torch.uint8),
                raw.pop(f"{spec.name}.scale").to(device))
    tensor = raw.pop(spec.name).to(device)
    if spec.fmt == "int":
        return tensor.long()
    return tensor.float() if spec.name.endswith(FP32_SUFFIXES) else tensor.to(dtype)
