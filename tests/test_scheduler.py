"""Admission by pages (runtime/engine/scheduler.py) on a real pool: batch slots, page reservations, FIFO order and
the queue bound, without a model."""

from __future__ import annotations

import pytest

from oval_edge.geometry import KVGeometry
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.engine.request import PREFILL, RUNNING, WAITING, QueueFull, Request
from oval_edge.runtime.engine.sampling import SamplingParams
from oval_edge.runtime.engine.scheduler import Scheduler

PAGE = 16


def _request(prompt: int, max_tokens: int) -> Request:
    return Request(list(range(prompt)), SamplingParams(max_tokens=max_tokens), tokenizer=None)


def _scheduler(pages: int, max_batch: int = 4, max_queue: int = 8) -> Scheduler:
    return Scheduler(PagePool(KVGeometry(1, 1, 16, PAGE), pages), max_batch, max_queue)


def test_admits_while_slots_and_pages_last_and_keeps_fifo_order():
    s = _scheduler(pages=4)
    big, small, tiny = _request(40, 8), _request(20, 8), _request(4, 4)  # 3 pages, 2 pages, 1 page
    for r in (big, small, tiny):
        s.enqueue(r)
    s.admit()
    # big takes 3 of 4 pages; small (2 pages) does not fit, and tiny may not overtake it
    assert s.active == [big] and list(s.waiting) == [small, tiny]
    assert big.status == PREFILL and small.status == WAITING and s.pool.num_free == 1
    assert s.prefilling() == [big] and s.running() == []
    big.status = RUNNING
    assert s.running() == [big] and s.has_work()
    s.pool.free(big.request_id)
    big.finish("cancelled")
    s.sweep()
    s.admit()
    assert s.active == [small, tiny] and not s.waiting
    s.pool.check_invariants()


def test_batch_slots_bound_the_active_set():
    s = _scheduler(pages=16, max_batch=2)
    requests = [_request(4, 4) for _ in range(3)]
    for r in requests:
        s.enqueue(r)
    s.admit()
    assert s.active == requests[:2] and list(s.waiting) == requests[2:]
    assert s.num_unfinished == 2 and s.requests() == requests[2:] + requests[:2]


def test_queue_bound_and_removal():
    s = _scheduler(pages=1, max_queue=2)
    first, second = _request(4, 4), _request(4, 4)
    s.enqueue(first)
    s.enqueue(second)
    with pytest.raises(QueueFull, match="2 waiting requests"):
        s.enqueue(_request(4, 4))
    s.remove(second)  # cancelled while waiting
    assert list(s.waiting) == [first]
    s.admit()
    assert s.active == [first] and not s.waiting and not s.pool.num_free
    first.finish("cancelled")
    s.sweep()
    assert not s.has_work()
