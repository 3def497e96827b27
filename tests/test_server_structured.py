"""The OpenAI fields an agent sends, through the official `openai` client against a served model: response_format
(JSON schemas from a seeded generator, each output validated with `jsonschema`; streaming gives the same text),
logprobs against the very logits the engine sampled from, n choices sharing the prompt's pages, /tokenize,
/detokenize and /v1/models' extra fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
from schema_cases import schemas
from test_server_support import PAGE_SIZE, ServerThread, get, make_engine, post, wait_pages_free

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
SCHEMA_COUNT = 20  # ~30 s on 2 cores, batched 4 at a time
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served():
    engine = make_engine(num_pages=64, max_model_len=512)
    with ServerThread(create_app(ServerSettings(model_name="smol-test", max_tokens_limit=128), lambda: engine)) as s:
        s.wait_ready()
        yield s, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0, timeout=300)


def _ask(client, schema, stream=False):
    messages = [{"role": "user", "content": "Reply with a JSON document for this schema: " + json.dumps(schema)}]
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema, "strict": True}}
    if not stream:
        response = client.chat.completions.create(model="smol-test", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, response_format=fmt)
        return response.choices[0].message.content, response.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model="smol-test", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, response_format=fmt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]


def test_generated_schemas_all_validate_and_streaming_matches(served, client):
    cases = schemas(SCHEMA_COUNT)
    with ThreadPoolExecutor(4) as pool:  # the engine batches them (max_batch 4)
        results = list(pool.map(lambda s: _ask(client, s), cases))
    for schema, (text, finish) in zip(cases, results):
        assert finish == "stop", (schema, text, finish)  # bounded schemas end well before max_tokens
        jsonschema.validate(json.loads(text), schema)
    # One at a time, so both runs see the same batch shapes, and after a warm-up run, so both map the prompt's pages
    # from the prefix cache (a full prefill and a cache hit sum floats in another order: a near-tie can flip).
    for schema in cases[:3]:
        _ask(client, schema)
        assert _ask(client, schema, stream=True) == _ask(client, schema)
    print(f"\n{len(cases)}/{len(cases)} schemas validated; e.g. {results[0][0]}")
    wait_pages_free(served[0].url)


# Number fields with no bounds of their own: xgrammar's number rules repeat digits without end, and the bundled model
# wrote {"point": {"x": 10, "y": 100000000000000000000... until max_tokens; the grammar now stops at 16 digits.
NUMBER_SCHEMAS = [
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number"}, "count": {"type": "integer"}},
     "required": ["price", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                                                 "maxItems": 3}}, "required": ["values"], "additionalProperties": False},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90}, "lon": {"type": "number"}},
     "required": ["lat", "lon"], "additionalProperties": False},
]
NUMBER_SEEDS = 20


def _numbers(client, seed: int):
    schema = NUMBER_SCHEMAS[seed % len(NUMBER_SCHEMAS)]
    response = client.chat.completions.create(
        model="smol-test", max_tokens=MAX_TOKENS, seed=seed, temperature=1.0,
        messages=[{"role": "user", "content": "Reply with a JSON document for this schema: " + json.dumps(schema)}],
        response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema, "strict": True}})
    return schema, response.choices[0]


def test_number_fields_end_within_max_tokens(client):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda seed: _numbers(client, seed), range(NUMBER_SEEDS)))
    for schema, choice in results:
        assert choice.finish_reason == "stop", (choice.message.content, choice.finish_reason)
        jsonschema.validate(json.loads(choice.message.content), schema)
    print(f"\njson_schema with number fields: {len(results)}/{NUMBER_SEEDS} parse and validate within max_tokens "
          f"{MAX_TOKENS}; e.g. {results[0][1].message.content}")


def test_json_object_mode_parses(client):
    response = client.completions.create(model="smol-test", prompt="A JSON object about a dog:", max_tokens=48,
                                         temperature=0.7, seed=3,
                                         extra_body={"response_format": {"type": "json_object"}})
    text, finish = response.choices[0].text, response.choices[0].finish_reason
    assert finish == "length" or isinstance(json.loads(text), dict), text


def test_greedy_logprobs_are_the_log_softmax_of_the_sampled_logits(served, client, monkeypatch):
    _, engine = served
    seen: list[torch.Tensor] = []
    original = engine._postprocess

    def recording(requests, logits):  # the rows the engine's sampler received, in order
        seen.extend(logits[i].float().cpu().clone() for i in range(len(requests)))
        return original(requests, logits)

    monkeypatch.setattr(engine, "_postprocess", recording)
    response = client.chat.completions.create(model="smol-test", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                              stop=None)
    content = response.choices[0].logprobs.content
    assert 1 <= len(content) <= len(seen) == response.usage.completion_tokens
    tokenizer = engine.tokenizer
    for entry, logits in zip(content, seen):
        reference = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        assert entry.token == tokenizer.decode([token])
        assert abs(entry.logprob - float(reference[token])) <= 1e-4
        best = torch.topk(reference, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    # completions: the legacy shape, the same numbers for the same greedy tokens
    legacy = client.completions.create(model="smol-test", prompt="The sky is", max_tokens=4, temperature=0,
                                       logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == legacy.choices[0].text and lp.text_offset[0] == 0
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_prefill_the_prompt_once(served, client, monkeypatch):
    _, engine = served
    made = []
    original = engine.submit

    def recording(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine, "submit", recording)
    prompt = "Once upon a time, in a village by the sea, there lived an old fisherman who told stories" * 2
    before = engine.stats.prompt_tokens
    response = client.completions.create(model="smol-test", prompt=prompt, max_tokens=5, temperature=1.0, seed=11,
                                         n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.text for c in response.choices)
    prompt_len = response.usage.prompt_tokens
    assert response.usage.completion_tokens == sum(r.completion_tokens for r in made) and len(made) == 3
    shared = prompt_len // PAGE_SIZE * PAGE_SIZE
    assert shared >= 2 * PAGE_SIZE
    # the first choice prefilled the prompt; the others mapped its full pages and prefilled only the open page
    assert [r.cached_tokens for r in made[1:]] == [shared, shared]
    assert engine.stats.prompt_tokens - before == prompt_len + 2 * (prompt_len - shared)


def test_tokenize_detokenize_and_models(served):
    url = served[0].url
    ids = post(url + "/tokenize", json={"model": "smol-test", "prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 512
    assert post(url + "/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert chat["count"] > ids["count"]  # the template's role markers
    bad = post(url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
    bad = post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    entry = get(url + "/v1/models").json()["data"][0]
    assert entry["max_model_len"] == 512
    assert entry["oval"]["page_size"] == PAGE_SIZE and entry["oval"]["scorer"] == "oval" and entry["oval"]["top_k"] == 1
