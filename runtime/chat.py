"""`oval-edge chat`: talk to a model in the terminal, tokens printed as they are generated.

Commands: /reset (forget the conversation), /exit (or Ctrl-D). Ctrl-C stops the current answer. The oldest turns
are dropped when the conversation no longer fits the engine's token limit.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable, TextIO

from oval_edge.runtime.server.options import add_engine_arguments, describe_spec, engine_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    group = parser.add_argument_group("chat")
    group.add_argument("--max-tokens", type=int, default=256, help="longest answer in tokens (default: 256)")
    group.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    group.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: 0.9)")
    group.add_argument("--seed", type=int, help="seed for reproducible sampling")
    group.add_argument("--system", help="a system message to start the conversation with")


def _fit(engine, messages: list[dict], max_tokens: int) -> list[int] | None:
    """Prompt ids of the conversation, dropping the oldest turns (not the system message) until it fits."""
    limit = engine.token_limit()
    while True:
        ids = engine.encode_chat(messages)
        if len(ids) + max_tokens <= limit:
            return ids
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            return None  # the last message alone is too long
        del messages[first : first + 2 if len(messages) - first > 2 else first + 1]


def chat_loop(engine, lines: Iterable[str], out: TextIO, params, system: str | None = None,
              prompt: str = "") -> int:
    """Run a conversation over `lines` (one user message each), writing answers to `out`. Returns 0."""
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    if prompt:
        out.write(prompt)
        out.flush()
    for line in lines:
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(base)
            out.write("(conversation cleared)\n")
        elif text:
            messages.append({"role": "user", "content": text})
            ids = _fit(engine, messages, params.max_tokens)
            if ids is None:
                messages.pop()
                out.write(f"(that message is too long: the limit is {engine.token_limit()} tokens including "
                          f"{params.max_tokens} for the answer)\n")
            else:
                messages.append({"role": "assistant", "content": _answer(engine, ids, params, out)})
        if prompt:
            out.write(prompt)
            out.flush()
    return 0


def _answer(engine, ids: list[int], params, out: TextIO) -> str:
    def show(request, token_id: int, delta: str) -> None:
        out.write(delta)
        out.flush()

    request = engine.submit(ids, params, on_token=show)
    try:
        while not request.finished:
            engine.step()
    except KeyboardInterrupt:  # stop this answer, keep the conversation
        engine.cancel(request.request_id)
        out.write(" [stopped]")
    if request.finish_reason == "error":
        out.write(f"\n(generation failed: {request.error})")
    out.write("\n")
    return request.text


def run(args: argparse.Namespace) -> int:
    from oval_edge.runtime.engine.sampling import SamplingParams
    from oval_edge.runtime.model.loader import describe

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    spec = engine_spec(args)
    print(f"loading {spec.model} ({spec.quant}) ...", file=sys.stderr, flush=True)
    engine = spec.load()
    print(describe(engine.loaded), file=sys.stderr)
    print(f"engine: {describe_spec(spec)}; /reset clears, /exit or Ctrl-D quits", file=sys.stderr, flush=True)
    interactive = sys.stdin.isatty()
    lines = _read_lines() if interactive else sys.stdin
    return chat_loop(engine, lines, sys.stdout, params, args.system, prompt="you> " if interactive else "")


def _read_lines():
    while True:
        try:
            yield input()
        except EOFError:
            return
        except KeyboardInterrupt:
            print()
            return
