"""Hybrid families (#55): Qwen3.5 (Gated DeltaNet + gated full attention) and LFM2 (short conv + attention).

Tiny random checkpoints built with transformers' own config classes; the runtime's logits against transformers'
(fp32, quant none) at prefill and over 64 greedy decode steps; the state layers' per-sequence state in the pool
(allocated once, a slot per running sequence, zeroed when taken); the static step's shapes and host reads; OVAL
with a budget covering the context equal to dense.
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model.config import DecoderConfig
from oval_edge.pool_sizing import size_pool
from oval_edge.state_layout import state_layout

from test_decoder_loading import save_folder
from test_families import (PROMPT, STEPS, _hf_all_logits, chunks_and_a_batch_equal_one_pass, decode_greedy,
                           follow_ups_decode_as_full_prefills, run_checked)
from test_static_step import compiled_step_matches_eager, traced_step

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=49152, max_position_embeddings=4096)
WIDE = OvalConfig(page_size=16, top_k=16, kv_dtype="float32")  # budget 336 >= 80 + 64 tokens: OVAL is exact


def hybrid_config(kind: str):
    import transformers

    if kind == "lfm2":
        return transformers.Lfm2Config(**SHAPE, norm_eps=1e-5, layer_types=["conv", "full_attention", "conv",
                                                                             "full_attention"])
    return transformers.Qwen3_5TextConfig(**SHAPE, rms_norm_eps=1e-6, head_dim=64, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                          tie_word_embeddings=False)


def perturbed_folder(path, config) -> str:
    """A tiny checkpoint whose norms, decays and conv taps are random too (transformers initialises the norms to
    0 or 1 and the conv to one scale: an offset or a tap read wrong could hide there)."""
    import transformers

    folder = save_folder(path, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or "conv" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2"])
def hybrid(request, tmp_path_factory):
    config = hybrid_config(request.param)
    return request.param, config, perturbed_folder(tmp_path_factory.mktemp(request.param), config)


def engine_for(folder: str, oval: OvalConfig = WIDE, quant: str = "none", **settings) -> Engine:
    config = dict(num_pages=64, oval_from=0, max_batch=4) | settings
    return Engine.load(folder, quant=quant, device="cpu", oval=oval, config=EngineConfig(**config))


def test_config_reads_the_layer_kinds_and_state_shapes(hybrid):
    kind, config, _ = hybrid
    ours = DecoderConfig.from_dict(config.to_dict(), "tiny")
    layout = state_layout(ours)
    if kind == "lfm2":
        assert ours.layer_types == ("conv", "full_attention", "conv", "full_attention") and ours.qk_norm
        # transformers' Lfm2MLP: 2/3 of 256 = 170, times 1.0, rounded up to a multiple of 256
        assert ours.intermediate_size == 256
        assert [(s.layer, s.conv_channels, s.conv_width, s.heads) for s in layout.layers] == [(0, 128, 2, 0),
                                                                                              (2, 128, 2, 0)]
        assert layout.bytes_per_sequence == 2 * 128 * 2 * 4
    else:
        assert ours.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert ours.attn_output_gate and ours.qk_norm and ours.rotary_dim == 16 and ours.norm_offset == 1.0
        channels = 2 * 2 * 32 + 4 * 32
        assert [(s.conv_channels, s.conv_width, s.heads, s.key_dim) for s in layout.layers] == [(channels, 3, 4, 32)] * 3
        assert layout.bytes_per_sequence == 3 * (channels * 3 * 4 + 4 * 32 * 32 * 4)


def test_lfm2_reads_liquid_names_for_the_mlp_width_and_tying_as_transformers_does():
    """LFM2's published configs say block_ff_dim and tie_embedding (LFM2-350M: 4608, the default 12288 elsewhere);
    transformers' Lfm2Config maps them onto intermediate_size and tie_word_embeddings."""
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    published = dict(model_type="lfm2", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=65536, block_ff_dim=4608, tie_embedding=False,
                     full_attn_idxs=[1, 3])
    ours = DecoderConfig.from_dict(published, "350m-like")
    theirs = transformers.Lfm2Config(**{k: v for k, v in published.items() if k != "model_type"})
    assert ours.intermediate_size == Lfm2MLP(theirs).w1.out_features == 3072
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is False


@pytest.mark.parametrize("attention", ["oval", "dense"])
def test_logits_equal_transformers_at_prefill_and_over_greedy_decode(hybrid, attention):
    kind, _, folder = hybrid
    engine = engine_for(folder, attention=attention)
    tokens, ours = decode_greedy(engine, PROMPT, STEPS)
    full = _hf_all_logits(folder, PROMPT + tokens)  # every position in one forward
    assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist(), kind
    assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4, kind
    engine.pool.check_invariants()


def test_oval_with_a_budget_over_the_context_equals_dense(hybrid):
    _, _, folder = hybrid
    tokens, oval = decode_greedy(engine_for(folder), PROMPT, 24)
    dense_tokens, dense = decode_greedy(engine_for(folder, attention="dense"), PROMPT, 24)
    assert tokens == dense_tokens and (oval - dense).abs().max().item() < 1e-5


def test_chunked_prefill_and_a_batch_carry_each_sequence_state(hybrid):
    """A prompt prefilled in three chunks (the state carried between them) gives the logits of one pass; two
    sequences decoded in one batch (each at its own state slot) give what each gives alone."""
    _, _, folder = hybrid
    chunks_and_a_batch_equal_one_pass(lambda: engine_for(folder), PROMPT, 45)


def _prefill_step(pool, seq_id: str, length: int):
    assert pool.allocate(seq_id, 200) is not None
    return pool.prepare([seq_id], [length])


def test_state_slots_are_allocated_once_taken_per_sequence_and_zeroed(hybrid):
    _, _, folder = hybrid
    engine = engine_for(folder, max_batch=2)
    pool = engine.pool
    pointers = pool.storage_pointers()
    assert pool.states is not None and pool.states.slots == 2
    assert pool.allocate("a", 20) is not None and pool.allocate("b", 20) is not None
    assert not pool.can_allocate(20) and pool.allocate("c", 20) is None  # every slot held: waits like no page
    pool.check_invariants()
    step = pool.prepare(["a"], [5])
    engine.runner.forward(step, torch.tensor(PROMPT[:5]), decode=False)
    pool.commit(step)
    slot = pool.states.slot("a")
    assert any(t[slot].abs().sum() > 0 for t in pool.states.tensors())
    pool.free("a")
    assert pool.allocate("c", 20) is not None and pool.states.slot("c") == slot
    assert all(t[slot].abs().sum() == 0 for t in pool.states.tensors())  # a fresh sequence starts from zero
    pool.check_invariants()
    assert pool.storage_pointers() == pointers


def test_static_step_same_ops_at_every_length_and_no_host_sync(hybrid, monkeypatch):
    _, _, folder = hybrid
    engine = engine_for(folder, num_pages=128)
    for sid, length in (("a", 40), ("b", 300)):
        step = _prefill_step_long(engine.pool, sid, length)
        engine.runner.forward(step, torch.tensor((PROMPT * 4)[:length]), decode=False)
        engine.pool.commit(step)
    traces = [traced_step(engine, ["a"], [7], monkeypatch), traced_step(engine, ["b"], [8], monkeypatch)]
    assert traces[0].count > 0 and traces[0].calls == traces[1].calls
    assert all(t.host_reads == [] and t.device_copies == [] for t in traces)


def _prefill_step_long(pool, seq_id: str, length: int):
    assert pool.allocate(seq_id, 1000) is not None
    return pool.prepare([seq_id], [length])


def test_compiled_step_traces_whole_and_matches_eager(hybrid):
    """torch.compile(fullgraph=True) of the hybrid's static step: no graph break (the state updates are in-place
    index ops on the pool's tensors), one graph over 40 steps, the eager step's numbers."""
    _, _, folder = hybrid
    compiled_step_matches_eager(lambda **settings: engine_for(folder, **settings), PROMPT)


@pytest.mark.parametrize("quant", ["int4", "nf4"])
def test_4bit_path_runs_the_hybrid(hybrid, quant):
    """int4 (what a 16-bit folder is served with) and bitsandbytes nf4: the fused DeltaNet / conv projections in 4
    bits; the prefill logits point where the fp32 model's do (a random tiny model with perturbed decays and taps:
    0.97 measured for int4)."""
    _, _, folder = hybrid
    _, exact = decode_greedy(engine_for(folder), PROMPT, 1)
    _, four = decode_greedy(engine_for(folder, quant=quant), PROMPT, 2)
    assert torch.isfinite(four).all()
    assert torch.nn.functional.cosine_similarity(four[0], exact[0], dim=0) > 0.9


def test_startup_report_metrics_and_step_stats_show_the_states(hybrid):
    """The startup report, /metrics and the decode step's read figures count the state layers' bytes."""
    from oval_edge.runtime.server.metrics import ServerMetrics
    from test_server_kv_store import _parser
    from oval_edge.runtime.server.options import engine_spec
    from oval_edge.runtime.server.serve import startup_report
    from oval_edge.units import format_bytes

    _, _, folder = hybrid
    engine = engine_for(folder, max_batch=2)
    per_sequence = engine.pool.geometry.state_bytes_per_sequence
    held = 2 + 4  # max_batch running slots + 2 x max_batch prefix-cache snapshots
    assert engine.pool.states.nbytes() == held * per_sequence
    sizing = size_pool(1 << 30, 1 << 20, engine.pool.geometry, ring_sequences=2, state_snapshots=4)
    assert sizing.state_bytes == held * per_sequence and "layer states" in sizing.explain()
    step = _prefill_step(engine.pool, "r", 20)
    engine.runner.forward(step, torch.tensor(PROMPT[:20]), decode=False)
    engine.pool.commit(step)
    _, stats, _ = engine.static.decode(["r"], [3])
    assert stats.state_bytes == per_sequence
    engine.stats.record_decode(1, 0.01, stats, engine.pool.geometry)
    text = ServerMetrics(lambda: ("ready", engine)).render()[0].decode()
    assert f"oval_edge_state_bytes {float(held * per_sequence)}" in text
    assert f"oval_edge_state_bytes_read_last_step {float(per_sequence)}" in text
    assert "oval_edge_state_slots_used 1.0" in text
    report = startup_report(engine, engine_spec(_parser().parse_args([])), "http://127.0.0.1:1", False)
    (line,) = [ln for ln in report.splitlines() if ln.startswith("  states    ")]
    assert f"x (2 running + 4 prefix-cache snapshots) = {format_bytes(held * per_sequence)}" in line


def test_prefix_cache_restores_the_state_where_the_cached_prompt_ends(hybrid):
    """A second request whose prompt starts with the first's conversation maps the cached pages only up to a page
    whose state was kept, starts from that snapshot and decodes what a full prefill decodes; snapshots are allocated
    once with the pool."""
    _, _, folder = hybrid
    cached = follow_ups_decode_as_full_prefills(lambda **settings: engine_for(folder, **settings), PROMPT)
    assert cached.pool.states.snapshots == 8


@pytest.mark.parametrize("architecture", ["qwen35", "lfm2"])
def test_gguf_as_llama_cpp_writes_it_serves_the_logits_of_transformers(tmp_path, architecture):
    """A GGUF written under llama.cpp's names and transforms (tools/gguf_write/hybrid.py; read back by
    families/hybrid_gguf.py), loaded by the engine with quant none: prefill and 64 greedy steps within 1e-4 of
    transformers, tokens equal; F32 and Q8_0 projections (Q8_0 against transformers on the dequantized weights)."""
    from oval_edge.runtime.model.weight_stream import GGUFWeights
    from oval_edge.tools.gguf_write.writer import write_gguf
    from test_gguf_hybrid import tiny_model

    model = tiny_model(architecture)
    for projection_type in ("F32", "Q8_0"):
        path = write_gguf(model, str(tmp_path / f"{architecture}-{projection_type}.gguf"), architecture,
                          projection_type)
        reference = model
        if projection_type != "F32":  # transformers on the weights the file holds
            stored = GGUFWeights(path, architecture, model.config.num_attention_heads,
                                 model.config.num_key_value_heads)
            reference = type(model)(model.config).eval()
            missing, unexpected = reference.load_state_dict({n: stored.read(n, torch.float32) for n in stored.names()},
                                                            strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}
            if model.config.tie_word_embeddings:
                reference.tie_weights()
        tokens, ours = decode_greedy(Engine.load(path, quant="none", device="cpu", oval=WIDE,
                                                 config=EngineConfig(num_pages=64, oval_from=0)), PROMPT, STEPS)
        with torch.no_grad():
            full = reference(torch.tensor([PROMPT + tokens])).logits[0]
        assert tokens == full[len(PROMPT) - 1 : -1].argmax(-1).tolist(), projection_type
        assert (ours - full[len(PROMPT) - 1 :]).abs().max().item() < 1e-4, projection_type


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preempted_requests_recompute_their_state_and_lose_nothing(hybrid, prefix_cache):
    """A pool too small for every request preempts the newest (its pages and its state slot freed); it comes back,
    recomputes (from a state snapshot where its cached pages allow) and ends with the tokens of a roomy run."""
    from oval_edge.runtime.engine.request import SamplingParams

    _, _, folder = hybrid
    prompts = [[100 + (seed * 37 + i * 11) % 3000 for i in range(n)] for seed, n in enumerate((20, 30, 17, 25, 40))]
    long = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    roomy = engine_for(folder, num_pages=128, prefix_cache=False)
    expected = [roomy.generate(p, long).output_ids for p in prompts]
    engine = engine_for(folder, num_pages=14, prefix_cache=prefix_cache, prefill_chunk=16)
    requests = run_checked(engine, prompts, long)
    assert engine.stats.preemptions > 0
    assert [r.output_ids for r in requests] == expected
    assert engine.pool.num_used == 0 and engine.pool.states.num_free == engine.pool.states.slots


def test_eval_refuses_a_hybrid_with_what_runs_it(hybrid):
    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.tools.eval.runtime import geometry_for

    kind, config, _ = hybrid
    with pytest.raises(ValueError, match="eval does not yet take a hybrid model.*serve and bench run it"):
        geometry_for(DecoderConfig.from_dict(config.to_dict(), "tiny"), 16, 4)
