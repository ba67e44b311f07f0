"""Checkpoint I/O: read DeepSeek-V4 safetensors checkpoints, write synthetic ones.

Reading: a directory with `config.json` and either `model.safetensors.index.json` (sharded) or
`*.safetensors` files. Files are memory-mapped and tensors read one at a time; a tensor whose
address is not 16-byte aligned (the file puts tensors back to back) is copied, since the mono
kernels' vector loads need aligned weights. Names are the
official ones (see `schema.py`); the spellings transformers' `save_pretrained` writes (a `model.`
prefix, `embed_tokens`, `lm_head`, `hc_head.hc_fn`, `attn.norm` for the kv norm) are mapped to
them. `validate()` checks every header (names, shapes, dtypes, scale grids) before any data is
read, so a bad checkpoint fails as a whole with a message naming the tensor and the file, and
nothing half-loaded is ever used.

Writing: `write_synthetic_checkpoint` produces the official quantized format (FP8 + UE8M0 block
scales for dense weights, MXFP4 + E8M0 per 32 for the routed experts) with seeded random weights,
one shard per layer, so that a v4-flash checkpoint is written holding one layer at a time.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from . import formats
from .config import ModelConfig
from .schema import STORAGE_DTYPES, TensorSpec, layer_of, tensor_specs

INDEX_FILE = "model.safetensors.index.json"
ALIGNMENT = 16  # bytes; mono/weights.py refuses weights that are not aligned to it
_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_KV_NORM_ALIAS = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or does not match its config; the message says where."""


def canonical_name(stored: str) -> str:
    name = stored.removeprefix("model.")
    name = _ALIASES.get(name, name)
    return _KV_NORM_ALIAS.sub(r"\1.kv_norm.weight", name)


class Checkpoint:
    """A checkpoint directory: its config and the headers of its tensors (no data read yet)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.config = ModelConfig.from_dir(self.path)
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, stored name)
        self._headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in self._files():
            self._read_header(file)
        self.specs = tensor_specs(self.config)

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
            files = [self.path / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index} lists {f.name}, which does not exist")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        return files

    def _read_header(self, file: Path) -> None:
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    piece = f.get_slice(stored)
                    name = canonical_name(stored)
                    if name in self._where:
                        raise CheckpointError(
                            f"tensor {name} appears twice: in {self._where[name][0].name} and {file.name}"
                        )
                    self._where[name] = (file, stored)
                    self._headers[name] = (tuple(piece.get_shape()), _dtype(piece.get_dtype()))
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated?): {e}") from e

    # --- checks ------------------------------------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return any(name.startswith("mtp.") for name in self._where)

    def validate(self, require_draft: bool = False) -> None:
        """Check every tensor's presence, shape and dtype against the config; raise on the first
        problem. The DSpark draft is optional unless `require_draft`, but checked when present."""
        if require_draft and not self.config.has_dspark:
            raise CheckpointError(f"{self.path}: config.json describes no DSpark draft")
        check_draft = require_draft or self.has_draft
        expected: dict[str, tuple[tuple[int, ...], str]] = {}
        for spec in self.specs:
            if spec.group == "model" or check_draft:
                expected.update(spec.stored())
        for name, (shape, kind) in expected.items():
            if name not in self._headers:
                what = "the DSpark draft tensor" if name.startswith("mtp.") else "tensor"
                raise CheckpointError(f"{self.path}: {what} {name} is missing")
            found_shape, found_dtype = self._headers[name]
            file = self._where[name][0].name
            if found_shape != shape:
                raise CheckpointError(
                    f"tensor {name} in {file} has shape {list(found_shape)}, expected {list(shape)}"
                )
            if found_dtype not in STORAGE_DTYPES[kind]:
                allowed = " or ".join(str(d).removeprefix("torch.") for d in STORAGE_DTYPES[kind])
                raise CheckpointError(
                    f"tensor {name} in {file} has dtype {str(found_dtype).removeprefix('torch.')}, "
                    f"expected {allowed}"
                )
        ignored = _ignored_prefixes(self.config)
        family = "DeepSeek-V4.1" if self.config.is_v41 else "DeepSeek-V4"
        for name in self._where:
            if name not in expected and not name.startswith(ignored):
                raise CheckpointError(
                    f"unexpected tensor {name} in {self._where[name][0].name} (not in the "
                    f"{family} layout that config.json describes)"
                )

    # --- data --------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor by canonical name (e.g. `layers.0.attn.wq_a.scale`)."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        file, stored = self._where[name]
        with safe_open(file, framework="pt") as f:
            return _aligned(f.get_tensor(stored))

    def tensors(self, names: list[str], desc: str = "loading") -> Iterator[tuple[str, torch.Tensor]]:
        """Stored tensors in file order, with a progress bar if it takes over a second."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._where:
                raise CheckpointError(f"{self.path}: tensor {name} is missing")
            by_file.setdefault(self._where[name][0], []).append(name)
        with tqdm(total=len(names), desc=desc, unit="tensor", delay=1.0) as bar:
            for file, file_names in by_file.items():
                with safe_open(file, framework="pt") as f:
                    for name in file_names:
                        yield name, _aligned(f.get_tensor(self._where[name][1]))
                        bar.update()


def _ignored_prefixes(config: ModelConfig) -> tuple[str, ...]:
    """Tensors a checkpoint may hold that this config does not describe, and that are left unread:
    an MTP-1 draft (not supported, not an error), and V4.1's vision tower and its aligner (the
    text model only)."""
    prefixes = () if config.has_dspark else ("mtp.",)
    return prefixes + (("vision.", "aligner.") if config.is_v41 else ())


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or an aligned copy of it when its memory-mapped address is not aligned."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def _dtype(safetensors_dtype: str) -> torch.dtype:
    table = {
        "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "BF16": torch.bfloat16,
        "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8,
        "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "I16": torch.int16,
        "BOOL": torch.bool, "F8_E5M2": torch.float8_e5m2,
    }
    if safetensors_dtype.startswith("F4"):  # packed e2m1 pairs, read as bytes
        return torch.uint8
    if safetensors_dtype not in table:
        raise CheckpointError(f"tensors of dtype {safetensors_dtype} are not supported")
    return table[safetensors_dtype]


# --- synthetic checkpoints ---------------------------------------------------------------------
def write_synthetic_checkpoint(
    config: ModelConfig, out_dir: str | Path, seed: int = 0, progress: bool = True
) -> Path:
    """Write `config.json` and seeded random weights in the official quantized format.

    Shards: one for the top-level tensors, one per layer, one per draft stage. Each tensor is
    drawn from a generator seeded by (seed, name), so a checkpoint with more layers shares the
    weights of a smaller one. The directory appears only when complete (written beside it, then
    renamed); an existing non-empty directory is refused."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new directory")
    if config.quantization_config is None:
        raise CheckpointError("synthetic checkpoints are quantized: the config needs a quantization_config")
    _check_largest_tensor_fits(config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        shards: dict[str, list[TensorSpec]] = {}
        for spec in tensor_specs(config):
            shards.setdefault(layer_of(spec.name) or "top", []).append(spec)
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map: dict[str, str] = {}
        total = 0
        bar = tqdm(total=sum(s.nbytes() for group in shards.values() for s in group),
                   unit="B", unit_scale=True, desc="writing", disable=not progress, delay=1.0)
        for file_name, specs in zip(names, shards.values()):
            tensors: dict[str, torch.Tensor] = {}
            for spec in specs:
                tensors.update(synthetic_tensors(config, spec, seed))
                bar.update(spec.nbytes())
            save_file(tensors, tmp / file_name, metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({name: file_name for name in tensors})
            del tensors
        bar.close()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_largest_tensor_fits(config: ModelConfig) -> None:
    """Refuse, before writing anything, a tensor too large to draw in memory (it is drawn in fp32,
    then quantized): V4.1's Engram tables are ~384 M rows (98 GB quantized) each."""
    from .model.weights import free_memory  # here: the model package imports this module

    largest = max(tensor_specs(config), key=lambda s: math.prod(s.shape))
    need, free = 2 * 4 * math.prod(largest.shape), free_memory("cpu")
    if need > free:
        raise CheckpointError(
            f"tensor {largest.name} {list(largest.shape)} needs about {need / 2**30:.0f} GiB of memory to "
            f"generate, {free / 2**30:.0f} GiB is free: write fewer layers (--layers N keeps layers 0..N-1)")


def synthetic_tensors(config: ModelConfig, spec: TensorSpec, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensors of one spec, random but scaled so activations stay in a sane range:
    linear maps keep the RMS of their input (std 1/sqrt(fan_in), halved on the projections that
    write into the residual stream), the mHC mixes vary per token but stay near their centre,
    norms are near 1, and routing tables pick distinct experts."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    if spec.fmt == "mxfp4":
        return _random_mxfp4(spec, gen)
    if spec.fmt == "int":  # tid2eid: top-k distinct experts per token
        n_experts = config.n_routed_experts
        order = torch.rand(spec.shape[0], n_experts, generator=gen).argsort(dim=1)
        return {spec.name: order[:, : spec.shape[1]].to(torch.int32).contiguous()}
    values = torch.randn(spec.shape, generator=gen) * _init_std(spec)
    values += _init_mean(spec)
    if spec.fmt == "fp8":
        q, scale = formats.quantize_fp8_block(values, spec.fp8_block)
        return {f"{spec.name}.weight": q, f"{spec.name}.scale": scale}
    dtype = torch.float32 if spec.fmt == "fp32" else torch.bfloat16
    return {spec.name: values.to(dtype)}


def _init_std(spec: TensorSpec) -> float:
    name = spec.name
    if name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):  # norm-like scales near 1
        return 0.1
    if name == "embed.weight" or "markov_w1" in name:
        return 1.0
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return 1.0 / math.sqrt(spec.shape[1])
    if re.search(r"hc_(attn|ffn|head)_(base|scale)$", name):
        return 0.2
    if name.endswith(("attn_sink", ".ape")):
        return 0.5
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1
    fan_in = spec.shape[-1]
    residual_writer = re.search(r"(wo_b|w2)(\.weight)?$", name) is not None
    return (0.5 if residual_writer else 1.0) / math.sqrt(fan_in)


def _init_mean(spec: TensorSpec) -> float:
    if spec.name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")) or re.search(
            r"hc_(attn|ffn|head)_scale$", spec.name):
        return 1.0
    return 0.0


def _random_mxfp4(spec: TensorSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random e2m1 codes with per-32 scales near 2^-log2(fan_in)/2: the RMS of uniformly drawn
    e2m1 values is about 2.93, so the scale targets std 1/sqrt(fan_in) (halved for w2)."""
    *lead, k = spec.shape
    packed = torch.randint(0, 256, (*lead, k // 2), generator=gen, dtype=torch.uint8)
    std = _init_std(spec)
    centre = round(math.log2(std / 2.93)) + 127
    codes = centre + torch.randint(-1, 2, (*lead, k // 32), generator=gen, dtype=torch.int16)
    scale = codes.to(torch.uint8).view(torch.float8_e8m0fnu)
    return {f"{spec.name}.weight": packed.view(torch.int8), f"{spec.name}.scale": scale}


class SyntheticCheckpoint:
    """A config's seeded random weights, generated on demand, nothing on disk: the same tensors
    `write_synthetic_checkpoint` writes, behind the reading interface of `Checkpoint`."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.path = Path(f"<synthetic seed={seed}>")
        self.specs = tensor_specs(config)
        self._spec_of = {name: spec for spec in self.specs for name in spec.stored()}
        self.has_draft = config.has_dspark

    def validate(self, require_draft: bool = False) -> None:
        """Always complete."""

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._spec_of:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        return synthetic_tensors(self.config, self._spec_of[name], self.seed)[name]

    def tensors(self, names: list[str], desc: str = "generating") -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `names` in that order. Each spec's tensors come from its own seeded
        generator, so threads make them ahead of the reader (torch releases the GIL) and the
        values do not depend on the order or the thread."""
        missing = [name for name in names if name not in self._spec_of]
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
        runs = [(spec, [name for name, _ in group]) for spec, group in
                itertools.groupby(((name, self._spec_of[name]) for name in names), key=lambda item: item[1])]
        workers = min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool, tqdm(total=len(names), desc=desc, unit="tensor", delay=1.0) as bar:
            ahead = collections.deque()
            for spec, run_names in runs:
                ahead.append((run_names, pool.submit(synthetic_tensors, self.config, spec, self.seed)))
                if len(ahead) > 2 * workers:
                    yield from self._drain(ahead.popleft(), bar)
            while ahead:
                yield from self._drain(ahead.popleft(), bar)

    @staticmethod
    def _drain(run, bar) -> Iterator[tuple[str, torch.Tensor]]:
        names, future = run
        tensors = future.result()
        for name in names:
            bar.update()
            yield name, tensors[name]
