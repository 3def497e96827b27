"""Admission by pages and the plan of each step, in nano-vllm's waiting -> running shape with vLLM's preemption.

A request waits (FIFO, bounded by `max_queue`) until a batch slot is free and the pool can hold its prompt's pages
(the pages a prefix hit maps cost nothing new), plus one page of headroom per active request so that the running
rows can grow without preempting at once. The head of the line waits rather than being overtaken, so long prompts
do not starve. Pages for generated tokens are taken one page at a time as a row fills its last one (`schedule`).

When a running row needs a page and none is left, the newest active request is preempted (vLLM's recompute
policy): its pages are freed (the full ones it sealed stay in the prefix cache, named by their tokens), and it goes
back to the front of the queue to re-prefill its prompt and the tokens it already generated, then continues where it
stopped; the client sees nothing but a pause. The oldest request is never preempted for a newer one, and one request
alone always fits (the engine refuses at submit what exceeds the pool), so the batch always makes progress.

Each step (`schedule`) runs every running row's next token first, then fills the rest of the token budget with
prompt chunks of requests in prefill, oldest first (Sarathi's decode-first mixed batches). Callers hold the engine's
lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from oval_edge.kv.store.page_file import StoreError
from oval_edge.kv.pool import PagePool

from .request import PREFILL, RUNNING, WAITING, QueueFull, Request


@dataclass
class StepPlan:
    """What one engine step computes: one new token for each decode row, and prompt chunks (request, tokens)."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue while planning this step
    failed: list[tuple[Request, str]] = field(default_factory=list)  # (request, why): a page store write failed

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_queue: int, scored_above: int | None = 0) -> None:
        """scored_above: the token budget past which decode steps score pages (OvalConfig.token_budget); requests
        that never grow past it seal their pages without summaries (PagePool.allocate(scored=False)). None: no
        request is ever scored (dense attention)."""
        self.pool = pool
        self.scored_above = scored_above
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # in prefill or running, in admission order (the newest last)
        self.preemptions = 0

    def enqueue(self, request: Request) -> None:
        """Queue a request; QueueFull when the queue is at its bound."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} waiting requests; retry shortly")
        self.waiting.append(request)

    def admit(self) -> None:
        """Move waiting requests into the active set while a batch slot is free and their prompt pages fit."""
        while self.waiting and len(self.active) < self.max_batch:
            request = self.waiting[0]
            if request.follows is not None and request.follows.status in (WAITING, PREFILL):
                return  # n > 1: wait until the first choice has sealed (and named) the prompt's full pages
            context = request.prefill_ids
            if not self._room_for(context):
                return  # head of line waits for pages (FIFO keeps long prompts from starving)
            scored = self.scored_above is not None and request.reserved_tokens > self.scored_above
            if self.pool.allocate(request.request_id, len(context), context, scored=scored) is None:
                return
            # A prefix hit (oval_edge/kv/prefix_cache.py) starts the sequence past the pages it mapped.
            request.prefilled = request.cached_tokens = self.pool.length(request.request_id)
            self.waiting.popleft()
            request.status = PREFILL
            self.active.append(request)

    def _room_for(self, context: list[int]) -> bool:
        """The prompt's pages fit with one page left per active request (headroom: every running row may open a
        page at the next step). Pages a prefix hit would map are counted as needed: a lower bound on the room."""
        return self.pool.pages_needed(max(len(context), 1)) + len(self.active) <= self.pool.num_takeable

    def schedule(self, max_step_tokens: int, prefill_chunk: int) -> StepPlan:
        """Plan the next step: every running row that has (or can get) a page for its next token, then prompt
        chunks (at most `prefill_chunk` tokens of one request) while the step's token budget lasts."""
        plan = StepPlan()
        for request in [r for r in self.active if r.status == RUNNING]:
            if request.status != RUNNING:  # preempted below, for an older row
                continue
            if self._grow(request, plan):
                plan.decode.append(request)
        budget = max_step_tokens - len(plan.decode)
        for request in list(self.active):  # a page store error removes a request while we go
            if budget <= 0:
                break
            if request.status != PREFILL:
                continue
            chunk = min(len(request.prefill_ids) - request.prefilled, prefill_chunk, budget)
            if any(k.snapshots for k in self.pool.keepers):  # end a chunk on the prompt's last full page: its
                # layer states and ring windows are kept there (kv/snapshots.py)
                last = len(request.prefill_ids) // self.pool.page_size * self.pool.page_size
                if request.prefilled < last < request.prefilled + chunk:
                    chunk = last - request.prefilled
            if not self._resident(request, request.prefilled + chunk, plan):
                break  # no frame for the chunk now (page store): it waits for a later step
            plan.prefill.append((request, chunk))
            budget -= chunk
        return plan

    def _resident(self, request: Request, end_tokens: int, plan: StepPlan) -> bool:
        """The pages the request's next tokens go into are in memory (a page store may have to take older ones);
        a store write error fails the request (in plan.failed) and its pages are freed by the engine."""
        try:
            return self.pool.make_resident(request.request_id, end_tokens)
        except StoreError as exc:
            plan.failed.append((request, f"the KV page store failed: {exc}"))
            self.active.remove(request)
            return False

    def _grow(self, request: Request, plan: StepPlan) -> bool:
        """Make room for one more token of a running row, preempting the newest requests while the pool is short.
        False if the row itself was the newest and went back to the queue."""
        need = self.pool.length(request.request_id) + 1
        while not (self.pool.grow(request.request_id, need) and self._resident(request, need, plan)):
            if request not in self.active:  # failed by the page store
                return False
            victim = next(r for r in reversed(self.active) if r.status in (PREFILL, RUNNING))
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Free the request's pages and put it first in the queue, to recompute what it had (prompt and output)."""
        self.pool.free(request.request_id)
        self.active.remove(request)
        request.preempt()
        self.waiting.appendleft(request)
        self.preemptions += 1

    def prefilling(self) -> list[Request]:
        return [r for r in self.active if r.status == PREFILL]

    def running(self) -> list[Request]:
        return [r for r in self.active if r.status == RUNNING]

    def remove(self, request: Request) -> None:
        """Take a request out of the queue (it leaves the active set at the next `sweep`)."""
        if request in self.waiting:
            self.waiting.remove(request)

    def sweep(self) -> None:
        """Drop finished requests from the active set (after a step)."""
        self.active = [r for r in self.active if not r.finished]

    def requests(self) -> list[Request]:
        """Every queued and active request."""
        return list(self.waiting) + self.active

    @property
    def num_unfinished(self) -> int:
        return sum(1 for r in self.active if not r.finished)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_unfinished > 0


__all__ = ["Scheduler", "StepPlan", "WAITING"]
