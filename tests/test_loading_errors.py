"""A model that is missing, broken or of the wrong architecture fails at startup with its path and the reason."""

from __future__ import annotations

import json

import pytest

from oval_edge.runtime.model.loader import load_model
from oval_edge.runtime.model.origin.source import bundled_gguf_path, resolve_model


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        load_model(str(missing), quant="none", device="cpu")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=f"{bogus} is not a GGUF file"):
        resolve_model(str(bogus))


def test_a_truncated_gguf_fails_with_its_path(tmp_path):
    broken = tmp_path / "broken.gguf"
    with open(bundled_gguf_path(), "rb") as handle:
        broken.write_bytes(handle.read(4096))  # the header of the real file, then nothing
    with pytest.raises(ValueError, match=f"model {broken}: cannot"):
        load_model(str(broken), quant="none", device="cpu")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_broken_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json cannot be read"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_names_it_and_the_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"config.json: model_type 'gpt2' is not supported"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        resolve_model(str(tmp_path))


def test_unknown_quant_and_device_are_named():
    with pytest.raises(ValueError, match="quant='int3' is unknown"):
        load_model("default", quant="int3", device="cpu")
    with pytest.raises(ValueError, match="device='tpu' is not supported; use cpu, cuda"):
        load_model("default", quant="none", device="tpu")


def test_sliding_window_models_are_refused_not_attended_wrongly(tmp_path):
    """Qwen2's use_sliding_window mixes layer kinds by max_window_layers, which is not built: refused. (Mistral
    v0.1's and Phi-3-mini-4k's window on every layer is: tests/test_family_phi3.py, tests/test_family_gemma.py.)"""
    config = {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
              "max_position_embeddings": 32768, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="sliding-window attention \\(4096 tokens\\) is not supported"):
        load_model(str(tmp_path), quant="none", device="cpu")
