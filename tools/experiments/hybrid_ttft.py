"""One question (#55): does prefix caching keep a hybrid's multi-turn time to first token flat, when the cached pages
give back K/V but the DeltaNet / conv layers need their state at the cached prefix's end (state snapshots,
oval_edge/kv/state.py)? Figures: docs/hybrids.md.

8-turn chats: a 300-word system message from the shipped Botchan, each turn a 60-word user message and a greedy
answer carried into the next turn; the engine driven directly as serve's loop drives it (submit, then step until
the request ends), TTFT from submit to the first token. Engines with the prefix cache on and off alternate, each
running `--conversations` chats per round, two rounds; medians per turn.

    python -m oval_edge.tools.experiments.hybrid_ttft FOLDER [--turns 8] [--conversations 3] [--answer 48]
                                                       [--state-snapshots N]
"""

from __future__ import annotations

import argparse

import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.engine.request import SamplingParams
from oval_edge.tools.timing import Stopwatch, median

TEXT = "tools/data/botchan_ch1-2.txt"


def conversation(engine: Engine, words: list[str], seed: int, turns: int, answer: int) -> list[tuple[int, int, float]]:
    """(prompt tokens, cached tokens, TTFT ms) of each turn of one chat."""
    messages = [{"role": "system", "content": " ".join(words[seed * 50 : seed * 50 + 300])}]
    out = []
    for turn in range(turns):
        start = 2000 + 97 * turn + 13 * seed
        messages.append({"role": "user", "content": " ".join(words[start : start + 60])})
        ids = engine.encode_chat(messages)
        first: dict[str, float] = {}
        watch = Stopwatch()
        request = engine.submit(ids, SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True))
        while not request.finished:
            engine.step()
            if request.output_ids:  # the step that sampled the first token (a callback fires on text, which a
                first.setdefault("s", watch.seconds)  # random model's first token may not give yet)
        out.append((len(ids), request.cached_tokens, first["s"] * 1000))
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(request.output_ids)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model folder or GGUF (a hybrid, or a sliding-window model with "
                                      "--state-snapshots N)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=3, help="chats per engine and round")
    parser.add_argument("--answer", type=int, default=48, help="tokens each answer generates")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--state-snapshots", type=int, default=None,
                        help="the engines' state_snapshots (default: the engine's; a sliding-window model needs > 0 "
                             "for its prefix cache)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with open(TEXT, encoding="utf-8") as handle:
        words = handle.read().split()
    runs: dict[bool, list[list[tuple[int, int, float]]]] = {True: [], False: []}
    for prefix in (True, False, True, False):
        engine = Engine.load(args.model, quant="auto", device="cpu", oval=OvalConfig(),
                             config=EngineConfig(max_batch=4, prefix_cache=prefix, max_model_len=8192,
                                                 state_snapshots=args.state_snapshots))
        runs[prefix] += [conversation(engine, words, seed, args.turns, args.answer)
                         for seed in range(args.conversations)]
    print("| turn | prompt tokens | cached (on) | TTFT, prefix cache on | TTFT, off | off / on |")
    print("|---|---|---|---|---|---|")
    for turn in range(args.turns):
        on, off = ([chat[turn] for chat in runs[p]] for p in (True, False))
        ttft_on, ttft_off = median(r[2] for r in on), median(r[2] for r in off)
        print(f"| {turn + 1} | {on[0][0]:,} | {median(r[1] for r in on):,.0f} | {ttft_on:.1f} ms | {ttft_off:.1f} ms "
              f"| {ttft_off / ttft_on:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
