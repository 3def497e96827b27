"""`oval-edge plan` for the hybrids (#55): Qwen3.5 and LFM2 counted with the loader's formulas — their state layers
(oval_edge/state_layout.py) outside the pages, the state bytes of max_batch sequences and the prefix-cache
snapshots before the pages, their own projections — and checked against what Engine.load allocates."""

from __future__ import annotations

import pytest

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.tools.plan.compute import state_snapshots
from oval_edge.tools.plan.memory import geometry_for
from oval_edge.tools.plan.model import read_model_shape
from oval_edge.tools.plan.weights import weight_bytes

from test_family_hybrid import hybrid  # noqa: F401  (the tiny Qwen3.5 / LFM2 checkpoints)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_plan_counts_what_the_loader_allocates(hybrid, quant):  # noqa: F811
    kind, _, folder = hybrid
    shape = read_model_shape(folder)
    oval = OvalConfig(page_size=16, kv_dtype="float32")
    engine = Engine.load(folder, quant=quant, device="cpu", oval=oval,
                         config=EngineConfig(num_pages=64, max_batch=2, oval_from=0))
    pool = engine.pool
    geometry = geometry_for(shape, oval, "cpu")
    assert geometry.bytes_per_page == pool.geometry.bytes_per_page
    assert geometry.paged_layers == pool.geometry.paged_layers == 2 if kind == "lfm2" else 1
    assert geometry.state_bytes_per_sequence == pool.geometry.state_bytes_per_sequence
    request = type("Request", (), {"batch": 2})()
    planned_states = (2 + state_snapshots(geometry, request)) * geometry.state_bytes_per_sequence
    assert planned_states == pool.states.nbytes()
    planned_pool = 64 * geometry.bytes_per_page + planned_states
    assert abs(planned_pool - pool.nbytes()) <= 0.001 * pool.nbytes()
    weights = weight_bytes(shape, quant, "cpu").total
    assert abs(weights - engine.loaded.weight_bytes) <= 0.001 * engine.loaded.weight_bytes, (weights,
                                                                                            engine.loaded.weight_bytes)


def test_a_real_model_state_bytes_by_hand():
    """Qwen3.5-0.8B's text decoder shape (hidden 1024, 24 layers, 3 of 4 DeltaNet, 16 key and 16 value heads of 128,
    conv kernel 4): 18 layers x (conv (2 x 16 x 128 + 16 x 128) x 3 in fp32 + 16 x 128 x 128 x 4)."""
    from oval_edge.tools.plan.model import shape_from_config

    config = {"model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320,
              "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
              "tie_word_embeddings": True}
    shape = shape_from_config(config, "qwen3.5-0.8b-shape", "q")
    assert shape.kinds.count("state") == 18 and shape.full_layers == 6
    assert shape.states.bytes_per_sequence == 18 * (6144 * 3 * 4 + 16 * 128 * 128 * 4)


@pytest.mark.parametrize("name, by_hand", [
    # 24 DeltaNet layers x (conv (2 x 16 x 128 + 32 x 128 channels) x 3 taps x 2 bytes + 32 x 128 x 128 x 4 bytes):
    # 51,511,296, the figure another engine's cache planner states for Qwen3.5-4B's 24 state layers
    ("Qwen3.5-4B", 24 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)),
    ("Qwen3.5-2B", 18 * ((2 * 16 * 128 + 16 * 128) * 3 * 2 + 16 * 128 * 128 * 4)),
    # LFM2: the 10 short-conv layers keep their last conv_L_cache - 1 = 2 inputs of `hidden` in fp16, nothing else
    ("LFM2-1.2B", 10 * 2048 * (3 - 1) * 2),
])
def test_published_hybrids_state_bytes_by_hand(name, by_hand):
    """The state a sequence keeps on a GPU (fp16 activations), read from the published config.json as `plan` does."""
    from pathlib import Path

    shape = read_model_shape(str(Path(__file__).parent / "fixtures" / "configs" / name))
    geometry = geometry_for(shape, OvalConfig(page_size=16), "cuda")
    assert geometry.state_bytes_per_sequence == by_hand
    assert geometry.paged_layers == shape.full_layers == (6 if name != "Qwen3.5-4B" else 8)


def test_docs_state_table_is_what_plan_counts():
    """docs/plan.md's "state per sequence" column is each known hybrid's GPU state as plan formats it."""
    import re
    from pathlib import Path

    from oval_edge.tools.plan.catalog import KNOWN_MODELS
    from oval_edge.units import format_bytes

    page = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text(encoding="utf-8")
    quoted = dict(re.findall(r"^\| (\S+) \| [^|]+ \| \d+ \| ([\d.]+ [KMG]iB) \|$", page, re.M))
    hybrids = {m.name: m.shape() for m in KNOWN_MODELS if m.shape().states is not None}
    assert set(quoted) == set(hybrids), "docs/plan.md's state table lists every known hybrid, nothing else"
    for name, shape in hybrids.items():
        state = geometry_for(shape, OvalConfig(page_size=16), "cuda").state_bytes_per_sequence
        assert quoted[name] == format_bytes(state), f"docs/plan.md: {name}'s state is {format_bytes(state)}"
