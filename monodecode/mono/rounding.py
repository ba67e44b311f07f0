"""The reference's bf16 rounding points, inside Triton kernels.

`bf16(v, FAST)` rounds fp32 values to the nearest bf16 (ties to even) and keeps them as fp32, for
kernels that go on computing in fp32 after a point where the per-op path rounds. FAST (compiled on
NVIDIA) uses the hardware cast; otherwise `round_to_bf16` does it with integer arithmetic, because
Triton's CPU interpreter truncates in its fp32 -> bf16 cast.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), still as fp32, by integer arithmetic."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16(v, FAST: tl.constexpr):
    """fp32 -> the nearest bf16, kept as fp32."""
    if FAST:
        r = v.to(tl.bfloat16).to(tl.float32)
    else:
        r = round_to_bf16(v)
    return r
