"""Choosing the next token: greedy at temperature 0, seeded nucleus sampling otherwise.

The reported logprob is always taken from the *unmodified* distribution (log-softmax of the raw
logits), so it is comparable across temperatures and equals what a transformers forward pass
gives for the same token -- the tests compare it with a reference computed that way.
"""

from __future__ import annotations

import torch


def pick_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[int, float]:
    """``logits``: float32 ``[vocab]``. Returns ``(token_id, logprob)``."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if temperature <= 0.0:
        token = int(torch.argmax(logits).item())
        return token, float(logprobs[token].item())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cumulative - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator).item())
    return token, float(logprobs[token].item())
