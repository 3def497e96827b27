"""Gemma 4 text (#55): two head sizes in one pool and step, K/V shared across layers, per-layer inputs.

A tiny random checkpoint built with transformers' own Gemma4TextConfig: sliding layers of head dim 32 (rings), full
layers of 64 (pages, OVAL), the last three layers reading the K/V of layers 2 (full) and 4 (sliding), per-layer inputs,
double-wide MLPs on the shared layers, random norms and layer scalars. The runtime's logits against transformers' (fp32,
quant none) at prefill and over 64 greedy steps; the shared layers keep no K/V (their views are their sources'); the
static step's shapes and host reads.
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.config import DecoderConfig, rotary_inv_freq

from test_decoder_loading import save_folder
from test_families import (PROMPT, STEPS, _hf_all_logits, chunks_and_a_batch_equal_one_pass, decode_greedy,
                           follow_ups_decode_as_full_prefills, run_checked)
from test_static_step import compiled_step_matches_eager, traced_step

TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention"]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=8, vocab_size=49152, vocab_size_per_layer_input=49152, max_position_embeddings=4096,
             head_dim=32, global_head_dim=64, layer_types=TYPES, sliding_window=24, num_kv_shared_layers=3,
             hidden_size_per_layer_input=64, use_double_wide_mlp=True, final_logit_softcapping=30.0, pad_token_id=0)
WIDE = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")  # budget 336 >= 80 + 64 tokens: OVAL is exact


def gemma4_config(**changes):
    import transformers

    return transformers.Gemma4TextConfig(**(SHAPE | changes))


def perturbed_folder(path, config) -> str:
    """A tiny checkpoint whose norms and layer scalars are random too (transformers initialises them to 1: a missed
    scale or a 1 + w read wrongly would hide there)."""
    import transformers

    folder = save_folder(path, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(1, generator=generator))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return perturbed_folder(tmp_path_factory.mktemp("gemma4"), gemma4_config())


def engine_for(folder: str, oval: OvalConfig = WIDE, quant: str = "none", **settings) -> Engine:
    config = dict(num_pages=64, oval_from=0, max_batch=4) | settings
    return Engine.load(folder, quant=quant, device="cpu", oval=oval, config=EngineConfig(**config))


def test_config_reads_both_head_sizes_the_sharing_and_proportional_rope():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    hf = gemma4_config()
    ours = DecoderConfig.from_dict(hf.to_dict(), "tiny")
    assert (ours.head_dim, ours.global_head_dim) == (32, 64)
    assert [ours.layer_head_dim(i) for i in range(8)] == [32, 32, 64, 32, 32, 64, 32, 64]
    # transformers' kv_sharing_modes: layers 5-7 reuse; 2 (full) and 4 (sliding) store
    assert [ours.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 4, 2, 4, 2]
    assert [ours.layer_intermediate(i) for i in range(8)] == [256] * 5 + [512] * 3
    assert ours.value_norm and ours.qk_norm and ours.norm_offset == 0.0 and ours.scaling == 1.0
    rotary = Gemma4TextRotaryEmbedding(hf)
    assert torch.equal(rotary_inv_freq(ours.full_rope()), rotary.full_attention_inv_freq)  # 8 turning, 24 zero
    assert torch.equal(rotary_inv_freq(ours.local_rope()), rotary.sliding_attention_inv_freq)


@pytest.mark.parametrize("flag, what", [("enable_moe_block", "mixture-of-experts"), ("attention_k_eq_v", "values")])
def test_the_26b_and_31b_variants_are_refused_with_what_runs(flag, what):
    config = gemma4_config().to_dict() | {flag: True}
    with pytest.raises(ValueError, match=f"{what}.*E2B and E4B are"):
        DecoderConfig.from_dict(config, "big")


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_logits_equal_transformers_at_prefill_and_over_greedy_decode(folder, attention):
    engine = engine_for(folder, attention=attention)
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    full = _hf_all_logits(folder, PROMPT + tokens)  # every position in one forward
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4
    engine.pool.check_invariants()


def test_oval_with_a_budget_over_the_context_equals_dense(folder):
    tokens, oval = decode_greedy(engine_for(folder), PROMPT, 24)
    dense_tokens, dense = decode_greedy(engine_for(folder, attention="dense"), PROMPT, 24)
    assert tokens == dense_tokens and (oval - dense).abs().max().item() < 1e-5


def test_shared_layers_keep_no_kv_and_read_their_sources(folder):
    """One paged layer (2) and four rings (0, 1, 3, 4) hold every K/V; layers 5 and 7 read layer 2's pages, layer 6
    layer 4's ring, through the same storage; the rings are 32 wide, the pages 64; storing K/V for a shared layer is
    refused."""
    pool = engine_for(folder).pool
    g = pool.geometry
    assert (g.paged_layers, g.ring_layers, g.shared) == (1, (0, 1, 3, 4), ((5, 2), (6, 4), (7, 2)))
    assert tuple(pool.k.shape[-1:]) == (64,) and tuple(pool.rings.k.shape[-1:]) == (32,)
    for layer, source in g.shared:
        assert pool.k_rows[layer].data_ptr() == pool.k_rows[source].data_ptr()
        assert pool.v_rows[layer].data_ptr() == pool.v_rows[source].data_ptr()
        assert pool.paged_index[layer] == pool.paged_index[source]
    assert pool.k.numel() == g.paged_layers * pool.k.shape[1] * 2 * 16 * 64
    assert pool.rings.nbytes() == pool.rings.sequences * g.ring_bytes_per_sequence
    assert pool.allocate("r", 20) is not None
    with pytest.raises(ValueError, match="layer 5 reads layer 2's K/V"):
        pool.write(5, pool.prepare(["r"], [1]), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))


def test_chunks_past_the_window_and_a_batch_equal_one_pass_and_each_alone(folder):
    """Prefill in chunks longer than the ring (each overwrites ring pages its first queries still need: the shared
    sliding layer reads its source's window as it was before the chunk) gives the logits of one pass; two sequences
    decoded in one batch give what each gives alone."""
    chunks_and_a_batch_equal_one_pass(lambda: engine_for(folder), PROMPT, 47)


def test_static_step_same_ops_at_every_length_and_no_host_sync(folder, monkeypatch):
    engine = engine_for(folder, num_pages=128)
    for sid, length in (("a", 40), ("b", 300)):
        assert engine.pool.allocate(sid, 1000) is not None
        step = engine.pool.prepare([sid], [length])
        engine.runner.forward(step, torch.tensor((PROMPT * 4)[:length]), decode=False)
        engine.pool.commit(step)
    traces = [traced_step(engine, ["a"], [7], monkeypatch), traced_step(engine, ["b"], [8], monkeypatch)]
    assert traces[0].count > 0 and traces[0].calls == traces[1].calls
    assert all(t.host_reads == [] and t.device_copies == [] for t in traces)


def test_compiled_step_traces_whole_and_matches_eager(folder):
    """torch.compile(fullgraph=True) of the step: one graph over 40 steps (two rotary tables of two widths, the
    shared layers' reads, the per-layer inputs), the eager step's numbers."""
    compiled_step_matches_eager(lambda **settings: engine_for(folder, **settings), PROMPT)


@pytest.fixture(scope="module")
def soft_folder(tmp_path_factory):
    """The tiny checkpoint with its q/k norm weights quartered. Gemma 4 attends with unscaled logits of RMS-normed
    heads: with random weights each query puts nearly all its weight on one key, and 4-bit rounding anywhere
    upstream moves which (transformers itself, on this model's weights rounded to int4 and back: cosine 0.70 to the
    fp32 logits). A trained model's norms keep attention softer; so does this one's."""
    import transformers

    folder = perturbed_folder(tmp_path_factory.mktemp("gemma4-soft"), gemma4_config())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(0.25)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("quant", ["int4", "nf4"])
def test_4bit_path_runs_gemma4(soft_folder, quant):
    """int4 (what a 16-bit folder is served with) and bitsandbytes nf4, the per-layer input table int8: the prefill
    logits point where the fp32 model's do (0.965 int4, 0.970 nf4 measured)."""
    folder = soft_folder
    _, exact = decode_greedy(engine_for(folder), PROMPT, 1)
    _, four = decode_greedy(engine_for(folder, quant=quant), PROMPT, 2)
    assert torch.isfinite(four).all()
    assert torch.nn.functional.cosine_similarity(four[0], exact[0], dim=0) > 0.9


def test_bytes_read_count_the_pages_and_the_rings_at_their_own_widths(folder):
    """A dense step at 81 tokens: the three full layers (2 and the two reading it) read 81 positions x 2 KV heads
    of 64-wide fp32 K and V rows; the five sliding layers (four rings, one reading layer 4's) the window's 24 of
    32-wide rows. The bytes say so, not the pages' width for all."""
    engine = engine_for(folder, attention="dense")
    assert engine.pool.allocate("r", 100) is not None
    step = engine.pool.prepare(["r"], [len(PROMPT)])
    engine.runner.forward(step, torch.tensor(PROMPT), decode=False)
    engine.pool.commit(step)
    _, stats, lengths = engine.static.decode(["r"], [7])
    assert lengths == [81]
    if engine.static.step_for(1).reads_valid_only:  # the C attention reads each row's valid slots only
        assert stats.kv_tokens_read == 3 * 81 * 2 + 5 * 24 * 2
        assert stats.kv_bytes == 2 * (3 * 81 * 2 * 64 * 4 + 5 * 24 * 2 * 32 * 4)
    else:  # the torch ops gather every slot of the padded tables and the whole rings
        g = engine.pool.geometry
        width = engine.static.step_for(1).width
        assert stats.kv_bytes == 2 * (3 * width * 16 * 2 * 64 * 4 + 5 * g.ring_pages * 16 * 2 * 32 * 4)


def test_startup_report_says_where_each_layers_kv_lives(folder):
    from oval_edge.runtime.server.options import engine_spec
    from oval_edge.runtime.server.serve import startup_report
    from test_server_kv_store import _parser

    engine = engine_for(folder, max_batch=2)
    report = startup_report(engine, engine_spec(_parser().parse_args([])), "http://127.0.0.1:1", False)
    (line,) = [ln for ln in report.splitlines() if ln.startswith("  layers    ")]
    assert line == ("  layers    8: 1 in pages (head dim 64), 4 sliding in rings of 24 tokens (head dim 32), 3 reading "
                    "an earlier layer's K/V, stored once (5->2, 6->4, 7->2)")


@pytest.mark.parametrize("projection_type", ["F32", "Q8_0"])
def test_gguf_as_llama_cpp_writes_it_serves_the_logits_of_transformers(tmp_path, projection_type):
    """A Gemma 4 GGUF under llama.cpp's names and header keys (tools/gguf_write/gemma4.py; read back by
    families/gemma4_gguf.py), loaded by the engine with quant none: prefill and 64 greedy steps within 1e-4 of
    transformers, tokens equal (Q8_0: transformers on the weights the file holds)."""
    from oval_edge.runtime.model.weight_stream import GGUFWeights
    from oval_edge.tools.gguf_write.writer import write_gguf
    from test_gguf_gemma4 import tiny_model

    model = tiny_model("e2b-like")
    path = write_gguf(model, str(tmp_path / f"gemma4-{projection_type}.gguf"), "gemma4", projection_type)
    reference = model
    if projection_type != "F32":
        config = model.config.to_dict()
        stored = GGUFWeights(path, "gemma4", config["num_attention_heads"], config["num_key_value_heads"])
        reference = type(model)(model.config).eval()
        missing, unexpected = reference.load_state_dict({n: stored.read(n, torch.float32) for n in stored.names()},
                                                        strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        reference.tie_weights()
    engine = Engine.load(path, quant="none", device="cpu", oval=WIDE, config=EngineConfig(num_pages=64, oval_from=0))
    assert engine.pool.geometry.shared == ((4, 3), (5, 3), (6, 2))
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    with torch.no_grad():
        full = reference(torch.tensor([PROMPT + tokens])).logits[0]
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4


def test_a_projection_narrower_than_a_4bit_block_is_kept_as_read(tmp_path):
    """The GGUF tiny model's per-layer input projection reads 16 values a row (a real E2B's: 256): no 4-bit layout
    takes it (groups of 32, bitsandbytes' blocks of 64), so it stays as read while the others take the file's blocks
    (--quant auto) or int4; both load and give the logits of quant none (Q8_0 file)."""
    from oval_edge.tools.gguf_write.writer import write_gguf
    from test_gguf_gemma4 import tiny_model

    path = write_gguf(tiny_model("e2b-like"), str(tmp_path / "gemma4-q8.gguf"), "gemma4", "Q8_0")
    exact = Engine.load(path, quant="none", device="cpu", oval=WIDE, config=EngineConfig(num_pages=64, oval_from=0))
    blocks = Engine.load(path, quant="auto", device="cpu", oval=WIDE, config=EngineConfig(num_pages=64, oval_from=0))
    gate = blocks.loaded.model.model.layers[0].per_layer_input
    assert isinstance(gate.projection, torch.nn.Linear) and not isinstance(gate.gate, torch.nn.Linear)
    _, want = decode_greedy(exact, PROMPT, 2)
    _, got = decode_greedy(blocks, PROMPT, 2)
    assert torch.nn.functional.cosine_similarity(got[0], want[0], dim=0) > 0.99


def test_mixed_steps_and_preemption_give_the_tokens_of_a_roomy_run(folder):
    """Five requests through the engine's scheduler: decode rows and prompt chunks of 16 share steps (the shared
    layers read their sources' K/V of both groups), a pool too small for all preempts and recomputes; every request
    ends with the tokens it gets alone in a roomy pool, and nothing is left held."""
    from oval_edge.runtime.engine.request import SamplingParams

    prompts = [[100 + (seed * 37 + i * 11) % 3000 for i in range(n)] for seed, n in enumerate((20, 30, 17, 25, 40))]
    greedy = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    roomy = engine_for(folder, num_pages=128)
    expected = [roomy.generate(p, greedy).output_ids for p in prompts]
    engine = engine_for(folder, num_pages=14, prefill_chunk=16)
    requests = run_checked(engine, prompts, greedy)
    assert engine.stats.preemptions > 0
    assert [r.output_ids for r in requests] == expected
    assert engine.pool.num_used == 0 and engine.pool.rings.num_free == engine.pool.rings.sequences


def test_prefix_cache_with_ring_snapshots_restores_the_windows(folder):
    """With state_snapshots > 0 a sliding model keeps copies of its rings at page boundaries: a follow-up prompt maps
    the cached pages up to a boundary whose windows were kept, starts its rings from that copy and decodes what a
    full prefill decodes (logprobs within 1e-4); the copies are allocated once with the pool. Default: off."""
    assert not engine_for(folder).pool.tables.ledger.enabled  # no snapshots by default: no prefix cache for rings
    cached = follow_ups_decode_as_full_prefills(lambda **settings: engine_for(folder, state_snapshots=4, **settings),
                                                PROMPT)
    assert cached.pool.rings.snapshots == 4
    assert cached.pool.rings.nbytes() == (4 + 4) * cached.pool.geometry.ring_bytes_per_sequence
    from oval_edge.runtime.server.metrics import ServerMetrics

    assert "oval_edge_kv_ring_snapshots_total 4.0" in ServerMetrics(lambda: ("ready", cached)).render()[0].decode()
