"""The reference's bf16 rounding points, inside Triton kernels.

`bf16(v)` rounds fp32 values to the nearest bf16 (ties to even) and keeps them as fp32, for kernels
that go on computing in fp32 after a point where the per-op path rounds. A compiled (NVIDIA)
build converts with one PTX instruction, `cvt.rn.bf16x2.f32` of the value and 0.0, whose 32
bits are the rounded value as fp32 (the bf16 in the high half); Triton's CPU interpreter, which
has no PTX and truncates in its own fp32 -> bf16 cast, rounds with integer arithmetic on the
bits. Either is opaque to the compiler: compiled for the H200 (Triton 3.6) a
`.to(tl.bfloat16).to(tl.float32)` round trip inside a fused expression did not always round (the
fold's hc_post: a third of its elements an ulp or more off the exact definition;
tests/test_mono_hc.py).
"""

import triton
import triton.language as tl

from .plan import interpreted

# decided when the module is imported, as triton.jit decides between the interpreter and a build
_PTX: tl.constexpr = tl.constexpr(not interpreted())


@triton.jit
def bf16(v):
    """fp32 -> the nearest bf16 (ties to even), still as fp32."""
    if _PTX:
        return tl.inline_asm_elementwise("{ .reg .f32 z; mov.f32 z, 0f00000000; cvt.rn.bf16x2.f32 $0, $1, z; }",
                                         "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    else:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
