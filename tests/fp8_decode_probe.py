"""Probe for a next step of the expert stage: e2m1 codes decoded to e4m3 in registers for FP8
tensor cores (docs/PERFORMANCE.md, "A plan for the next step"), without a GPU.

`python tests/fp8_decode_probe.py [--block-n 128] [--block-k 256] [--columns 32] [--warps 8]`, in a
process where TRITON_INTERPRET is unset (put the GPU's Triton first on PYTHONPATH, as for
tests/expert_sass.py). Two things:
1. The decode's bit formula, checked exhaustively in Python: a byte packs two codes so that
   `w & 0x9C9C9C9C` and `((w << 2) & 0x8C8C8C8C) | ((w >> 2) & 0x10101010)` are their e4m3 bytes, each
   the e2m1 value times 2^-6 (subnormals included), whatever the neighbouring bytes hold.
2. A K loop compiled for sm_90: 16-byte loads of a tile laid out like the fragment order (16-row
   blocks, lane t taking 16 bytes of a row per 128 columns), the decode, and a dot with an e4m3
   operand [BK, columns] from memory (standing in for a block-diagonal x). It prints the loop's
   length and opcodes and whether Triton converts the decoded tile's layout through shared memory
   or shuffles (TTGIR `convert_layout` on the way to the dot, and LDS / SHFL in the loop). Values are
   not checked: the byte order is the k32 A fragment's (lane t: columns 4t..4t+3 and 16 + 4t..16 +
   4t + 3 of each 32), which a real layout would have to produce at load.
On Triton 3.6 (2026-11-30): 178 instructions a K step of a 128 x 256 tile with 8 warps (LOP3 49,
STS 32 for the stand-in operand, PRMT 24, IMAD 19, SHF 16, QGMMA 8), no LDS or SHFL: the decoded
registers go to the wgmma as they are. The bf16 decode's loop is 292 (`tests/expert_sass.py
--diagonal`). The decode was then built into the stage (commit 4cc2e6b) and removed again: x as
e4m3 hi + lo was not exact (the FP8 tensor cores' accumulator keeps ~13 bits), x as base-32
digits was, and the stage was no faster (docs/PERFORMANCE.md, "FP8 tensor cores with x as base-32
digits").
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(__file__))
from expert_sass import loops  # noqa: E402
from mono_compile import registers  # noqa: E402

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pack(first: int, second: int) -> int:
    """The byte of two codes: the first's bits where `w & 0x9C` keeps them (sign 7, exponent and
    mantissa 4..2), the second's where the shifts bring them there (sign 5, exponent 6 and 1,
    mantissa 0)."""
    return ((first & 8) << 4) | ((first & 7) << 2) | ((second & 8) << 2) | ((second & 4) << 4) | (second & 3)


def check_formula() -> None:
    """Every pair of codes, in every byte of a word whose other bytes are random."""
    g = torch.Generator().manual_seed(0)
    for first in range(16):
        for second in range(16):
            for byte in range(4):
                noise = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64))
                w = ((noise & ~(0xFF << 8 * byte)) | pack(first, second) << 8 * byte) & 0xFFFFFFFF
                ours = (w & 0x9C9C9C9C, ((w << 2) & 0x8C8C8C8C) | ((w >> 2) & 0x10101010))
                for code, word in zip((first, second), ours):
                    value = torch.tensor([(word >> 8 * byte) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
                    expected = (-1.0 if code & 8 else 1.0) * E2M1[code & 7]
                    assert float(value) * 64 == expected, (first, second, byte)


@triton.jit
def _decode_e4m3(codes):
    """uint8 [..] -> (first, second) e4m3 [..], each the code's e2m1 value times 2^-6 (`pack`)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b;
        and.b32 $0, $2, 0x9C9C9C9C;
        shl.b32 a, $2, 2; and.b32 a, a, 0x8C8C8C8C;
        shr.b32 b, $2, 2; and.b32 b, b, 0x10101010; or.b32 $1, a, b;
        }""",
        constraints="=r,=r,r", args=[codes], dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)


@triton.jit
def _k_loop(codes_ptr, x_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr, NX: tl.constexpr):
    row0 = tl.program_id(0) * BN
    G: tl.constexpr = BK // 128  # column groups
    W: tl.constexpr = BN // 16  # 16-row bands
    g = tl.arange(0, G)[:, None, None]
    a = tl.arange(0, 2)[None, :, None]  # the row offset 8
    f = tl.arange(0, W * 512)[None, None, :]  # (band, row i, lane t, 16 bytes)
    acc = tl.zeros((BN, NX), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        block = (row0 // 16 + f // 512) * (K // 128) + k0 // 128 + g  # 1024 bytes: (a, i, t, 16)
        at = tl.max_contiguous(tl.multiple_of(block * 1024 + 512 * a + f % 512, [1, 1, 16]), [1, 1, 16])
        tile = tl.reshape(tl.permute(tl.reshape(tl.load(codes_ptr + at), (G, 2, W, 8, 64)), (2, 1, 3, 0, 4)),
                          (BN, BK // 2))  # [n, (g, t, word j, byte i)]
        first, second = _decode_e4m3(tile)
        w = tl.reshape(tl.join(first, second), (BN, G, 4, 4, 4, 2))  # (n, g, t, j, i, half h)
        w = tl.reshape(tl.permute(w, (0, 1, 3, 5, 2, 4)), (BN, BK))  # column 128 g + 32 j + 16 h + 4 t + i
        xk = k0 + tl.arange(0, BK)
        acc = tl.dot(w, tl.load(x_ptr + xk[:, None] * NX + tl.arange(0, NX)[None, :]), acc)
    tl.store(out_ptr + (row0 + tl.arange(0, BN))[:, None] * NX + tl.arange(0, NX)[None, :], acc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=256)
    parser.add_argument("--columns", type=int, default=32, help="N of the dot (rows x blocks x halves of x)")
    parser.add_argument("--warps", type=int, default=8)
    args = parser.parse_args(argv)
    check_formula()
    print("decode formula: all 256 pairs of codes exact (value times 2^-6)")
    types = {"codes_ptr": "*u8", "x_ptr": "*fp8e4nv", "out_ptr": "*fp32", "K": "i32", "BN": "constexpr",
             "BK": "constexpr", "NX": "constexpr"}
    source = ASTSource(_k_loop, types, constexprs={"BN": args.block_n, "BK": args.block_k, "NX": args.columns},
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": args.warps, "maxnreg": 128})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    conversions = [line.strip() for line in compiled.asm["ttgir"].splitlines() if "ttg.convert_layout" in line]
    print(f"BN {args.block_n}, BK {args.block_k}, N {args.columns}, {args.warps} warps; "
          f"{registers(compiled.asm['ptx'])}; {len(conversions)} layout conversions in the TTGIR (those in the loop are register renamings unless "
          "the loop has LDS or SHFL)")
    per_thread = args.block_n * args.block_k // (32 * args.warps)
    for length, opcodes in loops(sass):
        print(f"loop of {length} instructions ({length / per_thread:.2f} a weight): "
              + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
