"""Phi-3 / Phi-3.5-mini / Phi-4-mini: tiny random checkpoints made with transformers' own Phi3Config.

What the family adds: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj; llama.cpp's attn_qkv and ffn_up),
LongRoPE (short and long factor sets per frequency, an attention factor on cos/sin), partial rotary (Phi-4-mini
rotates 3/4 of each head) and tied embeddings (Phi-4-mini). The runtime fixes ONE LongRoPE factor set per engine,
long when its token limit (min(pool capacity, max_model_len)) exceeds original_max_position_embeddings, as llama.cpp
does by its context per sequence; transformers picks by the current length. Each regime is compared with
transformers where transformers picks the same set: original_max_position_embeddings = 32 here, prompts of 80
tokens (long) or a 32-token engine (short). Logits within 1e-4 (fp32, quant none) at prefill and over 64 greedy
decode steps, from the Hugging Face folder and from a GGUF written under llama.cpp's names; OVAL at a budget that
covers the context equals dense.
"""

from __future__ import annotations

import json

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.config import DecoderConfig
from oval_edge.runtime.model.loader import load_model

from test_decoder_loading import save_folder
from test_families import decode_greedy  # prefill, then greedy decode steps -> (tokens, logits [steps + 1, V])

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, pad_token_id=None)  # its defaults name ids past this vocabulary
ORIGINAL = 32  # original_max_position_embeddings: the factor sets switch above it
PROMPT = list(range(100, 100 + 3 * 80, 3))  # 80 tokens > ORIGINAL: transformers uses the long factors
STEPS = 64
WIDE = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")  # budget 336 >= 80 + 64 tokens: OVAL is exact
VARIANTS = {  # name -> (partial_rotary_factor, tie_word_embeddings)
    "phi4-mini": (0.75, True),  # 24 of 32 dims rotate, embeddings tied
    "phi3.5-mini": (1.0, False),
}


def phi3_config(variant: str, **overrides):
    import transformers

    partial, tied = VARIANTS[variant]
    half = int(32 * partial) // 2
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)]}
    settings = dict(SHAPE, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial,
                    tie_word_embeddings=tied, rope_scaling=rope, rope_theta=10000.0) | overrides
    return transformers.Phi3Config(**settings)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    config = phi3_config(request.param)
    return request.param, config, save_folder(tmp_path_factory.mktemp(request.param), config)


def engine_for(path: str, attention: str = "oval", quant: str = "none", **settings) -> Engine:
    return Engine.load(path, quant=quant, device="cpu", oval=WIDE,
                       config=EngineConfig(**(dict(num_pages=64, attention=attention, oval_from=0) | settings)))


def hf_all_logits(folder: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one forward over `ids` (its LongRoPE picks by len(ids))."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_matches_transformers(folder: str, prompt: list[int], tokens: list[int], ours: torch.Tensor) -> None:
    full = hf_all_logits(folder, prompt + tokens)
    assert tokens == full[len(prompt) - 1 : -1].argmax(-1).tolist()  # greedy tokens are transformers' argmax
    assert (ours - full[len(prompt) - 1 :]).abs().max().item() < 1e-4


def test_config_reads_fused_longrope_and_partial_rotary(variant):
    name, config, folder = variant
    with open(f"{folder}/config.json", encoding="utf-8") as handle:
        ours = DecoderConfig.from_dict(json.load(handle), folder)
    assert ours.rope_type == "longrope" and ours.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert ours.rotary_dim == (24 if name == "phi4-mini" else 32)
    assert len(ours.rope_scaling["short_factor"]) == ours.rotary_dim // 2
    assert ours.tie_word_embeddings == config.tie_word_embeddings
    loaded = load_model(folder, quant="none", device="cpu")
    attention = loaded.model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape == (4 * 32 + 2 * 2 * 32, 128)  # read fused, as stored
    assert loaded.model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 256, 128)
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == config.tie_word_embeddings


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_long_regime_logits_equal_transformers_over_greedy_decode(variant, attention):
    _, _, folder = variant
    engine = engine_for(folder, attention)  # token limit 64 pages x 16 = 1024 > 32: the long factors
    assert engine.runner.rotary_emb.long_factors is True
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    assert_matches_transformers(folder, PROMPT, tokens, ours)


def test_short_regime_follows_the_engine_token_limit(variant):
    """max_model_len = 32 (= original_max_position_embeddings): the engine serves <= 32 tokens per sequence, so the
    short factors, and transformers over <= 32 tokens uses them too. The long-factor engine differs on the same
    tokens: the choice is what makes them equal."""
    _, _, folder = variant
    prompt, steps = PROMPT[:12], 19  # 12 + 19 + 1 = 32 tokens
    short = engine_for(folder, max_model_len=ORIGINAL)
    assert short.runner.rotary_emb.long_factors is False and short.token_limit() == ORIGINAL
    tokens, ours = decode_greedy(short, prompt, steps)
    assert_matches_transformers(folder, prompt, tokens, ours)
    _, long = decode_greedy(engine_for(folder), prompt, steps)
    assert (long - ours).abs().max().item() > 1e-2


def test_gguf_written_under_llama_cpp_names_loads_to_the_same_logits(variant, tmp_path):
    """attn_qkv and ffn_up (gate | up) fused, q/k rows as in the checkpoint (llama.cpp's converter permutes only
    Llama's), rope_factors_long/short tensors and phi3.rope.* keys: the same configuration and logits."""
    import transformers

    from gguf_checkpoint import write_gguf

    name, config, folder = variant
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(model, str(tmp_path / f"tiny-{name}.gguf"), "phi3")
    engine = engine_for(path)
    ours, theirs = engine.loaded.config, DecoderConfig.from_dict(config.to_dict(), folder)
    assert ours.rotary_dim == theirs.rotary_dim and ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rope_scaling["long_factor"] == pytest.approx(theirs.rope_scaling["long_factor"])
    assert ours.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert engine.runner.rotary_emb.attention_scaling == pytest.approx(
        engine_for(folder).runner.rotary_emb.attention_scaling, rel=1e-6)
    tokens, logits = decode_greedy(engine, PROMPT, STEPS)
    assert_matches_transformers(folder, PROMPT, tokens, logits)


def test_4bit_fused_checkpoint_projections_run(variant):
    """nf4: the stored qkv_proj / gate_up_proj quantized as one 4-bit layer each; prefill logits point where the
    fp32 model's do."""
    _, _, folder = variant
    fused = engine_for(folder, quant="nf4")
    assert fused.runner.ops[0].qkv is not None and fused.runner.ops[0].gate_up is not None
    _, ours = decode_greedy(fused, PROMPT, 4)
    _, exact = decode_greedy(engine_for(folder), PROMPT, 0)
    assert torch.isfinite(ours).all()
    assert torch.nn.functional.cosine_similarity(ours[0], exact[0], dim=0) > 0.9


def test_static_step_has_no_host_sync_and_equals_the_eager_forward(tmp_path, monkeypatch):
    """Partial rotary and the LongRoPE scaling keep the static decode step free of host reads, with the same ops
    and shapes at every length; its logits equal the eager forward's."""
    from eager_decode import eager_decode
    from test_static_step import MAX_LEN, prefill, static_step, traced_step

    folder = save_folder(tmp_path / "phi4", phi3_config("phi4-mini"))
    oval = OvalConfig(page_size=16, top_k=4, window_min=32, window_max=32, dense_layers=1, kv_dtype="float32")
    settings = EngineConfig(num_pages=200, max_batch=2, max_model_len=MAX_LEN, oval_from=0)
    static = Engine.load(folder, quant="none", device="cpu", oval=oval, config=settings)
    eager = Engine.load(folder, quant="none", device="cpu", oval=oval, config=settings)  # decoded by eager_decode
    for engine in (static, eager):
        prefill(engine, "a", 150, seed=1)
    traces = [traced_step(static, ["a"], [7], monkeypatch), traced_step(static, ["a"], [8], monkeypatch)]
    assert traces[0].count > 0 and traces[0].calls == traces[1].calls
    assert all(t.host_reads == [] and t.device_copies == [] for t in traces)
    for token in (7, 8):  # the eager engine catches up with the two traced steps
        step = eager.pool.prepare(["a"], [1])
        eager_decode(eager.runner, step, torch.tensor([token]))
        eager.pool.commit(step)
    token = 9
    for _ in range(20):  # crosses a page boundary
        logits, _ = static_step(static, ["a"], [token])
        step = eager.pool.prepare(["a"], [1])
        want, _, _ = eager_decode(eager.runner, step, torch.tensor([token]))  # the tests' eager reference
        eager.pool.commit(step)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        token = int(want[0].argmax())


def test_phi3_mini_4k_window_on_every_layer_equals_transformers(tmp_path):
    """Phi-3-mini-4k: a window on every layer under the context (2047 of 4096; 40 here), so every layer keeps only a
    ring and no page holds bytes. From the folder and from the GGUF (whose window transformers' reader drops and
    gguf_metadata restores), 64 greedy steps past the window give transformers' logits. Phi-3.5/4-mini's windows
    cover their context: no ring."""
    import transformers

    from gguf_checkpoint import write_gguf

    config = transformers.Phi3Config(**SHAPE, sliding_window=40, rope_scaling=None, attn_implementation="eager")
    folder = save_folder(tmp_path / "phi3-mini-4k", config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(model, str(tmp_path / "phi3-mini-4k.gguf"), "phi3")
    for source in (folder, path):
        engine = engine_for(source)
        assert engine.pool.k.shape[0] == 0 and len(engine.pool.geometry.ring_layers) == SHAPE["num_hidden_layers"]
        tokens, ours = decode_greedy(engine, PROMPT, 64)
        assert_matches_transformers(folder, PROMPT, tokens, ours)
    wide = DecoderConfig.from_dict(phi3_config("phi4-mini", sliding_window=262144).to_dict(), "phi4")
    assert wide.rope_type == "longrope" and not wide.layer_types


def test_broken_phi3_checkpoints_fail_at_load_with_their_path(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_folder(tmp_path / "short-qkv", phi3_config("phi3.5-mini"))
    weights = load_file(f"{folder}/model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-32].contiguous()  # one KV head's v rows missing
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj has shape") as caught:
        load_model(folder, quant="none", device="cpu")
    assert folder in str(caught.value)

    values = phi3_config("phi4-mini").to_dict()
    values["rope_parameters"]["long_factor"] = values["rope_parameters"]["long_factor"][:-1]  # 11 for 12 freqs
    with pytest.raises(ValueError, match="long_factor must list 12 positive numbers") as caught:
        DecoderConfig.from_dict(values, "/models/phi4")
    assert "/models/phi4" in str(caught.value)
