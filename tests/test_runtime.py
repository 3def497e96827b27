"""The runtime against Hugging Face on the same weights, and the engine's sampling, stops and cancellation.

Hugging Face loads the GGUF with its own loader and model classes; the runtime with its streaming loader and its
own decoder, so these comparisons also check the loader (tensor names, q/k row order, tied head, RoPE).
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig, SamplingParams

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
    "List of the planets in the solar system:",
]
# Budget >= context: sink + 64 pages + window cover every position, so OVAL must equal dense attention.
COVERING = OvalConfig(page_size=32, top_k=64, kv_dtype="float32")


@pytest.fixture(scope="module")
def fp32_engine():
    return Engine.load("default", quant="none", device="cpu", oval=COVERING,
                       config=EngineConfig(max_batch=4, num_pages=96))


def hugging_face_model(dtype=torch.float32):
    """transformers' own model for the bundled GGUF (its loader dequantizes every tensor to fp32 first)."""
    from transformers import AutoModelForCausalLM

    from oval_edge.runtime.model.origin.source import resolve_model

    source = resolve_model("default")
    return AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype).eval()


@pytest.fixture(scope="module")
def hf_fp32():
    return hugging_face_model()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_matches_hugging_face_token_for_token(fp32_engine, hf_fp32):
    tok, model = fp32_engine.tokenizer, hf_fp32
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ours = fp32_engine.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True)).output_ids
        assert ours == hf_greedy(model, ids, 64), prompt
    assert fp32_engine.pool.num_free == fp32_engine.pool.num_pages


def test_prefill_and_decode_logits_match_hugging_face(fp32_engine, hf_fp32):
    tok, model, pool, runner = fp32_engine.tokenizer, hf_fp32, fp32_engine.pool, fp32_engine.runner
    ids = tok(PROMPTS[0] + " was one of the largest empires of the ancient world")["input_ids"]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].float()  # [T, vocab]
    assert pool.allocate("logits", len(ids)) is not None
    try:
        split = len(ids) - 4
        step = pool.prepare(["logits"], [split])
        logits, _ = runner.forward(step, torch.tensor(ids[:split]), decode=False)
        pool.commit(step)
        assert (logits[0] - reference[split - 1]).abs().max().item() < 1e-3
        for pos in range(split, len(ids)):  # then decode the rest one token at a time
            step = pool.prepare(["logits"], [1])
            logits, _ = runner.forward(step, torch.tensor([ids[pos]]), decode=True)
            pool.commit(step)
            assert (logits[0] - reference[pos]).abs().max().item() < 1e-3
    finally:
        pool.free("logits")


def test_batched_decode_of_different_lengths_equals_one_at_a_time(fp32_engine):
    tok = fp32_engine.tokenizer
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    alone = [fp32_engine.generate(ids, params).output_ids for ids in prompts]
    requests = [fp32_engine.submit(ids, params) for ids in prompts]
    while fp32_engine.has_work():
        fp32_engine.step()
    assert [r.output_ids for r in requests] == alone


class RuntimeProjection(torch.nn.Module):
    """A transformers projection computed the way the runtime computes it: `bind_projection` of the runtime's own
    4-bit layer (our GEMV for decode rows where bitsandbytes has no fused kernel), output rows [start, end) of it.
    x [..., in] -> [..., end - start]."""

    def __init__(self, layer: torch.nn.Module, start: int = 0, end: int | None = None):
        super().__init__()
        from oval_edge.runtime.model.projections import bind_projection

        self.layer, self.bound = layer, bind_projection(layer)
        self.start, self.end = start, layer.out_features if end is None else end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.bound(x.reshape(-1, x.shape[-1]))  # the runtime calls its projections on [tokens, in]
        return rows.reshape(*x.shape[:-1], -1)[..., self.start : self.end]


def give_hugging_face_the_runtime_weights(model, runtime_model) -> None:
    """Hugging Face's own forward (norms, RoPE, attention, MLP) over the runtime's very bnb 4-bit layers and
    16-bit embedding/head, each called through the kernel the runtime binds to it: what is compared is the forward
    around the projections; the kernels' own error against bitsandbytes is bounded in tests/test_projections.py."""
    for hf_layer, ours in zip(model.model.layers, runtime_model.model.layers):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        start = 0
        for name in ("q_proj", "k_proj", "v_proj"):
            end = start + getattr(attn, name).out_features
            setattr(attn, name, RuntimeProjection(ours.self_attn.qkv_proj, start, end))
            start = end
        attn.o_proj = RuntimeProjection(ours.self_attn.o_proj)
        half = mlp.gate_proj.out_features
        mlp.gate_proj = RuntimeProjection(ours.mlp.gate_up_proj, 0, half)
        mlp.up_proj = RuntimeProjection(ours.mlp.gate_up_proj, half, 2 * half)
        mlp.down_proj = RuntimeProjection(ours.mlp.down_proj)
    model.model.embed_tokens = runtime_model.model.embed_tokens
    model.lm_head = runtime_model.lm_head


def test_nf4_runtime_follows_hugging_face_with_the_same_bitsandbytes_weights():
    """Same bnb NF4 layers in both. bitsandbytes' fused CPU kernel rounds activations to bf16, so even HF's own
    cached decode differs from its full forward by ~0.15 logits; tokens are compared where that noise cannot
    flip them (top-2 margin > 1), logits within 1.0 along HF's own greedy trajectory."""
    from oval_edge.runtime.model.quantize import import_bitsandbytes

    engine = Engine.load("default", quant="nf4", device="cpu", oval=COVERING, config=EngineConfig(num_pages=16))
    bnb = import_bitsandbytes()
    fused = engine.loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, bnb.nn.Linear4bit) and fused.weight.quant_state.quant_type == "nf4"
    # One weight copy: the 4-bit model is far smaller than the fp32 decoder would be.
    n_params = sum(p.numel() for p in engine.loaded.model.model.layers.parameters())
    assert engine.loaded.weight_bytes < 0.5 * (n_params * 2 * 4 + 49152 * 576 * 4)
    model = hugging_face_model()
    give_hugging_face_the_runtime_weights(model, engine.loaded.model)
    pool, runner = engine.pool, engine.runner
    for prompt in PROMPTS[:2]:
        ids = engine.tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        hf_tokens = out.sequences[0, len(ids):].tolist()
        hf_logits = torch.stack(out.logits)[:, 0].float()  # [32, vocab]
        assert pool.allocate("nf4", len(ids) + 33) is not None
        step = pool.prepare(["nf4"], [len(ids)])
        logits, _ = runner.forward(step, torch.tensor(ids), decode=False)
        pool.commit(step)
        for i, token in enumerate(hf_tokens):
            assert (logits[0] - hf_logits[i]).abs().max().item() < 1.0, (prompt, i)
            top2 = hf_logits[i].topk(2).values
            if top2[0] - top2[1] > 1.0:
                assert int(logits[0].argmax()) == token, (prompt, i)
            step = pool.prepare(["nf4"], [1])
            logits, _ = runner.forward(step, torch.tensor([token]), decode=True)
            pool.commit(step)
        pool.free("nf4")
        ours = engine.generate(ids, SamplingParams(max_tokens=32, ignore_eos=True)).output_ids
        assert ours[:8] == hf_tokens[:8]  # the first tokens, before near-ties compound


def test_seeded_sampling_is_reproducible_and_seeds_differ(fp32_engine):
    ids = fp32_engine.tokenizer(PROMPTS[2])["input_ids"]

    def sample(seed):
        params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return fp32_engine.generate(ids, params).output_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_stop_strings_end_generation_and_are_not_returned(fp32_engine):
    ids = fp32_engine.tokenizer(PROMPTS[4])["input_ids"]
    free = fp32_engine.generate(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    words = free.text.split()
    assert len(words) > 3
    stop = words[2]
    stopped = fp32_engine.generate(ids, SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True))
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)
    assert len(stopped.output_ids) < len(free.output_ids)


def test_streaming_callback_sees_every_token_and_the_whole_text(fp32_engine):
    ids = fp32_engine.tokenizer(PROMPTS[0])["input_ids"]
    seen: list[tuple[int, str]] = []
    done = fp32_engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True),
                                on_token=lambda r, t, delta: seen.append((t, delta)))
    assert [t for t, _ in seen if t >= 0] == done.output_ids
    assert "".join(d for _, d in seen) == done.text


def test_cancellation_frees_pages_at_once(fp32_engine):
    pool = fp32_engine.pool
    ids = fp32_engine.tokenizer(PROMPTS[1])["input_ids"]
    request = fp32_engine.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(4):
        fp32_engine.step()
    # Pages come as tokens do: the prompt's at admission, then one page at a time (not prompt + max_tokens).
    held = pool.pages_needed(pool.length(request.request_id) + 1)
    assert pool.num_free == pool.num_pages - held and held < pool.pages_needed(len(ids) + 200)
    assert fp32_engine.cancel(request.request_id)
    assert pool.num_free == pool.num_pages
    assert request.finish_reason == "cancelled" and not fp32_engine.has_work()
    assert not fp32_engine.cancel(request.request_id)  # already gone


def test_requests_that_can_never_fit_are_refused_with_the_limit(fp32_engine):
    from oval_edge.runtime import RequestRejected

    limit = fp32_engine.token_limit()
    with pytest.raises(RequestRejected, match=f"limit of {limit} tokens"):
        fp32_engine.submit([1] * 10, SamplingParams(max_tokens=limit))
    with pytest.raises(RequestRejected, match="empty"):
        fp32_engine.submit([], SamplingParams())
    assert fp32_engine.pool.num_free == fp32_engine.pool.num_pages
