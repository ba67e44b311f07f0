"""The standalone one-row GEMV built for sm_90 on a CPU machine, and its K loop's SASS counted by
opcode (a probe for docs/notes/2026-12-07-split-sums-landed-and-a-null-ab.md, not project code).

Run from a checkout's root with the GPU's Triton in a venv and TRITON_INTERPRET unset:
    PYTHONPATH=$PWD /tmp/t36s/bin/python docs/results/one_row_step_sass_2026-12-07.py 32768 1024
(N, K of the weight: 32768 x 1024 is wq_b). Prints registers and spills, then the K loop's
instructions (the longest backward branch's body, the task's epilogue included)."""
import collections
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import mono_compile as MC  # noqa: E402
from monodecode.mono import gemv as G  # noqa: E402

N, K, WARPS = int(sys.argv[1]), int(sys.argv[2]), 8
launches = []
G._gemv_stage = MC.Recorder(G._gemv_stage, launches)  # record the launch instead of running it
x = torch.randn(1, K).to(torch.bfloat16)
w = torch.randint(0, 255, (N, K), dtype=torch.uint8)
s = torch.randint(120, 130, (N // 128, K // 128), dtype=torch.uint8)
G.gemv(x, w, s, block=G.single_row_blocks(N, K, 128, 132), fast=True)
kernel, args, kwargs = launches[0]
types, constants, attrs = MC.signature(kernel, args)
for name, value in kwargs.items():
    constants[(kernel.arg_names.index(name),)] = value
    types[name] = "constexpr"
compiled = triton.compile(ASTSource(kernel, types, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
print(MC.registers(compiled.asm["ptx"]))
with open("/tmp/one_row_step.cubin", "wb") as f:
    f.write(compiled.asm["cubin"])
nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
lines = subprocess.run([nvdisasm, "-c", "/tmp/one_row_step.cubin"], capture_output=True, text=True).stdout.splitlines()
labels = {l.strip()[:-1]: i for i, l in enumerate(lines) if re.match(r"^\.L_x_\d+:", l.strip())}
loop = (0, 0)
for i, line in enumerate(lines):
    m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
    if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > loop[1] - loop[0]:
        loop = (labels[m.group(1)], i)
body = [l for l in lines[loop[0]:loop[1] + 1] if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
ops = collections.Counter(re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", l).split()[0].split(".")[0]
                          for l in body)
print(len(body), "instructions in the K loop:", ", ".join(f"{k} {v}" for k, v in ops.most_common()))
