"""The randomness of a speculative step: every uniform a step uses, made before the work that reads it.

A request's step uses 2B + 1 uniforms (B = the draft's block size), in this order:
- [0, B): the Markov head's draws, one a draft position (`sampling.pick`);
- [B, 2B): verification's acceptances, one a draft token (standard, block and synthetic);
- 2B: the token verification appends (`pick` from P_k or the residual).
It draws them when they can change its tokens: above temperature 0, or under synthetic
verification (which keeps drafts by the uniforms at any temperature). At temperature 0 under
greedy, standard or block verification every draw is decided by an argmax, and the request draws
nothing: its row holds zeros.

A step's draws are keyed (counter-based, Philox as Triton's `tl.rand` makes it): uniform j of the
s-th step in which a request draws is rand(seed, s * (2B + 1) + j), with `seed` its generator's
initial seed (the default generator's, without one) and s its count of drawing steps so far
(`SpecRequest.draws`, which the step that commits advances). So a request's draws follow from its
seed and its own history, not from the requests beside it or its generator's state, and one
kernel (`keyed_uniforms`) makes a whole step's rows from a table of keys the host writes
(`step_keys`): on a GPU inside the whole step's CUDA graph, with no launch a request. Both forms
of a step (stepwise and whole, spec/step_graph.py) draw so: the same uniforms, the same tokens.

Verification alone (`verify.verify_batch`: k + 1 uniforms a request) draws from the generators
themselves (`draw_uniforms`), as `verify` does for one request.
"""

from __future__ import annotations

from array import array

import torch
import triton
import triton.language as tl

from ..mono.plan import interpreted

NO_DRAW = -1  # a key's step for a request that draws nothing this step: its row is zeros


def uniforms_per_step(block_size: int) -> int:
    return 2 * block_size + 1


def draws(temperature: float, method: str) -> bool:
    """Whether a request at `temperature` draws its step's uniforms under verification `method`."""
    return temperature > 0 or method == "synthetic"


def step_keys(requests, method: str) -> torch.Tensor:
    """The keys of a step of `requests` (each with temperature, generator and draws, as
    SpecRequest), int64 [2, R] on the host: each request's seed (its generator's initial seed,
    0 to 2**64 - 1, its 64 bits as an int64) and the step of its draws (`draws`), or NO_DRAW."""
    seeds = [q.generator.initial_seed() if q.generator is not None else torch.initial_seed() for q in requests]
    flat = array("q", [seed - 2**64 if seed >= 2**63 else seed for seed in seeds])
    flat.extend(q.draws if draws(q.temperature, method) else NO_DRAW for q in requests)
    return torch.frombuffer(flat, dtype=torch.long).view(2, -1)


def keyed_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """The uniforms [R, n] fp32 in [0, 1) of keys [2, R] (int64, on the device that computes
    them): row r is rand(seed_r, step_r * n + j) for j < n, or zeros where step_r is NO_DRAW.
    One kernel on a GPU (or under Triton's interpreter); on a CPU without it, the same values from
    torch's integer operations (`_philox_uniforms`)."""
    rows = keys.shape[1]
    if not (keys.is_cuda or interpreted()):
        return _philox_uniforms(keys, n)
    out = torch.empty(rows, n, dtype=torch.float32, device=keys.device)
    if rows:
        _keyed_uniforms[(rows,)](keys, out, rows, N=n, BLOCK=triton.next_power_of_2(n))
    return out


PHILOX_ROUNDS, PHILOX_MULTIPLIERS, PHILOX_KEY_STEPS = 10, (0xD2511F53, 0xCD9E8D57), (0x9E3779B9, 0xBB67AE85)
WORD = 0xFFFFFFFF


def _philox_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """`_keyed_uniforms`' values from torch's int64 operations: Philox 4x32 in 10 rounds on the
    counter (offset, 0, 0, 0) with the key (seed's low word, high word), as `tl.rand` computes it,
    the first word read as a signed int32 and mapped to [0, 1) as Triton maps it."""
    seed, step = keys
    offsets = step[:, None] * n + torch.arange(n, device=keys.device)
    c0 = offsets & WORD  # the int32 offset's bits
    c1, c2, c3 = (torch.zeros_like(c0) for _ in range(3))
    lo, hi = (seed & WORD)[:, None], ((seed >> 32) & WORD)[:, None]
    for _ in range(PHILOX_ROUNDS):
        (a_hi, a_lo), (b_hi, b_lo) = _wide_product(PHILOX_MULTIPLIERS[0], c0), _wide_product(PHILOX_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = b_hi ^ c1 ^ lo, b_lo, a_hi ^ c3 ^ hi, a_lo
        lo, hi = (lo + PHILOX_KEY_STEPS[0]) & WORD, (hi + PHILOX_KEY_STEPS[1]) & WORD
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    magnitude = torch.where(signed < 0, -signed - 1, signed).to(torch.float32)
    uniforms = magnitude * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return torch.where(step[:, None] < 0, 0.0, uniforms)


def _wide_product(multiplier: int, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of multiplier * words (32-bit unsigned values in int64),
    in 16-bit halves so that no int64 product overflows."""
    low, high = multiplier * (words & 0xFFFF), multiplier * (words >> 16)  # each < 2**48
    partial = low + ((high & 0xFFFF) << 16)
    return (partial >> 32) + (high >> 16), partial & WORD


@triton.jit
def _keyed_uniforms(keys_ptr, out_ptr, rows, N: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (R,): program r writes row r. Offsets are int32 (Philox's 4 x 32-bit counter with a
    64-bit key), so a request's stream repeats after 2**31 / N steps."""
    r = tl.program_id(0)
    seed = tl.load(keys_ptr + r)
    step = tl.load(keys_ptr + rows + r)
    j = tl.arange(0, BLOCK)
    u = tl.rand(seed, (step * N + j).to(tl.int32))
    tl.store(out_ptr + r * N + j, tl.where(step < 0, 0.0, u), mask=j < N)  # NO_DRAW


def draw_uniforms(sampling, method: str, out: torch.Tensor) -> torch.Tensor:
    """Verification alone: each request's uniforms into its row of out [R, k + 1] from its
    generator, in one draw, the rows of requests that draw none zeroed; `sampling`: each
    request's (temperature, top_p, top_k, generator)."""
    drawing = [draws(temperature, method) for temperature, *_ in sampling]
    if not all(drawing):
        out.zero_()
    for row, (*_, generator), drawn in zip(out, sampling, drawing):
        if drawn:
            torch.rand(out.shape[1], generator=generator, out=row)
    return out


def markov(uniforms: torch.Tensor, block_size: int) -> torch.Tensor:
    """The Markov head's uniforms [R, B] of a step's [R, 2B + 1]."""
    return uniforms[:, :block_size]


def verification(uniforms: torch.Tensor, block_size: int) -> torch.Tensor:
    """Verification's uniforms [R, B + 1] (the acceptances, then the appended token's)."""
    return uniforms[:, block_size:]
