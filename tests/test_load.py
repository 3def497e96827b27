"""`oval-edge bench --serve`, the load tool (tools/load/): its SSE checks, outcome classes, percentiles, the
inter-token latency and engine counters it reports, and its clients over HTTP against in-process apps (never
timing)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from oval_edge.tools.load.client import RequestResult, StreamCheck, run_clients
from oval_edge.tools.load.report import kv_pages, pages_returned, parse_metrics, summarize, verdict


def _chunk(content=None, finish=None):
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]})


def test_stream_check_accepts_a_well_formed_stream():
    check = StreamCheck()
    firsts = [check.feed(line) for line in
              [": keep-alive", _chunk(), "", _chunk("Hel"), "", _chunk("lo"), "", _chunk(None, "length"), "",
               'data: {"object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 3}}',
               "", "data: [DONE]", ""]]
    check.close()
    assert check.well_formed and check.finish_reason == "length" and check.content_chunks == 2
    assert firsts.count(True) == 1 and firsts[3] is True  # first content, not the role-only chunk
    assert check.usage == {"completion_tokens": 3} and "".join(check.text) == "Hello"


@pytest.mark.parametrize("lines, problem", [
    ([_chunk("a"), _chunk(None, "stop")], "without data: [DONE]"),
    ([_chunk("a"), "data: {not json", "data: [DONE]"], "not JSON"),
    ([_chunk(None, "stop"), "data: [DONE]", _chunk("late")], "after [DONE]"),
    ([_chunk("a"), "data: [DONE]"], "finish_reason"),
    (["garbage line", _chunk(None, "stop"), "data: [DONE]"], "not an SSE field"),
    (['data: {"choices": []}', "data: [DONE]"], "chat.completion.chunk"),
])
def test_stream_check_names_what_is_wrong(lines, problem):
    check = StreamCheck()
    for line in lines:
        check.feed(line)
    check.close()
    assert not check.well_formed and problem in check.problem


def test_outcomes_and_verdict():
    ok = RequestResult(0, 0, status=200, ttft_s=0.1, latency_s=1.0, completion_tokens=8, well_formed=True,
                       finish_reason="length")
    busy = RequestResult(0, 1, status=503, retry_after="1")
    bare_503 = RequestResult(1, 0, status=503)
    broken = RequestResult(1, 1, status=200, well_formed=False, problem="the stream ended without data: [DONE]")
    assert [r.outcome for r in (ok, busy, bare_503, broken)] == ["completed", "busy", "error", "error"]
    summary = summarize([ok, busy], wall_s=2.0)
    assert summary["completed"] == 1 and summary["busy"] == 1 and summary["aggregate_tok_s"] == 4.0
    assert verdict(summary, pages_ok=True) == []
    bad = summarize([ok, bare_503, broken], wall_s=1.0)
    problems = " ".join(verdict(bad, pages_ok=False))
    assert "5xx" in problems and "malformed" in problems and "did not return" in problems


def test_metrics_pages_are_found_and_checked():
    text = ("# HELP oval_edge_kv_pages_total KV pages in the pool\n# TYPE oval_edge_kv_pages_total gauge\n"
            "oval_edge_kv_pages_total 256.0\noval_edge_kv_pages_free 250.0\n"
            "oval_edge_selected_pages_total 9000\nhttp_requests_total{code=\"200\"} 3\n")
    pages = kv_pages(parse_metrics(text))
    assert pages == {"total": 256.0, "free": 250.0, "used": 6.0}
    assert pages_returned(pages) is False
    assert pages_returned(kv_pages(parse_metrics("oval_edge_kv_pages_used 0\noval_edge_kv_pages_total 8\n"))) is True
    assert pages_returned(kv_pages(parse_metrics("up 1\n"))) is None


def test_clients_over_http_classify_streams_and_503s():
    """run_clients against a small ASGI app speaking the OpenAI streaming protocol (no model): every third
    request is refused with 503 + Retry-After, the rest stream three tokens."""
    httpx = pytest.importorskip("httpx")
    calls = []

    async def app(scope, receive, send):
        assert scope["type"] == "http" and scope["path"] == "/v1/chat/completions"
        body = json.loads((await receive())["body"])
        calls.append(body)
        if len(calls) % 3 == 0:
            await send({"type": "http.response.start", "status": 503, "headers": [(b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for line in [_chunk(), _chunk("a"), _chunk("b"), _chunk("c", "length"), "data: [DONE]"]:
            await send({"type": "http.response.body", "body": (line + "\n\n").encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=app)
    results, wall = asyncio.run(run_clients("http://test", "m", clients=3, requests_per_client=2, max_tokens=3,
                                            headers={}, time_limit_s=30, transport=transport))
    assert len(results) == 6 and wall > 0
    assert all(body["stream"] is True and body["max_tokens"] == 3 for body in calls)
    outcomes = sorted(r.outcome for r in results)
    assert outcomes == ["busy", "busy", "completed", "completed", "completed", "completed"]
    done = [r for r in results if r.outcome == "completed"]
    assert all(r.completion_tokens == 3 and r.ttft_s is not None and r.finish_reason == "length" for r in done)


def test_multiturn_clients_resend_the_whole_conversation():
    """run_multiturn against a small ASGI app: each turn carries every earlier message plus a new passage, and the
    assistant message it appends is the text the server streamed."""
    httpx = pytest.importorskip("httpx")
    from oval_edge.tools.load.multiturn import format_turns, passages, per_turn, run_multiturn

    calls = []

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        calls.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for line in [_chunk(), _chunk("a"), _chunk("b", "length"), "data: [DONE]"]:
            await send({"type": "http.response.body", "body": (line + "\n\n").encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    results, _ = asyncio.run(run_multiturn("http://test", "m", clients=2, turns=3, turn_tokens=50, max_tokens=2,
                                           headers={}, time_limit_s=30, transport=httpx.ASGITransport(app=app)))
    assert len(results) == 6 and all(r.outcome == "completed" and r.text == "ab" for r in results)
    first = [c for c in calls if len(c["messages"]) == 2]
    third = [c for c in calls if len(c["messages"]) == 6]
    assert len(first) == 2 and len(third) == 2
    conversation = third[0]["messages"]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert conversation[2]["content"] == "ab" and conversation[1]["content"] in [c["messages"][1]["content"] for c in first]
    assert len(passages(3, 50)[0]) == 200 and passages(1, 50, offset=1)[0] == passages(2, 50)[1]
    rows = per_turn(results, 3)
    assert [r["completed"] for r in rows] == [2, 2, 2] and "last turn / first turn" in format_turns(rows)


_ROLE = 'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}'
_USAGE = 'data: {"object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9}}'


def test_inter_token_gaps_time_only_chunks_with_content(monkeypatch):
    """stream_chat on a scripted clock: the role-only chunk, the finish-only chunk, the usage chunk and [DONE] are
    not timed; the gaps are between the three content chunks."""
    pytest.importorskip("httpx")
    from types import SimpleNamespace

    from oval_edge.tools.load import client as load_client

    clock = {"now": 0.0}
    timed = [(0.05, _ROLE), (0.05, ""), (0.10, _chunk("Hel")), (0.10, ""), (0.13, _chunk("lo")), (0.20, _chunk(" you")),
             (0.50, _chunk(None, "length")), (0.60, _USAGE), (0.70, "data: [DONE]"), (0.70, "")]

    class Response:
        status_code, headers = 200, {}

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def aiter_lines(self):
            for at, line in timed:
                clock["now"] = at
                yield line

    monkeypatch.setattr(load_client, "clock", lambda: clock["now"])
    http = SimpleNamespace(stream=lambda *args, **kwargs: Response())
    result = asyncio.run(load_client.stream_chat(http, "http://test", {}, {}, 0, 0))
    assert result.outcome == "completed" and result.text == "Hello you" and result.completion_tokens == 3
    assert result.ttft_s == pytest.approx(0.10)
    assert result.itl_s == pytest.approx([0.03, 0.07])


def test_summary_reports_inter_token_latency_and_engine_counters():
    from oval_edge.tools.load.report import counter_changes, counters, format_summary

    done = dict(status=200, well_formed=True, finish_reason="length", completion_tokens=3, ttft_s=0.1, latency_s=0.5)
    results = [RequestResult(0, 0, itl_s=[0.010, 0.030], **done), RequestResult(0, 1, itl_s=[0.020], **done),
               RequestResult(1, 0, itl_s=[], **done),  # one content chunk: no gap
               RequestResult(1, 1, status=200, well_formed=False, itl_s=[9.0])]  # broken stream: not counted
    summary = summarize(results, wall_s=1.0)
    assert summary["itl_samples"] == 3
    assert summary["itl_p50_ms"] == pytest.approx(20.0) and summary["itl_p95_ms"] == pytest.approx(29.0)
    metrics = parse_metrics("oval_edge_requests_preempted_total 4.0\noval_edge_mixed_steps_total 10.0\n"
                            "oval_edge_prefix_cache_hit_tokens_total 30\noval_edge_prefix_cache_query_tokens_total 100\n")
    before = counters(metrics)
    assert before == {"preemptions": 4.0, "mixed_steps": 10.0, "prefix_hit_tokens": 30.0, "prefix_query_tokens": 100.0}
    after = {"preemptions": 7.0, "mixed_steps": 25.0, "prefix_hit_tokens": 90.0, "prefix_query_tokens": 200.0}
    assert counter_changes(before, after) == {"preemptions": 3, "mixed_steps": 15, "prefix_hit_ratio": 0.6}
    assert counter_changes(before, before) == {"preemptions": 0, "mixed_steps": 0}  # no lookups: no ratio
    assert counter_changes({}, {}) == {"preemptions": None, "mixed_steps": None}  # llama-server
    assert counter_changes(None, None) == {"preemptions": None, "mixed_steps": None}  # /metrics unreadable
    setup = {"clients": 2, "requests_per_client": 2, "max_tokens": 3, "url": "http://test"}
    pages = {"total": 8, "free": 8, "used": 0}
    text = format_summary(summary | counter_changes(before, after), pages, True, setup)
    assert "  inter-token latency p50 20.0 ms, p95 29.0 ms" in text
    assert "preemptions 3, mixed steps 15" in text and "prefix cache        60.0%" in text
    assert "preemptions unknown, mixed steps unknown" in format_summary(summary, pages, True, setup)
    empty = format_summary(summarize([], wall_s=1.0), pages, True, setup)
    assert "inter-token latency p50 -, p95 -" in empty


@pytest.mark.parametrize("exports_counters", [True, False])
def test_drive_reports_inter_token_latency_and_preemptions(exports_counters, capsys):
    """The whole report (command._drive) against an in-process ASGI server: /v1/models, /metrics with every KV page
    free and, when `exports_counters`, this runtime's preemption and mixed-step counters, which the load moves."""
    httpx = pytest.importorskip("httpx")
    from oval_edge.tools.load import command as load_command

    calls = []

    async def app(scope, receive, send):
        path = scope["path"]
        if path == "/v1/chat/completions":
            calls.append(json.loads((await receive())["body"]))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for line in [_ROLE, _chunk("a"), _chunk("b"), _chunk("c", "length"), _USAGE, "data: [DONE]"]:
                await send({"type": "http.response.body", "body": (line + "\n\n").encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/metrics":
            ran = 1 if calls else 0
            body = "oval_edge_kv_pages_total 8\noval_edge_kv_pages_free 8\n"
            if exports_counters:
                body += (f"oval_edge_requests_preempted_total {5 + 2 * ran}.0\n"
                         f"oval_edge_mixed_steps_total {10 + 3 * ran}.0\n")
        else:
            body = json.dumps({"data": [{"id": "tiny"}]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body.encode()})

    args = argparse.Namespace(scenario="burst", clients=2, requests_per_client=2, max_tokens=3, turns=1,
                              turn_tokens=10, time_limit=30.0)
    report = asyncio.run(load_command._drive("http://test", args, {}, 30.0, transport=httpx.ASGITransport(app=app)))
    summary = report["summary"]
    assert len(calls) == 4 and summary["completed"] == 4 and report["problems"] == []
    assert summary["itl_samples"] == 8  # three content chunks per stream: two gaps each
    assert 0 <= summary["itl_p50_ms"] <= summary["itl_p95_ms"]
    assert all(row["itl_samples"] == 2 and "itl_s" not in row for row in report["requests"])
    json.dumps(report)  # what --json writes
    printed = capsys.readouterr().out
    assert "inter-token latency p50 " in printed and " ms, p95 " in printed
    if exports_counters:
        assert summary["preemptions"] == 2 and summary["mixed_steps"] == 3
        assert "preemptions 2, mixed steps 3" in printed
    else:
        assert summary["preemptions"] is None and summary["mixed_steps"] is None
        assert "preemptions unknown, mixed steps unknown" in printed
