"""Device helpers the attention-side stages share (window attention, compressor, indexer): a row's
rms_norm and interleaved rope with the reference's rounding points, the heads' queries normalised
and rotated as they are loaded, their scaled logits against a block of keys, the compressed
entries a row sees; and the launch helpers of the stages' standalone forms.

Rounding (`model/norm.py`, `model/rope.py`): rms_norm in fp32, rounded to bf16; the rotation in
fp32 from those bf16 values, rounded to bf16; each by `rounding.bf16`. Dots (FAST): bf16 operands
with fp32 accumulation on a CUDA GPU; fp32 operands in IEEE precision elsewhere (the
interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rounding import bf16


HB = 16  # heads of an attend task: the M side of its dots


def head_pairs(R: int, H: int, HB: int = HB) -> int:
    """The (row, head block) pairs of R rows' attend: the unit its tasks are counted in."""
    return R * triton.cdiv(H, HB)


def power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (n >= 1): how many tasks a pair's work is spread over."""
    return 1 << (n.bit_length() - 1)


@triton.jit
def visible_entries(row, positions_ptr, slots_ptr, RATIO: tl.constexpr):
    """The compressed entries row `row` sees: (p + 1) // RATIO at its position p, none for a pad row."""
    return tl.where(tl.load(slots_ptr + row) >= 0, (tl.load(positions_ptr + row) + 1) // RATIO, 0)


@triton.jit
def pair_offsets(BLOCK: tl.constexpr):
    """Channel offsets of a row as [BLOCK / 2, 2] (pair k holds channels 2k, 2k + 1), and the pair
    index of each pair [BLOCK / 2]."""
    pair = tl.arange(0, BLOCK // 2)
    return pair[:, None] * 2 + tl.arange(0, 2)[None, :], pair


@triton.jit
def rms_norm(x, n, eps, w):
    """rms_norm of one row held in x (fp32, any shape, zeros past the n channels), weight w (fp32,
    x's shape) or None; rounded to bf16 as fp32."""
    y = x * tl.rsqrt(tl.sum(x * x) / n + eps)
    if w is not None:
        y = w * y
    return bf16(y)


@triton.jit
def rope(x, pair, position, freqs_ptr, first_pair, n_pairs, INVERSE: tl.constexpr):
    """x [..., P, 2] fp32 (bf16 values), channel pairs (2k, 2k + 1) with pair index `pair` (shape of
    x without its last axis): pairs first_pair .. first_pair + n_pairs - 1 are rotated in fp32 by
    position * freqs[k - first_pair] (negated if INVERSE), the rest kept; rounded to bf16 as fp32."""
    j = pair - first_pair
    is_rope = (j >= 0) & (j < n_pairs)
    angle = position.to(tl.float32) * tl.load(freqs_ptr + j, mask=is_rope, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    even, odd = tl.split(x)
    rot_even = tl.where(is_rope, even * cos - odd * sin, even)
    rot_odd = tl.where(is_rope, even * sin + odd * cos, odd)
    return bf16(tl.join(rot_even, rot_odd))


# --- the heads' queries and their logits ------------------------------------------------------
@triton.jit
def key_chunk(ring_kv_ptr, key_rows, valid, d):
    """Channels d of the window's keys: bf16 [KW, BD], zero where invalid."""
    return tl.load(ring_kv_ptr + key_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def heads_inverse_rms(q_ptr, rows, hmask, eps, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr):
    """rsqrt(mean(q^2) + eps) of each of the task's raw heads [HB] (the heads' rms_norm), its D / BD
    chunk loads all issued at once (unrolled)."""
    squares = tl.zeros((HB, BD), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        x = tl.load(q_ptr + rows + (d0 + tl.arange(0, BD))[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=1) / D + eps)


@triton.jit
def query_chunk(q_ptr, rows, hmask, inv, d0, position, freqs_ptr, D: tl.constexpr, RD, HB: tl.constexpr,
                BD: tl.constexpr, ROPE: tl.constexpr):
    """Channels d0 .. d0 + BD of the task's queries: rope(rms_norm(raw head)) (no norm weight), bf16
    values as fp32 [HB, BD]; ROPE False: a chunk before the rope channels, normalised only."""
    d = d0 + tl.arange(0, BD)
    x = tl.load(q_ptr + rows + d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    normed = bf16(x * inv[:, None])
    if ROPE:
        pair = (d0 // 2 + tl.arange(0, BD // 2))[None, :]
        normed = tl.reshape(rope(tl.reshape(normed, (HB, BD // 2, 2)), pair, position, freqs_ptr, (D - RD) // 2,
                                 RD // 2, False), (HB, BD))
    return normed


@triton.jit
def logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, ring_kv_ptr, key_rows, valid,
                 D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr, ROPE: tl.constexpr):
    """logits + q[:, d0 .. d0 + BD] . keys[:, d0 .. d0 + BD] ([HB, KW] fp32)."""
    q = query_chunk(q_ptr, rows, hmask, inv, d0, position, freqs_ptr, D, RD, HB, BD, ROPE)
    keys = key_chunk(ring_kv_ptr, key_rows, valid, d0 + tl.arange(0, BD))
    if FAST:
        return tl.dot(q.to(tl.bfloat16), tl.trans(keys), logits)
    return tl.dot(q, tl.trans(keys.to(tl.float32)), logits, input_precision="ieee")


@triton.jit
def scaled_logits(q_ptr, rows, hmask, inv, position, freqs_ptr, keys_ptr, key_rows, live, scale,
                  D: tl.constexpr, RD, HB: tl.constexpr, BD: tl.constexpr, NK: tl.constexpr, FAST: tl.constexpr):
    """scale * q . keys ([HB, NK] fp32; -inf where a key is not live), over D in chunks of BD: the
    chunks before any rope channel first, with no rotation to compute."""
    logits = tl.zeros((HB, NK), dtype=tl.float32)
    plain = (D - RD) // BD * BD
    for d0 in range(0, plain, BD):
        logits = logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, keys_ptr, key_rows, live,
                              D, RD, HB, BD, FAST, False)
    for d0 in range(plain, D, BD):
        logits = logits_chunk(logits, q_ptr, rows, hmask, inv, d0, position, freqs_ptr, keys_ptr, key_rows, live,
                              D, RD, HB, BD, FAST, True)
    return tl.where(live[None, :], logits * scale, float("-inf"))
