"""Gemma 4's text decoder as llama.cpp's converter writes it (`gemma4`; tools/gguf_write/gemma4.py) read back exactly
as transformers holds the model (runtime/model/families/gemma4_gguf.py through GGUFWeights and the header
conversion).

Tiny random Gemma4ForCausalLM: 7 layers, sliding and full mixed, the last 3 KV-shared (two sliding, one full, so both
kinds of shared layer are there), head_dim 32 on sliding and 64 on full layers, per-layer inputs of width 16,
double-wide MLPs on the shared layers, a final soft-cap, rope thetas / partial factor / eps away from the defaults.
Every parameter, every norm weight and every layer_scalar is drawn at random, so a norm offset (Gemma 2/3's 1 + w),
a folded scale or a lost layer_scalar shows. A second model has attention_k_eq_v (no v_proj on full layers) with
num_global_key_value_heads, so the per-layer head_count_kv goes through the file too. Written in F32 and with Q8_0
projections; read back, every tensor has transformers' name and shape (and, in F32, its values), the converted
config rebuilds the same Gemma4TextConfig, and the GGUF-read state dict gives the original logits.
"""

from __future__ import annotations

import os

import pytest
import torch

from oval_edge.runtime.model.gguf_metadata import PROJECTION_TYPES_KEY, gguf_config_values
from oval_edge.runtime.model.grouped.layout import dequantize
from oval_edge.runtime.model.origin.source import ModelSource
from oval_edge.runtime.model.weight_stream import GGUFWeights
from oval_edge.tools.gguf_write.writer import write_gguf, write_gguf_tensors

VOCAB = 49152  # the bundled tokenizer's (the writer copies its tokenizer fields)
PROMPT = list(range(100, 100 + 3 * 24, 3))  # 24 tokens: past the sliding window of 8
SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_model(variant: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL], num_kv_shared_layers=3,
        hidden_size_per_layer_input=16, sliding_window=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={SLIDING: dict(rope_type="default", rope_theta=20000.0),
                         FULL: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=500000.0)},
        bos_token_id=1, eos_token_id=2)
    if variant == "e2b-like":  # Gemma-4-E2B's shape: tied head, double-wide shared MLPs, soft-capped logits
        config = transformers.Gemma4TextConfig(**common, use_double_wide_mlp=True, final_logit_softcapping=30.0)
    else:  # the larger models' full layers: K used as V, their own kv head count; untied head, no soft-cap
        config = transformers.Gemma4TextConfig(**common, attention_k_eq_v=True, num_global_key_value_heads=2,
                                               tie_word_embeddings=False, final_logit_softcapping=None)
    model = transformers.Gemma4ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module", params=["e2b-like", "k-eq-v"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def written(tmp_path_factory, model):
    """projection type -> the model's GGUF with its projections stored so (each written once per module)."""
    paths: dict[str, str] = {}

    def path_for(projection_type: str) -> str:
        if projection_type not in paths:
            folder = tmp_path_factory.mktemp(f"gemma4-{projection_type}")
            paths[projection_type] = write_gguf(model, str(folder / "tiny-gemma4.gguf"), "gemma4", projection_type)
        return paths[projection_type]

    return path_for


def _weights(path: str, model) -> GGUFWeights:
    config = model.config.to_dict()  # num_key_value_heads is per layer: Gemma4TextConfig refuses the attribute
    return GGUFWeights(path, config["model_type"], config["num_attention_heads"], config["num_key_value_heads"])


def _expected_state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the converter writes no output.weight for a tied head
    return state


def _converted_config(path: str) -> dict:
    values = gguf_config_values(ModelSource(os.path.dirname(path), os.path.basename(path), "tiny"))
    values.pop(PROJECTION_TYPES_KEY)
    return values


def test_the_model_has_what_the_file_must_carry(model):
    """The fixture's premises: both kinds of shared layer, layer_scalar in the state dict, no K/V on shared layers."""
    config, state = model.config, model.state_dict()
    assert config.layer_types[4:] == [SLIDING, SLIDING, FULL]
    assert "model.layers.0.layer_scalar" in state and state["model.layers.0.layer_scalar"].shape == (1,)
    assert not any(f"layers.{i}.self_attn.k_proj" in name for i in (4, 5, 6) for name in state)
    assert ("model.layers.2.self_attn.v_proj.weight" in state) != config.attention_k_eq_v


@pytest.mark.parametrize("projection_type", ["F32", "Q8_0"])
def test_every_tensor_reads_back_under_transformers_name_shape_and_values(model, written, projection_type):
    weights = _weights(written(projection_type), model)
    expected = _expected_state(model)
    assert sorted(weights.names()) == sorted(expected)
    stored = {}
    for name, want in expected.items():
        got = weights.read(name, torch.float32)
        assert got.shape == want.shape, name
        kind = stored[name] = weights.stored_type(name)
        if kind == "F32":
            assert (got - want).abs().max().item() < 1e-6, name
        elif kind == "F16":  # the converter's fallback for rows that are not whole Q8_0 blocks
            assert torch.allclose(got, want, rtol=2 ** -10, atol=1e-6), name
        else:  # Q8_0: each 32-weight block within half its step d = amax / 127, plus d's fp16 rounding
            step = want.reshape(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
            assert ((got - want).reshape(step.shape[0], -1, 32).abs() <= step * 0.57).all(), name
            grouped = weights.read_grouped(name)  # the file's own blocks
            assert grouped is not None and torch.equal(dequantize(*grouped), got), name
    matrices = {n for n, t in expected.items() if t.ndim == 2 and "embed_tokens" not in n and n != "lm_head.weight"}
    if projection_type == "F32":
        assert set(stored.values()) == {"F32"}
    else:  # every matrix but the vocabulary-sized ones; per_layer_projection's 16-wide rows fall back to F16
        assert {n for n, kind in stored.items() if kind != "F32"} == matrices
        assert {n for n, kind in stored.items() if kind == "F16"} == \
            {n for n in matrices if n.endswith("per_layer_projection.weight")}


def test_the_header_converts_to_transformers_config(model, written):
    import transformers

    values = _converted_config(written("F32"))
    assert values["model_type"] == "gemma4_text"
    rebuilt = transformers.AutoConfig.for_model(**values).to_dict()
    original = model.config.to_dict()
    assert {key: (original.get(key), value) for key, value in rebuilt.items() if original.get(key) != value} == {}
    assert set(original) == set(rebuilt)


def test_the_gguf_state_dict_gives_the_original_logits_and_greedy_tokens(model, written):
    """The prompt's logits, then 8 greedy steps through transformers' cache (the shared layers reading their
    source layers' K/V): the same tokens, every step's logits within 1e-5."""
    import transformers

    path = written("F32")
    rebuilt = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_converted_config(path))).eval()
    weights = _weights(path, model)
    missing, unexpected = rebuilt.load_state_dict({name: weights.read(name, torch.float32)
                                                   for name in weights.names()}, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if model.config.tie_word_embeddings else [])
    prompt = torch.tensor([PROMPT])
    runs = {}
    with torch.no_grad():
        for kind, source in (("want", model), ("got", rebuilt)):
            out = source.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)
            runs[kind] = (source(prompt).logits, out.sequences, torch.stack(out.logits))
    (want_prompt, want_tokens, want_steps), (got_prompt, got_tokens, got_steps) = runs["want"], runs["got"]
    assert (got_prompt - want_prompt).abs().max().item() < 1e-5
    assert torch.equal(got_tokens, want_tokens)
    assert (got_steps - want_steps).abs().max().item() < 1e-5


def test_the_header_holds_llama_cpps_gemma4_keys(written):
    """What llama.cpp's gemma4 loader reads, under its names: per-layer flags and widths, both head dims, the
    shared-layer count, the per-layer input width, and rope_freqs for the full layers' proportional RoPE."""
    from gguf import GGUFReader

    from oval_edge.runtime.model.gguf_metadata import header_array, header_scalar

    reader = GGUFReader(written("F32"))
    fields = reader.fields
    assert header_scalar(fields, "general.architecture") == "gemma4"
    assert header_array(fields, "gemma4.attention.sliding_window_pattern") == [True, True, False, True, True, True,
                                                                              False]
    assert (header_scalar(fields, "gemma4.attention.key_length"),
            header_scalar(fields, "gemma4.attention.key_length_swa")) == (64, 32)
    assert (header_scalar(fields, "gemma4.rope.dimension_count"),
            header_scalar(fields, "gemma4.rope.dimension_count_swa")) == (64, 32)
    assert header_scalar(fields, "gemma4.attention.shared_kv_layers") == 3
    assert header_scalar(fields, "gemma4.embedding_length_per_layer_input") == 16
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.tolist()
    assert freqs == [1.0] * 8 + [pytest.approx(1e30)] * 24  # 0.25 of 64 dims rotated: 8 of 32 pairs


def test_shared_layers_k_v_a_checkpoint_kept_are_not_listed(tmp_path):
    """A checkpoint may still hold k_proj / v_proj / k_norm for the KV-shared layers; the converter writes them, and
    transformers has no place for them: the reader leaves them out."""
    model = tiny_model("e2b-like")
    state = model.state_dict()
    kept = {f"model.layers.{i}.self_attn.{part}": state[f"model.layers.3.self_attn.{part}"].clone()
            for i in (4, 5) for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight")}
    path = write_gguf_tensors(model.config, [*state.items(), *kept.items()], str(tmp_path / "kept.gguf"), "gemma4")
    from gguf import GGUFReader

    assert "blk.4.attn_k.weight" in {t.name for t in GGUFReader(path).tensors}
    assert sorted(_weights(path, model).names()) == sorted(_expected_state(model))
