"""One forward per step over decode rows and prompt chunks (runtime/engine/forward/step_rows.py, Engine._run), and
admission that grows pages as tokens come and preempts the newest request when the pool runs out (scheduler.py).

A tiny random Llama in fp32 (test_static_step.tiny_folder): a mixed step's logits equal those of a separate prefill
and a separate decode step, and requests served together, mixed and preempted, give the tokens each gives alone."""

from __future__ import annotations

import pytest
import torch

from oval_edge.kv.prefix_cache import page_hashes
from oval_edge.runtime.engine.forward.step_rows import PrefillRows, StaticDecodeRows
from oval_edge.runtime.engine.sampling import SamplingParams

from eager_decode import EagerDecodeRows
from test_static_step import OVAL, engine_for, prefill, tiny_folder  # noqa: F401 (fixture)

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def _ids(count: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(100, 40000, (count,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("decode_step", ["static", "eager"])  # eager: the tests' reference rows (eager_decode.py)
def test_a_mixed_step_equals_separate_prefill_and_decode_steps(tiny_folder, decode_step):
    engine = engine_for(tiny_folder)
    pool, runner = engine.pool, engine.runner
    for index, length in enumerate((700, 90)):  # one long row (sparse layers select pages), one short (dense)
        prefill(engine, f"d{index}", length, seed=index)
    prefill(engine, "p", 37, seed=7)  # a second chunk reads its earlier pages too
    decoding, tokens = ["d0", "d1"], [11, 12]
    chunk = torch.tensor(_ids(75, 8))

    def decode_rows():
        if decode_step == "static":
            return StaticDecodeRows(engine.static.load(decoding, tokens), decoding)
        return EagerDecodeRows(runner, pool.prepare(decoding, [1, 1]), torch.tensor(tokens))

    # Writes are idempotent (the same token at the same position writes the same K/V), and nothing is committed
    # between the runs, so all three read the same pool.
    (alone_decode,) = runner.forward_rows([decode_rows()])
    (alone_prefill,) = runner.forward_rows([PrefillRows(runner, pool.prepare(["p"], [75]), chunk)])
    mixed_decode, mixed_prefill = runner.forward_rows(
        [decode_rows(), PrefillRows(runner, pool.prepare(["p"], [75]), chunk)])
    torch.testing.assert_close(mixed_decode, alone_decode, atol=1e-4, rtol=0)
    torch.testing.assert_close(mixed_prefill, alone_prefill, atol=1e-4, rtol=0)
    assert mixed_decode.shape == (2, 49152) and mixed_prefill.shape == (1, 49152)


@pytest.fixture(scope="module")
def alone(tiny_folder):
    """Each prompt's greedy tokens, served one request at a time on a roomy pool."""
    engine = engine_for(tiny_folder, prefix_cache=False)
    prompts = [_ids(n, seed) for seed, n in enumerate((20, 150, 33, 64, 300, 5))]
    return prompts, [engine.generate(p, GREEDY).output_ids for p in prompts]


def _serve_together(engine, prompts):
    requests = [engine.submit(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    return requests


def test_requests_served_in_mixed_steps_give_the_tokens_they_give_alone(tiny_folder, alone):
    prompts, expected = alone
    engine = engine_for(tiny_folder, max_step_tokens=96, prefill_chunk=64)
    requests = _serve_together(engine, prompts)
    assert [r.error for r in requests] == [None] * len(prompts)
    assert [r.output_ids for r in requests] == expected
    assert engine.stats.mixed_steps > 0 and engine.stats.preemptions == 0
    engine.pool.check_invariants()
    assert engine.pool.num_used == 0


def test_step_budget_puts_decode_rows_first_and_chunks_of_several_prompts_in_the_rest(tiny_folder):
    engine = engine_for(tiny_folder, max_step_tokens=50, prefill_chunk=32)
    first = engine.submit(_ids(10, 1), GREEDY)
    engine.step()  # its whole prompt in one chunk
    second, third = engine.submit(_ids(40, 2), GREEDY), engine.submit(_ids(40, 3), GREEDY)
    engine.scheduler.admit()
    plan = engine.scheduler.schedule(engine.config.step_tokens, engine.config.prefill_chunk)
    assert plan.decode == [first]
    assert plan.prefill == [(second, 32), (third, 17)]  # 1 decode token + 32 + 17 = the budget of 50
    while engine.has_work():
        engine.step()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_pool_too_small_for_everyone_preempts_the_newest_and_loses_nothing(tiny_folder, prefix_cache):
    # Short prompts that grow: admission takes 2-3 pages each, then 4 rows of 20 + 100 tokens want 32 of 20 pages.
    prompts = [_ids(n, seed) for seed, n in enumerate((20, 30, 17, 25, 40, 8))]
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    roomy = engine_for(tiny_folder, prefix_cache=False)
    expected = [roomy.generate(p, long).output_ids for p in prompts]
    engine = engine_for(tiny_folder, num_pages=20, prefix_cache=prefix_cache)
    streamed: dict[str, list[int]] = {}

    def on_token(request, token, _text):
        streamed.setdefault(request.request_id, []).append(token)

    requests = [engine.submit(p, long, on_token=on_token) for p in prompts]
    while engine.has_work():
        engine.step()
        engine.pool.check_invariants()
    assert [r.error for r in requests] == [None] * len(prompts)
    assert [r.output_ids for r in requests] == expected
    # A preempted stream pauses; its client never sees a token twice or one missing.
    assert [streamed[r.request_id] for r in requests] == expected
    assert engine.stats.preemptions > 0 and sum(r.preemptions for r in requests) == engine.stats.preemptions
    assert requests[0].preemptions == 0  # the oldest is never preempted for a newer one
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.num_pages


def test_a_request_that_can_never_fit_is_still_refused_at_once_with_the_limit(tiny_folder):
    from oval_edge.runtime.engine.request import RequestRejected

    engine = engine_for(tiny_folder, num_pages=30)
    with pytest.raises(RequestRejected, match="limit of 480 tokens"):
        engine.submit(_ids(450, 1), SamplingParams(max_tokens=40))
    assert not engine.has_work() and engine.pool.num_used == 0


def test_max_step_tokens_is_validated():
    from oval_edge.runtime.engine.setup import EngineConfig

    assert EngineConfig(max_batch=8).step_tokens == 8 + EngineConfig().prefill_chunk
    with pytest.raises(ValueError, match="above max_batch=8"):
        EngineConfig(max_batch=8, max_step_tokens=8)


def test_requests_within_the_token_budget_skip_summaries_until_a_scored_one_maps_their_pages(tiny_folder):
    engine = engine_for(tiny_folder)
    pool, budget = engine.pool, engine.oval.token_budget
    prompt = _ids(64, 4)
    short = engine.generate(prompt, SamplingParams(max_tokens=budget - 64, ignore_eos=True))
    assert short.output_ids and not any(pool.owns(s) for s in pool.sequences())
    deferred = set(pool.unsummarized)
    assert len(deferred) == (budget - 1) // 16  # every page it filled (prompt and output), none summarised
    assert {name: torch.count_nonzero(t[:, :, sorted(deferred)]).item()  # never built
            for name, t in pool.summaries.items()} == {"mean": 0, "basis": 0, "coords": 0, "scales": 0}
    prompt_pages = sorted(pool.ledger.page_of[n] for n in page_hashes(prompt, 16, pool.ledger.salt))  # 4 pages
    follow_up = prompt + _ids(300, 5)  # past the budget: its decode steps score pages, the mapped ones included
    long = engine.generate(follow_up, SamplingParams(max_tokens=12, ignore_eos=True))
    assert long.cached_tokens == 64 and not set(prompt_pages) & pool.unsummarized
    built = {name: t[:, :, prompt_pages].clone() for name, t in pool.summaries.items()}
    assert all(torch.count_nonzero(t) for t in built.values())
    pool.seal(prompt_pages)  # building them again changes nothing: they were built when mapped
    for name, t in pool.summaries.items():
        torch.testing.assert_close(t[:, :, prompt_pages], built[name], atol=0, rtol=0)
    fresh = engine_for(tiny_folder, prefix_cache=False).generate(follow_up, SamplingParams(max_tokens=12,
                                                                                         ignore_eos=True))
    assert long.output_ids == fresh.output_ids


def test_cancel_mid_prefill_frees_its_pages_and_the_others_keep_their_tokens(tiny_folder, alone):
    prompts, expected = alone
    engine = engine_for(tiny_folder, prefix_cache=False, max_step_tokens=40, prefill_chunk=32)
    keep = engine.submit(prompts[0], GREEDY)
    engine.step()  # keep's 20-token prompt, whole
    leaving = engine.submit(prompts[4], GREEDY)  # 300 tokens: ~9 steps of chunks beside keep's decode
    for _ in range(3):
        engine.step()
    assert 0 < leaving.prefilled < len(leaving.prompt_ids) and not leaving.output_ids
    held = engine.pool.num_used
    assert engine.cancel(leaving.request_id)  # the client went away before its first token
    assert engine.pool.num_used < held and not engine.pool.owns(leaving.request_id)
    while engine.has_work():
        engine.step()
    assert leaving.finish_reason == "cancelled" and keep.output_ids == expected[0]
    engine.pool.check_invariants()
    assert engine.pool.num_used == 0
