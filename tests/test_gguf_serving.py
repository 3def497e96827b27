"""Serving a GGUF's own blocks (quant gguf, the default for a GGUF) from real files: a K-quant file made by llama.cpp's
quantizer (tests/fixtures/gguf, Q4_K + Q6_K) and tiny Llamas whose projections the gguf package writes as Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0, each against the gguf package's own dequantization of the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, dequantize

from oval_edge.config import OvalConfig
from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.decoder_build import _grouped_part
from oval_edge.runtime.model.grouped.gguf_blocks import EXACT_TYPES, is_stored_projection
from oval_edge.runtime.model.grouped.layout import dequantize as grouped_dequantize
from oval_edge.runtime.model.grouped.linear import GroupedLinear, StackedLinear, grouped_projection
from oval_edge.runtime.model.weight_stream import GGUFWeights
from test_gguf_blocks import op_reference

KQUANT = Path(__file__).parent / "fixtures" / "gguf" / "tiny-llama-Q4_K_M.gguf"


def test_the_k_quant_fixture_holds_both_k_quant_types():
    types = {t.tensor_type.name for t in GGUFReader(str(KQUANT)).tensors if is_stored_projection(t)}
    assert types == {"Q4_K", "Q6_K"}


def test_k_quant_blocks_read_as_the_gguf_package_dequantizes_them():
    weights = GGUFWeights(str(KQUANT), "llama", 4, 2)
    for name in weights.names():
        if not name.startswith("model.layers.") or "norm" in name:
            continue
        codes, scales, mins, bits, origin = _grouped_part(weights, name)
        want = weights.read(name, torch.float32)  # gguf's dequantize (q/k rows back in rotate_half order)
        got = grouped_dequantize(codes, scales, mins, bits)
        scale = scales.float().abs().repeat_interleave(want.shape[1] // scales.shape[1], 1)
        # the K-quant's sub-block scale d * sc rounded to fp16: at most 2^-11 of it per code step (codes < 64)
        assert bool(((got - want).abs() <= scale * 64 * 2 ** -11 + 1e-7).all()), name
        assert origin in ("Q4_K", "Q6_K")


def test_a_fused_projection_mixing_q4_k_and_q6_k_multiplies_as_its_parts():
    """Layer 1 stores q and k as Q4_K and v as Q6_K: one fused q/k/v of two layouts (a StackedLinear)."""
    weights = GGUFWeights(str(KQUANT), "llama", 4, 2)
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    module = grouped_projection([_grouped_part(weights, n) for n in names], None, torch.device("cpu"))
    assert isinstance(module, StackedLinear) and [p.origin for p in module.parts] == ["Q4_K", "Q6_K"]
    reference = torch.cat([weights.read(n, torch.float32) for n in names])
    for rows in (1, 3, 20):  # the GEMV and the prefill path
        x = torch.randn(rows, 256)
        want, tolerance = op_reference(x, reference)
        tolerance = max(tolerance, 2e-3)  # and the fp16 rounding of the K-quant scales
        torch.testing.assert_close(module(x), want, rtol=tolerance, atol=tolerance)


def tiny_llama_gguf(tmp_path: Path, projection_type: str) -> str:
    import transformers

    from gguf_checkpoint import write_gguf

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=49152,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return write_gguf(model, str(tmp_path / f"tiny-{projection_type}.gguf"), "llama", projection_type)


@pytest.mark.parametrize("projection_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_a_gguf_written_by_the_gguf_package_is_read_bit_for_bit(tmp_path, projection_type):
    """Every projection of the file, held as grouped codes, dequantizes to exactly the gguf package's values (q/k
    rows in rotate_half order on both sides)."""
    weights = GGUFWeights(tiny_llama_gguf(tmp_path, projection_type), "llama", 4, 2)
    projections = [n for n in weights.names() if n.startswith("model.layers.") and "norm" not in n]
    assert len(projections) == 14
    for name in projections:
        codes, scales, mins, bits, origin = _grouped_part(weights, name)
        assert origin == projection_type and projection_type in EXACT_TYPES
        assert torch.equal(grouped_dequantize(codes, scales, mins, bits), weights.read(name, torch.float32)), name


def test_serving_a_gguf_defaults_to_its_own_blocks_and_decodes_like_its_exact_weights(tmp_path):
    """quant auto on a GGUF (Q4_1, the bundled file's type) holds each projection as stored, and teacher-forced
    logits (prefill, then decode steps through the GEMV) match the exact-weights load (quant none) up to the
    GEMV's input rounding."""
    path = tiny_llama_gguf(tmp_path, "Q4_1")
    oval = OvalConfig(page_size=16, top_k=4, kv_dtype="float32")
    engines = [Engine.load(path, quant=q, device="cpu", oval=oval, config=EngineConfig(num_pages=32))
               for q in ("auto", "none")]
    served = engines[0].loaded
    assert served.quant == "gguf" and "Q4_1 served as stored (exact)" in served.precision_note
    module = served.model.model.layers[0].mlp.down_proj
    assert isinstance(module, GroupedLinear) and module.origin == "Q4_1"
    raw = {t.name: t for t in GGUFReader(path).tensors}["blk.0.ffn_down.weight"]
    want = torch.from_numpy(np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32))
    assert torch.equal(module.dequantized(), want)
    tokens = list(range(100, 100 + 3 * 40, 3))
    logits = []
    for engine in engines:
        pool = engine.pool
        assert pool.allocate("r", len(tokens) + 1) is not None
        step = pool.prepare(["r"], [24])
        rows, _ = engine.runner.forward(step, torch.tensor(tokens[:24]), decode=False)
        pool.commit(step)
        out = [rows[0]]
        for token in tokens[24:]:  # decode steps: the GEMV path
            step = pool.prepare(["r"], [1])
            row, _ = engine.runner.forward(step, torch.tensor([token]), decode=True)
            pool.commit(step)
            out.append(row[0])
        logits.append(torch.stack(out))
    rounds = cpu_kernels() is not None and cpu_kernels().grouped_rounds_inputs
    tolerance = 5e-2 if rounds else 1e-3  # bf16 inputs (and bf16 prefill matmuls): ~2^-9 of each activation
    assert (logits[0] - logits[1]).abs().max().item() < tolerance
