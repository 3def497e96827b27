"""The runs store-check compares, each on two engines sharing one loaded model: one fully in memory, one whose pool
holds `--pool-tokens` and keeps the rest in the page store. Both use the eager forward and no prefix cache, so any
difference can only come from where pages live."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from oval_edge.runtime.engine.request import RUNNING
from oval_edge.runtime.engine.sampling import SamplingParams


@dataclass
class TeacherForced:
    positions: tuple[int, int]  # the predicted tokens' positions [first, last]
    max_abs_diff: float = 0.0
    argmax_agree: int = 0
    steps: int = 0
    seconds: dict = field(default_factory=lambda: {"memory": 0.0, "store": 0.0})  # decode steps only


def _prefill(engine, seq_id: str, ids: torch.Tensor) -> torch.Tensor:
    """Write ids into a new sequence in prompt chunks (dense, exact); the last chunk's logits [1, vocab]."""
    pool, chunk = engine.pool, engine.config.prefill_chunk
    assert pool.allocate(seq_id, len(ids)) is not None, "the pool cannot hold the prompt"
    logits = None
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        if not (pool.grow(seq_id, end) and pool.make_resident(seq_id, end)):
            raise RuntimeError("no frame for a prompt chunk: raise --pool-tokens")
        step = pool.prepare([seq_id], [end - start])
        logits, _ = engine.runner.forward(step, ids[start:end], decode=False)
        pool.commit(step)
    return logits


def _decode(engine, seq_id: str, token: torch.Tensor) -> tuple[torch.Tensor, float]:
    pool = engine.pool
    end = pool.length(seq_id) + 1
    if not (pool.grow(seq_id, end) and pool.make_resident(seq_id, end)):
        raise RuntimeError("no frame for the next token: raise --pool-tokens")
    began = time.perf_counter()
    step = pool.prepare([seq_id], [1])
    logits, _ = engine.runner.forward(step, token.view(1), decode=True)
    pool.commit(step)
    return logits, time.perf_counter() - began


@torch.inference_mode()
def teacher_forced(memory, store, ids: list[int], start: int) -> TeacherForced:
    """Prefill ids[:start] in both engines, then feed ids[start:-1] one decode step at a time, in lockstep, and
    compare every step's logits (those of the predicted positions start..len(ids)-1)."""
    ids_t = torch.tensor(ids, dtype=torch.long)
    result = TeacherForced((start, len(ids) - 1))
    pair = {"memory": memory, "store": store}
    logits = {name: _prefill(engine, "teacher", ids_t[:start]) for name, engine in pair.items()}
    for t in range(start, len(ids)):
        a, b = logits["memory"], logits["store"]
        result.max_abs_diff = max(result.max_abs_diff, float((a - b).abs().max()))
        result.argmax_agree += int(a.argmax(-1) == b.argmax(-1))
        result.steps += 1
        if t + 1 == len(ids):
            break
        for name, engine in pair.items():
            logits[name], seconds = _decode(engine, "teacher", ids_t[t])
            result.seconds[name] += seconds
    for engine in pair.values():
        engine.pool.free("teacher")
    return result


@dataclass
class Served:
    output_ids: list[int]
    decode_steps: int
    decode_seconds: float
    disk_bytes: int  # read from the store during the decode steps (0 in memory)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else float("nan")


def served(engine, prompt: list[int], max_tokens: int) -> Served:
    """One greedy request through the engine's own steps (the served path); disk bytes counted after prefill."""
    request = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tier = engine.pool.store
    while request.status != RUNNING and not request.finished:
        engine.step()
    before = tier.stats.bytes_read if tier is not None else 0
    while not request.finished:
        engine.step()
    disk = (tier.stats.bytes_read - before) if tier is not None else 0
    if request.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"the request ended with {request.finish_reason}: {request.error}")
    return Served(list(request.output_ids), request.decode_steps, request.decode_seconds, disk)


def passkeys(engine, cases, tokenizer, answer_tokens: int) -> list[tuple[float, str, str, bool]]:
    """(depth, key, answer text, found) of each case, served greedily."""
    from oval_edge.tools.eval.passkey import parse_answer

    out = []
    for case in cases:
        result = served(engine, case.prompt + case.question, answer_tokens)
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        out.append((case.depth, case.key, text, parse_answer(text) == case.key))
    return out
