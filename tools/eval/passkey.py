"""Passkey retrieval the way the Quest paper measures it.

A haystack of repeated filler hides one sentence with a 5-digit key at depth d. The haystack is prefilled
densely; then the question is fed one token per decode step under each policy (so pages are selected while the
model reads the question, as in serving), and the answer is decoded greedily. Accuracy per policy, and retention:
of the cases dense answers correctly, the fraction the policy also answers correctly.

Cost: the prompt up to the needle is the same for every case of a context, so it is prefilled once; each case
prefills only the text after its needle, and its K/V are copied into the rows of every policy.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from oval_edge.config import OvalConfig
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama

from .policies import Policy
from .runtime import (EvalRunner, allocate_row, capture_kv, dense_prefix, ensure_output_metric, eval_pool, geometry_for,
                      groups_of, load_kv, prefill)

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key?"
# The assistant turn starts by echoing the needle up to its digits ("is" + the space token that precedes them in
# the needle), so a model that can retrieve answers with the key instead of explaining what a pass key is.
ANSWER_PREFIX = "The pass key is "
ANSWER_TOKENS = 6  # "7 1 4 3 2 ." : digits are single tokens in SmolLM2's vocabulary


@dataclass
class PasskeyCase:
    context: int
    depth: float
    key: str
    prompt: list[int]  # prefilled densely: chat header, instruction, haystack
    question: list[int]  # fed as decode steps: question, end of turn, assistant header, answer prefix
    needle_at: int  # prompt[:needle_at] is shared with every case of this context


@dataclass
class PasskeyResult:
    policy: Policy
    page_size: int
    tokens_per_step: int | None
    context: int
    answers: list[bool] = field(default_factory=list)  # in case order
    outputs: list[str] = field(default_factory=list)
    cases: list[tuple[float, str]] = field(default_factory=list)  # (depth, key) of each answer
    reads: float = 0.0  # K/V slots attended in sparse layers, summed over KV heads, steps and cases
    window_sum: float = 0.0  # window lengths, summed likewise
    head_steps: int = 0  # sparse layer-steps x KV heads
    kv_dtype: str = "float32"  # the K/V storage of the pool the cases ran in

    @property
    def tokens_attended(self) -> float | None:
        return self.reads / self.head_steps if self.head_steps else None

    @property
    def window_mean(self) -> float | None:
        return self.window_sum / self.head_steps if self.head_steps else None

    @property
    def accuracy(self) -> float:
        return sum(self.answers) / len(self.answers) if self.answers else float("nan")


def build_cases(tokenizer, context: int, depths: list[float], keys_per_depth: int, seed: int) -> list[PasskeyCase]:
    """Cases whose prompt + question is exactly `context` tokens (pieces tokenised separately, so the shared
    prefix has the same token ids in every case)."""
    before, after = _chat_frame(tokenizer)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    head = encode(before + INSTRUCTION)
    unit = encode(FILLER)
    question = encode(QUESTION + after + ANSWER_PREFIX)
    rng = random.Random(seed * 100_003 + context)
    cases = []
    for depth in depths:
        for _ in range(keys_per_depth):
            key = str(rng.randint(10_000, 99_999))
            needle = encode(NEEDLE.format(key=key))
            room = context - len(head) - len(needle) - len(question)
            if room < 4 * len(unit):
                raise ValueError(f"--contexts {context} is too short for the passkey prompt; use at least "
                                 f"{len(head) + len(needle) + len(question) + 4 * len(unit)} tokens")
            units = room // len(unit)
            first = round(depth * units)
            filler_after = unit * (units - first) + unit[: room - units * len(unit)]
            prompt = head + unit * first + needle + filler_after
            cases.append(PasskeyCase(context, depth, key, prompt, question, len(head) + first * len(unit)))
    return cases


def _chat_frame(tokenizer) -> tuple[str, str]:
    """The model's chat template around one user message: (text before the message, text after it)."""
    marker = "\u2063PASSKEY-MESSAGE\u2063"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # no chat template: plain text framing
        return "", "\nAnswer: "
    before, _, after = text.partition(marker)
    return before, after


def parse_answer(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


@torch.no_grad()
def run_passkey(loaded, cases: list[PasskeyCase], base: OvalConfig, policies: list[Policy], max_rows: int,
                chunk: int = 512, show_progress: bool = True, window_module=None) -> list[PasskeyResult]:
    """All cases of one context (and one page size, base.page_size); `window_module` for `module` rows."""
    if policies[0].name != "dense":
        raise ValueError("the first row must be the dense reference")
    context = cases[0].context
    model, tokenizer = loaded.model, loaded.tokenizer
    shared = max(cases, key=lambda c: c.needle_at)
    keys, values, _ = dense_prefix(model, shared.prompt[: shared.needle_at], base.page_size, base.rank,
                                   loaded.device, chunk)
    count = len(policies)
    per_batch = max(1, max_rows // count)
    capacity = context + ANSWER_TOKENS
    pages_per_row = -(-capacity // base.page_size)
    rows = min(per_batch, len(cases)) * count
    # int8 (kv_dtype): staging for every row's open page and the largest load (a whole prompt). Rows after the dense
    # one get the dense row's K/V copied (capture_kv): their pages are sealed from those dequantized keys.
    pool = eval_pool(geometry_for(loaded.config, base.page_size, base.rank, record=base.record, kv_dtype=base.kv_dtype,
                                 group_pages=groups_of(policies)),
                    rows * pages_per_row, loaded.device, eta=base.eta, stage_pages=rows + pages_per_row + 1)
    prefiller = PagedLlama(model, pool, base, attention="dense")  # chunked prefill is dense in any mode
    ensure_output_metric(pool, prefiller, policies)
    results = [PasskeyResult(p, base.page_size, p.tokens_per_step(base), context, kv_dtype=base.kv_dtype)
               for p in policies]
    bar = tqdm(total=len(cases), desc=f"passkey {context} tokens", unit="case", disable=not show_progress,
               leave=False)
    for first in range(0, len(cases), per_batch):
        batch = cases[first : first + per_batch]
        row_ids = [(c, r) for c in range(len(batch)) for r in range(count)]
        for c, case in enumerate(batch):
            source = (c, 0)  # the dense row holds the case's own prefill; the others get a copy
            allocate_row(pool, source, capacity, None)
            load_kv(pool, source, keys[:, : case.needle_at], values[:, : case.needle_at])
            prefill(prefiller, source, case.prompt[case.needle_at :], chunk)
            case_keys, case_values = capture_kv(pool, source, len(case.prompt))
            for r in range(1, count):
                allocate_row(pool, (c, r), capacity, policies[r].summary_eta())
                load_kv(pool, (c, r), case_keys, case_values)
            bar.update(1)
        runner = EvalRunner(model, pool, base, [policies[r] for _, r in row_ids], window_module)
        outputs = _decode(runner, pool, row_ids, batch[0].question)
        for i, (_, r) in enumerate(row_ids):
            results[r].reads += float(runner.reads[i])
            results[r].window_sum += float(runner.window_sum[i])
            results[r].head_steps += int(runner.sparse_layer_steps[i]) * pool.geometry.kv_heads
        for (c, r), ids in zip(row_ids, outputs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            results[r].outputs.append(text)
            results[r].answers.append(parse_answer(text) == batch[c].key)
            results[r].cases.append((batch[c].depth, batch[c].key))
        for row in row_ids:
            pool.free(row)
        bar.set_postfix_str(", ".join(f"{results[r].policy.label} {sum(results[r].answers)}/{len(results[r].answers)}"
                                      for r in range(count)), refresh=True)
    bar.close()
    return results


def _decode(runner: EvalRunner, pool: PagePool, row_ids: list, question: list[int]) -> list[list[int]]:
    """Feed the question to every row, then decode ANSWER_TOKENS greedily; returns each row's answer ids."""
    count = len(row_ids)
    logits = None
    for token in question:
        step = pool.prepare(row_ids, [1] * count)
        logits, _ = runner.forward(step, torch.full((count,), token, dtype=torch.long), decode=True)
        pool.commit(step)
    answers: list[list[int]] = [[] for _ in range(count)]
    for i in range(ANSWER_TOKENS):
        chosen = logits.argmax(-1)
        for row in range(count):
            answers[row].append(int(chosen[row]))
        if i + 1 == ANSWER_TOKENS:
            break
        step = pool.prepare(row_ids, [1] * count)
        logits, _ = runner.forward(step, chosen.cpu(), decode=True)
        pool.commit(step)
    return answers


def retention(dense: PasskeyResult, policy: PasskeyResult) -> float | None:
    """Of the cases dense answers correctly, the fraction the policy also answers correctly (None if none)."""
    kept = [p for d, p in zip(dense.answers, policy.answers) if d]
    return sum(kept) / len(kept) if kept else None
