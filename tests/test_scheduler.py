"""Admission by pages (runtime/engine/scheduler.py) on a real pool: batch slots, page reservations, FIFO order, the
queue bound, and (a hypothesis state machine) growth per page with preemption and prefix hits, without a model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from oval_edge.geometry import KVGeometry
from oval_edge.kv.pool import PagePool
from oval_edge.kv.prefix_cache import page_hashes
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


# ---- the scheduler over a real pool, driven at random: admission, growth, preemption, prefix hits --------------

SALT = b"scheduler-machine"


def next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the context, so a recomputed row continues alike."""
    return (sum(context) * 31 + len(context)) % 7


class SchedulerMachine(RuleBasedStateMachine):
    """Requests that share prompt prefixes arrive, steps run without a model (the pool's bookkeeping as the engine
    does it), requests finish or are cancelled; a pool of 12 pages of 16 tokens is short, so rows preempt."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(KVGeometry(1, 1, 16, PAGE), 12, prefix_salt=SALT)
        # Requests of at most 60 tokens are never scored: their pages skip summaries until a scored one maps them.
        self.scheduler = Scheduler(self.pool, max_batch=3, max_queue=64, scored_above=60)
        self.live: list[Request] = []

    @rule(base=st.sampled_from([(1,) * 20, (2,) * 40, (1,) * 16 + (3,) * 9]), extra=st.integers(1, 5),
          max_tokens=st.integers(1, 140))
    def submit(self, base, extra, max_tokens):
        request = _request(0, max_tokens)
        request.prompt_ids = request.prefill_ids = list(base) + [extra] * extra
        if len(request.prompt_ids) + max_tokens <= self.pool.capacity_tokens:  # the engine refuses the rest
            self.scheduler.enqueue(request)
            self.live.append(request)

    @precondition(lambda self: self.scheduler.has_work())
    @rule(budget=st.integers(4, 40))
    def step(self, budget):
        s, pool = self.scheduler, self.pool
        s.admit()
        plan = s.schedule(budget, prefill_chunk=24)
        assert len(plan.decode) + sum(n for _, n in plan.prefill) <= budget
        ids, lengths = [], []
        for request in plan.decode:  # the pool holds exactly prompt + output but the last, fed now
            assert pool.length(request.request_id) == len(request.prompt_ids) + len(request.output_ids) - 1
            pool.record_tokens(request.request_id, request.output_ids[-1:])
            ids.append(request.request_id)
            lengths.append(pool.length(request.request_id) + 1)
        for request, n in plan.prefill:
            pool.record_tokens(request.request_id, request.prefill_ids[request.prefilled : request.prefilled + n])
            ids.append(request.request_id)
            lengths.append(request.prefilled + n)
        pool.advance(ids, lengths)
        for request in plan.decode:
            self._emit(request)
        for request, n in plan.prefill:
            request.prefilled += n
            if request.prefilled == len(request.prefill_ids):
                request.status = RUNNING
                if not request.resumes:
                    self._emit(request)
        s.sweep()
        if not s.active and s.waiting:  # one request alone always fits: the queue never stalls
            s.admit()
            assert s.active

    def _emit(self, request: Request) -> None:
        request.output_ids.append(next_token(request.prompt_ids + request.output_ids))
        if len(request.output_ids) >= request.params.max_tokens:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        expected = list(request.prompt_ids)
        for _ in range(request.params.max_tokens):
            expected.append(next_token(expected))
        assert request.output_ids == expected[len(request.prompt_ids):]  # preemption lost or repeated nothing
        self.scheduler.remove(request)
        self.pool.free(request.request_id)
        request.finish("length")
        self.live.remove(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel(self, data):
        request = data.draw(st.sampled_from(self.live))
        self.scheduler.remove(request)
        self.pool.free(request.request_id)
        request.finish("cancelled")
        self.live.remove(request)
        self.scheduler.sweep()

    @invariant()
    def bookkeeping_holds(self):
        pool = self.pool
        pool.check_invariants()  # no page in two states or lost, refcounts = holders, free + cached + used = total
        active = [r for r in self.scheduler.active if not r.finished]
        assert len(active) <= 3 and all(pool.owns(r.request_id) for r in active)
        assert not any(pool.owns(r.request_id) for r in self.scheduler.waiting)  # preempted rows hold nothing
        if not active:
            assert pool.num_used == 0
        for request in active:  # a named page holds exactly the tokens its name says
            tokens = (request.prompt_ids + request.output_ids)[: pool.length(request.request_id)]
            names = page_hashes(tokens, PAGE, SALT)
            sealed = pool.page_table(request.request_id)[: pool.sealed_pages(request.request_id)]
            for index, page in enumerate(sealed):
                assert pool.ledger.name_of.get(page) in (None, names[index])
            if request.reserved_tokens > 60:  # a scored row's sealed pages all have their summaries
                assert not pool.unsummarized.intersection(sealed)

    def teardown(self):
        while self.scheduler.has_work():  # everything left finishes: no deadlock, nothing leaks
            self.step(budget=40)
        assert self.pool.num_used == 0 and self.pool.num_free == self.pool.num_pages


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
