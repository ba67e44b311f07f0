"""Instruction mix of the expert stage's K loop, for an H100/H200 (sm_90), without a GPU.

`python tools/expert_sass.py [--block-n 128 --block-k 256 --warps 8] [--down] [--top 12]
[--ttgir FILE]`, in a process where TRITON_INTERPRET is unset (the installed Triton compiles: put
the GPU's version first on PYTHONPATH to see what it builds). Records one gate/up (`--down`:
down) launch of `expert_stage.launch_stages` (K3's expert task loops, warps and register cap) at
v4-flash sizes (hidden 4096, intermediate 2048, 6 rows, top-6 of 8 experts), compiles it with
`triton.compile` (the JIT's divisibility hints: tools/mono_compile.py), disassembles the cubin
with Triton's bundled `nvdisasm`, and prints the kernel's registers a thread and spills (ptxas -v), then, for every
loop (a label and the branch back to it), its length and its most frequent opcodes. The K loop
is the long one: its length over the weights a thread decodes a K step (BN * BK / (32 * warps))
is the instructions a weight.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from monodecode.mono import expert_stage as stage
from monodecode.mono import experts as X
from monodecode.mono.shape import LaunchShape

sys.path.insert(0, os.path.dirname(__file__))
from mono_compile import Recorder, registers, signature  # noqa: E402

D, I, E, TOPK, ROWS = 4096, 2048, 8, 6, 6


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(length, opcode counts) of each loop: the instructions from a label to a branch back to it."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label[1]] = len(instructions)
            continue
        instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if instruction:
            instructions.append(instruction[1].strip())
    found = []
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if branch and labels.get(branch[1], i + 1) <= i:
            body = instructions[labels[branch[1]]:i + 1]
            found.append((len(body), collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the expert K loop's SASS instruction mix, for sm_90")
    parser.add_argument("--block-n", type=int, default=LaunchShape.expert_block_n)
    parser.add_argument("--block-k", type=int, default=LaunchShape.expert_block_k)
    parser.add_argument("--warps", type=int, default=LaunchShape.expert_warps)
    parser.add_argument("--down", action="store_true", help="the down kernel instead of gate/up")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed a loop, the most frequent first")
    parser.add_argument("--ttgir", help="also write the kernel's TTGIR (Triton's layouts) to this file")
    args = parser.parse_args(argv)

    def matrix(n, k):
        return (torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8),
                torch.randint(118, 130, (E, n, k // 32), dtype=torch.uint8))

    weights = X.ExpertWeights(matrix(I, D), matrix(D, I), matrix(I, D), _fast_decode=True)
    launches, others = [], []
    recorded = "_down" if args.down else "_up"
    for name in ("_up", "_swiglu", "_down"):
        setattr(stage, name, Recorder(getattr(stage, name), launches if name == recorded else others))
    shape = LaunchShape(expert_warps=args.warps, expert_block_n=args.block_n, expert_block_k=args.block_k)
    ids = torch.randint(0, E, (ROWS, TOPK))
    stage.interpreted = lambda: True  # grid (1,): no GPU to ask for its SM count
    stage.launch_stages(torch.randn(ROWS, D).to(torch.bfloat16), X.group_picks(ids), torch.rand(ROWS * TOPK),
                        weights, 10.0, stage.StageBuffers(ROWS * TOPK, weights, "cpu"), shape=shape, fast=True)
    kernel, launch_args, kwargs = launches[0]
    values = list(launch_args) + [tl.constexpr(kwargs.pop(name)) for name in kernel.arg_names[len(launch_args):]]
    types, constants, attrs = signature(kernel, values)
    compiled = triton.compile(ASTSource(kernel, types, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kwargs["num_warps"], "maxnreg": kwargs["maxnreg"]})
    if args.ttgir:
        with open(args.ttgir, "w") as f:
            f.write(compiled.asm["ttgir"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    per_thread = args.block_n * args.block_k // (32 * args.warps)
    print(f"{kernel.__name__}: BN {args.block_n}, BK {args.block_k}, {args.warps} warps; {per_thread} weights a "
          f"thread a K step; {registers(compiled.asm['ptx'])}")
    for length, opcodes in loops(sass):
        print(f"loop of {length} instructions ({length / per_thread:.2f} a weight if the K loop): "
              + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
