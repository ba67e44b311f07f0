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
def test_k1_and_k2_build_for_sm90(compiled_env):
    """Widths 1 and 48: K1, K2 and the ffn launch for hash and bias routing, and the first K1 and K2
    with the timeline's stamps."""
    assert "10 kernels built" in run_tool("mono_compile.py", compiled_env)


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
