"""Logit processors over a batch of rows: logits [B, vocab] float32 on the device, one parameter per row ([B, 1]).

They follow the definitions the OpenAI API and vLLM publish, so a unit test can check each against its formula:

- presence/frequency (OpenAI): l[t] -= presence * (count[t] > 0) + frequency * count[t], where count runs over the
  *generated* tokens only (OpenAI's definition; the prompt does not count).
- repetition (vLLM's extension, from the CTRL paper): for every token t seen in prompt or output, a positive l[t] is
  divided by r and a negative one multiplied by r (r > 1 discourages repeats, r = 1 is off).
- logit_bias (OpenAI): l[t] += bias[t], bias in [-100, 100].
- min_p: after temperature, drop tokens whose probability is below min_p * (the top token's probability).

Why batched: the sampler (sampling.py) processes and chooses every row of a step on the logits' device and reads
the result back once; a row whose parameter is off gets the neutral value (penalty 1, presence 0, min_p 0), which
leaves its logits bit for bit as they were.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch


def sparse_rows(per_row: Sequence[dict[int, float]], vocab: int) -> tuple[list[int], list[int], list[float]]:
    """(row ids, token ids, values) of each row's {token: value}, tokens outside 0..vocab-1 left out: the host side
    of a scatter into a [B, vocab] tensor (the only per-token data a step uploads)."""
    rows, tokens, values = [], [], []
    for row, entries in enumerate(per_row):
        for token, value in entries.items():
            if 0 <= token < vocab:
                rows.append(row), tokens.append(token), values.append(value)
    return rows, tokens, values


def token_counts(token_ids: Sequence[int]) -> dict[int, float]:
    """{token id: how often it occurs in token_ids} (the presence/frequency penalties' counts)."""
    return {t: float(c) for t, c in Counter(token_ids).items()}


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: l - presence * [count > 0] - frequency * count. counts [B, vocab] over generated tokens,
    presence and frequency [B, 1]."""
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty: where seen [B, vocab] (in prompt or output), positive logits / penalty and negative
    ones * penalty; penalty [B, 1]."""
    # Clamped to finite: a penalty near 0 (the API allows any > 0) would divide a logit to inf, and the sampler's
    # max shift would then turn inf - inf into NaN.
    limit = torch.finfo(logits.dtype).max
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-limit, limit)
    return torch.where(seen, scaled, logits)


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor | float) -> torch.Tensor:
    """Zero the probabilities below min_p * max(probs) of their row (the top token always stays); probs [..., vocab],
    min_p a float or [..., 1]; 0 keeps every token. Not renormalised (the draw's argmax does not need it)."""
    return probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest prefix of the tokens by probability whose mass reaches top_p [B, 1] (the first
    token always stays, also when top_p is below float32 resolution and rounds to 0); top_p 1 keeps the row."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop[:, 0] = False
    drop &= top_p < 1.0  # the cumulative sum may round up to 1 before the tail: top_p = 1 must drop nothing
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
