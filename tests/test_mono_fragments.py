"""The routed experts' fragment order (mono/fragments.py): where each code lands, and back."""

import pytest
import torch

from monodecode.mono.fragments import FRAGMENT_CODE_WAYS, fragment_code_masks, from_fragment_order, to_fragment_order


def test_the_fragment_order_places_each_column():
    """Column m*32 + s*16 + q*8 + 2t + r of a 128-column group g of row n is code 2s + q of half r
    of word (t, m) of that row's 64 bytes, which lie in block (n / 16, g) (1 KB, band by band,
    group by group) at 512 a + 64 i bytes for n % 16 = 8 a + i: that half, its bytes swapped or
    not and shifted as the code's way for each code bit says, has the bit at its bf16 place;
    checked one bit at a time."""
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 256, (2, 32, 128), dtype=torch.uint8, generator=g)  # 2 bands, K = 256: 2 groups
    nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(64, 256).long()  # column order
    b = to_fragment_order(codes).long().reshape(-1, 2)
    halves = b[:, 0] | b[:, 1] << 8
    n = torch.arange(64)
    for column in range(256):
        group, m, s, q = column // 128, column // 32 % 4, column // 16 % 2, column // 8 % 2
        t, r = column // 2 % 4, column % 2
        half = halves[(n // 16 * 2 + group) * 512 + n % 16 // 8 * 256 + n % 8 * 32 + t * 8 + m * 2 + r]
        for bit, (place, (swap, shift)) in enumerate(zip((6, 7, 8, 15), FRAGMENT_CODE_WAYS[2 * s + q])):
            source = (place - shift + 8 * swap) % 16  # the byte swap moves bit j of a half to j + 8 mod 16
            assert torch.equal(half >> source & 1, nibbles[:, column] >> bit & 1)
    assert torch.equal(from_fragment_order(to_fragment_order(codes)), codes)
    with pytest.raises(ValueError, match="multiple of 128"):
        to_fragment_order(codes[..., :32])
    with pytest.raises(ValueError, match="multiple of 16"):
        to_fragment_order(codes[:, :8])


def test_the_fragment_halves_bits_are_a_permutation():
    """Every bit of a 16-bit half lands on exactly one bf16 bit of one code's value, and no shift
    takes a bit from outside the half (the other half of a register)."""
    terms = [(swap, place - shift) for code in range(4)
             for (swap, shift), mask in fragment_code_masks(code).items()
             for place in range(16) if mask >> place & 1]
    assert all(0 <= j < 16 for _, j in terms), terms
    assert sorted((j + 8 * swap) % 16 for swap, j in terms) == list(range(16))
