"""The static decode step (runtime/engine/forward/static_step.py, [R-static-step]): the same ops and shapes at every
length inside a batch bucket, no host sync or device copy inside it, traceable whole by torch.compile with no
recompiles, and the same logits as the eager forward.

A small random Llama (transformers' own config class, saved as safetensors next to the bundled tokenizer) keeps this
fast; the bundled model goes through the static step in tests/test_runtime.py (greedy equals Hugging Face).
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.kernels.cpu import NATIVE_ENV
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.engine.forward.op_trace import OpTrace
from oval_edge.runtime.engine.forward.static_step import StaticDecoder, batch_buckets

from eager_decode import eager_decode

PAGE = 16
OVAL = OvalConfig(page_size=PAGE, top_k=4, window_min=32, window_max=32, dense_layers=1, kv_dtype="float32")
ADAPTIVE = OvalConfig(page_size=PAGE, top_k=3, window_min=16, window_max=48, dense_layers=1, kv_dtype="float32")
MAX_LEN = 1400


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    import transformers

    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=49152,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(path)
    return str(path)


def engine_for(folder: str, quant: str = "none", oval: OvalConfig = OVAL, **config) -> Engine:
    """oval_from=0: OVAL at every length (the tests decide what they compare; the crossover has its own tests)."""
    settings = dict(num_pages=400, max_batch=4, max_model_len=MAX_LEN, oval_from=0) | config
    return Engine.load(folder, quant=quant, device="cpu", oval=oval, config=EngineConfig(**settings))


def prefill(engine: Engine, seq_id: str, length: int, seed: int = 0) -> None:
    """Write `length` prompt tokens of a new sequence into the pool (dense prefill, pages sealed)."""
    pool = engine.pool
    assert pool.allocate(seq_id, MAX_LEN) is not None
    ids = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed))
    for start in range(0, length, 256):
        chunk = ids[start : start + 256]
        step = pool.prepare([seq_id], [len(chunk)])
        engine.runner.forward(step, chunk, decode=False)
        pool.commit(step)


def static_step(engine: Engine, seq_ids: list, tokens: list[int]):
    """One static decode step -> (logits, stats, lengths), committed to the pool."""
    logits, stats, lengths = engine.static.decode(seq_ids, tokens)
    engine.pool.advance(seq_ids, lengths)
    return logits, stats


def traced_step(engine: Engine, seq_ids: list, tokens: list[int], monkeypatch) -> OpTrace:
    """Run one static step under a recording dispatch mode, with every host read of a tensor turned into an error."""
    step = engine.static.step_for(len(seq_ids))
    step.load(seq_ids, tokens)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the static step read a tensor's value on the host")

    trace = OpTrace(shapes=True)
    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        with torch.inference_mode(), trace:
            step.run()
    engine.pool.advance(seq_ids, step.lengths_list)
    return trace


def compiled_step_matches_eager(make_engine, prompt: list[int], steps: int = 40) -> None:
    """torch.compile(fullgraph=True, backend="aot_eager") of an engine's static step (make_engine(max_batch=1) builds
    one) against the eager step over `steps` greedy steps after `prompt`: the same numbers (1e-4), no recompile,
    one graph (the model families' tests call this)."""
    from oval_edge.runtime.engine.forward.static_step import StaticDecoder

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = make_engine(max_batch=1), make_engine(max_batch=1)
    compiled.static = StaticDecoder(compiled.runner, 1, compiled.token_limit(), compile_backend="aot_eager")
    for engine in (eager, compiled):
        assert engine.pool.allocate("r", len(prompt) + steps + 1) is not None
        step = engine.pool.prepare(["r"], [len(prompt)])
        engine.runner.forward(step, torch.tensor(prompt), decode=False)
        engine.pool.commit(step)
    token = 5
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(steps):
            want, _, lengths = eager.static.decode(["r"], [token])
            eager.pool.advance(["r"], lengths)
            got, _, lengths = compiled.static.decode(["r"], [token])
            compiled.pool.advance(["r"], lengths)
            assert (got - want).abs().max().item() <= 1e-4
            token = int(want[0].argmax())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)


@pytest.mark.parametrize("quant", ["none", "int4"])  # int4: the grouped projections a 16-bit folder serves with
@pytest.mark.parametrize("oval", [OVAL, ADAPTIVE], ids=["fixed-window", "adaptive-window"])
def test_same_ops_and_shapes_at_every_length_and_no_host_sync(tiny_folder, oval, quant, decode_kernels, monkeypatch):
    engine = engine_for(tiny_folder, quant, oval=oval)
    # Batch 1 at 300, 301, 700 and 1300 tokens (short rows and sparse ones, across page boundaries), then batch 3
    # (a bucket of 4: one padded row) at two sets of mixed lengths.
    for seq_id, length in (("a", 299), ("b", 699), ("c", 1299), ("d", 40)):
        prefill(engine, seq_id, length, seed=length)
    single = [traced_step(engine, ["a"], [7], monkeypatch), traced_step(engine, ["a"], [8], monkeypatch),
              traced_step(engine, ["b"], [9], monkeypatch), traced_step(engine, ["c"], [10], monkeypatch)]
    triple = [traced_step(engine, ["d", "b", "c"], [11, 12, 13], monkeypatch),
              traced_step(engine, ["a", "d", "b"], [14, 15, 16], monkeypatch)]
    for traces in (single, triple):
        first = traces[0]
        assert first.count > 0
        for trace in traces:
            assert trace.calls == first.calls  # the same op sequence with the same shapes
            assert trace.host_reads == [] and trace.device_copies == []
    assert single[0].calls != triple[0].calls  # buckets differ in shapes, as they must
    engine.pool.check_invariants()


@pytest.mark.parametrize("scorer", ["oval", "quest"])
@pytest.mark.parametrize("oval", [OVAL, ADAPTIVE], ids=["fixed-window", "adaptive-window"])
def test_static_step_equals_the_eager_forward(tiny_folder, scorer, oval, decode_kernels):
    config = OvalConfig(**{**oval.__dict__, "scorer": scorer})
    static, eager = engine_for(tiny_folder, oval=config), engine_for(tiny_folder, oval=config)
    lengths = (20, 150, 500)  # a short row (dense: fits the token budget) and two that select pages
    seq_ids = [f"r{i}" for i in range(len(lengths))]
    for engine in (static, eager):
        for seq_id, length in zip(seq_ids, lengths):
            prefill(engine, seq_id, length, seed=length)
    static_equals_eager(static, eager, seq_ids, 40)  # crosses page boundaries (new sealed pages, wider tables)


def static_equals_eager(static: Engine, eager: Engine, seq_ids: list, steps: int) -> None:
    """Greedy-decode `steps` tokens of every sequence, by the static step in `static` and by the eager reference
    (tests/eager_decode.py) in `eager`: equal logits and read statistics each step."""
    tokens = [3 + i for i in range(len(seq_ids))]
    for _ in range(steps):
        logits, stats = static_step(static, seq_ids, tokens)
        step = eager.pool.prepare(seq_ids, [1] * len(seq_ids))
        want, want_stats, _ = eager_decode(eager.runner, step, torch.tensor(tokens))
        eager.pool.commit(step)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        assert stats.attended_tokens == want_stats.attended_tokens
        assert stats.window_mean == pytest.approx(want_stats.window_mean)
        tokens = want.argmax(-1).tolist()


@pytest.mark.parametrize("quant, backend", [("none", "inductor"), ("nf4", "aot_eager"), ("int4", "aot_eager")])
def test_compiled_step_decodes_300_to_1300_tokens_without_recompiles(tiny_folder, quant, backend, monkeypatch):
    """fullgraph=True fails on any graph break (a ctypes call, a .tolist(), a bool() of a tensor); with
    error_on_recompile the 1000 steps must reuse the one compiled graph as the page tables fill.

    nf4 goes through the 4-bit custom op. It runs with aot_eager (the same trace, eager kernels): inductor's fused
    fp32 reductions differ from eager ones by ~1e-7, which the bf16 input of the 4-bit kernel turns into one bf16 ulp
    of the logits (7.8e-3 measured), above this test's 1e-4 (fp32, quant none, does not have it). For
    the same reason the nf4 case runs with the native CPU kernels off: the eager step's C RMSNorm and the traced
    step's torch one sum in different orders (test_native_kernels.py compares the kernels with torch).
    Under inductor a sealed page's record is not bit-equal either: its fused reductions move the record's fp32
    values by ~1e-7, the logits drift by ~1e-4, and the int4 record rounds a few values to the neighbouring level
    (~300 of its codes over these 1000 steps, measured), which now and then flips a near-tie in the top-k and moves
    that step's logits by ~1e-2 (6 steps of 1000, measured; the next step reads the same pages again). So under
    inductor 99% of the steps must agree within 1e-3 and none by more than 0.1; aot_eager must agree on every step.
    The int4 records go through the same compiled graph in both cases. int4 weights (grouped_linear's op) take the
    nf4 case's settings for the same reasons."""
    if quant in ("nf4", "int4"):
        monkeypatch.setenv(NATIVE_ENV, "0")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = engine_for(tiny_folder, quant, max_batch=1), engine_for(tiny_folder, quant, max_batch=1)
    compiled.static = StaticDecoder(compiled.runner, 1, compiled.token_limit(), compile_backend=backend)
    for engine in (eager, compiled):
        prefill(engine, "r", 300)
    token, gaps = 5, []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(1000):
            want, _ = static_step(eager, ["r"], [token])
            got, _ = static_step(compiled, ["r"], [token])
            gaps.append(float((got - want).abs().max()))
            token = int(want[0].argmax())
    assert compiled.pool.length("r") == 1300
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for all 1000 steps
    if backend == "aot_eager":
        assert max(gaps) <= 1e-4
    else:
        assert sum(gap <= 1e-3 for gap in gaps) >= 990 and max(gaps) <= 0.1
