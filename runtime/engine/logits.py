"""Logit processors, each a pure function of one row's logits [vocab] float32 and, for the penalties, its history.

They follow the definitions the OpenAI API and vLLM publish, so a unit test can check each against its formula:

- presence/frequency (OpenAI): l[t] -= presence * (count[t] > 0) + frequency * count[t], where count runs over the
  *generated* tokens only (OpenAI's definition; the prompt does not count).
- repetition (vLLM's extension, from the CTRL paper): for every token t seen in prompt or output, a positive l[t] is
  divided by r and a negative one multiplied by r (r > 1 discourages repeats, r = 1 is off).
- logit_bias (OpenAI): l[t] += bias[t], bias in [-100, 100].
- min_p: after temperature, drop tokens whose probability is below min_p * (the top token's probability).
"""

from __future__ import annotations

from typing import Sequence

import torch


def token_counts(token_ids: Sequence[int], vocab: int) -> torch.Tensor:
    """[vocab] float32 counts of each id in `token_ids` (ids outside the vocabulary are ignored)."""
    ids = torch.as_tensor([t for t in token_ids if 0 <= t < vocab], dtype=torch.long)
    return torch.bincount(ids, minlength=vocab).to(torch.float32)


def apply_presence_frequency(logits: torch.Tensor, output_ids: Sequence[int], presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties over the generated tokens: l - presence * [count > 0] - frequency * count."""
    if not output_ids or (presence == 0.0 and frequency == 0.0):
        return logits
    counts = token_counts(output_ids, logits.shape[-1])
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_repetition(logits: torch.Tensor, seen_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty over prompt + output: seen positive logits / penalty, seen negative ones * penalty."""
    if penalty == 1.0 or not seen_ids:
        return logits
    seen = token_counts(seen_ids, logits.shape[-1]) > 0
    # Clamped to finite: a penalty near 0 (the API allows any > 0) would divide a logit to inf, and the sampler's
    # max shift would then turn inf - inf into NaN.
    limit = torch.finfo(logits.dtype).max
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-limit, limit)
    return torch.where(seen, scaled, logits)


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """l[t] += b for each (t, b); ids past this vocabulary are refused earlier (the server checks them)."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype)
    return logits.index_add(0, ids, values)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the probabilities below min_p * max(probs) (the top token always stays); probs [vocab], not renormalised
    (torch.multinomial normalises)."""
    if min_p <= 0.0:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of a [vocab] log-softmax row, most likely first; tokens a grammar or a
    bias ruled out (logprob -inf) are not alternatives and are left out."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
