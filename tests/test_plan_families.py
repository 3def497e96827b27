"""plan for each model family and the real configs Jetson users run (issue 21): shapes, norms, sliding layers as
rings beside the pool, the Llama-3.1-8B bar on an Orin Nano 8GB, and the weight formula against the loader on tiny
random checkpoints of each family. tests/fixtures/configs/README.md says where each config came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oval_edge.config import OvalConfig
from oval_edge.tools.plan.memory import geometry_for
from oval_edge.tools.plan.model import read_model_shape
from oval_edge.tools.plan.weights import weight_bytes
from test_plan import StateDictWeights, plan


CONFIGS = Path(__file__).parent / "fixtures" / "configs"
# name -> (architecture, layers, hidden, heads, kv heads, head dim, vocab, tied, sliding layers, published params)
REAL = {
    "Llama-3.2-3B-Instruct": ("llama", 28, 3072, 24, 8, 128, 128256, True, 0, 3.21e9),
    "Qwen3-4B": ("qwen3", 36, 2560, 32, 8, 128, 151936, True, 0, 4.02e9),
    # 4.3B with the SigLIP tower (~0.42B) and projector; plan counts the text decoder only
    "gemma-3-4b-it": ("gemma3_text", 34, 2560, 8, 4, 256, 262208, True, 29, 3.88e9),
    "Phi-4-mini-instruct": ("phi3", 32, 3072, 24, 8, 128, 200064, True, 0, 3.84e9),
    "Llama-3.1-8B-Instruct": ("llama", 32, 4096, 32, 8, 128, 128256, False, 0, 8.03e9),
    "Llama-3.2-1B-Instruct": ("llama", 16, 2048, 32, 8, 64, 128256, True, 0, 1.24e9),
    "Qwen3-8B": ("qwen3", 36, 4096, 32, 8, 128, 151936, False, 0, 8.19e9),
    # the card's exact count, 1,170,340,608; plan leaves out the 6 attention layers' q/k norms (768 weights)
    "LFM2-1.2B": ("lfm2", 16, 2048, 32, 8, 64, 65536, True, 0, 1.170340608e9),
}
# Qwen3.5's cards ("Model Overview", language model): hidden, layers (3 Gated DeltaNet to 1 gated attention), DeltaNet
# heads for V / for QK (dim 128), attention heads Q / KV (dim 256), RoPE dim, FFN, and the parameters they state
# (rounded, vision tower not counted: 0.8B, 2B, 4B)
QWEN3_5_CARDS = {
    "Qwen3.5-0.8B": (1024, 24, 16, 16, 8, 2, 64, 3584, 0.8),
    "Qwen3.5-2B": (2048, 24, 16, 16, 8, 2, 64, 6144, 2),
    "Qwen3.5-4B": (2560, 32, 32, 16, 16, 4, 64, 9216, 4),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_read_as_their_published_shapes(name):
    arch, layers, hidden, heads, kv, head_dim, vocab, tied, sliding, params = REAL[name]
    shape = read_model_shape(str(CONFIGS / name))
    assert (shape.architecture, shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == \
        (arch, layers, hidden, heads, kv, head_dim)
    assert (shape.vocab, shape.tied_embeddings, shape.sliding_layers) == (vocab, tied, sliding)
    assert abs(shape.parameters - params) < 0.01 * params, shape.parameters  # the model cards' counts


@pytest.mark.parametrize("name", sorted(QWEN3_5_CARDS))
def test_qwen3_5_configs_read_as_their_model_cards(name):
    hidden, layers, v_heads, qk_heads, heads, kv, rope, ffn, stated = QWEN3_5_CARDS[name]
    shape = read_model_shape(str(CONFIGS / name))
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.rotary_dim,
            shape.intermediate) == (hidden, layers, heads, kv, 256, rope, ffn)
    # layers 3, 7, 11, ... are the gated attention layers; the others keep a DeltaNet state
    assert [i for i, k in enumerate(shape.kinds) if k == "full"] == list(range(3, layers, 4))
    assert {(s.heads, s.key_dim, s.value_dim, s.conv_channels) for s in shape.states.layers} == {
        (v_heads, 128, 128, 2 * qk_heads * 128 + v_heads * 128)}
    assert shape.attn_output_gate and shape.tied_embeddings and shape.vocab == 248320
    assert round(shape.parameters / 1e9, 1 if stated < 1 else 0) == stated, shape.parameters  # untied: 1.0 / 4.8


def test_family_features_gemma3_text_part_qwen3_norms_phi3_rotary():
    gemma = read_model_shape(str(CONFIGS / "gemma-3-4b-it"))
    # 5 of every 6 layers sliding: layers 5, 11, 17, 23, 29 are full
    assert [i for i, k in enumerate(gemma.kinds) if k == "full"] == [5, 11, 17, 23, 29]
    assert (gemma.sliding_window, gemma.norms_per_layer, gemma.qk_norm, gemma.max_context) == (1024, 4, True, 131072)
    assert any("vision_config ignored" in n for n in gemma.notes) and "text only" in gemma.describe()
    qwen3 = read_model_shape(str(CONFIGS / "Qwen3-4B"))
    assert qwen3.qk_norm and qwen3.norms_per_layer == 2 and qwen3.sliding_layers == 0
    phi = read_model_shape(str(CONFIGS / "Phi-4-mini-instruct"))
    # Phi-4-mini's sliding_window 262144 never binds at 131072 positions: every layer full
    assert phi.rotary_dim == 96 and phi.sliding_layers == 0 and phi.norms_per_layer == 2
    g_nf4, q_nf4 = weight_bytes(gemma, "nf4", "cuda"), weight_bytes(qwen3, "nf4", "cuda")
    assert g_nf4.norms == ((4 * 34 + 1) * 2560 + 2 * 34 * 256) * 2  # fp16 on CUDA
    assert q_nf4.norms == ((2 * 36 + 1) * 2560 + 2 * 36 * 128) * 2


def test_family_defaults_are_transformers_defaults():
    """families.CONFIG_DEFAULTS fills what Gemma's published configs leave out: the values must be the config
    classes' own."""
    transformers = pytest.importorskip("transformers")
    from oval_edge.tools.plan.families import CONFIG_DEFAULTS

    classes = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}
    for arch, defaults in CONFIG_DEFAULTS.items():
        config = classes[arch]()
        for key, value in defaults.items():
            if key == "sliding_window_pattern":  # newer transformers keep it as layer_types only
                types = config.layer_types
                assert [i for i, t in enumerate(types) if t == "full_attention"][:2] == [value - 1, 2 * value - 1]
                continue
            assert getattr(config, key) == value, (arch, key)
    gemma2 = transformers.Gemma2Config(num_hidden_layers=4)
    from oval_edge.tools.plan.families import layer_kinds

    want = tuple("sliding" if t == "sliding_attention" else "full" for t in gemma2.layer_types)
    assert layer_kinds("gemma2", 4, 4096, {}, 8192) == want == ("sliding", "full", "sliding", "full")


def test_sliding_rings_come_out_of_the_budget_before_the_full_pages(capsys, tmp_path):
    """Gemma-3-4B: the pool's pages hold the 5 full layers only; each of the 29 sliding layers keeps a ring of
    ceil((1024 - 1) / P) + 1 pages of K/V per sequence, allocated for the batch and subtracted first."""
    from oval_edge.geometry import KVGeometry

    def ring_pages(window: int, page: int) -> int:
        return KVGeometry(2, 1, 8, page, ring_layers=(0,), window=window).ring_pages

    def sliding_ring_bytes(shape, page: int, batch: int, _dtype_bytes: int) -> int:
        return batch * geometry_for(shape, OvalConfig(page_size=page), "cuda").ring_bytes_per_sequence

    assert [ring_pages(1024, p) for p in (16, 32, 64, 128)] == [65, 33, 17, 9]
    assert ring_pages(4096, 4096) == 2 and ring_pages(1, 16) == 1  # a window of 1 is the current page only
    shape = read_model_shape(str(CONFIGS / "gemma-3-4b-it"))
    assert sliding_ring_bytes(shape, 128, 2, 2) == 2 * 9 * 128 * 2 * 29 * 4 * 256 * 2
    out_json = tmp_path / "plan.json"
    plan(capsys, "--device", "orin-nano-8gb", "--model", str(CONFIGS / "gemma-3-4b-it"), "--batch", "2",
         "--context", "8192", "--json", str(out_json))
    dev = json.loads(out_json.read_text())["devices"][0]
    geo = geometry_for(shape, OvalConfig(page_size=16), "cuda")
    assert geo.paged_layers == 5 and len(geo.ring_layers) == 29
    for row in dev["page_sizes"]:
        rings = sliding_ring_bytes(shape, row["page_size"], 2, 2)
        assert row["ring_bytes"] == rings
        left = dev["budget_bytes"] - rings - dev["weight_bytes"] - row["workspace_bytes"] - dev["runtime_overhead_bytes"]
        assert row["pages"] == left // row["bytes_per_page"]


def test_llama31_8b_nf4_on_an_orin_nano_8gb_needs_the_int8_head_for_8192_tokens(capsys, tmp_path):
    """Issue 21's bar (<= 4.7 GiB of resident weights, >= 8192 tokens held) holds only with the int8 head, which CUDA
    runs through its Triton kernel; a JetPack torch has no Triton, so plan counts a 16-bit head there and says
    what the module holds instead."""
    from oval_edge.tools.plan.weights import weight_bytes

    shape = read_model_shape(str(CONFIGS / "Llama-3.1-8B-Instruct"))
    assert weight_bytes(shape, "nf4", "cuda", int8_head_kernel=True).total <= 4.7 * 2**30
    out_json = tmp_path / "plan.json"
    rc, out, _ = plan(capsys, "--device", "orin-nano-8gb", "--model", str(CONFIGS / "Llama-3.1-8B-Instruct"),
                      "--quant", "nf4", "--context", "8192", "--json", str(out_json))
    dev = json.loads(out_json.read_text())["devices"][0]
    assert dev["weight_bytes"] == weight_bytes(shape, "nf4", "cuda").total > 4.7 * 2**30
    assert rc == 1 and not dev["fits"] and 4096 < dev["longest_context"] < 8192, dev["longest_context"]
    assert dev["what_fits"].startswith(f"orin-nano-8gb: Llama-3.1-8B-Instruct up to {dev['longest_context']:,} tokens")


TINY = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            vocab_size=1000, max_position_embeddings=256)  # vocab 1000: the CPU table pads it to 1024 rows


def _tiny_config(family: str):
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=64, tie_word_embeddings=False)
    if family == "smollm3":
        return transformers.SmolLM3Config(**TINY, tie_word_embeddings=True, pad_token_id=None, bos_token_id=1,
                                          eos_token_id=2)
    if family == "phi3":
        return transformers.Phi3Config(**TINY, partial_rotary_factor=0.75, tie_word_embeddings=False,
                                       pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if family == "gemma2":
        return transformers.Gemma2Config(**TINY, head_dim=64, sliding_window=64)
    return transformers.Gemma3TextConfig(**TINY, head_dim=64, sliding_window=64, sliding_window_pattern=3)


@pytest.mark.parametrize("quant", ["nf4", "none"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3"])
def test_planned_weight_bytes_match_the_loader_for_each_family(tmp_path, family, quant):
    """A tiny random checkpoint of each family (transformers' own config class), built by the loader's own path
    (runtime/model/decoder_build.build_decoder) on this CPU: the planner's bytes for its config.json are within 3%
    of what the decoder holds (runtime quantize.weight_bytes, the figure load_model reports). Families whose
    decoder this branch's loader refuses are skipped with its message."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bitsandbytes.functional import has_avx512bf16

    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.runtime.model.decoder_build import build_decoder
    from oval_edge.runtime.model.quantize import weight_bytes as runtime_weight_bytes

    config = _tiny_config(family)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    shape = read_model_shape(str(tmp_path))  # the planner reads the file, as `oval-edge plan --model DIR` does
    try:
        decoder_config = DecoderConfig.from_dict(config.to_dict(), str(tmp_path))
    except ValueError as exc:
        pytest.skip(f"this branch's loader refuses {family}: {exc}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = {n: t for n, t in model.state_dict().items()
             if not (config.tie_word_embeddings and n == "lm_head.weight")}
    dtype = torch.float32 if quant == "none" else torch.bfloat16
    decoder = build_decoder(StateDictWeights(state), decoder_config, quant, torch.device("cpu"), torch.float32, dtype)
    flags = frozenset({"avx512_bf16"}) if has_avx512bf16() else frozenset()
    planned = weight_bytes(shape, quant, "cpu", flags).total
    held = runtime_weight_bytes(decoder)
    assert abs(planned - held) <= 0.03 * held, (family, quant, planned, held, (planned - held) / held)


@pytest.mark.slow
def test_qwen3_gguf_metadata_plans_its_q_k_norms_and_the_loaders_bytes(tmp_path):
    """A tiny Qwen3 written as GGUF under llama.cpp's names (tests/gguf_checkpoint.py): plan finds attn_q_norm in the
    tensor list and its bytes match what load_model holds from that file."""
    pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bitsandbytes.functional import has_avx512bf16
    from gguf_checkpoint import write_gguf

    from oval_edge.runtime.model.loader import load_model

    config = transformers.Qwen3Config(**dict(TINY, vocab_size=49152), head_dim=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = write_gguf(model, str(tmp_path / "tiny-qwen3.gguf"), "qwen3")  # the bundled tokenizer: vocab 49152
    shape = read_model_shape(path)
    assert (shape.architecture, shape.qk_norm, shape.norms_per_layer, shape.tied_embeddings) == ("qwen3", True, 2,
                                                                                                  False)
    loaded = load_model(path, "nf4", "cpu")
    flags = frozenset({"avx512_bf16"}) if has_avx512bf16() else frozenset()
    planned = weight_bytes(shape, "nf4", "cpu", flags).total
    assert abs(planned - loaded.weight_bytes) <= 0.03 * loaded.weight_bytes, (planned, loaded.weight_bytes)
