"""The mono kernels build with compiled Triton for sm_90 (no GPU needed): tools/mono_compile.py
and tools/expert_sass.py, each in a subprocess where Triton compiles."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Triton is not imported here: the kernel tests run it interpreted (conftest.py).
TRITON = importlib.util.find_spec("triton")
HAS_NVIDIA_BACKEND = TRITON is not None and any(
    (Path(root) / "backends" / "nvidia").is_dir() for root in TRITON.submodule_search_locations)
TOOLS = Path(__file__).parent.parent / "tools"
needs_nvidia = pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="this Triton has no NVIDIA backend")


def run_tool(name: str, env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, str(TOOLS / name), *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_nvidia
@pytest.mark.parametrize("widths, kernels", [pytest.param("1,48", 16, marks=pytest.mark.slow), ("6", 10)],
                         ids=["1_and_48_rows", "6_rows"])
def test_the_kernels_build_for_sm90(compiled_env, widths, kernels):
    """K1 and K2 of the window, the CSA and the HCA layer at each width, K3 (one build for every
    width and layer), and the first K1, K2 and K3 with the timeline's stamps. A build takes
    seconds, so widths 1 (the one-row loops) and 48 (the widest tiles) are `slow`; by default 6
    rows (a draft block's step: the many-row loops)."""
    assert f"{kernels} kernels built" in run_tool("mono_compile.py", compiled_env, "--widths", widths)


@needs_nvidia
def test_rank_one_of_two_builds(compiled_env):
    """Rank 1's kernels under tensor parallelism: its slices, the sums over the ranks in K2 and K3,
    its peer sites' rank a compile-time constant (the JIT makes a 1 one)."""
    out = run_tool("mono_compile.py", compiled_env, "--widths", "6", "--tensor-parallel", "2", "--rank", "1")
    assert "10 kernels built" in out


@needs_nvidia
def test_the_kernels_build_with_one_compressed_entry(compiled_env):
    """A cache of 16 positions holds one entry of the tiny HCA layer (ratio 16): the entry count
    1 is then a compile-time constant, as the JIT specialises it (it took Triton 3.6, the GPU's,
    a move of the count out of the compressor's nested arguments to build: k1.py)."""
    assert "10 kernels built" in run_tool("mono_compile.py", compiled_env, "--widths", "6", "--context", "16")


@needs_nvidia
@pytest.mark.parametrize("matrix", ["gate/up", "down"])
def test_the_expert_k_loops_disassemble_for_sm90(compiled_env, matrix):
    """The expert stage's K loops in the SASS (the default 8-warp 128 x 256 tile, v4-flash sizes):
    the ordinary loop and the diagonal one (tasks of one or two rows), each on the tensor cores
    with the codes straight from global memory into the dot's registers (`experts.load_fragments`:
    no shared-memory loads or async copies), at most 3.0 instructions a weight."""
    out = run_tool("expert_sass.py", compiled_env, "--top", "100", *(["--down"] if matrix == "down" else []))
    per_thread = int(re.search(r"(\d+) weights a thread a K step", out)[1])
    k_loops = []
    for line in out.splitlines():
        found = re.match(r"loop of (\d+) instructions \([^)]*\): (.*)", line)
        if found:
            mix = {op: int(n) for op, n in (item.rsplit(" ", 1) for item in found[2].split(", "))}
            if "HGMMA" in mix and int(found[1]) < 4 * per_thread:  # not the task loop around them
                k_loops.append((int(found[1]), mix))
    assert len({length for length, _ in k_loops}) >= 2, out  # (gate/up: both once for w1 and once for w3)
    for length, mix in k_loops:
        assert mix["LDG"] > 0 and "LDS" not in mix and "LDGSTS" not in mix, mix
        assert length <= 3.0 * per_thread, (length, per_thread)


# Compiles the standalone GEMV stage for sm_90 with K's alignment unknown to the compiler (as for
# a K the kernel computes, wo_a's) and prints how many bytes of a weight row a thread loads at once.
GEMV_WEIGHT_LOAD_WIDTH = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from monodecode.mono.gemv import _gemv_stage

rows, bn, bk, split = (int(a) for a in sys.argv[1:5])
sig = {"x_ptr": "*bf16", "x_stride": "i32", "R": "i32", "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*bf16",
       "y_stride": "i32", "N": "i32", "K": "i32", "group_rows": "i32", "sums_ptr": "*fp32", "tickets_ptr": "*i32",
       "up_ptr": "*bf16", "limit": "fp32"}
aligned = {(list(sig).index(name),): [["tt.divisibility", 16]] for name in sig if name not in ("K", "R", "limit")}
sig.update(dict.fromkeys(["WFMT", "SB", "BN", "BK", "SPLIT", "BR", "OUT_BF16", "FAST", "STAGES", "SWIGLU"],
                         "constexpr"))
constants = {"WFMT": 0, "SB": 128, "BN": bn, "BK": bk, "SPLIT": split, "BR": 1 if rows == 1 else 16,
             "OUT_BF16": True, "FAST": True, "STAGES": 4, "SWIGLU": False}
built = triton.compile(ASTSource(fn=_gemv_stage, signature=sig, constexprs=constants, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
ir = built.asm["ttgir"]
layouts = dict(re.findall(r"^(#blocked\\d*) = #ttg.blocked<{sizePerThread = \\[\\d+, (\\d+)\\]", ir, re.M))
loads = re.findall(rf"(tt.load|async_copy_global_to_local) .*: tensor<{bn}x{bk}x!tt.ptr<i8>, (#blocked\\d*)>", ir)
print(min(int(layouts[layout]) for _, layout in loads), all(op == "async_copy_global_to_local" for op, _ in loads))
"""


@needs_nvidia
@pytest.mark.parametrize("rows, bn, bk, split", [(1, 32, 512, 1), (6, 64, 128, 1), (6, 128, 128, 4)])
def test_gemv_loads_weight_rows_in_vectors_whatever_k(compiled_env, rows, bn, bk, split):
    """The dense GEMV's weight tile is loaded 8+ bytes a thread at a time even where the compiler
    cannot prove K a multiple of 16 (it loaded wo_a a byte at a time, unpipelined, inside K2), and
    through Triton's pipeline (async copies) at every width, split along K too (a CTA barrier in
    the K loop, where a split task once took its ticket, silently turned the pipeline off)."""
    done = subprocess.run([sys.executable, "-c", GEMV_WEIGHT_LOAD_WIDTH, str(rows), str(bn), str(bk), str(split)],
                          env=compiled_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    width, pipelined = done.stdout.split()[-2:]
    assert int(width) >= 8, done.stdout
    assert pipelined == "True", done.stdout
