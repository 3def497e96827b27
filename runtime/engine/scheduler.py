"""Admission by pages: the bounded waiting queue and the active set, in nano-vllm's waiting -> running shape.

A request waits (FIFO, bounded by `max_queue`) until a batch slot is free and the pool can reserve its pages
(`prompt + max_tokens`, DESIGN §3); the head of the line waits for pages rather than being overtaken, so long
prompts do not starve. The engine runs what `prefilling()` and `running()` return and ends requests through
`remove`. Callers hold the engine's lock.
"""

from __future__ import annotations

from collections import deque

from oval_edge.kv.pool import PagePool

from .request import PREFILL, RUNNING, QueueFull, Request


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_queue: int) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # in prefill or running, in admission order

    def enqueue(self, request: Request) -> None:
        """Queue a request; QueueFull when the queue is at its bound."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} waiting requests; retry shortly")
        self.waiting.append(request)

    def admit(self) -> None:
        """Move waiting requests into the active set while a batch slot is free and their pages fit."""
        while self.waiting and len(self.active) < self.max_batch:
            request = self.waiting[0]
            if self.pool.allocate(request.request_id, request.reserved_tokens, request.prompt_ids) is None:
                return  # head of line waits for pages (FIFO keeps long prompts from starving)
            # A prefix hit (oval_edge/kv/prefix_cache.py) starts the sequence past the pages it mapped.
            request.prefilled = request.cached_tokens = self.pool.length(request.request_id)
            self.waiting.popleft()
            request.status = PREFILL
            self.active.append(request)

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
