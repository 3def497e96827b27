"""bench's synthetic long model (tools/gguf_write/synthetic.py): the GGUF it writes, what it copies from the bundled
file, its cache, and that this runtime loads and runs it. A 2-layer, 64-wide shape on the bundled vocabulary keeps
the file small; the header sizes, tensor types and tokenizer are checked as bench's full-size model gets them."""

from __future__ import annotations

import dataclasses
import os

import pytest

from oval_edge.cache_dir import CACHE_ENV
from oval_edge.tools.gguf_write.synthetic import SPEED_ONLY, bundled_shape, synthetic_gguf, synthetic_gguf_path

POSITIONS = 384
TINY = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, positions=POSITIONS, base_name="")


def _fields(path: str) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {"fields": reader.fields, "types": {t.name: t.tensor_type.name for t in reader.tensors}}


@pytest.fixture(scope="module")
def bundled():
    return bundled_shape()  # parsing the bundled header (its 49k-token vocabulary) once for the module


@pytest.fixture(scope="module")
def tiny(bundled):
    return dataclasses.replace(bundled, **TINY)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny):
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(cache)
    try:
        yield synthetic_gguf(tiny, announce=lambda _text: None), str(cache)
    finally:
        if old is None:
            os.environ.pop(CACHE_ENV)
        else:
            os.environ[CACHE_ENV] = old


def test_bundled_shape_is_read_from_the_bundled_header(bundled):
    shape = bundled
    # SmolLM2-135M: 30 layers, 576 wide, 1536 MLP, 9 heads over 3 KV heads of 64, 49152 tokens
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab) == \
        (30, 576, 1536, 9, 3, 49152)
    assert shape.positions == 32768 and shape.head_dim == 64
    assert shape.describe() == f"SmolLM2-135M shape, random weights (seed 0), 32k positions ({SPEED_ONLY})"
    # the gguf package quantizes both of the bundled file's types
    assert (shape.projection_type, shape.embedding_type) == ("Q4_1", "Q8_0")


def test_the_file_has_the_asked_positions_the_bundled_types_and_tokenizer(tiny_gguf, tiny):
    from oval_edge.runtime.model.gguf_metadata import header_scalar
    from oval_edge.runtime.model.origin.source import bundled_gguf_path

    path, cache = tiny_gguf
    assert path.startswith(cache) and path == synthetic_gguf_path(tiny)
    got, bundled = _fields(path), _fields(bundled_gguf_path())
    assert header_scalar(got["fields"], "llama.context_length") == POSITIONS
    assert header_scalar(got["fields"], "llama.block_count") == 2
    assert SPEED_ONLY in header_scalar(got["fields"], "general.name")
    assert {got["types"][f"blk.{i}.{n}.weight"] for i in range(2) for n in ("attn_q", "attn_k", "ffn_down")} == {"Q4_1"}
    assert got["types"]["token_embd.weight"] == "Q8_0" and got["types"]["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in got["types"]  # tied, as in the bundled file
    tokenizer_keys = sorted(k for k in bundled["fields"] if k.startswith("tokenizer."))
    assert "tokenizer.chat_template" in tokenizer_keys
    assert sorted(k for k in got["fields"] if k.startswith("tokenizer.")) == tokenizer_keys
    for key in tokenizer_keys:
        mine, theirs = got["fields"][key], bundled["fields"][key]
        assert [bytes(mine.parts[i]) for i in mine.data] == [bytes(theirs.parts[i]) for i in theirs.data], key


def test_the_file_is_made_once_and_a_new_seed_is_another_file(tiny_gguf, tiny):
    path, _cache = tiny_gguf
    stamp = os.stat(path).st_mtime_ns
    assert synthetic_gguf(tiny, announce=lambda _text: pytest.fail("rewrote a cached file")) == path
    assert os.stat(path).st_mtime_ns == stamp
    assert synthetic_gguf_path(dataclasses.replace(tiny, seed=1)) != path
    assert synthetic_gguf_path(dataclasses.replace(tiny, positions=512)) != path
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".staging-")]


@pytest.mark.slow
def test_this_runtime_loads_and_runs_it_with_the_bundled_tokenizer(tiny_gguf):
    from oval_edge.runtime import Engine, EngineConfig, SamplingParams
    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer
    from oval_edge.tools.plan.model import read_model_shape

    path, _cache = tiny_gguf
    assert read_model_shape(path).max_context == POSITIONS  # what bench reads to shorten prompts
    text = "The ferry to the island leaves twice a day."
    assert load_tokenizer(resolve_model(path))(text)["input_ids"] == \
        load_tokenizer(resolve_model("default"))(text)["input_ids"]
    engine = Engine.load(path, quant="nf4", device="cpu", config=EngineConfig(max_batch=1, num_pages=8))
    assert engine.loaded.config.max_position_embeddings == POSITIONS and engine.loaded.config.num_hidden_layers == 2
    assert "Q4_1" in engine.loaded.precision_note  # converted as the bundled Q4_1 file is
    request = engine.generate(list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert request.finish_reason == "length" and len(request.output_ids) == 4


def test_shape_errors_name_what_to_change(tiny):
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        dataclasses.replace(tiny, heads=3, hidden=96)
    with pytest.raises(ValueError, match="--synthetic-positions=16"):
        dataclasses.replace(tiny, positions=16)
    with pytest.raises(ValueError, match="multiples of 32"):
        dataclasses.replace(tiny, intermediate=100)
    with pytest.raises(ValueError, match="cannot write it"):
        dataclasses.replace(tiny, projection_type="Q4_K")
