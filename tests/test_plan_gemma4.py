"""`oval-edge plan` for Gemma 4 (#55): counted as the loader builds it — pages only for the full layers that keep K/V
(at global_head_dim), rings for the sliding layers that keep K/V (at head_dim), nothing for the last
num_kv_shared_layers layers (they read their sources'), each layer's projections at its own head dim and MLP width,
the per-layer input table kept as an int8 table — checked against what Engine.load allocates on the tiny Gemma 4 of
test_family_gemma4 and on a GGUF written as llama.cpp writes Gemma 4, and against hand counts on
gemma-4-E2B-it's published config."""

from __future__ import annotations

from pathlib import Path

import pytest

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.quantize import weight_bytes as loaded_weight_bytes
from oval_edge.tools.plan.memory import decode_reads, geometry_for
from oval_edge.tools.plan.model import read_model_shape
from oval_edge.tools.plan.weights import weight_bytes
from oval_edge.units import format_bytes

from test_decoder_loading import save_folder
from test_family_gemma4 import gemma4_config
from test_plan import flat, plan

E2B = Path(__file__).resolve().parent / "fixtures" / "configs" / "gemma-4-E2B-it"
# the tiny model's pool: fp32 K/V in 64 pages of 16, rings for 2 sequences
POOL, ENGINE = OvalConfig(page_size=16, kv_dtype="float32"), EngineConfig(num_pages=64, max_batch=2, oval_from=0)


@pytest.fixture(scope="module", params=[64, 16], ids=["P64", "P16"])
def folder(request, tmp_path_factory):
    """8 layers: 2, 5, 7 full (head dim 64), the rest sliding (32); 5-7 read layers 2 and 4's K/V; per-layer inputs
    of P = 64, or 16 (the per-layer projection's rows then too narrow for int4's groups of 32: kept as read)."""
    return save_folder(tmp_path_factory.mktemp("gemma4_plan"), gemma4_config(hidden_size_per_layer_input=request.param))


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_plan_counts_what_the_loader_allocates(folder, quant):
    """The pool's geometry, its bytes (pages, rings) and the weights' bytes equal Engine.load's. The weights are
    compared exactly, not within 0.1%: a missed vector (a k_norm on a shared layer, the per-layer blocks' output
    norms) or a narrow projection counted as 4-bit is a few hundred bytes in a tiny model's megabytes."""
    shape, engine = read_model_shape(folder), Engine.load(folder, quant=quant, device="cpu", oval=POOL, config=ENGINE)
    pool, geometry = engine.pool, geometry_for(shape, POOL, "cpu")
    assert geometry == pool.geometry  # every field: head dims, ring and shared layers, records
    assert (geometry.paged_layers, geometry.ring_layers, geometry.head_dim, geometry.ring_dim) == (1, (0, 1, 3, 4),
                                                                                                   64, 32)
    assert 2 * geometry.ring_bytes_per_sequence == pool.rings.nbytes()
    planned_pool = 64 * geometry.bytes_per_page + 2 * geometry.ring_bytes_per_sequence
    assert planned_pool == pool.nbytes()
    planned = weight_bytes(shape, quant, "cpu")
    assert planned.per_layer_table == loaded_weight_bytes(engine.loaded.model.model.per_layer.table)
    assert planned.total == engine.loaded.weight_bytes, (planned.as_dict(), engine.loaded.weight_bytes)


@pytest.mark.parametrize("config", [
    "E2B",  # the published multimodal config (text_config read, towers ignored)
    {"model_type": "gemma4_text", "num_hidden_layers": 12, "num_kv_shared_layers": 5},  # defaults: every 6th full
    {"model_type": "gemma4_text", "num_hidden_layers": 7, "num_kv_shared_layers": 2, "head_dim": 32,
     "layer_types": ["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 2,  # last forced full
     "per_layer_config": {"4": {"head_dim": 96}, "6": {"head_dim": 96}}},  # transformers 5's full head dim
], ids=["e2b", "defaults", "per_layer_config"])
def test_plan_reads_a_gemma4_config_as_the_loader_does(config):
    """The pool geometry plan derives from a config equals the one the engine builds from the loader's reading of
    the same config (DecoderConfig.from_dict -> setup.pool_geometry), defaults and transformers 5's keys included."""
    import json

    import torch

    from oval_edge.runtime.engine.setup import pool_geometry
    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.tools.plan.model import shape_from_config

    config = json.loads((E2B / "config.json").read_text()) if config == "E2B" else config
    shape = shape_from_config(config, "a gemma4 config", "gemma4")
    for target, oval in (("cpu", OvalConfig(page_size=16)), ("cuda", OvalConfig(page_size=32, record="int8"))):
        engine = pool_geometry(DecoderConfig.from_dict(config, "a gemma4 config"), oval, EngineConfig(),
                               torch.device(target), torch.float16 if target == "cuda" else torch.float32)
        assert geometry_for(shape, oval, target) == engine, target


def test_e2b_kv_bytes_by_hand():
    """gemma-4-E2B-it (35 layers, every 5th full; 1 KV head; full layers' head dim 512, sliding 256; window 512;
    the last 20 layers shared): of the first 15 layers, 3 are full (4, 9, 14) and keep pages, 12 sliding keep rings;
    layers 15-34 read layer 14's pages (full) or layer 13's ring (sliding)."""
    shape = read_model_shape(str(E2B))
    g = geometry_for(shape, OvalConfig(page_size=16), "cuda")  # fp16 K/V
    assert g.paged_layers == 3 and len(g.ring_layers) == 12 and len(g.shared) == 20
    assert set(dict(g.shared).values()) == {13, 14}
    assert g.kv_bytes_per_token == 3 * 2 * 1 * 512 * 2  # pages: 3 layers x K and V x 1 head x 512 x fp16
    ring_pages = -(-(512 - 1) // 16) + 1  # 33 pages hold the window's 512 positions
    assert g.ring_bytes_per_sequence == ring_pages * 16 * 2 * 12 * 1 * 256 * 2
    # a decode step at 8,192 tokens reads, per layer, the budget's tokens in the 7 full layers (3 own + 4 shared, all
    # past the 2 dense layers) at 512 and the window in the 28 sliding ones (12 own + 16 shared) at 256
    oval = OvalConfig(page_size=16)
    budget = min(8192, oval.token_budget)
    reads = decode_reads(shape, oval, g, 8192, 1)
    assert reads["kv_bytes"] == 7 * budget * 2 * 512 * 2 + 28 * 512 * 2 * 256 * 2


def test_e2b_weights_show_the_per_layer_table(capsys):
    """The per-layer input table [262144, 35 x 256] is an int8 table (a code byte a value, an fp32 scale per 32) in
    4-bit modes on a CPU and on CUDA alike; it is in the weights' total, not in the bytes a decode step reads (only
    the batch's rows are looked up), and plan's weight line names it."""
    shape = read_model_shape(str(E2B))
    values = 262144 * 35 * 256
    for target in ("cpu", "cuda"):
        w = weight_bytes(shape, "int4", target)
        assert w.per_layer_table == values + values // 32 * 4
        assert w.read_per_decode_step == w.total - w.per_layer_table - (w.embedding if w.lm_head else 0)
    assert weight_bytes(shape, "none", "cuda").per_layer_table == values * 2
    rc, out, _ = plan(capsys, "--device", "orin-nx-16gb", "--model", "gemma-4-E2B-it", "--context", "8192")
    table = format_bytes(values + values // 32 * 4)
    assert rc == 0 and f"per-layer input table {table} ([262144, 35 x 256]" in flat(out), out
    assert "6.00 KiB per token (float16, the 3 full layers)" in flat(out)
    assert "the last 20 layers keep no K/V (they read the pages or ring of layers 13, 14)" in flat(out)


def test_a_gemma4_gguf_plans_what_the_loader_holds(tmp_path):
    """A Q8_0 GGUF as llama.cpp's converter writes Gemma 4 (test_gguf_gemma4's E2B-like tiny model: shared layers
    found from the header, per-layer inputs of 16) is read as the loader reads it: the same pool geometry, and the
    weights it holds exactly, in the file's own blocks (--quant auto; the per-layer model projection included, the
    narrow per-layer projections kept as read) and re-quantized to int4."""
    from oval_edge.tools.gguf_write.writer import write_gguf
    from test_gguf_gemma4 import tiny_model

    path = write_gguf(tiny_model("e2b-like"), str(tmp_path / "gemma4-q8.gguf"), "gemma4", "Q8_0")
    shape = read_model_shape(path)
    assert (shape.source, shape.kv_shared_layers, shape.global_head_dim, shape.per_layer_input) == \
        ("GGUF metadata", 3, 64, 16)
    for quant in ("auto", "int4"):
        engine = Engine.load(path, quant=quant, device="cpu", oval=POOL, config=ENGINE)
        assert geometry_for(shape, POOL, "cpu") == engine.pool.geometry
        assert weight_bytes(shape, quant, "cpu").total == engine.loaded.weight_bytes, quant
    _plans_without_torch(path)
    # `oval-edge pull` plans from the header alone (the rest of the file a hole of zeros): the same plan
    header_only = tmp_path / "header-only.gguf"
    from gguf import GGUFReader

    header_only.write_bytes(Path(path).read_bytes()[:GGUFReader(path).data_offset])
    with open(header_only, "r+b") as handle:
        handle.truncate(Path(path).stat().st_size)
    hole = read_model_shape(str(header_only))
    assert geometry_for(hole, POOL, "cuda") == geometry_for(shape, POOL, "cuda")
    assert weight_bytes(hole, "auto", "cuda") == weight_bytes(shape, "auto", "cuda")


def _plans_without_torch(gguf_path: str) -> None:
    """plan stays torch-free on Gemma 4 (a config and a GGUF): the loader's config readers it imports are."""
    import subprocess
    import sys

    code = ("import sys\nfrom oval_edge.jetson.modules import get_module\n"
            "from oval_edge.tools.plan.compute import PlanRequest, plan_device\n"
            "from oval_edge.tools.plan.model import read_model_shape\n"
            f"for model in ({str(E2B)!r}, {gguf_path!r}):\n"
            "    plan_device(read_model_shape(model), get_module('orin-nano-8gb'), PlanRequest(context=512))\n"
            "assert 'torch' not in sys.modules, 'plan imported torch'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_serve_reserves_the_widest_mlp():
    """E2B's 20 shared layers have MLPs twice as wide (use_double_wide_mlp): serve's prefill reserve (and plan's
    copy of it) is sized by that width, not the config's intermediate_size."""
    from oval_edge.geometry import prefill_workspace_bytes
    from oval_edge.tools.plan.memory import reserved_workspace_bytes, widest_mlp

    shape = read_model_shape(str(E2B))
    g = geometry_for(shape, OvalConfig(page_size=16), "cpu")
    assert widest_mlp(shape) == 2 * shape.intermediate == 12288
    assert reserved_workspace_bytes(shape, g, "cpu", 512, 4096) == prefill_workspace_bytes(
        shape.hidden, 12288, shape.heads, g, 512, 4096, 4, step_tokens=513)
