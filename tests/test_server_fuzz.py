"""Property-based fuzzing with schemathesis against the server's own OpenAPI schema: generated requests that fit
the schema and requests that break it (tools, tool messages and response_format among their fields), for every
operation, must never get a 5xx; afterwards every KV page is free. The server's max_tokens cap is 2 here, and the
schema publishes it, so valid requests stay cheap."""

from __future__ import annotations

from collections import Counter

import pytest
from test_server_support import ServerThread, get, make_engine, wait_pages_free

from oval_edge.runtime.model.tokenizer import read_chat_template
from oval_edge.runtime.server.app import ServerSettings, create_app

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 25}


@pytest.fixture(scope="module")
def server():
    engine = make_engine(num_pages=32, max_model_len=256)
    # The tool-capable template, so that generated `tools` requests reach the template, the tool-call grammar and
    # the parser instead of stopping at the bundled template's "cannot render tools" 400.
    engine.chat_template = read_chat_template("chatml-tools")
    app = create_app(ServerSettings(model_name="smol-test", max_tokens_limit=2, max_body_bytes=64 * 1024),
                     lambda: engine)
    with ServerThread(app) as running:
        running.wait_ready()
        yield running


def _operations(url: str):
    schema = schemathesis.openapi.from_dict(get(url + "/openapi.json").json())
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    }
    return ops


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_no_server_errors_on_generated_requests(server, mode):
    seen: list[tuple[str, int]] = []

    for operation in _operations(server.url):
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # the GET routes take no input to break

        @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=server.url, timeout=120)
            seen.append((operation.path, response.status_code))
            assert response.status_code < 500, (case.body, response.status_code, response.text[:500])

        check()
    codes = [code for _, code in seen]
    assert codes and max(codes) < 500
    per_route = Counter(path for path, _ in seen)
    print(f"\n{mode.value}: requests per route {dict(per_route)}, status codes {dict(Counter(codes))}")
    for route in ("/v1/completions", "/v1/chat/completions"):  # the fuzzer really exercised the POST routes
        assert per_route[route] >= EXAMPLES[mode] // 2, per_route
    if mode == GenerationMode.POSITIVE:  # the schema's valid requests are mostly served, not mostly refused
        assert sum(code == 200 for path, code in seen if path.startswith("/v1/c")) >= 10, seen
    else:
        assert all(400 <= code < 500 for path, code in seen if path.startswith("/v1/c")), seen
    wait_pages_free(server.url)
