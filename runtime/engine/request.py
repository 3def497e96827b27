"""One generation request as the engine tracks it, from the queue to its last token."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from .detokenize import TextStream
from .sampling import RowSampler, Sample, SampleRow, SamplingParams

WAITING, PREFILL, RUNNING, FINISHED = "waiting", "prefill", "running", "finished"
_ids = itertools.count()


class RequestRejected(ValueError):
    """The request can never be served as asked (too long for the pool or the model); say what to change."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 503 with Retry-After)."""


# on_token(request, token_id, new_text) runs in the engine thread after each sampled token.
TokenCallback = Callable[["Request", int, str], None]
FinishCallback = Callable[["Request"], None]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: object
    request_id: str = ""
    on_token: TokenCallback | None = None
    on_finish: FinishCallback | None = None
    status: str = WAITING
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefilled: int = 0  # tokens of `prefill_ids` already in the pool
    cached_tokens: int = 0  # of them, tokens a prefix hit mapped (not prefilled)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    preemptions: int = 0  # times the scheduler freed its pages to make room (it recomputed them)
    # n > 1: the choice whose prompt prefill this one waits for, so its full pages are mapped from the prefix cache
    # instead of prefilled again (scheduler.admit).
    follows: "Request | None" = None
    samples: list[Sample] = field(default_factory=list)  # one per output token when params.logprobs is set

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        self.sampler = RowSampler(self.params)
        self.grammar = None
        if self.params.grammar is not None:
            from .grammar import GrammarState

            self.grammar = GrammarState(self.params.grammar)
        self.stream = TextStream(self.tokenizer, self.params.stop)
        # What must be in the pool before the next decode step: the prompt, and after a preemption also every
        # generated token but the last (the next decode step feeds that one).
        self.prefill_ids: list[int] = self.prompt_ids

    def preempt(self) -> None:
        """Back to the queue with no pages (scheduler.preempt): recompute the prompt and the output so far."""
        self.status = WAITING
        self.prefilled = self.cached_tokens = 0
        self.prefill_ids = self.prompt_ids + self.output_ids[:-1]
        self.preemptions += 1

    @property
    def resumes(self) -> bool:
        """Its prefill recomputes tokens after a preemption: its end continues the output instead of sampling."""
        return bool(self.output_ids)

    @property
    def reserved_tokens(self) -> int:
        """Positions this request may ever write: the prompt plus every generated token but the last."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def sample_row(self) -> SampleRow:
        """What the step's batch sampler (sampling.choose_batch) needs of this request besides its logits: its
        penalties see the prompt and output so far, its grammar (if any) masks the row."""
        allowed = self.grammar.allowed() if self.grammar is not None else None
        return SampleRow(self.sampler, self.prompt_ids, self.output_ids, allowed)

    def take(self, sample: Sample) -> int:
        """The token chosen for this request (from its sample_row): its grammar accepts it, its logprobs are kept."""
        if self.grammar is not None:
            self.grammar.accept(sample.token)
        if self.params.logprobs is not None:
            self.samples.append(sample)
        return sample.token

    def emit(self, token_id: int, eos_ids: set[int]) -> bool:
        """Record a sampled token; return True when the request is done."""
        self.output_ids.append(token_id)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        p = self.params
        if (token_id in eos_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            self._callback(token_id, "")
            self.finish_reason = "stop"
            return True
        delta = self.stream.push(token_id)
        self.text += delta
        self._callback(token_id, delta)
        if self.stream.stopped:
            self.finish_reason = "stop"
            return True
        if len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def finish(self, reason: str | None = None, error: str | None = None) -> None:
        if self.status == FINISHED:
            return
        if reason:
            self.finish_reason = reason
        self.error = error
        if self.finish_reason in ("stop", "length"):
            tail = self.stream.flush()
            if tail:
                self.text += tail
                self._callback(-1, tail)
        self.status = FINISHED
        self.finished_at = time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(self)

    def _callback(self, token_id: int, delta: str) -> None:
        if self.on_token is not None:
            self.on_token(self, token_id, delta)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
