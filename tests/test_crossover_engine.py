"""The engine's use of the crossover (runtime/engine/crossover.py): below `oval_from` tokens a step runs the dense
static step, and a request that never reaches it seals its pages without summaries (the records OVAL would score),
unless it shares an OVAL step with a longer row: then its pages get their summaries before that step
(PagePool.score), and it decodes exactly as if it had been scored from the start.

The tiny random Llama of tests/test_static_step.py: token budget (1 + 4) * 16 + 32 = 112 tokens."""

from __future__ import annotations

import torch
from test_static_step import OVAL, engine_for, tiny_folder  # noqa: F401  (a fixture)

from oval_edge.runtime.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _ids(count: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(100, 40000, (count,), generator=torch.Generator().manual_seed(seed))]


def test_a_request_below_oval_from_runs_dense_and_seals_no_summaries(tiny_folder):  # noqa: F811
    engine = engine_for(tiny_folder, oval_from=400)
    seen = []
    original = engine._decoder_for
    engine._decoder_for = lambda requests: seen.append(original(requests)) or seen[-1]
    sealed = []
    seal = engine.pool.seal
    engine.pool.seal = lambda pages, *args, **kwargs: sealed.append(list(pages)) or seal(pages, *args, **kwargs)
    request = engine.submit(_ids(300, 1), GREEDY)  # 312 tokens at most: below 400, past the 112-token budget
    while not request.finished:
        engine.step()
    assert seen and all(decoder is engine.dense_static for decoder in seen)
    assert sealed == []  # ten full pages, none summarised
    assert "dense below 400 tokens" in engine.describe_decode_step()


def test_a_short_request_beside_a_long_one_is_scored_and_decodes_as_if_scored_from_the_start(tiny_folder):  # noqa: F811
    prompts = [_ids(300, 2), _ids(500, 3)]  # the short one alone would stay dense; the long one is past 400
    outputs, unsummarized = [], []
    for oval_from in (400, 0):
        engine = engine_for(tiny_folder, oval_from=oval_from)
        requests = [engine.submit(p, GREEDY) for p in prompts]
        while engine.has_work():
            engine.step()
            if oval_from:  # pages sealed without summaries, after each step
                unsummarized.append(len(engine.pool.unsummarized))
        outputs.append([r.output_ids for r in requests])
        assert [r.error for r in requests] == [None, None]
        engine.pool.check_invariants()
    assert outputs[0] == outputs[1]
    # the short row's pages were deferred while it prefilled and summarised before its first decode step
    first_decode = len(unsummarized) - GREEDY.max_tokens + 1
    assert max(unsummarized[:first_decode]) > 0 and unsummarized[first_decode:] == [0] * (GREEDY.max_tokens - 1)


def test_a_dense_engine_never_summarises_a_page(tiny_folder):  # noqa: F811
    engine = engine_for(tiny_folder, attention="dense")
    sealed = []
    seal = engine.pool.seal
    engine.pool.seal = lambda pages, *args, **kwargs: sealed.append(list(pages)) or seal(pages, *args, **kwargs)
    request = engine.submit(_ids(300, 4), GREEDY)  # past the token budget: an OVAL engine would score it
    while not request.finished:
        engine.step()
    assert sealed == []
