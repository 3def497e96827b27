"""The pool is allocated once: a 4k-token generation neither reallocates it nor raises the process's peak."""

from __future__ import annotations

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig, SamplingParams
from oval_edge.runtime.engine.memory import peak_rss_bytes

TEXT = (
    "The river ran past the mill and under the old stone bridge, where the children of the village gathered "
    "every evening to watch the boats come in from the lake. "
)


def test_peak_memory_after_a_4k_generation_equals_peak_after_warm_up():
    engine = Engine.load("default", quant="nf4", device="cpu", oval=OvalConfig(),
                         config=EngineConfig(max_batch=1, num_pages=132))  # 132 * 32 = 4224 tokens
    pool = engine.pool
    pointers = pool.storage_pointers()
    ids = engine.tokenizer(TEXT * 200)["input_ids"]
    # Warm-up: one prefill chunk and some decode steps exercise every code path once.
    engine.generate(ids[:600], SamplingParams(max_tokens=40, ignore_eos=True))
    warm_peak = peak_rss_bytes()
    long_run = engine.generate(ids[:4000], SamplingParams(max_tokens=96, ignore_eos=True))
    assert len(long_run.output_ids) == 96 and pool.capacity_tokens >= 4096
    after_peak = peak_rss_bytes()
    assert pool.storage_pointers() == pointers, "the pool's tensors were reallocated"
    assert pool.num_free == pool.num_pages
    growth = (after_peak - warm_peak) / warm_peak
    assert growth <= 0.05, f"peak RSS grew {growth:.1%}: {warm_peak >> 20} MiB -> {after_peak >> 20} MiB"
