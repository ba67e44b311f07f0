"""Probe (issue 30): what a whole speculative step's small head operations cost on the GPU, each
alone in a CUDA graph of 5 calls in a row (the draft head's 5 positions), at v4-flash sizes.

- argmax over a vocabulary row (129,280 fp32) at 1, 5, 6, 8, 40, 48 rows: torch's `argmax` against
  `sampling.argmax_rows` (parts, then the part holding the maximum);
- the Markov head's logits at 1 and 8 rows: prev's row of markov_w1 [R, 256] against markov_w2
  [129,280 x 256] bf16 with fp32 output, as `Model.fp32_linear` runs it (`torch.mm(...,
  out_dtype=float32)`), as a bf16 `F.linear` then `.float()`, and (1 row) as `torch.mv`.

Run from the repository root: `python3 docs/results/draft_head_probe_2026-12-07.py`; prints
microseconds a call (the graph's replay time / 5, median of 20 replays). Not a test.
"""

import statistics

import torch
import torch.nn.functional as F

from monodecode.sampling import argmax_rows

VOCAB, RANK, CALLS = 129280, 256, 5


def per_call_us(fn) -> float:
    """fn() five times in a CUDA graph; the median replay over 20, a call's share, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rows in (1, 5, 6, 8, 40, 48):
        logits = torch.randn(rows, VOCAB, device="cuda")
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        print(f"argmax [{rows} x {VOCAB}] fp32: torch {per_call_us(lambda: logits.argmax(dim=-1)):6.1f} us, "
              f"argmax_rows {per_call_us(lambda: argmax_rows(logits)):6.1f} us")
    w2 = torch.randn(VOCAB, RANK, device="cuda").to(torch.bfloat16)
    for rows in (1, 8):
        e = torch.randn(rows, RANK, device="cuda").to(torch.bfloat16)
        forms = {"mm out fp32": lambda: torch.mm(e, w2.t(), out_dtype=torch.float32),
                 "linear bf16 .float()": lambda: F.linear(e, w2).float()}
        if rows == 1:
            forms["mv"] = lambda: torch.mv(w2, e[0])
        print(f"markov logits [{rows} x {RANK}] @ [{VOCAB} x {RANK}]^T: "
              + ", ".join(f"{name} {per_call_us(fn):6.1f} us" for name, fn in forms.items()))


if __name__ == "__main__":
    main()
