"""The text the fidelity task is teacher-forced over: a user's file, or passages the model writes itself.

Without `--text` the command must work with nothing shipped, so the model samples its own text from a fixed
seed: one chat prompt per passage, all passages generated together as rows of one batch (a CPU decode step costs
about the same for 1 or 8 rows), then joined with blank lines into one plain text.
"""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from oval_edge.config import OvalConfig
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.engine.sampling import RowSampler, SamplingParams

from .runtime import geometry_for, prefill

# tools/data/, beside this folder (package data of oval_edge.tools)
SHIPPED_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "botchan_ch1-2.txt")

PROMPTS = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a city builds and maintains its water supply, step by step.",
    "Write a long essay about the history of sailing ships and the people who sailed them.",
    "Describe a day at a busy mountain village market, with many characters and conversations.",
    "Write a detailed guide to growing vegetables in a small garden through the seasons.",
    "Tell a long story about two friends who travel across a desert to find a lost library.",
    "Explain how the planets of the solar system formed and what makes each of them different.",
    "Write a long letter from a young scientist to her teacher about her first experiment.",
)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ValueError(f"--text {path}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path}: not UTF-8 text ({exc})") from exc
    if not text.strip():
        raise ValueError(f"--text {path} is empty")
    return text


def encode_text(tokenizer, text: str, length: int, source: str) -> list[int]:
    """The first `length` tokens of the text (no chat template, no special tokens)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise ValueError(f"{source} has {len(ids)} tokens, fewer than --length {length}; lower --length or give "
                         "a longer text")
    return list(ids[:length])


@torch.no_grad()
def generate_text(loaded, tokens: int, seed: int, passages: int = 8, temperature: float = 0.8,
                  top_p: float = 0.95, show_progress: bool = True) -> str:
    """About `tokens` tokens of model-written text: `passages` sampled answers of tokens/passages tokens each.

    Ends of turn are suppressed so every passage runs to its length; the seed fixes every draw.
    """
    if not 1 <= passages <= len(PROMPTS):
        raise ValueError(f"passages={passages} must be in [1, {len(PROMPTS)}]")
    tokenizer, model = loaded.tokenizer, loaded.model
    per_row = -(-tokens // passages) + 8  # a little extra: re-tokenising the joined text shifts counts
    prompts = [_chat_ids(tokenizer, PROMPTS[i]) for i in range(passages)]
    page_size = 32
    longest = max(len(p) for p in prompts) + per_row
    pool = PagePool(geometry_for(model.config, page_size, 4, kinds=("quest",)),
                    passages * -(-longest // page_size), loaded.device)
    runner = PagedLlama(model, pool, OvalConfig(page_size=page_size, kv_dtype="float32"), attention="dense")
    samplers = [RowSampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed * 1000 + i))
                for i in range(passages)]
    banned = _end_ids(loaded)
    logits = []
    for row, ids in enumerate(prompts):
        pool.allocate(row, longest)
        logits.append(prefill(runner, row, ids))
    out: list[list[int]] = [[] for _ in range(passages)]
    rows = list(range(passages))
    for i in tqdm(range(per_row), desc="writing the eval text", unit="step", leave=False,
                  disable=not show_progress):
        next_ids = []
        for row in rows:
            row_logits = logits[row].clone()
            row_logits[banned] = float("-inf")
            token = samplers[row].sample(row_logits)
            out[row].append(token)
            next_ids.append(token)
        if i + 1 < per_row:
            step = pool.prepare(rows, [1] * passages)
            batch_logits, _ = runner.forward(step, torch.tensor(next_ids, dtype=torch.long), decode=True)
            pool.commit(step)
            logits = list(batch_logits)
    texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in out]
    return "\n\n".join(texts) + "\n"


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _end_ids(loaded) -> list[int]:
    tokenizer = loaded.tokenizer
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
