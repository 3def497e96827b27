"""The sampler's logit processors against their published definitions (no model: small hand-made rows)."""

from __future__ import annotations

import math

import pytest
import torch

from oval_edge.runtime.engine.grammar import GrammarError, check_enforceable
from oval_edge.runtime.engine.logits import min_p_filter
from oval_edge.runtime.engine.sampling import RowSampler, SamplingParams

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])


def processed(prompt=(), output=(), **params) -> torch.Tensor:
    return RowSampler(SamplingParams(**params)).process(LOGITS, prompt, output)


def test_presence_and_frequency_follow_openai_definition():
    output = [3, 3, 0, 3]  # token 3 three times, token 0 once
    got = processed(output=output, presence_penalty=0.5, frequency_penalty=0.25)
    counts = [output.count(t) for t in range(len(LOGITS))]
    want = [float(LOGITS[t]) - 0.5 * (c > 0) - 0.25 * c for t, c in enumerate(counts)]
    assert got.tolist() == pytest.approx(want)
    # the prompt does not count for OpenAI's penalties
    assert processed(prompt=[1, 2], presence_penalty=1.0).tolist() == pytest.approx(LOGITS.tolist())
    # negative values encourage repeats
    assert float(processed(output=[1], presence_penalty=-1.0)[1]) == pytest.approx(0.0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    got = processed(prompt=[0, 1], output=[5], repetition_penalty=2.0)
    want = LOGITS.tolist()
    want[0], want[1], want[5] = 2.0 / 2.0, -1.0 * 2.0, 0.0  # seen in prompt (0, 1) and output (5: 0 stays 0)
    assert got.tolist() == pytest.approx(want)
    # unseen tokens are untouched, and a penalty of 1 is off
    assert processed(prompt=[0], repetition_penalty=1.0).tolist() == pytest.approx(LOGITS.tolist())


def test_a_tiny_repetition_penalty_still_samples():
    # 1e-300 > 0 is a valid value: dividing a logit by it overflows, which must not reach the softmax as NaN
    # (a 500 the schemathesis run found); the seen positive logit dominates, as the definition says.
    got = processed(prompt=[0], repetition_penalty=1e-300)
    assert torch.isfinite(got).all()
    sampler = RowSampler(SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=3))
    assert sampler.choose(LOGITS, [0], []).token == 0


def test_logit_bias_adds_and_can_force_or_forbid_a_token():
    got = processed(logit_bias={1: 5.0, 3: -100.0})
    assert float(got[1]) == pytest.approx(4.0) and float(got[3]) == pytest.approx(-97.0)
    assert RowSampler(SamplingParams(logit_bias={4: 100.0})).choose(LOGITS).token == 4


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    probs = torch.softmax(LOGITS, dim=-1)
    kept = min_p_filter(probs, 0.3)
    assert ((kept > 0) == (probs >= 0.3 * probs.max())).all()
    assert kept[3] > 0  # the top token always stays
    for seed in range(20):  # sampling never draws a dropped token
        token = RowSampler(SamplingParams(temperature=1.0, min_p=0.3, seed=seed)).choose(LOGITS).token
        assert probs[token] >= 0.3 * probs.max()


def test_logprobs_are_the_log_softmax_of_the_processed_logits():
    sampler = RowSampler(SamplingParams(logprobs=3, frequency_penalty=1.0))
    sample = sampler.choose(LOGITS, output_ids=[3])
    reference = torch.log_softmax(processed(output=[3], frequency_penalty=1.0), dim=-1)
    assert sample.token == int(torch.argmax(reference))
    assert sample.logprob == pytest.approx(float(reference[sample.token]), abs=1e-6)
    order = torch.argsort(reference, descending=True)[:3].tolist()
    assert [t for t, _ in sample.top] == order
    assert [lp for _, lp in sample.top] == pytest.approx([float(reference[t]) for t in order], abs=1e-6)
    assert math.fsum(math.exp(lp) for lp in reference.tolist()) == pytest.approx(1.0)


def test_grammar_mask_rules_tokens_out_and_hides_them_from_alternatives():
    allowed = torch.tensor([False, True, True, False, False, False])
    sample = RowSampler(SamplingParams(logprobs=5)).choose(LOGITS, allowed=allowed)
    assert sample.token == 2  # the best allowed token, not the best one (3)
    assert {t for t, _ in sample.top} == {1, 2}


def test_a_seed_reproduces_the_draws_and_another_seed_differs():
    def draws(seed):
        sampler = RowSampler(SamplingParams(temperature=1.5, seed=seed))
        return [sampler.choose(LOGITS).token for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(min_p=1.5), dict(logit_bias={1: 101.0}),
                                 dict(logprobs=21)])
def test_out_of_range_values_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.mark.parametrize("schema, where", [
    ({"not": {"type": "string"}}, "$"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "$.properties.a"),
    ({"anyOf": [{"type": "integer"}, {"if": {"type": "integer"}}]}, "$.anyOf[1]"),
])
def test_keywords_the_grammar_would_ignore_are_refused_with_their_path(schema, where):
    with pytest.raises(GrammarError, match=r"^" + where.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")
                       + ": "):
        check_enforceable(schema)
    check_enforceable({"type": "object", "properties": {"not": {"type": "string"}}})  # a property named "not"
