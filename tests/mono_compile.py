"""Compile the mono kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's CPU interpreter accepts code that compiled Triton refuses (a non-constexpr global in a
kernel, for one), so the CPU tests alone can pass kernels that do not build. This runs one mono
step of a tiny three-layer model (a `whole`, a hash-routed `ffn` and a bias-routed `ffn` layer)
at widths 1 and 48 with the launches recorded instead of run, then compiles each distinct
recorded launch with `triton.compile` for sm_90 (and the first K1 and K2 with the timeline's
stamps), and prints one line a kernel. Run it in a
process where TRITON_INTERPRET is unset (tests/test_mono_compiles.py does).
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import preset
from monodecode.model import Model
from monodecode.mono import k1, k2, plan
from monodecode.mono import runner as runner_module

POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64",
           torch.uint8: "*u8"}


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def signature(kernel, args, kwargs):
    values = list(args) + [kwargs[name] for name in kernel.arg_names[len(args):]]
    types, constants = {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, values)):
        if kernel.params[i].is_constexpr:
            types[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        else:
            types[name] = "i32" if isinstance(value, int) else "fp32"
    return types, constants


def main() -> int:
    launches = []
    k1._k1, k2._k2 = Recorder(k1._k1, launches), Recorder(k2._k2, launches)
    plan.interpreted = runner_module.interpreted = lambda: True  # a CPU runner, grid (1,)
    config = preset("tiny", num_hidden_layers=3, compress_ratios=(0, 4, 16), dspark_target_layer_ids=(0, 1, 2))
    model = Model.from_checkpoint(SyntheticCheckpoint(config, seed=1), "cpu", torch.bfloat16)
    runner = runner_module.MonoRunner(model)
    runner.fast = True  # the NVIDIA code paths
    runner.check = lambda: None  # nothing ran
    for rows in (1, 48):
        cache = model.make_cache(8, 64, 8)
        positions = [0] if rows == 1 else [0, 1, 2, 3, 4] + [0] * (rows - 5)
        slots = [0] if rows == 1 else [0] * 5 + [-1] * (rows - 5)
        runner.step(cache, [1] * rows, positions, slots)  # its outputs are garbage: nothing ran
    built = set()
    # ... and the first K1 and K2 launches again with the timeline's stamps compiled in
    timed = [(kernel, args, {**kwargs, "TIMELINE": True}) for kernel, args, kwargs in launches[:2]]
    for kernel, args, kwargs in launches + timed:
        options = {"num_warps": kwargs.get("num_warps", 4)}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("launch_cooperative_grid", "num_warps")}
        types, constants = signature(kernel, args, kwargs)
        if kwargs["TIMELINE"]:
            types["timeline_ptr"] = "*i64"
        key = (kernel.__name__, tuple(sorted((k, repr(v)) for k, v in constants.items())))
        if key in built:
            continue
        built.add(key)
        compiled = triton.compile(ASTSource(kernel, types, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        timed_note = " (timeline)" if kwargs["TIMELINE"] else ""
        print(f"{kernel.__name__}{timed_note}: built for sm_90, {compiled.metadata.shared} bytes of shared memory")
    print(f"{len(built)} kernels built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
