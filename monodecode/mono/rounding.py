"""The reference's bf16 rounding points, inside Triton kernels.

`bf16(v)` rounds fp32 values to the nearest bf16 (ties to even) and keeps them as fp32, for kernels
that go on computing in fp32 after a point where the per-op path rounds. It rounds with integer
arithmetic on the bits, everywhere: Triton's CPU interpreter truncates in its fp32 -> bf16 cast, and
compiled for the H200 (Triton 3.6) a `.to(tl.bfloat16).to(tl.float32)` round trip inside a fused
expression did not always round (the fold's hc_post: a third of its elements an ulp or more off the
exact definition, none with this function; tests/test_mono_hc.py). The bitcasts leave the compiler
nothing to fold away.
"""

import triton
import triton.language as tl


@triton.jit
def bf16(v):
    """fp32 -> the nearest bf16 (ties to even), still as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
