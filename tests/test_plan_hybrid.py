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
