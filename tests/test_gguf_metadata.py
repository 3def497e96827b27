"""The GGUF's config and tokenizer converted once into a cache folder (runtime/model/gguf_metadata.py).

What is read from the folder must be exactly what the GGUF gives in-process: the same DecoderConfig, the same
token ids, special tokens and chat template. A cache that cannot be written, or a file the converter rejects,
falls back to the in-process path.
"""

from __future__ import annotations

import os
import shutil

import pytest

from oval_edge.cache_dir import CACHE_ENV
from oval_edge.runtime.model.gguf_metadata import cached_metadata_folder, metadata_folder_for
from oval_edge.runtime.model.loader import read_decoder_config
from oval_edge.runtime.model.origin.source import bundled_gguf_path, resolve_model
from oval_edge.runtime.model.tokenizer import load_tokenizer

TEXTS = ["Hello world, the capital of France is Paris.", "  spaces\tand\nnewlines  ", "émigré 東京 🙂 1234567"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.slow
def test_converted_folder_gives_the_same_config_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = resolve_model("default")
    folder = cached_metadata_folder(source.path)
    assert folder == metadata_folder_for(source.path) and folder.startswith(str(tmp_path / "cache"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    assert not [name for name in os.listdir(os.path.dirname(folder)) if name.startswith(".staging-")]

    assert read_decoder_config(source, folder) == read_decoder_config(source)
    cached, direct = load_tokenizer(source, folder), load_tokenizer(source)
    for text in TEXTS:
        assert cached(text)["input_ids"] == direct(text)["input_ids"]
        ids = direct(text)["input_ids"]
        assert cached.decode(ids, skip_special_tokens=True) == direct.decode(ids, skip_special_tokens=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(cached, name) == getattr(direct, name), name
    assert cached.all_special_tokens == direct.all_special_tokens
    render = dict(tokenize=False, add_generation_prompt=True)
    assert cached.apply_chat_template(CHAT, **render) == direct.apply_chat_template(CHAT, **render)
    assert cached_metadata_folder(source.path) == folder  # second call: found, not converted again


def test_a_changed_file_gets_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(bundled_gguf_path(), copy)
    before = metadata_folder_for(str(copy))
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    assert metadata_folder_for(str(copy)) != before


def test_an_unwritable_cache_falls_back_to_the_gguf(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    assert cached_metadata_folder(bundled_gguf_path()) is None


def test_a_file_the_converter_rejects_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    with open(bundled_gguf_path(), "rb") as handle:
        broken.write_bytes(handle.read(4096))  # a header cut short
    assert cached_metadata_folder(str(broken)) is None
    assert not os.path.exists(metadata_folder_for(str(broken)))


def test_startup_report_says_what_requantizing_a_q8_0_file_costs(tmp_path):
    """A GGUF whose projections are Q8_0 is read tensor by tensor (dequantized in slices, no fp32 copy of the model)
    to the same logits as its F32 twin within Q8_0's rounding, and the report says that nf4 loses precision the
    file had; a Q4 file's report says it is rounded twice."""
    import torch
    import transformers

    from gguf_checkpoint import write_gguf
    from oval_edge.runtime.model.loader import describe, load_model, requantization_note
    from test_decoder_loading import runtime_logits, save_folder
    from test_families import family_config

    folder = save_folder(tmp_path / "src", family_config("qwen3"))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    exact = write_gguf(model, str(tmp_path / "f32.gguf"), "qwen3")
    q8 = write_gguf(model, str(tmp_path / "q8.gguf"), "qwen3", projection_type="Q8_0")
    ids = list(range(100, 160))
    assert (runtime_logits(q8, ids) - runtime_logits(exact, ids)).abs().max().item() < 0.05
    report = describe(load_model(q8, quant="nf4", device="cpu"))
    assert "projections stored as Q8_0 x28" in report and "the Q8_0 ones lose precision" in report, report
    assert "precision" not in describe(load_model(q8, quant="none", device="cpu"))
    assert "a second rounding" in requantization_note({"oval_edge_gguf_projection_types": {"Q4_K": 3}}, "nf4")
