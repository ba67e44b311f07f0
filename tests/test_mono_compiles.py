"""The mono kernels build with compiled Triton for sm_90 (no GPU needed): see tests/mono_compile.py."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Triton is not imported here: the other kernel tests set TRITON_INTERPRET before it is.
TRITON = importlib.util.find_spec("triton")
HAS_NVIDIA_BACKEND = TRITON is not None and any(
    (Path(root) / "backends" / "nvidia").is_dir() for root in TRITON.submodule_search_locations)


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="this Triton has no NVIDIA backend")
@pytest.mark.parametrize("shape", ["default", "gemv_tma=1,expert_tma=1"])
def test_k1_and_k2_build_for_sm90(shape):
    """The default shape, and every weight tile through tensor descriptors."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("mono_compile.py")
    done = subprocess.run([sys.executable, str(script), "--shape", shape], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # widths 1 and 48: K1, K2 and the ffn launch for hash and bias routing, and two with a timeline
    assert "10 kernels built" in done.stdout, done.stdout


def k_loop(*options: str) -> tuple[int, dict[str, int]]:
    """(instructions, opcode counts) of the expert K loop (the longest loop) that
    tests/expert_sass.py prints for these options."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("expert_sass.py")
    done = subprocess.run([sys.executable, str(script), "--top", "100", *options], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "128 weights a thread a K step" in done.stdout
    loops = [re.match(r"loop of (\d+) instructions \([^)]*\): (.*)", line) for line in done.stdout.splitlines()]
    length, mix = max((int(m[1]), m[2]) for m in loops if m)
    return length, {op: int(n) for op, n in (item.rsplit(" ", 1) for item in mix.split(", "))}


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="this Triton has no NVIDIA backend")
def test_the_expert_k_loop_disassembles_for_sm90():
    """tests/expert_sass.py: the gate/up kernel's K loop found in the SASS, with its tensor-core ops
    and its loads; in the fragment order (`experts.to_fragment_order`, the launcher's 8-warp
    128 x 256 tile capped at 128 registers) the decoded pairs need no byte shuffles, a code is a
    shift and a mask, and the codes come straight from global memory into the dot's registers
    (`experts._load_fragments`: no shared-memory loads or async copies): fewer PRMT, at most 3.0
    instructions a weight (2.95 with this machine's Triton; the checkpoint's order takes 5.0)."""
    interleaved, interleaved_mix = k_loop()
    fragments, fragments_mix = k_loop("--fragments", "--block-n", "128", "--warps", "8", "--max-registers", "128")
    for mix in (interleaved_mix, fragments_mix):
        assert mix["HGMMA"] > 0 and mix["LDG"] > 0, mix
    assert fragments_mix.get("PRMT", 0) < interleaved_mix["PRMT"], (interleaved_mix, fragments_mix)
    assert "LDS" not in fragments_mix and "LDGSTS" not in fragments_mix, fragments_mix
    assert fragments <= 3.0 * 128 < interleaved, (fragments, interleaved)
