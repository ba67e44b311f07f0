"""The speculative verification rules (monodecode/spec/verify.py), SpeculativeConfig, the
`probabilities` that both sides of a verification are built from, `argmax_rows`, and a step's
keyed uniforms (monodecode/spec/draws.py) against a Python Philox reference.

The statistical tests use a toy target p(x | prefix) and draft q(x | prefix): an independent
random distribution for every prefix of up to K tokens over V tokens, so every position's
distribution depends on the tokens before it. Each trial drafts K tokens from q, verifies them,
and continues the committed tokens by sampling from p up to K + 1 tokens. For a lossless rule
those K + 1 tokens are distributed exactly as K + 1 tokens sampled from p: a chi-square
goodness-of-fit test must not reject at 1e-3 (on the first token, the first two, and all K + 1).
Deliberately broken rules must be rejected at 1e-9 by the same test, which shows its power.
The verification rules' seeds are fixed, so their statistical outcomes are reproducible; the
keyed uniforms' tests take a fresh seed each run (their uniformity bound fails by chance once in
a million runs).
"""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from monodecode.sampling import argmax_rows, pick, probabilities, sample, sample_from
from monodecode.spec import verify as verify_module
from monodecode.spec.config import REJECTION_SAMPLE_METHODS, SpeculativeConfig
from monodecode.spec.draws import _philox_uniforms, draw_uniforms, draws, keyed_uniforms, step_keys, uniforms_per_step
from monodecode.spec.verify import (Verdict, synthetic_acceptance_rate, verify, verify_batch, verify_block,
                                    verify_greedy, verify_standard, verify_synthetic)

V, K = 6, 3
TRIALS = 15_000
LOSSLESS_P = 1e-3  # a lossless rule's p-value must stay above this
BROKEN_P = 1e-9  # a broken rule's p-value must fall below this


# ---------------------------------------------------------------------------------------------
# The toy models and the statistics


class ToyModels:
    """p(. | prefix) and q(. | prefix) for every prefix of 0..K tokens, as rows of two tables. The
    draft is the target's logits plus noise, so that it is right often but not always."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(sum(V**m for m in range(K + 1)), V, generator=g)
        self.target = logits.softmax(dim=-1)
        self.draft = (logits + torch.randn(logits.shape, generator=g)).softmax(dim=-1)

    def prefix_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, n] sequences -> [N, n + 1]: the table row of each sequence's prefixes of 0..n tokens."""
        rows = [torch.zeros(tokens.shape[0], dtype=torch.long)]
        code, offset = torch.zeros_like(rows[0]), 0
        for j in range(tokens.shape[1]):
            offset += V**j  # rows of the shorter prefixes come first
            code = code * V + tokens[:, j]
            rows.append(offset + code)
        return torch.stack(rows, dim=1)

    def draft_blocks(self, n: int, seed: int) -> torch.Tensor:
        """n blocks of K tokens, drafted autoregressively from q: [n, K]."""
        g = torch.Generator().manual_seed(seed)
        tokens = torch.zeros(n, 0, dtype=torch.long)
        for _ in range(K):
            rows = self.draft[self.prefix_rows(tokens)[:, -1]]
            tokens = torch.cat([tokens, torch.multinomial(rows, 1, generator=g)], dim=1)
        return tokens

    def continue_from_target(self, committed: list[list[int]], length: int, seed: int) -> torch.Tensor:
        """Each committed list cut or continued by sampling from p to `length` tokens: [N, length]."""
        g = torch.Generator().manual_seed(seed)
        sequences = torch.tensor([(c + [-1] * length)[:length] for c in committed])
        for j in range(length):
            missing = sequences[:, j] < 0
            rows = self.target[self.prefix_rows(sequences[missing, :j])[:, -1]]
            sequences[missing, j] = torch.multinomial(rows, 1, generator=g).squeeze(1)
        return sequences

    def sequence_probs(self, length: int) -> torch.Tensor:
        """p of every sequence of `length` tokens, in lexicographic order: [V ** length]."""
        sequences = torch.tensor(list(itertools.product(range(V), repeat=length)))
        rows = self.prefix_rows(sequences)[:, :length]
        return self.target[rows, sequences].prod(dim=1)


def run_verifier(verifier, models: ToyModels, drafts: torch.Tensor, seed: int) -> list[Verdict]:
    target_rows = models.target[models.prefix_rows(drafts)]  # [N, K + 1, V]
    draft_rows = models.draft[models.prefix_rows(drafts)[:, :K]]  # [N, K, V]
    g = torch.Generator()
    verdicts = []
    for t in range(drafts.shape[0]):
        g.manual_seed(seed + t)  # a trial's draws depend on the trial only: equal for every rule
        verdicts.append(verifier(target_rows[t], drafts[t], draft_rows[t], g))
    return verdicts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of `counts` to `probs`; cells expecting fewer than `min_expected` are
    pooled into one, which keeps the chi-square approximation valid."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    small = expected < min_expected
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(observed) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def fit_pvalues(models: ToyModels, verdicts: list[Verdict], seed: int) -> dict[int, float]:
    """p-value of the first n generated tokens against p, for n = 1, 2 and K + 1."""
    sequences = models.continue_from_target([v.tokens for v in verdicts], K + 1, seed)
    pvalues = {}
    for n in (1, 2, K + 1):
        codes = (sequences[:, :n] * V ** torch.arange(n - 1, -1, -1)).sum(dim=1)
        counts = torch.bincount(codes, minlength=V**n)
        pvalues[n] = chi_square_pvalue(counts, models.sequence_probs(n))
    return pvalues


@pytest.fixture(scope="module")
def toy():
    """The toy models, TRIALS drafted blocks, and standard's and block's verdicts on them. Shared
    by the fit tests and the acceptance comparison, which needs both rules on equal draws."""
    models = ToyModels(seed=1)
    drafts = models.draft_blocks(TRIALS, seed=2)
    verdicts = {name: run_verifier(rule, models, drafts, seed=3)
                for name, rule in (("standard", verify_standard), ("block", verify_block))}
    return models, drafts, verdicts


# ---------------------------------------------------------------------------------------------
# greedy and temperature 0


def greedy_logits(best: list[int], vocab: int, seed: int) -> torch.Tensor:
    """Random logits whose row i has its argmax at best[i]."""
    logits = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(seed))
    logits[torch.arange(len(best)), torch.tensor(best)] += 10
    return logits


@pytest.mark.parametrize("drafts, accepted, tokens", [
    ([2, 0, 3], 3, [2, 0, 3, 1]),  # all accepted: the bonus is the last row's argmax
    ([4, 0, 3], 0, [2]),  # the first rejected: the target's own first token
    ([2, 1, 3], 1, [2, 0]),  # the middle rejected; later matches do not count
    ([2, 0, 4], 2, [2, 0, 3]),  # the last rejected
])
def test_greedy_hand_built(drafts, accepted, tokens):
    logits = greedy_logits([2, 0, 3, 1], vocab=5, seed=10)
    assert verify_greedy(logits, torch.tensor(drafts)) == Verdict(accepted, tokens)
    assert verify("greedy", logits, torch.tensor(drafts), None, temperature=0.8, top_p=1.0,
                  generator=None) == Verdict(accepted, tokens)


def test_greedy_verifies_requests_together_as_one_by_one():
    """The four hand-built cases above as one batch of four requests: each its own verdict."""
    cases = [([2, 0, 3], 3, [2, 0, 3, 1]), ([4, 0, 3], 0, [2]), ([2, 1, 3], 1, [2, 0]), ([2, 0, 4], 2, [2, 0, 3])]
    logits = torch.stack([greedy_logits([2, 0, 3, 1], vocab=5, seed=10 + i) for i in range(len(cases))])
    greedy = [(0.0, 1.0, 0, None)] * len(cases)
    verdicts = verify_batch("greedy", logits, torch.tensor([drafts for drafts, _, _ in cases]), None, greedy)
    assert verdicts == [Verdict(accepted, tokens) for _, accepted, tokens in cases]


@pytest.mark.parametrize("method", ["standard", "block"])
def test_temperature_zero_is_exactly_greedy(method):
    vocab, k, g = 8, 5, torch.Generator().manual_seed(20)
    seen = set()
    for case in range(300):
        logits = torch.randn(k + 1, vocab, generator=g)
        drafts = torch.randint(vocab, (k,), generator=g)
        agree = torch.rand(k, generator=g) < 0.8  # most drafts match, so long prefixes occur
        drafts[agree] = logits[:k].argmax(dim=-1)[agree]
        # The rows a drafter gives at temperature 0 (one-hot at its drafts), or any other rows:
        # the result must not depend on them.
        draft_probs = (torch.nn.functional.one_hot(drafts, vocab).float() if case % 2
                       else torch.randn(k, vocab, generator=g).softmax(dim=-1))
        top_p = [1.0, 0.9, 0.3][case % 3]
        expected = verify_greedy(logits, drafts)
        rule = verify_standard if method == "standard" else verify_block  # the rule itself, on one-hot rows
        assert rule(probabilities(logits, 0.0, top_p), drafts, draft_probs, g) == expected
        assert verify(method, logits, drafts, draft_probs, temperature=0.0, top_p=top_p, generator=g) == expected
        seen.add(expected.accepted)
    assert seen == set(range(k + 1))  # every accepted count, 0 (first rejected) to k (bonus), was checked


@pytest.mark.parametrize("method", ["standard", "block", "synthetic", "greedy"])
def test_requests_verified_together_as_one_by_one(method):
    """verify_batch on requests of different settings, each with its own generator, gives each the
    verdict it gets alone with the same generator state (the same draws in the same order)."""
    g = torch.Generator().manual_seed(70)
    settings = [(0.7, 1.0, 0), (1.0, 0.8, 0), (1.0, 1.0, 5), (0.0, 1.0, 0), (0.7, 1.0, 0)]
    r, vocab = len(settings), 12
    logits = torch.randn(r, K + 1, vocab, generator=g) * 2
    draft_probs = torch.rand(r, K, vocab, generator=g).softmax(dim=-1)
    drafts = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=g).view(r, K)
    seeded = lambda: [(*s, torch.Generator().manual_seed(100 + i)) for i, s in enumerate(settings)]
    together = verify_batch(method, logits, drafts, draft_probs, seeded(), acceptance_length=2.0)
    alone = [verify(method, logits[i], drafts[i], draft_probs[i], temperature=t, top_p=p, top_k=k, generator=gen,
                    acceptance_length=2.0) for i, (t, p, k, gen) in enumerate(seeded())]
    assert together == alone
    assert len({v.accepted for v in together}) > 1 or method == "greedy"  # the requests really differ


def test_zero_draft_probability_and_zero_residual():
    target = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5]])
    # x_1 = 1 has draft probability 0 but target probability 0.5: kept (the ratio counts as 1).
    # x_2 = 0 has probability 0 under both: rejected, and the residual max(P_1 - Q_1, 0) is all
    # zero because Q_1 == P_1, so the correction comes from P_1 itself: token 2. In block terms
    # w_1 = 1, w_2 = 0, and h_1 = r_1 / (r_1 + 1 - w_1) = 0 / 0 counts as 1, so a = 1 as well.
    draft = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(60)
    for rule in (verify_standard, verify_block):
        for _ in range(50):
            assert rule(target, torch.tensor([1, 0]), draft, g) == Verdict(1, [1, 2])
    # Identical target and draft rows: every draft token is kept, whatever the uniforms.
    same = torch.rand(4, 5, generator=g).softmax(dim=-1)
    for rule in (verify_standard, verify_block):
        for _ in range(50):
            assert rule(same, torch.tensor([3, 0, 4]), same[:3], g).accepted == 3


# ---------------------------------------------------------------------------------------------
# Lossless sampling, and the power of the test


@pytest.mark.parametrize("method", ["standard", "block"])
def test_verification_is_lossless(toy, method):
    models, _, verdicts = toy
    pvalues = fit_pvalues(models, verdicts[method], seed=4)
    print(f"{method}: p-values of the first 1, 2, {K + 1} tokens: {pvalues}")
    assert min(pvalues.values()) > LOSSLESS_P, pvalues


def accept_everything(target_probs, draft_tokens, draft_probs, generator) -> Verdict:
    k = draft_tokens.shape[0]
    return Verdict(k, draft_tokens.tolist() + [int(sample_from(target_probs[k], generator))])


def correction_from_target(target_row, draft_row, weight=1.0):
    return target_row  # the classic mistake: resampling a rejected token from p, not the residual


RESIDUAL = verify_module._residual


def residual_without_weight(target_row, draft_row, weight=1.0):
    return RESIDUAL(target_row, draft_row)  # block's subtle mistake: max(P_a - Q_a, 0), not w_a P_a


BROKEN = {  # name: (rule, replacement for verify's residual or None)
    "standard, corrected from p": (verify_standard, correction_from_target),
    "block, corrected from p": (verify_block, correction_from_target),
    "block, residual not scaled by w_a": (verify_block, residual_without_weight),
    "accept everything": (accept_everything, None),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_verification_fails_the_same_test(toy, monkeypatch, broken):
    models, drafts, _ = toy
    rule, residual = BROKEN[broken]
    if residual is not None:
        monkeypatch.setattr(verify_module, "_residual", residual)
    pvalues = fit_pvalues(models, run_verifier(rule, models, drafts, seed=3), seed=4)
    print(f"{broken}: p-values of the first 1, 2, {K + 1} tokens: {pvalues}")
    assert min(pvalues.values()) < BROKEN_P, pvalues


# ---------------------------------------------------------------------------------------------
# Block verification keeps at least as many tokens as standard


def test_block_accepts_at_least_as_many_as_standard(toy):
    _, _, verdicts = toy
    block = torch.tensor([v.accepted for v in verdicts["block"]], dtype=torch.float64)
    standard = torch.tensor([v.accepted for v in verdicts["standard"]], dtype=torch.float64)
    difference = block - standard  # paired: same drafts and same uniforms in every trial
    standard_error = difference.std() / len(difference) ** 0.5
    print(f"mean accepted: block {block.mean():.4f}, standard {standard.mean():.4f}, "
          f"difference {difference.mean():.4f} +- {standard_error:.4f}")
    # Sun et al. Theorem 2: >= in expectation (not trial by trial). On these tables block is
    # clearly better, so asking for 3 standard errors above 0 also catches a block rule that has
    # quietly become token-wise verification.
    assert difference.mean() > 3 * standard_error


def test_block_reproduces_the_papers_example():
    """Sun et al. 2024, section 1: target (1/3, 2/3), draft (2/3, 1/3) at every position, two draft
    tokens. Expected accepted tokens: 10/9 token by token, 11/9 with block verification."""
    target, draft, n = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3]), 8_000
    g = torch.Generator().manual_seed(30)
    drafts = torch.multinomial(draft.expand(n * 2, 2), 1, generator=g).view(n, 2)
    for rule, exact in ((verify_standard, 10 / 9), (verify_block, 11 / 9)):
        accepted = torch.tensor([rule(target.expand(3, 2), drafts[t], draft.expand(2, 2), g).accepted
                                 for t in range(n)], dtype=torch.float64)
        standard_error = accepted.std() / n**0.5
        print(f"{rule.__name__}: mean accepted {accepted.mean():.4f} (exact {exact:.4f}) +- {standard_error:.4f}")
        assert abs(accepted.mean() - exact) < 4 * standard_error


# ---------------------------------------------------------------------------------------------
# Synthetic acceptance


@pytest.mark.parametrize("length", [1.5, 3.51, 5.5])
def test_synthetic_mean_committed_length(length):
    vocab, k, steps, g = 16, 5, 20_000, torch.Generator().manual_seed(40)
    target_probs = torch.randn(k + 1, vocab, generator=g).softmax(dim=-1)
    drafts = torch.randint(vocab, (k,), generator=g)
    committed = [len(verify_synthetic(target_probs, drafts, length, g).tokens) for _ in range(steps)]
    mean = sum(committed) / steps
    print(f"synthetic L = {length}: rate {synthetic_acceptance_rate(length, k):.4f}, mean committed {mean:.4f}")
    assert abs(mean - length) < 0.02 * length


def test_synthetic_endpoints_and_temperature_zero():
    vocab, k, g = 16, 5, torch.Generator().manual_seed(41)
    logits, drafts = torch.randn(k + 1, vocab, generator=g), torch.randint(vocab, (k,), generator=g)
    best = logits.argmax(dim=-1)
    for length, accepted in ((1, 0), (k + 1, k)):
        for _ in range(200):
            verdict = verify("synthetic", logits, drafts, None, temperature=0.0, top_p=1.0, generator=g,
                             acceptance_length=length)
            assert verdict == Verdict(accepted, drafts[:accepted].tolist() + [int(best[accepted])])
    verdict = verify("synthetic", logits, drafts, None, temperature=0.0, top_p=1.0, generator=g,
                     acceptance_length=3.0)
    assert verdict.tokens == drafts[: verdict.accepted].tolist() + [int(best[verdict.accepted])]


@pytest.mark.parametrize("length", [0.99, 6.01, None])
def test_synthetic_length_out_of_range(length):
    target_probs = torch.rand(6, 4).softmax(dim=-1)
    with pytest.raises(ValueError, match=r"in \[1, k \+ 1\] = \[1, 6\]"):
        verify_synthetic(target_probs, torch.tensor([0, 1, 2, 3, 0]), length, None)


def test_unknown_method_and_shape_errors():
    logits, drafts = torch.randn(4, 5), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="unknown verification method 'probabilistic'"):
        verify("probabilistic", logits, drafts, None, temperature=1.0, top_p=1.0, generator=None)
    with pytest.raises(ValueError, match="3 draft tokens need 4 target rows and 3 draft rows, got 4 target rows and 2"):
        verify_standard(logits.softmax(-1), drafts, torch.rand(2, 5), None)


# ---------------------------------------------------------------------------------------------
# probabilities and sample


def test_probabilities_is_what_sample_draws_from():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(50))
    for temperature, top_p in ((0.7, 1.0), (1.3, 0.8)):
        drawn = sample(logits, temperature, top_p, torch.Generator().manual_seed(51))
        again = sample_from(probabilities(logits, temperature, top_p), torch.Generator().manual_seed(51))
        assert torch.equal(drawn, again)
    probs = probabilities(logits, 1.0, 0.5)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(64))
    assert ((probs > 0).sum(dim=-1) < 50).all()  # the nucleus cut the tail
    greedy = probabilities(logits, 0.0, 0.5)
    assert torch.equal(greedy, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    assert torch.equal(sample(logits, 0.0), logits.argmax(-1))


def test_pick_draws_each_token_with_its_weight():
    """The inverse CDF: tokens drawn in proportion to their weights (which need not sum to 1), a
    token of weight 0 never, not even by the uniforms at the ends of [0, 1), and a one-hot row's
    token by every uniform."""
    g = torch.Generator().manual_seed(52)
    weights = torch.tensor([0.0, 3.0, 0.5, 0.0, 1.5, 0.0])
    n = 60_000
    tokens = pick(weights.expand(n, -1), torch.rand(n, generator=g))
    assert chi_square_pvalue(torch.bincount(tokens, minlength=6), weights / weights.sum()) > LOSSLESS_P
    ends = torch.tensor([0.0, 1 - 2**-24])
    for row in (weights, torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.tensor([2.0, 1e-30, 0.0, 0.0]),
                torch.tensor([1e-30, 0.0, 3.0, 0.0])):
        assert (row[pick(row.expand(2, -1), ends)] > 0).all(), row
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 0, 5]), 6).float()
    assert torch.equal(pick(one_hot[:, None].expand(-1, 50, -1), torch.rand(3, 50, generator=g)),
                       torch.tensor([3, 0, 5])[:, None].expand(-1, 50))


@pytest.mark.parametrize("vocab", [129280, 512, 1000, 127, 7])
def test_argmax_in_parts_is_torch_argmax(vocab, device):
    """`argmax_rows` (parts of each row, then the part holding the maximum) gives torch's argmax,
    the first of equal maxima too: ties planted inside a part and across parts, rows of one
    value, -inf, any leading dims, fp32 and bf16; a prime vocabulary is one part."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, vocab, generator=g)
    i, j = torch.randint(vocab, (2,), generator=g).tolist()
    logits[0, 1, [i, j]] = 50.0  # two equal maxima: the first counts
    logits[0, 2, -2:] = 50.0  # at the row's end, in one part
    logits[1, 0] = 3.0  # a row of one value: index 0
    logits[1, 1, : vocab // 2] = float("-inf")
    logits[2, 3] = logits[2, 3].round(decimals=1)  # many ties below the maximum, bf16 or not
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype).to(device)
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
        assert torch.equal(argmax_rows(rows[0, 1]), rows[0, 1].argmax(dim=-1))
    assert argmax_rows(logits)[0, 1] == min(i, j) and argmax_rows(logits)[1, 0] == 0


def philox_uniforms(seed: int, offsets: list[int]) -> torch.Tensor:
    """The reference of `tl.rand(seed, offsets)` for int32 offsets: Philox 4x32 in 10 rounds on
    (offset, 0, 0, 0) with the 64-bit key (seed's low word, high word), the first word's bits as
    a signed int mapped to [0, 1) (Triton's `uint_to_uniform_float`)."""
    mask, values = 0xFFFFFFFF, []
    for offset in offsets:
        c0, c1, c2, c3 = offset & mask, 0, 0, 0
        lo, hi = seed & mask, (seed >> 32) & mask
        for _ in range(10):
            a, b = 0xD2511F53 * c0, 0xCD9E8D57 * c2
            c0, c1, c2, c3 = (b >> 32) ^ c1 ^ lo, b & mask, (a >> 32) ^ c3 ^ hi, a & mask
            lo, hi = (lo + 0x9E3779B9) & mask, (hi + 0xBB67AE85) & mask
        x = c0 - 2**32 if c0 >= 2**31 else c0
        values.append(-x - 1 if x < 0 else x)
    return torch.tensor(values, dtype=torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


@pytest.mark.parametrize("method", REJECTION_SAMPLE_METHODS)
def test_a_step_draws_a_requests_uniforms_by_its_seed_and_steps_only_where_they_can_change_its_tokens(method, device):
    """spec/draws.py: above temperature 0, or under synthetic verification, a request's 2B + 1
    uniforms of its s-th drawing step are rand(seed, s * (2B + 1) + j) (the reference Philox,
    any 64-bit seed), whatever requests are beside it; otherwise its row is zeros. Its generator
    is not drawn from."""
    b, n = 5, uniforms_per_step(5)
    seed = int(torch.randint(0, 2**62, (1,)))
    generators = [torch.Generator().manual_seed(seed + i + (i % 2) * 2**63) for i in range(3)] + [None]
    settings = [0.0, 0.8, 0.0, 1.0]
    requests = [SimpleNamespace(temperature=t, generator=g, draws=int(torch.randint(0, 10**6, (1,))))
                for t, g in zip(settings, generators)]
    states = [g.get_state() for g in generators[:3]]
    out = keyed_uniforms(step_keys(requests, method).to(device), n).cpu()
    alone = [keyed_uniforms(step_keys([q], method).to(device), n).cpu()[0] for q in requests]
    for i, q in enumerate(requests):
        if draws(q.temperature, method):
            key = q.generator.initial_seed() if q.generator is not None else torch.initial_seed()
            assert torch.equal(out[i], philox_uniforms(key, [q.draws * n + j for j in range(n)])), i
        else:
            assert torch.equal(out[i], torch.zeros(n))
        assert torch.equal(out[i], alone[i])  # not changed by the requests beside it
    assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, states))


def test_the_cpu_form_of_keyed_uniforms_is_the_kernel_bit_for_bit(device):
    """`_philox_uniforms` (a CPU without Triton's interpreter) against the kernel on the test's
    device and the Python reference: random 63-bit seeds, steps up to 2**27, rows that draw none."""
    n, rows = uniforms_per_step(5), 64
    keys = torch.stack([torch.randint(-2**63, 2**63 - 1, (rows,)), torch.randint(-1, 2**27, (rows,))])
    keys[1, :4] = -1
    cpu = _philox_uniforms(keys, n)
    assert torch.equal(cpu, keyed_uniforms(keys.to(device), n).cpu())
    for r in range(8, rows, 7):
        seed, step = keys[:, r].tolist()
        assert torch.equal(cpu[r], philox_uniforms(seed, [step * n + j for j in range(n)]) if step >= 0
                           else torch.zeros(n)), r


def test_keyed_uniforms_are_uniform_and_differ_from_step_to_step(device):
    """The keyed rows of 1,000 steps of one request: every value in [0, 1), their distribution
    uniform (Kolmogorov-Smirnov), and no two steps' rows alike."""
    n, steps = uniforms_per_step(5), 1000
    keys = torch.stack([torch.full((steps,), int(torch.randint(0, 2**62, (1,)))), torch.arange(steps)])
    rows = keyed_uniforms(keys.to(device), n).cpu()
    assert rows.min() >= 0 and rows.max() < 1
    values = rows.flatten().double().sort().values
    cdf = torch.arange(1, len(values) + 1, dtype=torch.float64) / len(values)
    # Kolmogorov-Smirnov at p = 1e-6: a fresh seed each run, so a run fails by chance once in a
    # million (at p = 0.01, one CI run in a hundred did)
    assert (cdf - values).abs().max() < 2.69 / len(values) ** 0.5
    assert len({tuple(r.tolist()) for r in rows}) == steps


def test_verification_alone_draws_from_the_generators():
    """verify_batch's uniforms (spec/draws.py's `draw_uniforms`): k + 1 from each drawing
    request's generator in one draw, zeros for the others."""
    k = 5
    generators = [torch.Generator().manual_seed(80 + i) for i in range(3)]
    sampling = [(0.0, 1.0, 0, generators[0]), (0.8, 0.9, 0, generators[1]), (0.0, 0.5, 3, generators[2])]
    out = draw_uniforms(sampling, "standard", torch.full((3, k + 1), 7.0))
    assert torch.equal(out[0], torch.zeros(k + 1)) and torch.equal(out[2], torch.zeros(k + 1))
    assert torch.equal(out[1], torch.rand(k + 1, generator=torch.Generator().manual_seed(81)))


# ---------------------------------------------------------------------------------------------
# SpeculativeConfig


def test_config_parses_the_vllm_shape():
    text = json.dumps({"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"})
    assert SpeculativeConfig.from_json(text) == SpeculativeConfig("dspark", 5, "block")
    assert SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5}).rejection_sample_method \
        == "standard"
    alias = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                         "rejection_sample_method": "probabilistic"})
    assert alias.rejection_sample_method == "standard"
    synthetic = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                             "rejection_sample_method": "synthetic",
                                             "synthetic_acceptance_length": 3.51})
    assert synthetic.synthetic_acceptance_length == 3.51


BASE = {"method": "dspark", "num_speculative_tokens": 5}


@pytest.mark.parametrize("raw, message", [
    ({**BASE, "method": "eagle"}, "method must be 'dspark'.*got 'eagle'"),
    ({**BASE, "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({**BASE, "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1, got 2.5"),
    ({**BASE, "num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1, got True"),
    ({**BASE, "rejection_sample_method": "tree"}, "rejection_sample_method must be one of .*got 'tree'"),
    ({**BASE, "rejection_sample_method": "synthetic"}, "'synthetic' needs synthetic_acceptance_length"),
    ({**BASE, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 6.5},
     r"synthetic_acceptance_length must be a number in \[1, num_speculative_tokens \+ 1\] = \[1, 6\], got 6.5"),
    ({**BASE, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 0.5},
     r"= \[1, 6\], got 0.5"),
    ({**BASE, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": "3"}, r"got '3'"),
    ({**BASE, "synthetic_acceptance_length": 3.0}, "synthetic_acceptance_length \\(3.0\\) is only for .*'standard'"),
    ({**BASE, "model": "x", "draft_tensor_parallel_size": 1},
     r"unknown keys \['draft_tensor_parallel_size', 'model'\]"),
    ({"num_speculative_tokens": 5}, r"missing required keys \['method'\]"),
    ({"method": "dspark"}, r"missing required keys \['num_speculative_tokens'\]"),
    ([1, 2], "must be a JSON object"),
])
def test_config_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(json.dumps(raw))


def test_config_rejects_bad_json():
    with pytest.raises(ValueError):
        SpeculativeConfig.from_json('{"method": "dspark",')


def test_check_block_size():
    SpeculativeConfig("dspark", 5).check_block_size(5)
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(7\) must equal the DSpark draft's block "
                                         r"size \(5\): the draft proposes a whole block per step"):
        SpeculativeConfig("dspark", 7).check_block_size(5)
