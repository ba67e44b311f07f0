"""Instruction mix of the expert stage's K loop, for an H100/H200 (sm_90), without a GPU.

`python tests/expert_sass.py [--block-n 64 --block-k 256 --warps 4 --stages 1 --programs 0]
[--max-registers 0] [--tma] [--fragments] [--pdl] [--paired] [--down-split 1] [--down] [--overlap] [--diagonal]
[--up-split 1] [--top 12]
[--ttgir FILE]`, in a process where
TRITON_INTERPRET is unset (the installed Triton compiles: put the GPU's version first on
PYTHONPATH to see what it builds, e.g. `pip install --target DIR triton==3.6.0`).
Records one gate/up (`--down`: down) launch of `experts.launch_stages` at v4-flash sizes (hidden 4096,
intermediate 2048, 6 rows, top-6 of 8 experts), compiles it with `triton.compile` (the JIT's
divisibility hints: tests/mono_compile.py), disassembles the cubin with Triton's bundled
`nvdisasm`, and prints, for every loop (a label and the branch back to it),
its length and its most frequent opcodes, after the kernel's registers a thread and spills
(ptxas -v, as tests/mono_compile.py reads them). The K loop is the long one: its length over the weights a thread decodes a K
step (BN * BK / (32 * warps)) is the instructions a weight (docs/PERFORMANCE.md: ~5.0 for the
4-warp 64 x 256 tile in the checkpoint's order; 2.77-2.79 for the 8-warp 128 x 256 one in the
fragment order with Triton 3.6).
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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from monodecode.mono import experts as X

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
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=256)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--programs", type=int, default=0, help="0: a program a task; n: n persistent programs")
    parser.add_argument("--tma", action="store_true", help="LaunchConfig.tma")
    parser.add_argument("--max-registers", type=int, default=0, help="LaunchConfig.max_registers")
    parser.add_argument("--fragments", action="store_true", help="the codes in the fragment order")
    parser.add_argument("--stages", type=int, default=1, help="LaunchConfig.num_stages")
    parser.add_argument("--pdl", action="store_true", help="LaunchConfig.pdl")
    parser.add_argument("--paired", action="store_true", help="LaunchConfig.paired")
    parser.add_argument("--down-split", type=int, default=1, help="LaunchConfig.down_split")
    parser.add_argument("--down", action="store_true", help="the down kernel instead of gate/up")
    parser.add_argument("--overlap", action="store_true", help="LaunchConfig.overlap")
    parser.add_argument("--diagonal", action="store_true", help="LaunchConfig.diagonal")
    parser.add_argument("--up-split", type=int, default=1, help="LaunchConfig.up_split")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed a loop, the most frequent first")
    parser.add_argument("--ttgir", help="also write the kernel's TTGIR (Triton's layouts) to this file")
    args = parser.parse_args(argv)

    def matrix(n, k):
        return (torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8),
                torch.randint(118, 130, (E, n, k // 32), dtype=torch.uint8))

    weights = X.ExpertWeights(matrix(I, D), matrix(D, I), matrix(I, D), fragments=args.fragments, _fast_decode=True)
    launches, others = [], []
    recorded = ("_down", "_down_persistent") if args.down else ("_up", "_up_persistent", "_paired_up")
    for name in ("_up", "_up_persistent", "_paired_up", "_swiglu", "_down", "_down_persistent"):
        setattr(X, name, Recorder(getattr(X, name), launches if name in recorded else others))
    config = X.LaunchConfig(True, args.block_n, args.block_k, args.warps, args.stages, programs=args.programs,
                            tma=args.tma, max_registers=args.max_registers, pdl=args.pdl,
                            paired=args.paired, down_split=args.down_split, overlap=args.overlap,
                            diagonal=args.diagonal, up_split=args.up_split)
    ids = torch.randint(0, E, (ROWS, TOPK))
    X.launch_stages(torch.randn(ROWS, D).to(torch.bfloat16), X.group_picks(ids), torch.rand(ROWS * TOPK), weights,
                    10.0, config, X.StageBuffers(ROWS * TOPK, weights, "cpu", splits=args.down_split,
                                              up_splits=args.up_split))
    kernel, launch_args, kwargs = launches[0]
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg", "launch_pdl") if key in kwargs}
    types, constants, attrs = signature(kernel, launch_args, kwargs)
    compiled = triton.compile(ASTSource(kernel, types, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    if args.ttgir:
        with open(args.ttgir, "w") as f:
            f.write(compiled.asm["ttgir"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    per_thread = args.block_n * args.block_k // (32 * args.warps)
    print(f"{kernel.__name__}: BN {args.block_n}, BK {args.block_k}, {args.warps} warps, {args.stages} stages, "
          f"programs {args.programs}, tma {args.tma}, fragments {args.fragments}, pdl {args.pdl}, "
          f"paired {args.paired}; "
          f"{per_thread} "
          f"weights a thread a K step; {registers(compiled.asm['ptx'])}")
    for length, opcodes in loops(sass):
        print(f"loop of {length} instructions ({length / per_thread:.2f} a weight if the K loop): "
              + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
