"""Log-probabilities of chosen tokens under the target's raw logits (before temperature, top-k
or top-p), with the most likely alternatives: what `logprobs` and `echo` report."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, vocab] (row i scores token_ids[i]) -> one TokenLogprob a row."""
    if not token_ids:
        return []
    logprobs = logits[: len(token_ids)].float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(-1).tolist()
    best = logprobs.topk(top, dim=-1) if top > 0 else None
    return [TokenLogprob(t, lp, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, (t, lp) in enumerate(zip(token_ids, chosen))]
