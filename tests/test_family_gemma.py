"""Gemma 3 (text) and Gemma 2: sliding-window layers on rings, (1 + w) sandwich norms, a scaled embedding, GeGLU, per-head q/k
norms, query_pre_attn_scalar, and a second rotary base for the sliding layers — against transformers.

A tiny random Gemma3TextConfig (window 64, a full layer every 3rd) saved as safetensors and written as GGUF under
llama.cpp's names; the runtime's logits must equal transformers' within 1e-4 (fp32, quant none) at prefill and over
64 greedy decode steps that run well past the window (the rings wrap), with OVAL at a budget covering the context
and with dense attention. With a small budget the sliding layers still read exactly their window (counted).
Gemma 2 adds soft-capped attention and final logits (tested with caps small enough to bite).
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime.model.config import DecoderConfig

from test_decoder_loading import save_folder
from test_families import (PROMPT, STEPS, _hf_all_logits, decode_greedy, engine_for,
                           follow_ups_decode_as_full_prefills)

WINDOW = 64


def gemma3_config(layers: int = 4, pattern: int = 3, scalar: int = 24, **extra):
    import transformers

    return transformers.Gemma3TextConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=layers, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6,
        sliding_window=WINDOW, sliding_window_pattern=pattern, query_pre_attn_scalar=scalar, pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        attn_implementation="eager", **extra)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = gemma3_config()
    folder = save_folder(tmp_path_factory.mktemp("gemma3"), config)
    _perturb_norms(folder)
    return config, folder


def _perturb_norms(folder: str) -> None:
    """transformers initializes Gemma's norm weights to 0 ((1 + 0) = 1): give them values, so a forgotten offset or
    a norm applied in the wrong place shows in the logits."""
    from safetensors.torch import load_file, save_file

    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (torch.randn(tensor.shape, generator=gen) * 0.3).to(tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_config_reads_gemma3_layer_kinds_and_rope_bases(gemma3):
    config, _ = gemma3
    ours = DecoderConfig.from_dict(config.to_dict(), "tiny")
    assert ours.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert ours.sliding_window == WINDOW and ours.qk_norm and ours.sandwich_norms and ours.norm_offset == 1.0
    assert ours.rope_theta == 1e6 and ours.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ours.local_rope_theta == 1e4 and ours.scaling == 24 ** -0.5 and ours.embedding_scale == 128 ** 0.5
    multimodal = DecoderConfig.from_dict({"model_type": "gemma3", "text_config": config.to_dict()}, "tiny")
    assert multimodal.layer_types == ours.layer_types


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_logits_equal_transformers_past_the_window(gemma3, attention):
    _, folder = gemma3
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")  # budget 336 >= 80 + 64: OVAL is exact
    engine = engine_for(folder, wide, attention)
    pool = engine.pool
    assert pool.rings is not None and pool.k.shape[0] == 1  # one full layer keeps pages; three live in rings
    assert pool.geometry.ring_pages == 5  # ceil(63 / 16) + 1
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    full = _hf_all_logits(folder, PROMPT + tokens)
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4
    pool.check_invariants()
    assert pool.rings.num_free == pool.rings.sequences


def test_prefill_in_chunks_longer_than_the_ring_equals_one_forward(gemma3):
    """A 150-token prompt in chunks of 96 (longer than the 80-slot ring): the second chunk's first queries read the
    window from the ring before the chunk overwrites it."""
    _, folder = gemma3
    engine = engine_for(folder, OvalConfig(page_size=16, top_k=16, kv_dtype="float32"))
    pool, prompt = engine.pool, list(range(200, 350))
    assert pool.allocate("c", len(prompt) + 1) is not None
    for start, stop in ((0, 96), (96, 150)):
        step = pool.prepare(["c"], [stop - start])
        logits, _ = engine.runner.forward(step, torch.tensor(prompt[start:stop]), decode=False)
        pool.commit(step)
    pool.free("c")
    assert (logits[0] - _hf_all_logits(folder, prompt)[-1]).abs().max().item() < 1e-4


def test_small_budget_sliding_layers_read_their_window(gemma3):
    _, folder = gemma3
    small = OvalConfig(page_size=16, top_k=1, window_min=16, window_max=16, dense_layers=0, kv_dtype="float32")
    read: list[int] = []
    engine = engine_for(folder, small)
    decode_greedy(engine, PROMPT, 16, read)
    # the last step (context 96), per KV head: the 3 sliding layers read exactly their 64-token window out of the
    # ring (5 pages x 16 slots), the full layer sink + 1 page + window = 48; the static step's kernels read the
    # valid slots in place (the torch ops gather the whole ring: 5 x 16)
    ring = 64 if engine.static.step_for(1).ops.attends_in_place() else 5 * 16
    assert read[-1] == 2 * (3 * ring + 48), read[-1]


def test_static_step_equals_the_eager_forward_for_concurrent_rows(gemma3):
    """The static decode step (the server's default) computes what the eager forward does with rings, for three
    concurrent requests (three rings) decoding past the window, each also equal to transformers' greedy tokens."""
    from oval_edge.runtime import Engine, EngineConfig
    from oval_edge.runtime.engine.sampling import SamplingParams

    _, folder = gemma3
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")
    prompts = [PROMPT, list(range(300, 340)), list(range(500, 610, 2))]
    outputs = []
    for kind in ("static", "eager"):
        engine = Engine.load(folder, quant="none", device="cpu", oval=wide,
                             config=EngineConfig(num_pages=64, decode_step=kind, oval_from=0))
        requests = [engine.submit(p, SamplingParams(max_tokens=48, ignore_eos=True)) for p in prompts]
        while not all(r.finished for r in requests):
            engine.step()
        outputs.append([r.output_ids for r in requests])
        engine.pool.check_invariants()
    assert outputs[0] == outputs[1]
    for prompt, tokens in zip(prompts, outputs[0]):
        assert tokens == _hf_all_logits(folder, prompt + tokens)[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_gemma3_prefix_cache_with_ring_snapshots(gemma3):
    """state_snapshots > 0 turns prefix caching on for Gemma 3 (copies of its rings at page boundaries): follow-up
    prompts map the cached pages and decode as full prefills (test_families.follow_ups_decode_as_full_prefills)."""
    from oval_edge.runtime import Engine, EngineConfig

    _, folder = gemma3

    def make(prefix_cache: bool = True, **settings):
        return Engine.load(folder, quant="none", device="cpu", oval=OvalConfig(page_size=16, top_k=16,
                                                                               kv_dtype="float32"),
                           config=EngineConfig(oval_from=0, max_batch=2, state_snapshots=2, prefix_cache=prefix_cache,
                                           **settings))

    follow_ups_decode_as_full_prefills(make, PROMPT)


def test_gemma3_gguf_under_llama_cpp_names_loads_to_the_same_logits(tmp_path):
    """llama.cpp's converter stores each Gemma norm as 1 + w and names the four norms attn_norm, post_attention_norm,
    ffn_norm (before the MLP) and post_ffw_norm; the loader reads them without a second offset. What the header does
    not carry is what llama.cpp fixes: a full layer every 6th, base 10000 for the sliding layers, head_dim ** -0.5."""
    import transformers

    from gguf_checkpoint import write_gguf

    folder = save_folder(tmp_path / "src", gemma3_config(layers=6, pattern=6, scalar=32))
    _perturb_norms(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(model, str(tmp_path / "tiny-gemma3.gguf"), "gemma3")
    engine = engine_for(path, OvalConfig(page_size=16, top_k=16, kv_dtype="float32"))
    tokens, ours = decode_greedy(engine, PROMPT, 8)
    full = _hf_all_logits(folder, PROMPT + tokens)
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4


def test_4bit_path_runs_gemma3(gemma3):
    """nf4: the sandwich norms, q/k norms and rings on the fused 4-bit layers; prefill logits close to fp32's."""
    _, folder = gemma3
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")
    _, ours = decode_greedy(engine_for(folder, wide, quant="nf4"), PROMPT, 70)
    _, exact = decode_greedy(engine_for(folder, wide), PROMPT, 0)
    assert torch.isfinite(ours).all()
    assert torch.nn.functional.cosine_similarity(ours[0], exact[0], dim=0) > 0.9


def gemma2_config(**extra):
    import transformers

    # soft-caps far below Gemma 2's 50 / 30, so that a tiny random model's logits are really capped
    return transformers.Gemma2Config(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=4, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6,
        sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", **extra)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    folder = save_folder(tmp_path_factory.mktemp("gemma2"), gemma2_config())
    _perturb_norms(folder)
    return folder


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_gemma2_soft_capped_logits_equal_transformers_past_the_window(gemma2, attention):
    """Gemma 2: every other layer sliding, attention logits capped at 0.5 * tanh(x / 0.5), final logits capped."""
    engine = engine_for(gemma2, OvalConfig(page_size=16, top_k=16, kv_dtype="float32"), attention)
    assert engine.runner.softcap == 0.5 and engine.pool.k.shape[0] == 2  # layers 1 and 3 keep pages
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    full = _hf_all_logits(gemma2, PROMPT + tokens)
    assert ours.abs().max().item() <= 2.0  # the final cap
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4


def test_gemma2_static_step_and_gguf_match(gemma2, tmp_path):
    """The static step (soft-capped attention through the step's own op) and a llama.cpp-named GGUF (soft-caps read
    from its header) give transformers' greedy tokens."""
    import transformers

    from gguf_checkpoint import write_gguf
    from oval_edge.runtime import Engine, EngineConfig
    from oval_edge.runtime.engine.sampling import SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.float32).eval()
    path = write_gguf(model, str(tmp_path / "tiny-gemma2.gguf"), "gemma2")
    wide = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")
    for source in (gemma2, path):
        engine = Engine.load(source, quant="none", device="cpu", oval=wide, config=EngineConfig(num_pages=64))
        request = engine.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
        want = _hf_all_logits(gemma2, PROMPT + request.output_ids)[len(PROMPT) - 1 : -1].argmax(-1).tolist()
        assert request.output_ids == want, source


def test_static_step_with_rings_has_no_host_sync(gemma3, monkeypatch):
    """The rings keep the static decode step free of host reads and device copies, with the same ops and shapes at
    two lengths (the ring slots and their validity are computed on the device from the lengths)."""
    from oval_edge.runtime import Engine, EngineConfig
    from test_static_step import MAX_LEN, prefill, traced_step

    _, folder = gemma3
    oval = OvalConfig(page_size=16, top_k=4, window_min=32, window_max=32, dense_layers=0, kv_dtype="float32")
    engine = Engine.load(folder, quant="none", device="cpu", oval=oval,
                         config=EngineConfig(num_pages=200, max_batch=2, max_model_len=MAX_LEN, oval_from=0))
    prefill(engine, "a", 150, seed=1)
    traces = [traced_step(engine, ["a"], [7], monkeypatch), traced_step(engine, ["a"], [8], monkeypatch)]
    assert traces[0].count > 0 and traces[0].calls == traces[1].calls
    assert all(t.host_reads == [] and t.device_copies == [] for t in traces)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_compiled_step_traces_rings_and_softcaps_whole(gemma3, gemma2, family):
    """torch.compile(fullgraph=True) traces the static step with rings (and Gemma 2's capped attention op) without a
    graph break, and recompiles not once over 60 steps that wrap the rings; logits equal the eager step's."""
    from oval_edge.runtime import Engine, EngineConfig
    from oval_edge.runtime.engine.forward.static_step import StaticDecoder
    from test_static_step import MAX_LEN, prefill, static_step

    folder = gemma3[1] if family == "gemma3" else gemma2
    oval = OvalConfig(page_size=16, top_k=4, window_min=32, window_max=32, dense_layers=0, kv_dtype="float32")
    settings = EngineConfig(num_pages=200, max_batch=1, max_model_len=MAX_LEN, oval_from=0)
    engines = [Engine.load(folder, quant="none", device="cpu", oval=oval, config=settings) for _ in range(2)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engines[1].static = StaticDecoder(engines[1].runner, 1, engines[1].token_limit(), compile_backend="aot_eager")
    for engine in engines:
        prefill(engine, "r", 100)
    token = 5
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(60):
            want, _ = static_step(engines[0], ["r"], [token])
            got, _ = static_step(engines[1], ["r"], [token])
            assert (got - want).abs().max().item() < 1e-4
            token = int(want[0].argmax())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_mistral_window_on_every_layer_sizes_by_rings_and_equals_transformers(tmp_path):
    """Mistral v0.1's window binds on every layer: no page holds bytes, the rings are the whole KV cache, and the
    pool is sized by sequences (max_batch at full length) instead of by the budget; 64 steps past the window give
    transformers' logits."""
    import transformers

    from oval_edge.runtime import Engine, EngineConfig

    config = transformers.MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=49152,
                                        max_position_embeddings=4096, sliding_window=48, attn_implementation="eager")
    folder = save_folder(tmp_path / "mistral", config)
    engine = Engine.load(folder, quant="none", device="cpu", oval=OvalConfig(page_size=16, kv_dtype="float32"),
                         config=EngineConfig(max_batch=2, max_model_len=512))
    pool = engine.pool
    assert pool.k.numel() == 0 and pool.num_pages == 2 * 512 // 16 and pool.rings.sequences == 2
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    full = _hf_all_logits(folder, PROMPT + tokens)
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4
