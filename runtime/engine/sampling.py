"""Sampling parameters (validated like the OpenAI API validates them) and the batch sampler.

One row's logits go through, in order: repetition, presence and frequency penalties, logit_bias, the grammar's
token mask (response_format / tools); those are the *processed* logits, whose log-softmax is what `logprobs`
reports (so a logprob is the one the model's distribution gave after the request's own rules, before temperature
and truncation). Then greedy takes their argmax; sampling divides by the temperature and applies top_k, min_p and
top_p before drawing with the request's own generator.

Every row of a step is processed and chosen together on the logits' device (choose_batch), each request's values
as a row of a [B, 1] tensor, and the tokens (with their logprobs) come back to the host in ONE copy: on CUDA a
per-row argmax and read would stall the host once per row. The draw is the Gumbel-max form torch.multinomial uses
for one sample, argmax(probs / q) with q ~ Exp(1) drawn from the request's own generator on the device, so a seed
reproduces a request's tokens in any batch, and on a CPU they are the tokens torch.multinomial drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .logits import (apply_presence_frequency, apply_repetition, min_p_filter, sparse_rows, token_counts,
                     top_p_filter)

MAX_STOP_STRINGS = 8
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens
    repetition_penalty: float = 1.0  # (0, 2], over prompt + generated tokens; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # None = off; else how many top alternatives per token (0..20)
    grammar: object | None = field(default=None, compare=False)  # a compiled grammar (grammar.py), None = free

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        for name, low, high in (("temperature", 0.0, 2.0), ("presence_penalty", -2.0, 2.0),
                                ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not _number(value) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is out of range: allowed [{low:g}, {high:g}]")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is out of range: allowed (0, 1]")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is out of range: allowed (0, 2] "
                             "(1 = off, above 1 discourages repeats)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r}: give at most {MAX_STOP_STRINGS} non-empty strings")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError(f"logit_bias={self.logit_bias!r}: token ids must be >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def penalised(self) -> bool:
        """Any processor before the grammar mask is on (the plain greedy path skips the host copy without)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < torch.finfo(torch.float32).tiny  # below it a temperature would divide by 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


class Sample(NamedTuple):
    token: int
    logprob: float | None = None  # of `token` under the processed logits (None when logprobs are off)
    top: tuple[tuple[int, float], ...] = ()  # the most likely (id, logprob), params.logprobs of them


@dataclass
class RowSampler:
    """One request's parameters and random stream: its seed (or a fresh one) seeds a generator on the device its
    logits are on, so a seed reproduces the output in any batch."""

    params: SamplingParams
    seed: int | None = None
    _generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else torch.Generator().seed()

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's generator on `device` (made on first use there)."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def process(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """One row's processed logits [vocab] float32: penalties, logit_bias, then the grammar's mask (`allowed`:
        [vocab] bool, True where the grammar accepts the token)."""
        return process_rows([SampleRow(self, prompt_ids, output_ids, allowed)], logits[None])[0]

    def sample(self, logits: torch.Tensor) -> int:
        """logits [vocab] -> token id, with no history (no penalties) and no grammar (the eval tool's rows)."""
        return self.choose(logits).token

    def choose(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
               allowed: torch.Tensor | None = None) -> Sample:
        """logits [vocab] -> the next token (and its logprobs when the request asked for them)."""
        return choose_batch([SampleRow(self, prompt_ids, output_ids, allowed)], logits[None])[0]


class SampleRow(NamedTuple):
    """What one row of a step is chosen from besides its logits: the request's sampler, its history (for the
    penalties) and its grammar's mask ([vocab] bool on the host, or None)."""

    sampler: RowSampler
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    allowed: torch.Tensor | None = None


def choose_batch(rows: Sequence[SampleRow], logits: torch.Tensor) -> list[Sample]:
    """logits [B, vocab] (any float dtype, any device) -> one Sample per row, chosen on the device and read back
    with one copy to the host."""
    params = [r.sampler.params for r in rows]
    work = process_rows(rows, logits)  # [B, V] fp32
    tokens = torch.argmax(work, dim=-1)  # [B] greedy choices
    if not all(p.greedy for p in params):
        tokens = torch.where(_on(work, [p.greedy for p in params], torch.bool), tokens, _draw(rows, work))
    packed = tokens[:, None].double()  # [B, 1]: token ids and logprobs (fp32, exact in fp64) in one tensor
    top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if top is not None:
        logprobs = torch.log_softmax(work, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])  # [B, 1]
        values, ids = torch.topk(logprobs, min(top, work.shape[-1]), dim=-1)  # [B, k]
        packed = torch.cat([packed, chosen.double(), ids.double(), values.double()], dim=1)
    host = packed.tolist()  # the step's one device -> host copy
    return [_sample(row, p) for row, p in zip(host, params)]


def _sample(row: list[float], p: SamplingParams) -> Sample:
    token = int(row[0])
    if p.logprobs is None:
        return Sample(token)
    width = (len(row) - 2) // 2
    ids, values = row[2:2 + p.logprobs], row[2 + width:2 + width + p.logprobs]
    # tokens a grammar or a bias ruled out (logprob -inf) are not alternatives and are left out
    return Sample(token, row[1], tuple((int(i), v) for i, v in zip(ids, values) if v != float("-inf")))


def process_rows(rows: Sequence[SampleRow], logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the processed logits [B, V] fp32 on the same device. The per-token inputs (seen tokens,
    counts, biases, grammar masks) are uploaded only for the rows that have them, without waiting for the device."""
    work, vocab = logits.float(), logits.shape[-1]
    params = [r.sampler.params for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [dict.fromkeys(list(r.prompt_ids) + list(r.output_ids), 1.0) if p.repetition_penalty != 1.0 else {}
                for r, p in zip(rows, params)]
        mask = _scatter(work, seen, torch.bool)
        work = apply_repetition(work, mask, _on(work, [[p.repetition_penalty] for p in params]))
    if any((p.presence_penalty or p.frequency_penalty) and r.output_ids for r, p in zip(rows, params)):
        counts = _scatter(work, [token_counts(r.output_ids) for r in rows], torch.float32)
        work = apply_presence_frequency(work, counts, _on(work, [[p.presence_penalty] for p in params]),
                                        _on(work, [[p.frequency_penalty] for p in params]))
    if any(p.logit_bias for p in params):
        index_rows, tokens, values = sparse_rows([dict(p.logit_bias) for p in params], vocab)
        work = work.index_put((_on(work, index_rows, torch.long), _on(work, tokens, torch.long)),
                              _on(work, values), accumulate=True)
    if any(r.allowed is not None for r in rows):
        allowed = torch.stack([r.allowed[:vocab] if r.allowed is not None else torch.ones(vocab, dtype=torch.bool)
                               for r in rows])
        work = work.masked_fill(~allowed.to(work.device, non_blocking=True), float("-inf"))
    return work


def _draw(rows: Sequence[SampleRow], work: torch.Tensor) -> torch.Tensor:
    """The sampled rows' tokens [B] (greedy rows' entries are meaningless): temperature, top_k, min_p and top_p on
    the whole batch, then argmax(probs / q) with q ~ Exp(1) from each row's own generator (torch.multinomial's
    one-sample draw)."""
    params = [r.sampler.params for r in rows]
    temperature = _on(work, [[1.0 if p.greedy else p.temperature] for p in params])
    # Shift by the max first: a tiny temperature then sends the others to -inf instead of overflowing to inf
    # (inf - inf = NaN in the softmax); the softmax is shift-invariant, so nothing else changes.
    x = (work - work.amax(-1, keepdim=True)) / temperature
    ks = [p.top_k if 0 < p.top_k < work.shape[-1] else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values  # [B, max k]
        kth = top.gather(1, _on(work, [[max(k - 1, 0)] for k in ks], torch.long))
        kth = kth.masked_fill(_on(work, [[k == 0] for k in ks], torch.bool), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = min_p_filter(probs, _on(work, [[p.min_p] for p in params]))
    if any(p.top_p < 1.0 for p in params):
        # top_p's mass is of what min_p kept
        renorm = _on(work, [[p.min_p > 0.0 and p.top_p < 1.0] for p in params], torch.bool)
        probs = top_p_filter(torch.where(renorm, probs / probs.sum(-1, keepdim=True), probs),
                             _on(work, [[p.top_p] for p in params]))
    noise = torch.ones_like(probs)  # [B, V]; the greedy rows keep ones and draw nothing from their stream
    for i, (row, p) in enumerate(zip(rows, params)):
        if not p.greedy:
            noise[i].exponential_(1.0, generator=row.sampler.generator(work.device))
    return torch.argmax(probs / noise, dim=-1)


def _on(like: torch.Tensor, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host list as a tensor on like's device, copied without waiting for the device (no host sync)."""
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)


def _scatter(like: torch.Tensor, per_row: Sequence[dict[int, float]], dtype: torch.dtype) -> torch.Tensor:
    """[B, V] zeros of `dtype` on like's device with each row's {token: value} written in."""
    rows, tokens, values = sparse_rows(per_row, like.shape[-1])
    out = torch.zeros(like.shape, dtype=dtype, device=like.device)
    return out.index_put_((_on(like, rows, torch.long), _on(like, tokens, torch.long)), _on(like, values, dtype))
