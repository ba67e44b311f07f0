"""Greedy speculation on the kernels checked against plain greedy decoding at real dims:
`python -m monodecode.bench.spec_check [--preset NAME] [--layers N] [--requests 1,2,4,8]
[--tokens T] [--device cuda] [--out FILE]`.

A model of the first N layers of the preset (synthetic weights, bf16, as `bench decode` builds
it) and its DSpark draft, the kernels on: the target's decode and verify steps and the draft's
stages run on them, and every speculative step runs whole (spec/step_graph.py: one CUDA graph a
request count on a GPU). For each request count R, R requests (random prompts of the lengths in
`PROMPTS`: inside the attention window, past it, across compressed-entry boundaries) are decoded
T tokens each twice, from caches prefilled alike:
- plain: greedy decoding, one row a request a step (`Decoder.step` at R rows);
- speculative: greedy verification (`SpeculativeDecoder.step`, R x (1 + block) rows a verify
  step) until every request has T tokens, of the blocks of
  - `draft`: the draft itself (with synthetic weights it rarely proposes what the target picks:
    a step then commits the target's one token), and of
  - `oracle`: the plain path's own next tokens, each block cut at a random place (its token
    there changed, the rest kept; one block in six whole), written into the whole step's
    proposals in place of the draft's (the draft still runs): so steps accept 0 to `block`
    drafts, and a step's accepted rows, its rejected ones and what they leave in the caches are
    what the next steps read.
Lossless means each request's two sequences are equal. Where they part, the report gives the
index, the plain path's top-two logit gap there and its margin over the token the speculative
path chose: the two paths run the target at different widths (and write its caches at them),
whose bf16 rounding can flip a near-tie, after which the sequences are different decodings and
are not compared further. To tell such a flip from a fault, every row both paths computed from
the same tokens (up to and including the parting one; the first token is the prefill's, the same
on both) has its two logit vectors compared: their lowest cosine and largest difference. A fault
(a wrong position, a stale cache row) shows there as a cosine far from 1; rounding as a cosine of
about the per-layer agreement (`AGREEMENT`) and differences of the size of the parting margins.
Printed and written as JSON, a request count at a time.
Not a benchmark. On a CPU (tests: `--preset tiny`, TRITON_INTERPRET=1) the kernels run under
Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
import triton

from ..sampling import argmax_rows
from ..spec.config import SpeculativeConfig
from ..spec.decoder import SpeculativeDecoder
from .decode import build

# each request's prompt length: short, past the window (128 at v4-flash), across an HCA entry's
# end (position 127 and 255) and a CSA entry's (every 4)
PROMPTS = (37, 150, 9, 250, 122, 5, 130, 61)
# the lowest cosine of two paths' logits for one prefix that rounding alone explains: the agreement
# asked of the draft's layers on the kernels with their per-op path, which the target's layers exceed
AGREEMENT = 0.9999


def prompts(requests: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPTS[:requests]]


def plain_greedy(decoder, prompt_ids: list[list[int]], tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each request's first `tokens` greedy tokens, all requests a step together, and the fp32
    logits [tokens, vocab] each was chosen from."""
    r = len(prompt_ids)
    cache = decoder.make_cache(r, max(map(len, prompt_ids)) + tokens, max_step_rows=1)
    last = []
    for slot, ids in enumerate(prompt_ids):  # a prompt-sized step: per-op
        last.append(decoder.step(cache, ids, range(len(ids)), [slot] * len(ids))[-1])
    logits, out, rows = torch.stack(last), [[] for _ in range(r)], []
    for t in range(tokens):
        rows.append(logits.float())
        for i, token in enumerate(argmax_rows(logits).tolist()):
            out[i].append(token)  # as `sample` picks at temperature 0
        if t + 1 < tokens:
            positions = [len(ids) + t for ids in prompt_ids]
            logits = decoder.step(cache, [o[-1] for o in out], positions, list(range(r)))
            assert decoder.last_path == "mono", decoder.last_path
    return out, list(torch.stack(rows, dim=1))


class OracleBlocks:
    """`Draft.greedy_tokens` replaced (the whole step's greedy proposals): the tokens the host put
    in `proposals` before the step, read on the device (inside the step's graph on a GPU)."""

    def __init__(self, requests: int, block: int, device, seed: int):
        self.proposals = torch.zeros(requests, block, dtype=torch.long, device=device)
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, streams, anchors):
        return self.proposals

    def set(self, plain: list[list[int]], out: list[list[int]], vocab: int) -> None:
        """Each request's block: plain's tokens after the `len(out[i])` it has (0 past them), the
        one at a random place among block + 1 (the last: none) changed."""
        r, block = self.proposals.shape
        cuts = torch.randint(0, block + 1, (r,), generator=self.g).tolist()
        rows = []
        for ours, theirs, cut in zip(out, plain, cuts):
            row = (theirs[len(ours):len(ours) + block] + [0] * block)[:block]
            if cut < block:
                row[cut] = (row[cut] + 1) % vocab
            rows.append(row)
        self.proposals.copy_(torch.tensor(rows))


def speculative_greedy(decoder, prompt_ids: list[list[int]], tokens: int, oracle: list[list[int]] | None,
                       seed: int) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Each request's first `tokens` tokens by greedy speculation (the blocks `oracle`'s when
    given: `OracleBlocks`), the fp32 logits [tokens - 1, vocab] its verify steps chose all but
    the first (the prefill's) from, and the steps' record."""
    paths = []
    config = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": decoder.draft().block_size,
                                          "rejection_sample_method": "greedy"})
    spec = SpeculativeDecoder(decoder, config, count_path=paths.append)
    # a request may run ahead of the slowest, up to block + 1 tokens a step
    caches = spec.make_caches(len(prompt_ids), max(map(len, prompt_ids)) + (tokens + 2) * (spec.block_size + 1))
    requests = [spec.prefill(caches, slot, ids) for slot, ids in enumerate(prompt_ids)]
    out, rows = [[q.anchor] for q in requests], [[] for _ in requests]
    blocks = None
    if oracle is not None:
        blocks = spec.whole_step.draft.greedy_tokens = OracleBlocks(len(requests), spec.block_size, decoder.device, seed)
    try:
        while min(map(len, out)) < tokens:
            if blocks is not None:
                blocks.set(oracle, out, decoder.config.vocab_size)
            for o, r, committed, logits in zip(out, rows, *spec.step(caches, requests, return_logits=True)):
                o += committed
                r.append(logits)
    finally:
        if blocks is not None:
            del spec.whole_step.draft.greedy_tokens  # the instance attribute: back to the class's method
    record = {"steps": len(paths), "paths": {p: paths.count(p) for p in sorted(set(paths))},
              "tokens_a_step": spec.stats.mean_acceptance_length}
    return [o[:tokens] for o in out], [torch.cat(r)[:tokens - 1] for r in rows], record


def compare(plain: list[int], plain_logits: torch.Tensor, spec: list[int], spec_logits: torch.Tensor) -> dict:
    """One request's two sequences (module docstring), where they part, the plain path's top-two
    gap and margin there, and its logits against the speculative path's on the rows both
    computed from the same tokens. The tokens are kept: a prompt's plain sequences at other
    request counts (other widths) show whether plain decoding alone parts as well."""
    first = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), None)
    shared = len(plain) if first is None else first + 1  # rows of one prefix, the parting one too
    top2 = plain_logits[:shared].topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    row = {"plain": plain, "speculative": spec, "equal": first is None, "first_difference": first,
           "top2_gap_there": None if first is None else gaps[first],
           "margin_there": None if first is None else (plain_logits[first, plain[first]]
                                                       - plain_logits[first, spec[first]]).item(),
           "smallest_top2_gap": min(gaps), "lowest_logit_cosine": None, "largest_logit_difference": None}
    if shared > 1:  # row 0 is the prefill's on both paths
        ours, theirs = plain_logits[1:shared].double(), spec_logits[:shared - 1].double()
        row["lowest_logit_cosine"] = F.cosine_similarity(ours, theirs, dim=-1).min().item()
        row["largest_logit_difference"] = (ours - theirs).abs().max().item()
    return row


DRAFTS = ("draft", "oracle")  # `--drafts`: whose blocks the speculative runs verify (module docstring)


def check(decoder, requests: int, tokens: int, seed: int, drafts=DRAFTS) -> dict:
    """Plain greedy decoding against greedy speculation of each kind of blocks in `drafts`."""
    prompt_ids = prompts(requests, decoder.config.vocab_size, seed)
    plain, plain_logits = plain_greedy(decoder, prompt_ids, tokens)
    report = {}
    for kind in drafts:
        spec, spec_logits, record = speculative_greedy(decoder, prompt_ids, tokens, plain if kind == "oracle" else None,
                                                       seed)
        rows = [{"prompt_length": len(ids), **compare(*pair)}
                for ids, *pair in zip(prompt_ids, plain, plain_logits, spec, spec_logits)]
        cosines = [r["lowest_logit_cosine"] for r in rows if r["lowest_logit_cosine"] is not None]
        report[kind] = {"requests": rows, "all_equal": all(r["equal"] for r in rows),
                        "logits_agree": min(cosines, default=1.0) >= AGREEMENT, **record}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--layers", type=int, default=4, help="the first N layers of the preset")
    parser.add_argument("--requests", default="1,2,4,8", help="request counts, comma-separated (at most 8)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded a request")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--drafts", default=",".join(DRAFTS), help="whose blocks to verify, comma-separated: "
                                                                    "draft, oracle (module docstring)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and the oracle's cuts' seed")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.requests.split(",")]
    drafts = args.drafts.split(",")
    if not all(1 <= n <= len(PROMPTS) for n in counts) or args.tokens < 2 or not set(drafts) <= set(DRAFTS):
        parser.error(f"--requests takes counts from 1 to {len(PROMPTS)}, --tokens at least 2, --drafts "
                     f"{' and '.join(DRAFTS)}")
    started = time.perf_counter()
    decoder = build(args.preset, args.layers, args.device)
    on_gpu = torch.device(args.device).type == "cuda"
    report = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(), "preset": args.preset,
              "layers": args.layers, "layer_kinds": list(decoder.config.compress_ratios), "tokens": args.tokens,
              "build_seconds": time.perf_counter() - started, "counts": {}}
    try:
        for n in counts:  # each count printed and saved as it comes (a run may be cut short)
            report["counts"][n] = check(decoder, n, args.tokens, args.seed, drafts)
            report["seconds"] = time.perf_counter() - started
            print(f"{n} requests: {json.dumps(report['counts'][n])}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(json.dumps(report, indent=1))
    finally:
        decoder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
