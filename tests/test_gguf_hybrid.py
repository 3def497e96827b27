"""Qwen3.5 and LFM2 GGUF files as llama.cpp's converter writes them (tools/gguf_write/hybrid.py) read back exactly as
transformers holds the model (runtime/model/families/hybrid_gguf.py through GGUFWeights and the header conversion).

Tiny random Qwen3_5ForCausalLM / Lfm2ForCausalLM (every parameter drawn at random, so the 1 + w norms, A_log and
the value-head order all matter; Qwen3.5 with 2 key and 4 value heads, so llama.cpp's tiled value-head order
differs from transformers'; sizes, eps, rope and conv taps away from the config classes' defaults, so a key the
conversion drops shows as a difference) are written in F32 and with Q8_0 projections; read back, every tensor has
transformers' name and shape (and, in F32, its values), the converted config rebuilds the same transformers
config, and the GGUF-read state dict gives the original logits.
"""

from __future__ import annotations

import os

import pytest
import torch

from oval_edge.runtime.model.gguf_metadata import PROJECTION_TYPES_KEY, gguf_config_values
from oval_edge.runtime.model.grouped.layout import dequantize
from oval_edge.runtime.model.origin.source import ModelSource
from oval_edge.runtime.model.weight_stream import GGUFWeights
from oval_edge.tools.gguf_write.writer import write_gguf

VOCAB = 49152  # the bundled tokenizer's (the writer copies its tokenizer fields)
PROMPT = list(range(100, 100 + 3 * 24, 3))


def tiny_model(family: str):
    import transformers

    if family == "qwen35":
        config = transformers.Qwen3_5TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=3, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = transformers.Qwen3_5ForCausalLM(config)
    else:  # conv_bias on: the conv's and its projections' biases go through the file too
        config = transformers.Lfm2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv"], conv_bias=True,
            conv_L_cache=4, max_position_embeddings=4096, norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
        model = transformers.Lfm2ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen35", "lfm2"])
def family(request):
    return request.param, tiny_model(request.param)


def _weights(path: str, model) -> GGUFWeights:
    config = model.config
    return GGUFWeights(path, config.model_type, config.num_attention_heads, config.num_key_value_heads)


@pytest.fixture(scope="module")
def written(tmp_path_factory, family):
    """projection type -> the family's GGUF with its projections stored so (each written once per module)."""
    architecture, model = family
    paths: dict[str, str] = {}

    def path_for(projection_type: str) -> str:
        if projection_type not in paths:
            folder = tmp_path_factory.mktemp(f"{architecture}-{projection_type}")
            paths[projection_type] = write_gguf(model, str(folder / f"tiny-{architecture}.gguf"), architecture,
                                                projection_type)
        return paths[projection_type]

    return path_for


def _expected_state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the converter writes no output.weight for a tied head
    return state


@pytest.mark.parametrize("projection_type", ["F32", "Q8_0"])
def test_every_tensor_reads_back_under_transformers_name_shape_and_values(family, written, projection_type):
    _, model = family
    weights = _weights(written(projection_type), model)
    expected = _expected_state(model)
    assert sorted(weights.names()) == sorted(expected)
    quantized = 0
    for name, want in expected.items():
        got = weights.read(name, torch.float32)
        assert got.shape == want.shape, name
        if weights.stored_type(name) == "F32":
            assert (got - want).abs().max().item() < 1e-6, name
            continue
        # Q8_0: each 32-weight block within half its step d = amax / 127, plus d's fp16 rounding (127 d 2^-11)
        quantized += 1
        step = want.reshape(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        assert ((got - want).reshape(step.shape[0], -1, 32).abs() <= step * 0.57).all(), name
        grouped = weights.read_grouped(name)  # the file's own blocks, reordered like `read`
        assert grouped is not None, name
        assert torch.equal(dequantize(*grouped), got), name
    assert quantized == (0 if projection_type == "F32" else
                         sum(1 for n, t in expected.items() if n.startswith("model.layers.") and t.ndim == 2))


def test_the_header_converts_to_transformers_config(family, written):
    import transformers

    architecture, model = family
    path = written("F32")
    values = gguf_config_values(ModelSource(os.path.dirname(path), os.path.basename(path), "tiny"))
    assert values.pop(PROJECTION_TYPES_KEY) == {"F32": len([n for n in _expected_state(model)
                                                            if n.startswith("model.layers.") and
                                                            _expected_state(model)[n].ndim in (2, 3)])}
    rebuilt = transformers.AutoConfig.for_model(**values).to_dict()
    original = model.config.to_dict()
    if architecture == "lfm2":  # the header holds the MLP width the tensors have, not intermediate_size before 2/3
        assert transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**values)).model.layers[0].feed_forward.w1 \
            .weight.shape == model.model.layers[0].feed_forward.w1.weight.shape
        assert (rebuilt.pop("intermediate_size"), rebuilt.pop("block_auto_adjust_ff_dim")) == (256, False)
        original.pop("intermediate_size"), original.pop("block_auto_adjust_ff_dim")
    assert {key: value for key, value in rebuilt.items() if original.get(key) != value} == {}
    assert set(original) == set(rebuilt)


def test_the_gguf_state_dict_gives_the_original_logits(family, written):
    import transformers

    _, model = family
    path = written("F32")
    values = gguf_config_values(ModelSource(os.path.dirname(path), os.path.basename(path), "tiny"))
    values.pop(PROJECTION_TYPES_KEY)
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**values)).eval()
    weights = _weights(path, model)
    missing, unexpected = rebuilt.load_state_dict({name: weights.read(name, torch.float32)
                                                   for name in weights.names()}, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if model.config.tie_word_embeddings else [])
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits
        got = rebuilt(torch.tensor([PROMPT])).logits
    assert (got - want).abs().max().item() < 1e-5


def test_a_layer_pattern_qwen35_cannot_hold_is_refused(tmp_path):
    _, model = "qwen35", tiny_model("qwen35")
    model.config.layer_types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="full_attention_interval"):
        write_gguf(model, str(tmp_path / "bad.gguf"), "qwen35")


def test_a_qwen35_gguf_with_its_multi_token_prediction_head_reads_the_decoder_only(tmp_path):
    """llama.cpp's converter keeps Qwen3.5's MTP head (config.json's mtp_num_hidden_layers) as extra blocks counted
    in block_count, named in nextn_predict_layers: the reader neither lists their tensors nor counts them."""
    from gguf import GGUFReader

    from oval_edge.runtime.model.gguf_metadata import header_scalar
    from oval_edge.tools.gguf_write.writer import write_gguf_tensors

    model = tiny_model("qwen35")
    config = model.config
    config.mtp_num_hidden_layers = 1
    state = model.state_dict()
    hidden = config.hidden_size
    head = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
            "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden),
            "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden)}
    head.update({f"mtp.layers.0.{name.split('.', 3)[3]}": tensor.clone() for name, tensor in state.items()
                 if name.startswith("model.layers.1.")})  # a full-attention block, as Qwen3.5's MTP layer is
    path = write_gguf_tensors(config, [*state.items(), *head.items()], str(tmp_path / "mtp.gguf"), "qwen35")
    reader = GGUFReader(path)
    assert header_scalar(reader.fields, "qwen35.block_count") == 5
    assert header_scalar(reader.fields, "qwen35.nextn_predict_layers") == 1
    stored = {t.name for t in reader.tensors}
    assert {"blk.4.attn_q.weight", "blk.4.nextn.eh_proj.weight", "blk.4.nextn.shared_head_norm.weight"} <= stored

    assert sorted(_weights(path, model).names()) == sorted(state)
    values = gguf_config_values(ModelSource(str(tmp_path), "mtp.gguf", "tiny"))
    assert values["num_hidden_layers"] == 4 and values["layer_types"] == config.layer_types
