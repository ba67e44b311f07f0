"""The routed experts' MXFP4 codes in the fragment order: the expert kernels' layout.

The same codes rearranged within each block of 16 rows and 128 columns
(`N % 16 == 0`, `K % 128 == 0`). Within a row, a group of 128 columns
(64 bytes) is permuted as follows; the group's 32 16-bit halves (little-endian byte
pairs) are indexed (t, m, r) row-major (t, m 0..3, r 0..1); half (t, m, r)
holds the 4 codes of columns `m*32 + s*16 + q*8 + 2t + r` for q, s in
0..1, as its code `c = 2s + q`. Thread t of a quad of the tensor cores'
operand then finds its columns (2t, 2t + 1, 2t + 8, 2t + 9 of every 16)
in 16 contiguous bytes, and code c of halves r = 0 and 1 is the pair of
columns it takes from one register. Within a half the codes' bits are
placed for the expert kernels' fast decode (`expert_decode.py`): taking
the half with its two bytes swapped or not, and shifting it left by
`shift` (negative: right), as `FRAGMENT_CODE_WAYS[c][bit]` says,
brings bit `bit` of code c (0..3: mantissa, exponent low, exponent
high, sign) to bf16 bit 6, 7, 8 or 15, which makes the bf16 of the code's
value times 2^-126. A register of two halves decodes both at once: one
byte swap, three shifts, five masks for the 4 codes, and no bit crosses
from one half into the other's result. The blocks are stored one after
the other, row band (16 rows) by row band, and within a band group by
group, each a 1 KB run of its rows' 64 bytes in the order rows 0 and 8,
1 and 9, ..., 7 and 15 become 0..7 then 8..15 (row `8a + i` at `a * 512
+ i * 64` bytes): the order in which the 32 lanes of a warp take the
tensor cores' operand, 16 bytes each, so that one load instruction of a
warp reads 512 contiguous bytes (whole 128-byte lines, where rows K / 2 bytes
apart would make it 8 half lines). Scales are not permuted.
`from_fragment_order` is the inverse.
"""

import functools

import torch
from torch import Tensor

FRAGMENT_GROUP = 128  # columns a fragment-order block spans
FRAGMENT_ROWS = 16  # rows a fragment-order block spans: the tensor cores' operand, rows 8a + i for a warp


# How each bit (mantissa, exponent low, exponent high, sign) of code c = 2s + q of a 16-bit half
# reaches its bf16 place: (swap the half's two bytes first, then shift left by; negative: right).
# No four single shifts tile 16 bits; with a byte swap the fewest instructions of any tiling are 9
# for a register of two halves (1 swap, 3 shifts, 5 masks; shifts alone: 11), searched exhaustively.
FRAGMENT_CODE_WAYS = (((False, 6),) * 4, ((True, 4),) * 4, ((False, 2),) * 4,
                      ((True, 0), (False, 0), (False, 0), (False, 0)))
E2M1_BF16_BITS = (6, 7, 8, 15)  # where an e2m1 code's bits go in the bf16 of its value times 2^-126


def fragment_code_masks(code: int) -> dict[tuple[bool, int], int]:
    """{(byte swap, left shift): the bits of a 16-bit half's code `code` it brings to their bf16
    places}."""
    masks: dict[tuple[bool, int], int] = {}
    for bit, way in zip(E2M1_BF16_BITS, FRAGMENT_CODE_WAYS[code]):
        masks[way] = masks.get(way, 0) | 1 << bit
    return masks


def _shift(x: Tensor, shift: int) -> Tensor:
    return x << shift if shift >= 0 else x >> -shift


def _swap_bytes(halves: Tensor) -> Tensor:
    return ((halves & 255) << 8) | ((halves >> 8) & 255)


def _halves_of(nibbles: Tensor) -> Tensor:
    """Codes [..., 2 (q), 2 (s)] of each 16-bit half -> the halves (int32)."""
    n = nibbles.int()
    halves = torch.zeros(n.shape[:-2], dtype=torch.int32, device=n.device)
    for code in range(4):
        c = n[..., code % 2, code // 2]
        placed = ((c & 7) << 6) | ((c & 8) << 12)  # the bf16 bits of the code's value times 2^-126
        for (swap, shift), mask in fragment_code_masks(code).items():
            part = _shift(placed & mask, -shift)
            halves |= _swap_bytes(part) if swap else part
    return halves


def _codes_of_halves(halves: Tensor) -> Tensor:
    """The inverse of `_halves_of`, the way the expert kernels decode: swap the bytes or not,
    shift, mask, read the bf16 bits; -> codes [..., 2 (q), 2 (s)]."""
    codes, swapped = [], _swap_bytes(halves)
    for code in range(4):
        placed = sum(_shift(swapped if swap else halves, shift) & mask
                     for (swap, shift), mask in fragment_code_masks(code).items())
        codes.append(((placed >> 6) & 7) | ((placed >> 12) & 8))
    return torch.stack(codes, dim=-1).reshape(*halves.shape, 2, 2).transpose(-1, -2)  # c = 2s + q


@functools.cache
def _half_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(the stored half of each code word c0 | c1 << 4 | c2 << 8 | c3 << 12, the code word of each
    stored half as the kernels decode it), int32 [65536] each, on `device`: the layout of a half
    is a fixed permutation of its 16 bits, so one gather converts it."""
    words = torch.arange(1 << 16, dtype=torch.int32)
    codes = torch.stack([(words >> 4 * c) & 15 for c in range(4)], dim=-1).reshape(-1, 2, 2).transpose(-1, -2)
    decoded = _codes_of_halves(words).transpose(-1, -2).reshape(-1, 4)  # code c = 2s + q
    return _halves_of(codes).to(device), sum(decoded[:, c] << 4 * c for c in range(4)).int().to(device)


_CHUNK_BYTES = 1 << 24  # codes converted at a time: bounds the temporaries on a layer's experts


def fragment_order_refusal(shape) -> str | None:
    """What MXFP4 codes of `shape` [..., N, K / 2] lack for the fragment order, or None."""
    if len(shape) < 2:
        return f"codes [..., N, K / 2], got shape {tuple(shape)}"
    if shape[-1] * 2 % FRAGMENT_GROUP:
        return f"K a multiple of {FRAGMENT_GROUP}, got {shape[-1] * 2}"
    if shape[-2] % FRAGMENT_ROWS:
        return f"N (rows) a multiple of {FRAGMENT_ROWS}, got {shape[-2]}"
    return None


def _by_row_bands(convert, codes: Tensor) -> Tensor:
    """`convert` (rows [n, K / 2] uint8 -> the same, n a multiple of 16) over the rows of codes
    [..., N, K / 2], whole bands of 16 rows at a time, after checking the shape."""
    refusal = fragment_order_refusal(codes.shape)
    if refusal:
        raise ValueError(f"the fragment order needs {refusal}")
    flat = codes.view(torch.uint8).reshape(-1, codes.shape[-1])
    out = torch.empty_like(flat)
    step = max(1, _CHUNK_BYTES // (FRAGMENT_ROWS * flat.shape[1])) * FRAGMENT_ROWS
    for row in range(0, flat.shape[0], step):
        out[row:row + step] = convert(flat[row:row + step])
    return out.reshape(codes.shape)


def _blocks(rows: Tensor) -> Tensor:
    """Rows [n, K / 2] (fragment-permuted within each row) to the blocks' order (module docstring)."""
    n, half = rows.shape
    # (band, a, i, g, byte) -> (band, g, a, i, byte)
    bands = rows.reshape(n // FRAGMENT_ROWS, 2, 8, half * 2 // FRAGMENT_GROUP, FRAGMENT_GROUP // 2)
    return bands.permute(0, 3, 1, 2, 4).reshape(n, half)


def _unblocks(blocks: Tensor) -> Tensor:
    """The inverse of `_blocks`."""
    n, half = blocks.shape
    # (band, g, a, i, byte) -> (band, a, i, g, byte)
    bands = blocks.reshape(n // FRAGMENT_ROWS, half * 2 // FRAGMENT_GROUP, 2, 8, FRAGMENT_GROUP // 2)
    return bands.permute(0, 2, 3, 1, 4).reshape(n, half)


def _rows_to_fragment_order(p: Tensor) -> Tensor:
    """Rows [n, K / 2] in the checkpoint's order to the fragment order, n a multiple of 16."""
    rows, half = p.shape
    # column g*128 + m*32 + s*16 + q*8 + 2t + r, s: which nibble of the fragment-order byte
    v = torch.stack((p & 15, p >> 4), dim=-1).reshape(rows, half * 2 // FRAGMENT_GROUP, 4, 2, 2, 4, 2)
    v = v.permute(0, 1, 5, 2, 6, 3, 4).int()  # (row, g, m, s, q, t, r) -> (row, g, t, m, r, s, q)
    words = v[..., 0, 0] | v[..., 0, 1] << 4 | v[..., 1, 0] << 8 | v[..., 1, 1] << 12  # code c = 2s + q at 4c
    halves = _half_tables(p.device)[0][words]
    return _blocks(torch.stack((halves & 255, halves >> 8), dim=-1).to(torch.uint8).reshape(rows, half))


def _rows_from_fragment_order(p: Tensor) -> Tensor:
    rows, half = p.shape
    b = _unblocks(p).int().reshape(rows, half // 2, 2)
    words = _half_tables(p.device)[1][b[..., 0] | b[..., 1] << 8]
    v = torch.stack([(words >> 4 * c) & 15 for c in range(4)], dim=-1).to(torch.uint8)
    v = v.reshape(rows, half * 2 // FRAGMENT_GROUP, 4, 4, 2, 2, 2)  # (row, g, t, m, r, s, q)
    v = v.permute(0, 1, 3, 5, 6, 2, 4)  # -> (row, g, m, s, q, t, r)
    return (v[..., 0] | (v[..., 1] << 4)).reshape(rows, half)


def to_fragment_order(codes: Tensor) -> Tensor:
    """MXFP4 codes [..., N, K / 2] from the checkpoint's order (column 2i in the low nibble of byte
    i) to the fragment order (module docstring), as uint8."""
    return _by_row_bands(_rows_to_fragment_order, codes)


def from_fragment_order(codes: Tensor) -> Tensor:
    """MXFP4 codes [..., N, K / 2] from the fragment order back to the checkpoint's, as uint8."""
    return _by_row_bands(_rows_from_fragment_order, codes)
