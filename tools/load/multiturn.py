"""The multi-turn chat scenario of `oval-edge bench --serve --scenario multiturn`: each client holds one conversation
and, every turn, sends the whole conversation so far plus ~`turn_tokens` tokens of new text, as chat clients do.

Why: this is where a prefix cache pays (oval_edge/kv/prefix_cache.py, llama-server's `cache_prompt`): without one,
turn N re-prefills everything turns 1..N-1 already computed, and time to first token grows with the history. The
report gives TTFT per turn (median over clients) next to the prompt length the server counted.

The new text of each turn is consecutive passages of the shipped public-domain text (tools/data/botchan_ch1-2.txt),
cut at ~4 characters per token; replies are the server's own (greedy), appended as assistant messages.
"""

from __future__ import annotations

from pathlib import Path

from oval_edge.tools.timing import Stopwatch, median

from .client import RequestResult, run_within, stream_chat

TEXT = Path(__file__).resolve().parents[1] / "data" / "botchan_ch1-2.txt"
CHARS_PER_TOKEN = 4
SYSTEM = "You are a careful reader. Answer briefly, in one or two sentences, about the passage the user sends."


def passages(count: int, tokens: int, offset: int = 0) -> list[str]:
    """`count` consecutive passages of about `tokens` tokens each, starting `offset` passages into the text."""
    text = " ".join(TEXT.read_text(encoding="utf-8").split())
    size = tokens * CHARS_PER_TOKEN
    need = (offset + count) * size
    text = (text * (need // max(1, len(text)) + 1))[:need]
    return [text[(offset + i) * size:(offset + i + 1) * size] for i in range(count)]


async def run_multiturn(base_url: str, model: str, clients: int, turns: int, turn_tokens: int, max_tokens: int,
                        headers: dict, time_limit_s: float, transport=None) -> tuple[list[RequestResult], float]:
    """`clients` conversations in parallel, `turns` requests each (request index = turn). Returns (results, wall s)."""
    import httpx

    results: list[RequestResult] = []
    timeout = httpx.Timeout(connect=10.0, read=max(30.0, time_limit_s), write=10.0, pool=max(30.0, time_limit_s))

    async def conversation(client_id: int, http) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        for turn, passage in enumerate(passages(turns, turn_tokens, offset=client_id * turns)):
            messages.append({"role": "user", "content": f"Passage {turn + 1}: {passage}\nWhat happens here?"})
            body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "messages": list(messages), "stream_options": {"include_usage": True}}
            result = await stream_chat(http, base_url, body, headers, client_id, turn)
            results.append(result)
            if result.outcome != "completed":
                return
            messages.append({"role": "assistant", "content": result.text})

    watch = Stopwatch()
    # A fresh connection per turn: a server may close an idle keep-alive connection between turns (llama-server
    # did, and httpx does not retry a POST on a connection that died).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, transport=transport, limits=limits) as http:
        await run_within([conversation(i, http) for i in range(clients)], time_limit_s)
    return results, watch.seconds


def per_turn(results: list[RequestResult], turns: int) -> list[dict]:
    """Median TTFT and prompt tokens of each turn over the conversations that reached it."""
    rows = []
    for turn in range(turns):
        done = [r for r in results if r.index == turn and r.outcome == "completed"]
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        prompt = [r.prompt_tokens for r in done if r.prompt_tokens]
        rows.append({"turn": turn + 1, "completed": len(done),
                     "ttft_s_median": median(ttft), "prompt_tokens_median": median(prompt)})
    return rows


def format_turns(rows: list[dict]) -> str:
    lines = ["turn  prompt tokens  TTFT s (median)"]
    for row in rows:
        prompt = "-" if row["prompt_tokens_median"] is None else f"{row['prompt_tokens_median']:.0f}"
        ttft = "-" if row["ttft_s_median"] is None else f"{row['ttft_s_median']:.2f}"
        lines.append(f"{row['turn']:4d}  {prompt:>13s}  {ttft:>15s}")
    if len(rows) > 1 and rows[0]["ttft_s_median"] and rows[-1]["ttft_s_median"]:
        lines.append(f"last turn / first turn TTFT: {rows[-1]['ttft_s_median'] / rows[0]['ttft_s_median']:.2f}x")
    return "\n".join(lines)
