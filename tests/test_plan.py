"""`oval-edge plan`: weight bytes against real bitsandbytes, the Llama-3-8B / seven-module answers, errors, TOML."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from oval_edge.cli import main
from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.runtime.config_file import engine_kwargs, load_config_file, oval_config, validate_sections
from oval_edge.tools.plan.memory import geometry_for, reserved_workspace_bytes
from oval_edge.tools.plan.model import ModelShape, read_model_shape
from oval_edge.tools.plan.weights import cpu_layout, linear4bit_bytes, weight_bytes

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA3 = str(FIXTURES / "llama3_8b_config.json")
MODULES = ["orin-nano-4gb", "orin-nano-8gb", "orin-nano-8gb-super", "orin-nx-8gb", "orin-nx-16gb", "agx-orin-32gb",
           "agx-orin-64gb"]


def plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def flat(text: str) -> str:
    """Output with its 120-column folding undone (lines break at spaces), to find a sentence in it."""
    return " ".join(text.split())


# ---- weight bytes vs real bitsandbytes ------------------------------------------------------------------------

def _real_linear4bit(n_out: int, n_in: int, quant: str):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from oval_edge.runtime.model.quantize import BLOCKSIZE

    weight = torch.randn(n_out, n_in, dtype=torch.bfloat16)
    layer = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                              quant_type=quant, device="meta")
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type=quant,
                                     blocksize=BLOCKSIZE).to(torch.device("cpu"))
    return layer


SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1024, 4096), (96, 200)]


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_linear4bit_formula_matches_bitsandbytes_nested_layout(quant):
    """The layout CUDA/Jetson keep (double-quantized absmax): same tensors bitsandbytes builds on CPU."""
    torch = pytest.importorskip("torch")
    from oval_edge.runtime.model.quantize import weight_bytes as runtime_weight_bytes

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for n_out, n_in in SHAPES:
        layer = _real_linear4bit(n_out, n_in, quant)
        assert layer.weight.quant_state.nested
        real = runtime_weight_bytes(torch.nn.ModuleList([layer]))
        codes, state = linear4bit_bytes(n_out, n_in, "nested")
        assert abs(codes + state - real) <= 0.03 * real, (n_out, n_in, codes + state, real)
        assert codes == layer.weight.data.numel()  # packed codes are exact


def test_linear4bit_formula_matches_bitsandbytes_packed_cpu_layout():
    """The layout bitsandbytes converts to on AVX512-BF16 CPUs at the first inference call."""
    torch = pytest.importorskip("torch")
    from bitsandbytes.functional import has_avx512bf16

    from oval_edge.runtime.model.quantize import weight_bytes as runtime_weight_bytes

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes keeps the nested layout here")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for n_out, n_in in SHAPES[:5]:  # N % 32 == 0 and K % 64 == 0, as the packed kernel requires
        layer = _real_linear4bit(n_out, n_in, "nf4").eval()
        with torch.no_grad():
            layer(torch.zeros(1, n_in))
        state = layer.weight.quant_state
        assert state.packing_format_for_cpu and not state.nested
        assert tuple(state.absmax.shape) == (n_in // 64, n_out) and state.absmax.dtype == torch.bfloat16
        real = runtime_weight_bytes(torch.nn.ModuleList([layer]))
        codes, qstate = linear4bit_bytes(n_out, n_in, "cpu-packed")
        assert abs(codes + qstate - real) <= 0.03 * real, (n_out, n_in, codes + qstate, real)


class StateDictWeights:
    """A state dict served the way runtime.model.weight_stream serves a checkpoint (names, read, close)."""

    def __init__(self, state: dict):
        self.state, self.path = state, "state dict"

    def names(self):
        return list(self.state)

    def read(self, name, dtype):
        return self.state[name].to(dtype)

    def close(self):
        pass


def test_whole_decoder_quantized_by_the_runtime_matches_the_planner():
    """A small random Llama through runtime.model.decoder_build.build_decoder (the loader's own path, fused layers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bitsandbytes.functional import has_avx512bf16

    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.runtime.model.decoder_build import build_decoder
    from oval_edge.runtime.model.quantize import import_bitsandbytes
    from oval_edge.runtime.model.quantize import weight_bytes as runtime_weight_bytes

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=512,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    decoder = build_decoder(StateDictWeights(model.state_dict()), DecoderConfig.from_dict(config.to_dict(), "tiny"),
                            "nf4", torch.device("cpu"), torch.float32, torch.bfloat16)
    bnb = import_bitsandbytes()
    linears = torch.nn.ModuleList([m for m in decoder.modules() if isinstance(m, bnb.nn.Linear4bit)])
    assert len(linears) == 3 * 4  # fused q/k/v, o, fused gate/up, down per layer
    shape = ModelShape("tiny", "-", "llama", 3, 256, 704, 4, 2, 64, 512, 256, True, False, "test", 0)
    flags = frozenset({"avx512_bf16"}) if has_avx512bf16() else frozenset()
    planned = weight_bytes(shape, "nf4", "cpu", flags)
    assert planned.layout == cpu_layout(shape, flags)
    real = runtime_weight_bytes(linears)
    assert abs(planned.linear_codes + planned.quant_state - real) <= 0.03 * real


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["nf4", "auto", "int4"])  # auto: the GGUF's own Q4_1 blocks
def test_weight_bytes_match_loaded_model(quant):
    """The bundled model loaded by the runtime: planner weight bytes within 3% of runtime's quantize.weight_bytes."""
    pytest.importorskip("torch")
    from bitsandbytes.functional import has_avx512bf16

    from oval_edge.runtime.model.loader import load_model

    loaded = load_model("default", quant, "cpu")
    flags = frozenset({"avx512_bf16"}) if has_avx512bf16() else frozenset()
    planned = weight_bytes(read_model_shape("default"), quant, "cpu", flags).total
    assert abs(planned - loaded.weight_bytes) <= 0.03 * loaded.weight_bytes, (planned, loaded.weight_bytes)


# ---- arithmetic shared with the runtime (one implementation, called by both) ------------------------------------

def test_planner_and_runtime_share_their_arithmetic():
    torch = pytest.importorskip("torch")
    from oval_edge.geometry import KVGeometry, decode_graph_bytes, prefill_workspace_bytes, seal_chunk_pages
    from oval_edge.kv.pool import PagePool
    from oval_edge.runtime.engine.setup import EngineConfig, pool_geometry
    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.sparse.selection import slots_per_step as runtime_slots

    shape = read_model_shape(LLAMA3)
    decoder = DecoderConfig.from_dict(json.loads(Path(LLAMA3).read_text()), LLAMA3)
    for cfg in (OvalConfig(), OvalConfig(page_size=16, top_k=8), OvalConfig(page_size=128, window_max=96),
                OvalConfig(kv_dtype="float32", scorer="quest")):
        assert cfg.token_budget == runtime_slots(cfg)
        for target in ("cpu", "cuda"):  # the pool serve builds is the one the planner predicts
            assert geometry_for(shape, cfg, target) == pool_geometry(decoder, cfg, EngineConfig(),
                                                                     torch.device(target))
    assert OvalConfig().pool_dtype("cpu") == "bfloat16" and OvalConfig().pool_dtype("cuda") == "float16"
    geo_small = KVGeometry(30, 3, 64, 32, "bfloat16")
    assert PagePool(geo_small, 4).seal_chunk == seal_chunk_pages(geo_small)
    geo = KVGeometry(shape.layers, shape.kv_heads, shape.head_dim, 32, "float16")
    # A step carries max_batch decode rows beside the chunk (EngineConfig.step_tokens, as build_pool passes it).
    step_tokens = EngineConfig(max_batch=4, prefill_chunk=512).step_tokens
    prefill = prefill_workspace_bytes(shape.hidden, shape.intermediate, shape.heads, geo, 512, 4096, 2,
                                      step_tokens=step_tokens)
    assert reserved_workspace_bytes(shape, geo, "cpu", 512, 4096) == prefill_workspace_bytes(
        shape.hidden, shape.intermediate, shape.heads, geo, 512, 4096, 4,
        step_tokens=EngineConfig(max_batch=1, prefill_chunk=512).step_tokens)
    # On CUDA serve also keeps what its captured decode graphs hold (runtime/engine/setup.build_pool).
    graphs = decode_graph_bytes(shape.hidden, shape.intermediate, shape.heads, shape.vocab, geo, 4, 4096, 2)
    assert reserved_workspace_bytes(shape, geo, "cuda", 512, 4096, 4) == prefill + graphs


# ---- model shapes ---------------------------------------------------------------------------------------------

def test_bundled_gguf_and_llama3_config_shapes():
    smol = read_model_shape("default")
    assert (smol.layers, smol.heads, smol.kv_heads, smol.head_dim, smol.hidden, smol.intermediate) == (30, 9, 3, 64, 576, 1536)
    assert (smol.vocab, smol.max_context, smol.tied_embeddings, smol.source) == (49152, 8192, True, "GGUF metadata")
    llama = read_model_shape(LLAMA3)
    assert (llama.layers, llama.hidden, llama.heads, llama.kv_heads, llama.head_dim) == (32, 4096, 32, 8, 128)
    assert (llama.intermediate, llama.vocab, llama.tied_embeddings) == (14336, 128256, False)
    assert abs(llama.parameters - 8.03e9) < 0.01e9  # Meta-Llama-3-8B: 8.03B parameters


# ---- the CLI --------------------------------------------------------------------------------------------------

def test_llama3_8b_on_orin_nano_8gb_says_whether_and_what_context(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    rc, out, _ = plan(capsys, "--device", "orin-nano-8gb", "--model", LLAMA3, "--quant", "nf4",
                      "--context", "8192", "--json", str(out_json))
    report = json.loads(out_json.read_text())
    dev = report["devices"][0]
    # Weights as stored: 4-bit projections (+ nested quant state), the untied embedding as an int8 table (CUDA's
    # row-major layout: a code byte per weight and an fp32 scale per 32, no padding) and the head in 16 bits (no
    # Triton head kernel on a JetPack torch).
    assert dev["weights"]["linear_codes"] == 32 * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) // 2
    assert dev["weights"]["embedding"] == 128256 * 4096 + 128256 * 128 * 4
    assert dev["weights"]["lm_head"] == 128256 * 4096 * 2
    longest = dev["longest_context"]
    if dev["fits"]:
        assert rc == 0 and "recommendation: page_size" in out
    else:
        assert rc == 1 and "does not fit" in out
        assert f"what fits: up to {longest} tokens per sequence" in flat(out)
    assert report["predicted_peak_bytes"] == dev["predicted_peak_bytes"] > dev["weight_bytes"]
    # At a context the pool holds, the same module answers "fits" with a recommendation.
    if longest >= 512:
        rc2, out2, _ = plan(capsys, "--device", "orin-nano-8gb", "--model", LLAMA3, "--quant", "nf4",
                           "--context", str(longest))
        assert rc2 == 0 and "recommendation: page_size" in out2


def test_device_all_prints_one_table_with_seven_modules(capsys, tmp_path):
    out_json = tmp_path / "all.json"
    rc, out, _ = plan(capsys, "--device", "all", "--model", LLAMA3, "--context", "4096", "--json", str(out_json))
    assert rc == 0
    rows = [line.split()[0] for line in out.splitlines() if line.strip().split(" ")[0] in MODULES]
    assert rows == MODULES
    devices = json.loads(out_json.read_text())["devices"]
    assert [d["device"]["name"] for d in devices] == MODULES
    # 64 GB holds an 8B model at its full 8k context; the 4 GB Orin Nano cannot hold its weights.
    assert devices[-1]["fits"] and not devices[0]["fits"]


def test_unknown_device_lists_the_known_names(capsys):
    rc, _, err = plan(capsys, "--device", "orin-nano-16gb", "--model", LLAMA3)
    assert rc == 2 and "orin-nano-16gb" in err
    for name in MODULES + ["cuda", "cpu"]:
        assert name in err


def test_budget_below_weights_gives_the_minimum(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    rc, out, _ = plan(capsys, "--device", "orin-nano-8gb", "--model", LLAMA3, "--memory-budget", "4GiB",
                      "--context", "2048", "--json", str(out_json))
    assert rc == 1 and "does not fit" in out and "not even one page per sequence fits" in flat(out)
    dev = json.loads(out_json.read_text())["devices"][0]
    minimum = int(re.search(r"at least [\d.]+ GiB \((\d+) bytes", flat(out)).group(1))
    assert minimum == min(r["minimum_budget"] for r in dev["page_sizes"])
    assert minimum > dev["weight_bytes"] + dev["runtime_overhead_bytes"] > 4 * 2**30
    # ... and that minimum is enough.
    rc2, out2, _ = plan(capsys, "--device", "orin-nano-8gb", "--model", LLAMA3, "--memory-budget", str(minimum),
                        "--context", "2048")
    assert rc2 == 0, out2


@pytest.mark.parametrize("make, why", [
    (lambda d: d / "missing.gguf", "does not exist"),
    (lambda d: d, "has no config.json"),
    (lambda d: (d / "notes.txt").write_text("hello") and d / "notes.txt", "neither a GGUF file nor a JSON"),
    (lambda d: (d / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00") and d / "bad.gguf", "not a readable GGUF"),
])
def test_unreadable_model_path_names_path_and_why(capsys, tmp_path, make, why):
    path = make(tmp_path)
    rc, _, err = plan(capsys, "--device", "orin-nano-8gb", "--model", str(path))
    assert rc == 2 and str(path) in err and why in err


def test_write_config_round_trips_through_the_serve_reader(capsys, tmp_path):
    toml_path, json_path = tmp_path / "serve.toml", tmp_path / "plan.json"
    rc, out, _ = plan(capsys, "--device", "agx-orin-64gb", "--model", LLAMA3, "--context", "8192", "--batch", "2",
                      "--page-size", "32,64", "--write-config", str(toml_path), "--json", str(json_path))
    assert rc == 0 and f"wrote {toml_path}" in out
    sections = load_config_file(str(toml_path))
    dev = json.loads(json_path.read_text())["devices"][0]
    best = dev["recommended"]
    assert sections["model"] == {"path": str(FIXTURES), "quant": "int4"}  # auto, planned as a folder loads it
    assert oval_config(sections).page_size == best["page_size"]
    # CUDA: serve counts neither the CUDA context nor the sealing transient; the written budget leaves them out.
    assert oval_config(sections).memory_budget == best["serve_memory_budget"] == (
        dev["budget_bytes"] - dev["runtime_overhead_bytes"] - (best["workspace_bytes"] - best["serve_workspace_bytes"]))
    assert engine_kwargs(sections) == {"max_batch": 2, "max_model_len": 8192, "prefill_chunk": DEFAULT_PREFILL_CHUNK}
    assert sections["plan"]["predicted_peak_bytes"] == best["predicted_peak_bytes"] == dev["predicted_peak_bytes"]
    assert sections["plan"]["pages"] == best["pages"]


def test_config_reader_names_the_bad_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nmax_batch = 4\nmax_bach = 2\n")
    with pytest.raises(ValueError, match=r"\[server\] unknown key\(s\) \['max_bach'\]"):
        load_config_file(str(bad))
    bad.write_text("[oval]\npage_size = 48\n")
    with pytest.raises(ValueError, match="page_size=48 is not a power of two"):
        load_config_file(str(bad))
    bad.write_text("[server]\nmemory_budget = 'lots'\n")
    with pytest.raises(ValueError, match="memory_budget"):
        load_config_file(str(bad))
    bad.write_text("[model\npath = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config_file(str(bad))
    with pytest.raises(ValueError, match="unknown section"):
        validate_sections({"sever": {}})
    with pytest.raises(ValueError, match="set twice"):
        oval_config({"oval": {"memory_budget": 10**9}, "server": {"memory_budget": 2 * 10**9}})


def test_auto_on_a_recorded_orin_nano_plans_with_memavailable(capsys, tmp_path):
    root = str(FIXTURES / "jetson" / "orin_nano_8gb_super_r36")
    out_json = tmp_path / "auto.json"
    rc, out, _ = plan(capsys, "--device", "auto", "--root", root, "--model", "default", "--context", "4096",
                      "--json", str(out_json))
    dev = json.loads(out_json.read_text())["devices"][0]
    assert dev["device"]["name"] == "orin-nano-8gb-super" and dev["device"]["bandwidth_gbps"] == 102.0
    assert dev["budget_bytes"] == 6245596 * 1024  # MemAvailable of the recorded board
    assert "jtop not available" in out and "R36.4.3" in out
    assert rc == 0 and dev["fits"]


def test_cuda_device_without_cuda_says_so():
    torch = pytest.importorskip("torch")
    from oval_edge.jetson.modules import get_module

    if torch.cuda.is_available():
        spec = get_module("cuda")
        assert spec.kind == "cuda" and spec.dram_bytes > 0 and spec.arch.startswith("sm_")
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            get_module("cuda")


def test_written_config_is_what_serve_reads(tmp_path, capsys):
    """runtime/server/options.engine_spec (serve --config) takes the planner's file as it is."""
    import argparse

    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    toml_path = tmp_path / "serve.toml"
    rc, _, _ = plan(capsys, "--device", "orin-nx-16gb", "--context", "4096", "--batch", "2",
                    "--write-config", str(toml_path))
    assert rc == 0
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    spec = engine_spec(parser.parse_args(["--config", str(toml_path)]))
    sections = load_config_file(str(toml_path))
    assert (spec.model, spec.quant, spec.device) == ("default", "gguf", "cuda")  # auto: the GGUF's own blocks
    assert spec.oval.memory_budget == sections["server"]["memory_budget"]
    assert (spec.max_batch, spec.max_context, spec.prefill_chunk) == (2, 4096, DEFAULT_PREFILL_CHUNK)
    assert spec.oval.page_size == sections["oval"]["page_size"]


def test_int8_records_are_planned_and_written_for_serve(capsys, tmp_path):
    """--record int8 with --kv-dtype int8: smaller records, more pages in the same budget, and serve gets both."""
    pages = {}
    for kv, record in (("bfloat16", "float"), ("int8", "float"), ("int8", "int8")):
        toml_path, json_path = tmp_path / f"{kv}-{record}.toml", tmp_path / f"{kv}-{record}.json"
        rc, out, _ = plan(capsys, "--device", "cpu", "--memory-budget", "1GiB", "--page-size", "32", "--kv-dtype", kv,
                          "--record", record, "--write-config", str(toml_path), "--json", str(json_path))
        assert rc == 0, out
        pages[kv, record] = json.loads(json_path.read_text())["devices"][0]["recommended"]["pages"]
        written = oval_config(load_config_file(str(toml_path)))
        assert (written.kv_dtype, written.record) == (kv, record)
    assert pages["int8", "int8"] > pages["int8", "float"] > 1.6 * pages["bfloat16", "float"]
    assert pages["int8", "int8"] > 1.8 * pages["bfloat16", "float"]
    with pytest.raises(SystemExit):
        main(["plan", "--device", "cpu", "--record", "int2"])
    assert "int2" in capsys.readouterr().err
