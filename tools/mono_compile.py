"""Compile the mono kernels for an H100/H200 (sm_90) on a machine without a GPU.

`python tools/mono_compile.py [--dims tiny|v4-flash] [--shape SPEC] [--widths 1,48] [--context 64]`, in a process
where TRITON_INTERPRET is unset (tests/test_mono_compiles.py runs it so).

Triton's CPU interpreter accepts code that compiled Triton refuses (a non-constexpr global in a
kernel, for one), so the CPU tests alone can pass kernels that do not build. This runs one mono
step at each width (default 1 and 48) with the launches recorded instead of run, then compiles
each distinct recorded launch with `triton.compile` for sm_90 (and the first K1, K2 and K3 with the
timeline's stamps), and prints one line a kernel: shared memory, registers and spills from
ptxas -v, and the size of its machine code.
- `--dims tiny` (default): a three-layer tiny model (a window, a hash-routed CSA and a
  bias-routed HCA layer), seconds.
- `--dims v4-flash`: three layers at v4-flash sizes (a hash-routed window, CSA and HCA layer,
  bias-routed; a 1024-token vocabulary; ~12 GB of memory, ~3 min): the tiles a launch shape gives at real
  sizes, so that a shape's registers and spills are known before a GPU times it (registers are
  per thread, at most 255; a SM holds 64 K, so P programs of W warps need <= 65536 / (32 P W)).
  This machine's Triton may allocate a little differently from the GPU's, and
  may build what the GPU's refuses: run the tool with the GPU's Triton too (a venv made with
  `--system-site-packages`, then `pip install triton==3.6.0`, the H200's) before a device call.
- `--shape`: a `LaunchShape` spec (`shape.LaunchShape.parse`), default the default shape.
- `--sms`: the target's multiprocessor count (default 132, an H100 SXM / H200): the grid the
  tile choices that depend on it assume (a CPU runner's own grid is 1).
- `--context N`: the positions a request's cache holds (default 64); a compressed layer's
  cache then holds N // ratio entries (16 at the tiny dims: one entry of the HCA layer).
- `--tensor-parallel N [--rank R]`: rank R's (default 0) kernels of N ranks (its slices, the sums
  over the ranks inside K2 and K3), with stand-ins for the ranks' collectives and peer memory:
  nothing runs.
- `--draft`: the DSpark draft's runner (`mono.DraftRunner`: its stages, draft blocks in K2's
  attend) instead of the target's; widths are then whole blocks, one a request.
- `--widths`: rows a step, comma-separated: one request of up to 5 rows (a draft block), the rest
  pad rows. Each build takes seconds (a K2 at 48 rows about 10 s on a 2-core machine).
- `--dump DIR`: also write each build's TTGIR there (its `ttg.local_alloc`s and their
  `allocation.offset`s show what holds the shared memory) and its cubin (`nvdisasm -c` shows
  the SASS: where the spills are).
"""

import argparse
import functools
import multiprocessing
import os
import re
import struct
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.model import Model
from monodecode.model.parallel import TensorParallel
from monodecode.mono import k1, k2, plan
from monodecode.mono import runner as runner_module
from monodecode.mono.draft_runner import DraftRunner
from monodecode.mono.peers import site_bytes
from monodecode.mono.shape import LaunchShape
from monodecode.mono.sync import TIMELINE_SLOTS, SyncArgs

POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64",
           torch.uint8: "*u8", torch.int16: "*i16"}


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def signature(kernel, args):
    """(types, constexprs, attrs) of a recorded launch, as the JIT derives them from its arguments
    (named tuples of them too: their types a named tuple of the same class, paths of indices into
    them): `tl.constexpr` values, None and integers equal to 1 are compile-time constants (the
    JIT specialises a 1, anywhere in the arguments); attrs mark what the JIT would specialize on a
    GPU, pointers aligned to 16 bytes and integers divisible by 16 (which lets it vectorize
    loads)."""
    constants, attrs = {}, {}

    def leaf(path, value):
        if isinstance(value, tuple):
            types = [leaf(path + (i,), v) for i, v in enumerate(value)]
            return type(value)(*types) if hasattr(value, "_fields") else tuple(types)
        if value is None or isinstance(value, tl.constexpr) or (type(value) is int and value == 1):
            constants[path] = getattr(value, "value", value)
            return "constexpr"
        if isinstance(value, torch.Tensor):
            if value.data_ptr() % 16 == 0:
                attrs[path] = [["tt.divisibility", 16]]
            return POINTER[value.dtype]
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            if value % 16 == 0:
                attrs[path] = [["tt.divisibility", 16]]
            return "i32"
        return "fp32"

    types = {name: leaf((i,), value) for i, (name, value) in enumerate(zip(kernel.arg_names, args))}
    return types, constants, attrs


def with_timeline(args):
    """A recorded launch's arguments with the timeline's stamps compiled in: TIMELINE on in its
    meta tuple (the last argument), and an int64 stamps buffer in its SyncArgs."""
    def swap(value):
        if isinstance(value, SyncArgs):
            return value._replace(timeline=torch.zeros(1, TIMELINE_SLOTS, dtype=torch.int64))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(swap(v) for v in value))
        return value

    *tensors, meta = args
    return [swap(a) for a in tensors] + [meta._replace(TIMELINE=tl.constexpr(True))]


class LoneRank(TensorParallel):
    """One rank of a tensor-parallel group without the others: its collectives return their input
    (the recorded step's outputs are garbage anyway)."""

    def check_same(self, what: str, value: str) -> None:
        pass

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)


def model_config(dims: str, draft: bool):
    if dims == "tiny":
        return preset("tiny", num_hidden_layers=3, compress_ratios=(0, 4, 16), dspark_target_layer_ids=(0, 1, 2))
    return preset("v4-flash", num_hidden_layers=3, compress_ratios=(0, 4, 128), num_hash_layers=1,
                  dspark_target_layer_ids=(0, 1, 2), num_nextn_predict_layers=int(draft), vocab_size=1024,
                  dspark_noise_token_id=1000)


def registers(ptx: str) -> str:
    """ptxas -v's registers and spills of a kernel, for sm_90a, from the first of Triton's bundled
    ptxas builds that reads the PTX version it emits."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for name in sorted(n for n in os.listdir(bin_dir) if n.startswith("ptxas")):
            done = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                                   os.devnull], capture_output=True, text=True)
            if done.returncode == 0:
                used, spilled = re.search(r"Used (\d+) registers", done.stderr), re.search(
                    r"(\d+) bytes spill stores", done.stderr)
                return f"{used and used[1]} registers, {spilled and spilled[1]} bytes of spill stores"
    return "no bundled ptxas read the PTX"


BUILDS = []  # (kernel, args, kwargs) of each distinct launch: a global, which forked workers inherit unpickled


def build(index: int, dump: str | None) -> str:
    """Compile BUILDS[index] for sm_90 (with `dump`, write its TTGIR and cubin there): its line."""
    kernel, args, kwargs = BUILDS[index]
    types, constants, attrs = signature(kernel, args)
    compiled = triton.compile(ASTSource(kernel, types, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kwargs.get("num_warps", 4), "maxnreg": kwargs.get("maxnreg")})
    timeline = bool(args[-1].TIMELINE)
    if dump:
        os.makedirs(dump, exist_ok=True)
        name = f"{kernel.__name__}{index + 1}{'_timeline' if timeline else ''}"
        with open(os.path.join(dump, name + ".ttgir"), "w") as f:
            f.write(compiled.asm["ttgir"])
        with open(os.path.join(dump, name + ".cubin"), "wb") as f:
            f.write(compiled.asm["cubin"])
    return (f"{kernel.__name__}{' (timeline)' if timeline else ''}: built for sm_90, {compiled.metadata.shared} "
            f"bytes of shared memory; {registers(compiled.asm['ptx'])}; "
            f"{code_bytes(compiled.asm['cubin'], kernel.__name__) // 1024} KB of code")


def code_bytes(cubin: bytes, name: str) -> int:
    """The size of the kernel's machine code (its ELF section `.text.<name>`): what a SM's instruction
    caches must hold, fetched again on every launch (a persistent kernel runs each stage's code
    once or a few times a launch)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strings = headers[shstrndx][4]
    for sh_name, _, _, _, _, size in headers:
        if cubin[strings + sh_name:cubin.index(b"\0", strings + sh_name)] == f".text.{name}".encode():
            return size
    raise ValueError(f"no .text.{name} in the cubin")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compile the mono kernels for sm_90 on a machine without a GPU")
    parser.add_argument("--dims", choices=("tiny", "v4-flash"), default="tiny")
    parser.add_argument("--shape", default="default", help="a LaunchShape spec")
    parser.add_argument("--dump", help="a folder for each build's TTGIR")
    parser.add_argument("--widths", default="1,48", help="rows a step, comma-separated")
    parser.add_argument("--sms", type=int, default=132, help="the target GPU's SMs (an H200's 132): the grid "
                                                            "that the launch shape's tile choices assume")
    parser.add_argument("--context", type=int, default=64, help="positions a request's cache holds (a compressed "
                        "layer's cache holds context // ratio entries)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="compile one rank's kernels of this many ranks")
    parser.add_argument("--rank", type=int, default=0, help="that rank (its rank number is a constant of its build "
                        "when it is 1)")
    parser.add_argument("--draft", action="store_true", help="the DSpark draft's runner instead of the "
                        "target's (widths: whole blocks of the draft's block size)")
    cli = parser.parse_args(argv)
    launches = []
    k1._k1, k2._k2, k2._k3 = (Recorder(kernel, launches) for kernel in (k1._k1, k2._k2, k2._k3))
    plan.interpreted = runner_module.interpreted = lambda: True  # a CPU runner, grid (1,)
    tp = TensorParallel()
    if cli.tensor_parallel > 1:
        if not 0 <= cli.rank < cli.tensor_parallel:
            parser.error(f"--rank {cli.rank} is not a rank of {cli.tensor_parallel}")
        tp = LoneRank(rank=cli.rank, size=cli.tensor_parallel)
        k2.PeerMemory.allocate = classmethod(lambda cls, tp, device, columns: cls(
            [torch.zeros(sum(site_bytes(tp.size, n) for n in columns), dtype=torch.uint8)] * tp.size, tp.rank, columns))
    model = Model.from_checkpoint(SyntheticCheckpoint(model_config(cli.dims, cli.draft), seed=1), "cpu",
                                  torch.bfloat16, tp=tp)
    shape = LaunchShape.parse(cli.shape)
    runner = DraftRunner(model, model.draft(), shape=shape) if cli.draft else runner_module.MonoRunner(model,
                                                                                                      shape=shape)
    runner.fast = True  # the NVIDIA code paths
    # tiles chosen by the grid (one-row GEMV blocks) as on the target GPU, not the CPU runner's grid of 1;
    # the recorded launches never run, so nothing else reads it
    runner.grids = runner_module.kernel_grids(runner.shape, cli.sms)
    runner.check = lambda: None  # nothing ran
    for rows in (int(w) for w in cli.widths.split(",")):
        if cli.draft:  # a block a request
            cache, block = runner.draft.make_cache(8), runner.draft_block
            positions, slots = [8 + i % block for i in range(rows)], [i // block for i in range(rows)]
        else:
            cache, live = model.make_cache(8, cli.context, 8), min(rows, 5)
            positions, slots = list(range(live)) + [0] * (rows - live), [0] * live + [-1] * (rows - live)
        runner.step(cache, [1] * rows, positions, slots)  # its outputs are garbage: nothing ran
    # each distinct launch once, and the first K1, K2 and K3 launches again with the timeline's stamps
    timed = [(kernel, with_timeline(args), kwargs) for kernel, args, kwargs in launches[:3]]
    keys = set()
    BUILDS.clear()
    for kernel, args, kwargs in launches + timed:
        constants = signature(kernel, args)[1]
        key = (kernel.__name__, tuple(sorted((k, repr(v)) for k, v in constants.items())))
        if key not in keys:
            keys.add(key)
            BUILDS.append((kernel, args, kwargs))
    # A build runs on one core: one process a core, forked so that they share the recorded launches.
    with multiprocessing.get_context("fork").Pool(min(len(BUILDS), len(os.sched_getaffinity(0)))) as pool:
        for line in pool.imap(functools.partial(build, dump=cli.dump), range(len(BUILDS))):
            print(line, flush=True)
    print(f"{len(BUILDS)} kernels built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
