"""/metrics as an LLM-aware router reads it, and --metrics-public.

The llm-d router (the Gateway API Inference Extension's endpoint picker) parses /metrics with Go's expfmt text
parser (legacy name validation), looks each metric up by family name, optionally filters by labels (a spec string
`name{label=value}`), takes a gauge's (or counter's) value, and reads `cache_config_info`'s `block_size` and
`num_gpu_blocks` labels with strconv.Atoi. `_extract` below does the same with prometheus_client's parser, and the
specs it resolves are the ones jetson/k8s/router/epp-config.yaml gives the picker.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_support import PAGE_SIZE, ServerThread, assert_error_object, get, make_engine, post

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_PAGES = 40
CHAT = {"messages": [{"role": "user", "content": "Count from one to fifty."}], "temperature": 0}
EPP_CONFIG = os.path.join(os.path.dirname(__file__), "..", "jetson", "k8s", "router", "epp-config.yaml")
LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # expfmt LegacyValidation: what the picker accepts
LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
DECIMAL = re.compile(r"^[+-]?[0-9]+$")  # what strconv.Atoi accepts


@pytest.fixture(scope="module")
def server():
    """A keyed server whose /metrics is public (the way base/daemonset.yaml runs it)."""
    engine = make_engine(num_pages=NUM_PAGES, max_model_len=512)
    settings = ServerSettings(model_name="smol-test", api_key=KEY, metrics_public=True, max_tokens_limit=256)
    with ServerThread(create_app(settings, lambda: engine)) as running:
        running.wait_ready(headers=AUTH)
        yield running


def _families(url: str) -> dict:
    response = get(url + "/metrics")  # no key: the router has none
    assert response.status_code == 200, response.text
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name` or `name{label=value,...}` (quotes optional), as the picker's metric specs are written."""
    match = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*", spec)
    assert match, f"not a metric spec: {spec!r}"
    labels = {}
    for pair in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
        name, _, value = pair.partition("=")
        labels[name.strip()] = value.strip().strip('"')
    return match.group(1), labels


def _extract(families: dict, spec: str):
    """The one sample the picker would use for `spec` (no timestamps here, so the first matching one)."""
    name, labels = _parse_spec(spec)
    # prometheus_client names a counter family without its _total suffix; a gauge keeps its full name.
    family = families.get(name)
    assert family is not None, f"metric family {name!r} not found"
    assert family.type in ("gauge", "counter"), f"{name} is a {family.type}: the picker reads gauges and counters"
    matching = [s for s in family.samples if labels.items() <= s.labels.items()]
    assert matching, f"no sample of {name} has labels {labels}"
    return family, matching[0]


def test_every_name_passes_the_pickers_parser(server):
    for family in _families(server.url).values():
        for sample in family.samples:
            assert LEGACY_NAME.match(sample.name), sample.name
            assert all(LEGACY_LABEL.match(label) for label in sample.labels), sample


def test_router_gauges_at_rest(server):
    families = _families(server.url)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info"):
        assert families[name].type == "gauge" and len(families[name].samples) == 1, name
    assert _extract(families, "vllm:num_requests_waiting")[1].value == 0
    assert _extract(families, "vllm:num_requests_running")[1].value == 0
    assert _extract(families, "vllm:kv_cache_usage_perc")[1].value == 0.0
    _, info = _extract(families, "vllm:cache_config_info")
    assert info.value == 1
    assert all(DECIMAL.match(info.labels[key]) for key in ("block_size", "num_gpu_blocks")), info.labels
    assert int(info.labels["block_size"]) == PAGE_SIZE and int(info.labels["num_gpu_blocks"]) == NUM_PAGES


def test_router_gauges_follow_a_running_request(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                      json={**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        tokens = 0
        for line in lines:  # the first event (the role) can come before the engine admits the request
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                tokens += 1
                if tokens == 2:
                    break  # decoding now: the request holds pages
        families = _families(server.url)
        running = _extract(families, "vllm:num_requests_running")[1].value
        usage = _extract(families, "vllm:kv_cache_usage_perc")[1].value
        assert running == 1 and _extract(families, "vllm:num_requests_waiting")[1].value == 0
        assert 0.0 < usage <= 1.0
        # One scrape, one reading: the vLLM names carry our own figures.
        assert running == families["oval_edge_requests_running"].samples[0].value
        assert usage == families["oval_edge_kv_usage_ratio"].samples[0].value
        for _ in lines:  # let it finish, so later tests see an idle server
            pass
    assert _extract(_families(server.url), "vllm:num_requests_running")[1].value == 0


def test_the_picker_config_resolves_against_our_metrics(server):
    yaml = pytest.importorskip("yaml")
    with open(EPP_CONFIG, encoding="utf-8") as handle:
        config = yaml.safe_load(handle)
    (extractor,) = [p for p in config["plugins"] if p["type"] == "model-server-protocol-metrics"]
    (engine,) = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "oval-edge"]
    families = _families(server.url)
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        family, sample = _extract(families, engine[key])
        assert family.type == "gauge" and sample.value >= 0, key
    assert 0.0 <= _extract(families, engine["kvUsageSpec"])[1].value <= 1.0


def test_metrics_public_leaves_the_api_keyed(server):
    assert get(server.url + "/metrics").status_code == 200
    assert get(server.url + "/health").status_code == 200
    assert_error_object(get(server.url + "/v1/models"), 401)
    refused = post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert assert_error_object(refused, 401)["type"] == "authentication_error"
    assert get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert post(server.url + "/v1/chat/completions", headers=AUTH, json={**CHAT, "max_tokens": 2}).status_code == 200


def test_metrics_stay_keyed_without_the_flag():
    settings = ServerSettings(model_name="smol-test", api_key=KEY)
    with ServerThread(create_app(settings, lambda: make_engine(num_pages=8, max_model_len=128))) as keyed:
        keyed.wait_ready(headers=AUTH)
        assert_error_object(get(keyed.url + "/metrics"), 401)
        assert get(keyed.url + "/metrics", headers=AUTH).status_code == 200


def test_metrics_public_must_be_a_bool():
    with pytest.raises(ValueError, match="metrics_public"):
        ServerSettings(model_name="smol-test", metrics_public="yes")
