"""Decoder families beyond Llama/Qwen2: tiny random checkpoints made with transformers' own config classes.

Qwen3 (an RMSNorm over each query and key head before RoPE) and SmolLM3 (every 4th layer without RoPE, NoPE) are
saved as safetensors next to the bundled tokenizer and loaded through `load_model` (quant none, fp32). The
runtime's logits must equal transformers' forward of the same folder within 1e-4 at prefill and over 64 greedy
decode steps (teacher-forced on the runtime's own tokens, which must be transformers' argmax), both with OVAL at a
budget that covers the context and with dense attention; with a small budget, sparse layers read fewer tokens than
the context. The runtime's fused q/k/v path (4-bit) and transformers' unfused modules (`apply_oval_to_model`'s
route) are both covered: the same LayerOps decide per-head norms and NoPE for either.
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.config import DecoderConfig

from test_decoder_loading import hf_logits, save_folder

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5)
PROMPT = list(range(100, 100 + 3 * 80, 3))  # 80 tokens
STEPS = 64


def family_config(kind: str):
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(**SHAPE, head_dim=48, tie_word_embeddings=False, rope_theta=1000000.0)
    return transformers.SmolLM3Config(**SHAPE, tie_word_embeddings=True, rope_theta=2000000.0, pad_token_id=None,
                                      bos_token_id=1, eos_token_id=2)  # its defaults name ids past this vocabulary


@pytest.fixture(scope="module", params=["qwen3", "smollm3"])
def family(request, tmp_path_factory):
    config = family_config(request.param)
    return request.param, config, save_folder(tmp_path_factory.mktemp(request.param), config)


def chunks_and_a_batch_equal_one_pass(make_engine, prompt: list[int], cut: int) -> None:
    """`prompt` prefilled in chunks [0, 7), [7, cut), [cut, end) gives the last logits of one pass (1e-4); two
    sequences decoded in one static step give what each gives alone (make_engine() builds a fresh engine)."""
    def prefill(pool, seq_id: str, length: int):
        assert pool.allocate(seq_id, 200) is not None
        return pool.prepare([seq_id], [length])

    engine = make_engine()
    pool = engine.pool
    step = prefill(pool, "one", len(prompt))
    whole, _ = engine.runner.forward(step, torch.tensor(prompt), decode=False)
    pool.commit(step)
    pool.free("one")
    assert pool.allocate("chunks", 200) is not None
    for start, stop in ((0, 7), (7, cut), (cut, len(prompt))):
        step = pool.prepare(["chunks"], [stop - start])
        logits, _ = engine.runner.forward(step, torch.tensor(prompt[start:stop]), decode=False)
        pool.commit(step)
    assert (logits - whole).abs().max().item() < 1e-4
    other = prompt[::-1][:33]
    step = prefill(pool, "other", len(other))
    engine.runner.forward(step, torch.tensor(other), decode=False)
    pool.commit(step)
    together, _, _ = engine.static.decode(["chunks", "other"], [11, 12])
    alone = make_engine()
    for sid, asked, token, row in (("chunks", prompt, 11, 0), ("other", other, 12, 1)):
        step = prefill(alone.pool, sid, len(asked))
        alone.runner.forward(step, torch.tensor(asked), decode=False)
        alone.pool.commit(step)
        single, _, _ = alone.static.decode([sid], [token])
        assert (single[0] - together[row]).abs().max().item() < 1e-4


def follow_ups_decode_as_full_prefills(make_engine, prompt: list[int]) -> Engine:
    """Prefix caching past what pages give back (layer states, ring windows: oval_edge/kv/snapshots.py). With
    make_engine(num_pages, prefill_chunk, prefix_cache=...) engines of 16-token pages: a 70-token prompt (chunks end
    at 48 and at 64, its last full page) and a 30-token answer (decode ends steps at 80 and 96); a re-asked prompt
    then maps 64 cached tokens and the next turn 96, each decoding the tokens and logprobs (1e-4) of a full
    prefill; nothing is allocated after startup. Returns the caching engine."""
    from oval_edge.runtime.engine.request import SamplingParams

    greedy = dict(temperature=0.0, ignore_eos=True, logprobs=3)
    cached = make_engine(num_pages=64, prefill_chunk=48)
    pointers = cached.pool.storage_pointers()
    first = prompt[:70]
    out = cached.generate(first, SamplingParams(max_tokens=30, **greedy))
    turn = first + list(out.output_ids) + [400, 401, 402, 403, 404]
    again = cached.generate(first + [405, 406], SamplingParams(max_tokens=4, **greedy))
    assert again.cached_tokens == 64  # the prompt's own last full page
    second = cached.generate(turn, SamplingParams(max_tokens=6, **greedy))
    assert second.cached_tokens == 96  # the answer's last page boundary, reached in decode
    fresh = make_engine(num_pages=64, prefill_chunk=48, prefix_cache=False)
    for got, asked in ((again, first + [405, 406]), (second, turn)):
        want = fresh.generate(asked, SamplingParams(max_tokens=len(got.output_ids), **greedy))
        assert got.output_ids == want.output_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.samples, want.samples)) < 1e-4
    cached.pool.check_invariants()
    assert cached.pool.storage_pointers() == pointers
    return cached


def run_checked(engine: Engine, prompts: list[list[int]], params) -> list:
    """Submit every prompt, step the engine until it has no work, checking the pool's invariants after each step;
    every request must end without an error. Returns the requests."""
    requests = [engine.submit(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
        engine.pool.check_invariants()
    assert [r.error for r in requests] == [None] * len(prompts)
    return requests


def decode_greedy(engine: Engine, prompt: list[int], steps: int, attention_layers_read: list | None = None):
    """Prefill `prompt`, then `steps` greedy decode steps. Returns (tokens, logits [steps + 1, vocab])."""
    pool = engine.pool
    assert pool.allocate("r", len(prompt) + steps + 1) is not None
    step = pool.prepare(["r"], [len(prompt)])
    logits, _ = engine.runner.forward(step, torch.tensor(prompt), decode=False)
    pool.commit(step)
    tokens, rows = [], [logits[0]]
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        step = pool.prepare(["r"], [1])
        logits, stats = engine.runner.forward(step, torch.tensor(tokens[-1:]), decode=True)
        pool.commit(step)
        rows.append(logits[0])
        if attention_layers_read is not None:
            attention_layers_read.append(stats.kv_tokens_read)
    pool.free("r")
    return tokens, torch.stack(rows)


def engine_for(folder: str, oval: OvalConfig, attention: str = "oval", quant: str = "none") -> Engine:
    return Engine.load(folder, quant=quant, device="cpu", oval=oval,
                       config=EngineConfig(num_pages=64, attention=attention, oval_from=0))


def test_config_reads_the_family_features(family):
    kind, config, _ = family
    ours = DecoderConfig.from_dict(config.to_dict(), "tiny")
    if kind == "qwen3":
        assert ours.qk_norm and ours.head_dim == 48 and not ours.rope_layers
    else:
        assert not ours.qk_norm and ours.rope_layers == (1, 1, 1, 0)
        assert [ours.uses_rope(i) for i in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_logits_equal_transformers_at_prefill_and_over_greedy_decode(family, attention):
    kind, _, folder = family
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")  # budget 336 >= 80 + 64: OVAL is exact
    engine = engine_for(folder, wide, attention)
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    sequence = PROMPT + tokens
    theirs = torch.stack([hf_logits(folder, sequence[: len(PROMPT) + i]) for i in (0, STEPS // 2, STEPS)])
    picked = ours[[0, STEPS // 2, STEPS]]
    assert (picked - theirs).abs().max().item() < 1e-4, kind
    full = _hf_all_logits(folder, sequence)  # every position in one forward: the greedy tokens must be its argmax
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4


def test_small_budget_reads_less_than_the_context_and_stays_close(family):
    kind, _, folder = family
    small = OvalConfig(page_size=16, top_k=1, window_min=16, window_max=16, dense_layers=1, kv_dtype="float32")
    read: list[int] = []
    tokens, ours = decode_greedy(engine_for(folder, small), PROMPT, 16, read)
    _, dense = decode_greedy(engine_for(folder, small, "dense"), PROMPT, 16)
    assert torch.isfinite(ours).all()
    # the last step (context 96): the dense layer reads all 96 tokens per KV head, the 3 sparse ones sink + 1 page +
    # window = 48 each; NoPE layers select like the others
    context = len(PROMPT) + 16
    assert read[-1] == 2 * context + 3 * 2 * 48, (kind, read[-1])
    assert (ours[0] - dense[0]).abs().max().item() < 1e-4  # prefill is dense and exact either way


def test_4bit_fused_path_runs_the_family(family):
    """nf4: the per-head norms and NoPE bound on the 4-bit fused q/k/v layer; the prefill logits point where the
    fp32 model's do (4-bit rounding of a random tiny model only moves them a little)."""
    kind, _, folder = family
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")
    fused = engine_for(folder, wide, quant="nf4")
    assert type(fused.runner.ops[0].qkv).__name__ == "PackedCpu4bit" or fused.runner.ops[0].qkv is not None
    assert (fused.runner.ops[0].qk_norm is not None) == (kind == "qwen3")
    assert [op.rope for op in fused.runner.ops] == ([True] * 4 if kind == "qwen3" else [True, True, True, False])
    _, ours = decode_greedy(fused, PROMPT, 4)
    _, exact = decode_greedy(engine_for(folder, wide), PROMPT, 0)
    assert torch.isfinite(ours).all()
    assert torch.nn.functional.cosine_similarity(ours[0], exact[0], dim=0) > 0.9


def test_transformers_own_modules_run_through_the_paged_forward(family):
    """The eval tools run PagedLlama over transformers' model (unfused q/k/v, its own q_norm/k_norm modules and
    use_rope flags): prefill logits equal its forward."""
    import transformers

    from oval_edge.kv.pool import PagePool
    from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
    from oval_edge.tools.eval.runtime import geometry_for

    kind, _, folder = family
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = OvalConfig(page_size=16, kv_dtype="float32")
    pool = PagePool(geometry_for(model.config, 16, config.rank, kinds=("oval",)), 16)
    runner = PagedLlama(model, pool, config, attention="dense")
    assert runner.ops[0].qkv is None and (runner.ops[0].qk_norm is not None) == (kind == "qwen3")
    pool.allocate("s", len(PROMPT))
    step = pool.prepare(["s"], [len(PROMPT)])
    logits, _ = runner.forward(step, torch.tensor(PROMPT), decode=False)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0, -1]
    assert (logits[0] - want).abs().max().item() < 1e-4


def _hf_all_logits(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", ["qwen3", "smollm3"])
def test_gguf_written_under_llama_cpp_names_loads_to_the_same_logits(tmp_path_factory, kind):
    """A GGUF (llama.cpp's tensor names and header keys) loads to transformers' logits of the same weights: Qwen3
    with head_dim != hidden / heads, SmolLM3 (whose header transformers' reader refuses: read from the generic keys,
    its NoPE every 4th layer as llama.cpp fixes it)."""
    import transformers

    from gguf_checkpoint import write_gguf

    config = family_config(kind)
    folder = save_folder(tmp_path_factory.mktemp(f"{kind}-gguf-src"), config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(model, str(tmp_path_factory.mktemp(f"{kind}-gguf") / f"tiny-{kind}.gguf"), kind)
    engine = engine_for(path, OvalConfig(page_size=16, top_k=16, kv_dtype="float32"))
    if kind == "qwen3":
        assert engine.runner.decoder.layers[0].self_attn.q_norm is not None and engine.runner.head_dim == 48
    else:
        assert [op.rope for op in engine.runner.ops] == [True, True, True, False]
    tokens, ours = decode_greedy(engine, PROMPT, 8)
    full = _hf_all_logits(folder, PROMPT + tokens)
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "jamba", "phimoe"])
def test_families_not_yet_supported_are_refused_with_the_supported_list(tmp_path, model_type):
    import json

    from oval_edge.runtime.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps(dict(SHAPE, model_type=model_type)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as caught:
        load_model(str(tmp_path), quant="none", device="cpu")
    message = str(caught.value)
    assert str(tmp_path) in message and repr(model_type) in message
    assert "llama, mistral, qwen2, qwen3, smollm3" in message
