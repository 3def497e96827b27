"""The streaming loader on Hugging Face folders: the runtime's decoder computes what transformers computes.

Small random Llama (with Llama 3.1 RoPE scaling) and Qwen2 (q/k/v biases, untied head) models are saved with
safetensors next to the bundled tokenizer, loaded through `load_model` (quant none, fp32) and run by the
runtime's forward; their logits must equal transformers' own forward of the same folder. The bundled GGUF is
covered token for token in tests/test_runtime.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.config import DecoderConfig
from oval_edge.runtime.model.loader import load_model
from oval_edge.runtime.model.origin.source import resolve_model
from oval_edge.runtime.model.tokenizer import load_tokenizer

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5)


def save_folder(path, config) -> str:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(path)
    return str(path)


def runtime_logits(folder: str, ids: list[int]) -> torch.Tensor:
    engine = Engine.load(folder, quant="none", device="cpu", oval=OvalConfig(page_size=16, kv_dtype="float32"),
                         config=EngineConfig(num_pages=16))
    pool = engine.pool
    assert pool.allocate("r", len(ids)) is not None
    step = pool.prepare(["r"], [len(ids) - 1])
    engine.runner.forward(step, torch.tensor(ids[:-1]), decode=False)
    pool.commit(step)
    step = pool.prepare(["r"], [1])
    logits, _ = engine.runner.forward(step, torch.tensor(ids[-1:]), decode=True)
    pool.commit(step)
    pool.free("r")
    return logits[0]


def hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2-bias-untied"])
def test_hugging_face_folder_logits_equal_transformers(tmp_path, kind):
    import transformers

    if kind == "llama3-rope":
        config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    else:
        config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False, rope_theta=1000000.0)
    folder = save_folder(tmp_path / kind, config)
    ids = list(range(100, 100 + 300, 3))  # 100 positions: beyond the llama3 scaling's original 64
    ours, theirs = runtime_logits(folder, ids), hf_logits(folder, ids)
    assert (ours - theirs).abs().max().item() < 1e-4
    loaded = load_model(folder, quant="none", device="cpu")
    assert loaded.config.model_type == config.model_type
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) == config.tie_word_embeddings
    if kind == "qwen2-bias-untied":
        assert loaded.model.model.layers[0].self_attn.qkv_proj.bias is not None


def test_loading_does_not_import_transformers_model_classes(tmp_path):
    """The point of the runtime's own decoder: no transformers modeling code (and no sympy) in a serving process."""
    import subprocess

    code = ("import sys; from oval_edge.runtime.model.loader import load_model; load_model('default', 'nf4', 'cpu'); "
            "bad = [m for m in sys.modules if m.startswith(('transformers.models.llama.modeling', 'sympy', "
            "'torch._dynamo'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]


def test_unsupported_rope_and_broken_configs_are_named():
    base = dict(SHAPE, model_type="llama")
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        DecoderConfig.from_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "/m")
    with pytest.raises(ValueError, match="/m: its configuration lacks 'hidden_size'"):
        DecoderConfig.from_dict({k: v for k, v in base.items() if k != "hidden_size"}, "/m")
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        DecoderConfig.from_dict(dict(base, num_key_value_heads=3), "/m")
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        DecoderConfig.from_dict(dict(base, hidden_act="gelu"), "/m")


def test_folder_with_missing_layer_weights_names_the_layer(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    folder = save_folder(tmp_path / "m", transformers.LlamaConfig(**SHAPE))
    weights = load_file(f"{folder}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 1 lacks mlp.down_proj.weight"):
        load_model(folder, quant="none", device="cpu")
