"""The page store under the pool (oval_edge/kv/store/, issue #23): the store changes where pages live, never what
is attended. Logits with pages on disk equal those fully in memory (tiny random Llama, fp32 and int8 K/V); served
greedy tokens equal a roomy pool's; a hypothesis state machine over resident, stored and recalled pages (never lost,
never read stale); an injected I/O error fails only its request; a full store waits, an impossible request is
refused with both limits; the store file is checked, created at full size and removed."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.geometry import KVGeometry, kv_dims
from oval_edge.kv.pool import PagePool
from oval_edge.kv.store.layout import StoreLayout
from oval_edge.kv.store.page_file import PageStore, StoreError, check_store_path, layer_bytes_for
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.engine.request import RequestRejected
from oval_edge.runtime.engine.sampling import SamplingParams

from test_static_step import engine_for, tiny_folder  # noqa: F401 (fixture)

PAGE = 16
# group_pages=0: the page store scores flat (the engine resolves it so; these tests build pools directly)
OVAL = OvalConfig(page_size=PAGE, top_k=4, window_min=32, window_max=32, dense_layers=1, kv_dtype="float32",
                  group_pages=0)
INT8 = OVAL.replace(kv_dtype="int8")


def _store(folder, geometry: KVGeometry, blocks: int, **kwargs) -> PageStore:
    g = geometry
    element = 1 if g.kv_int8 else g.dtype_bytes
    layer_bytes = layer_bytes_for(g.kv_heads, g.page_size, g.head_dim, element, g.kv_int8)
    return PageStore(str(folder), blocks * layer_bytes * g.paged_layers, layer_bytes, g.paged_layers, **kwargs)


def _teacher_forced(model, oval: OvalConfig, ids: torch.Tensor, prompt: int, pool: PagePool) -> torch.Tensor:
    """Prefill `prompt` tokens in chunks of 64, then decode the rest one token at a time -> logits [steps, vocab]."""
    runner = PagedLlama(model, pool, oval)
    assert pool.allocate("a", prompt) is not None
    out = []
    for end in [*range(64, prompt, 64), prompt, *range(prompt + 1, len(ids) + 1)]:
        start = pool.length("a")
        assert pool.grow("a", end) and pool.make_resident("a", end)
        step = pool.prepare(["a"], [end - start])
        logits, _ = runner.forward(step, ids[start:end], decode=end - start == 1)
        pool.commit(step)
        if end >= prompt:
            out.append(logits)
        pool.check_invariants()
    pool.free("a")
    pool.check_invariants()
    return torch.cat(out)


@pytest.mark.parametrize("oval,mirrored", [(OVAL, 0), (INT8, 0), (OVAL, 1), (INT8, 1)],
                         ids=["fp32", "int8", "fp32-mirror", "int8-mirror"])
def test_logits_with_pages_on_disk_equal_those_fully_in_memory(tmp_path, oval, mirrored):
    """mirrored: the dense layer's stored rows also kept in memory (kv/store/mirror.py), as the engine does."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=500,
                                      max_position_embeddings=2048, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    geometry = KVGeometry.for_oval(*kv_dims(config), oval, "float32")
    ids = torch.randint(0, 500, (900,), generator=torch.Generator().manual_seed(1))
    memory = _teacher_forced(model, oval, ids, 500, PagePool(geometry, 64))
    store = _store(tmp_path, geometry, 64, checksums=True)
    pool = PagePool(geometry, 16, store=store, store_layout=StoreLayout(8, 1, 3, mirrored))  # 256 tokens in memory
    disk = _teacher_forced(model, oval, ids, 500, pool)
    stats = pool.store.stats
    assert stats.spills > 30 and stats.recall_misses > 0 and stats.transient_reads > 0  # the store was really used
    assert (stats.mirror_reads > 0) == bool(mirrored)
    assert torch.equal(memory, disk), (memory - disk).abs().max()
    assert pool.store.stored_pages() == 0 and not pool.store.written


def _serve(engine, prompts, max_tokens=24):
    requests = [engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for p in prompts]
    while engine.has_work():
        engine.step()
    return requests


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


STORE_ENGINE = dict(num_pages=28, max_batch=2, prefill_chunk=64, decode_step="static")


def test_served_greedy_tokens_equal_a_roomy_pool_and_every_page_comes_back(tiny_folder, tmp_path):
    prompts = _prompts([700, 530])
    roomy = [r.output_ids for r in _serve(engine_for(tiny_folder, max_batch=2), prompts)]
    engine = engine_for(tiny_folder, kv_store=str(tmp_path), kv_store_size=4 << 20, kv_store_checksums=True,
                        **STORE_ENGINE)
    assert "page store" in engine.describe_decode_step()
    served = _serve(engine, prompts)
    assert [r.finish_reason for r in served] == ["length", "length"]
    assert [r.output_ids for r in served] == roomy
    tier = engine.pool.store
    assert tier.stats.spills > 0 and tier.stats.bytes_read > 0
    assert engine.pool.num_used == 0 and tier.stored_pages() == 0
    engine.pool.check_invariants()


def test_an_io_error_fails_only_the_request_whose_page_it_was(tiny_folder, tmp_path):
    long_prompt, short_prompt = _prompts([800, 100], seed=3)
    alone = _serve(engine_for(tiny_folder, max_batch=2), [short_prompt])[0].output_ids
    engine = engine_for(tiny_folder, kv_store=str(tmp_path), kv_store_size=4 << 20, **STORE_ENGINE)
    tier = engine.pool.store
    doomed = engine.submit(long_prompt, SamplingParams(max_tokens=24, temperature=0.0))
    survivor = engine.submit(short_prompt, SamplingParams(max_tokens=24, temperature=0.0))

    def failing_drive(op: str, block: int) -> None:  # the drive fails where the long request's pages are
        if op == "read" and engine.pool.owns(doomed.request_id) and \
                tier.base + block in engine.pool.page_table(doomed.request_id):
            raise OSError(errno.EIO, "Input/output error")

    tier.store.io_hook = failing_drive
    while engine.has_work():
        engine.step()
    assert doomed.finish_reason == "error" and "page store" in doomed.error and "Input/output" in doomed.error
    assert survivor.finish_reason == "length" and survivor.output_ids == alone
    assert engine.pool.num_used == 0 and engine.pool.store.stored_pages() == 0
    engine.pool.check_invariants()
    engine.pool.store.store.io_hook = None  # the drive is back: the next request is served
    assert _serve(engine, [long_prompt])[0].finish_reason == "length"


def test_a_full_store_makes_requests_wait_and_an_impossible_one_is_refused_with_both_limits(tiny_folder, tmp_path):
    # 28 frames (448 tokens) + 36 blocks (576 tokens): two 600-token requests cannot both be held at once
    engine = engine_for(tiny_folder, kv_store=str(tmp_path), kv_store_size=36 * 3 * 8192, **STORE_ENGINE)
    assert engine.pool.store.blocks == 36 and engine.token_limit() == (28 + 36) * PAGE
    with pytest.raises(RequestRejected, match=r"448 tokens, the page store 576"):
        engine.submit(_prompts([1100])[0], SamplingParams(max_tokens=10))
    first, second = _serve(engine, _prompts([600, 600], seed=5), max_tokens=8)
    assert first.finish_reason == second.finish_reason == "length"
    assert engine.pool.num_used == 0 and engine.pool.store.stored_pages() == 0
    engine.pool.check_invariants()


def test_pool_tokens_caps_the_pool_the_budget_would_size(tiny_folder):
    engine = engine_for(tiny_folder, num_pages=None, pool_tokens=20 * PAGE)
    assert engine.pool.num_pages == 20 and engine.token_limit() == 20 * PAGE


def test_a_page_corrupted_on_disk_is_caught_by_its_checksum(tmp_path):
    geometry = KVGeometry(2, 1, 8, 4, rank=3)
    store = _store(tmp_path, geometry, 4, checksums=True)
    k = torch.randn(2, 1, 4, 8)
    buffers = [[memoryview(k[layer].numpy()).cast("B")] for layer in range(2)]
    store.write_block(1, buffers)
    out = torch.empty(1, 4, 8)
    store.read_layer(1, 1, [memoryview(out.numpy()).cast("B")])
    assert torch.equal(out, k[1])
    os.pwrite(store.fd, b"\xff" * 8, store.offset(1, 1))  # a flipped sector
    with pytest.raises(StoreError, match="checksum"):
        store.read_layer(1, 1, [memoryview(out.numpy()).cast("B")])


def test_the_store_file_is_made_at_full_size_and_removed_at_close(tmp_path):
    store = _store(tmp_path, KVGeometry(2, 1, 8, 4, rank=3), 10)
    assert os.path.getsize(store.path) == 10 * 2 * 4096 and store.blocks == 10
    assert store.measure_read(1 << 16) > 0
    store.close()
    assert not os.path.exists(store.path) and os.listdir(tmp_path) == []


def test_store_paths_that_cannot_work_are_refused_with_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_store_path(str(tmp_path / "missing" / "kv.store"), 1 << 20)
    (tmp_path / "taken.store").write_bytes(b"x")
    with pytest.raises(ValueError, match="already exists"):
        check_store_path(str(tmp_path / "taken.store"), 1 << 20)
    with pytest.raises(ValueError, match="free on"):
        check_store_path(str(tmp_path), 1 << 60)
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").total:
        from oval_edge.kv.store.page_file import mount_of

        if mount_of("/dev/shm")[1] == "tmpfs":
            with pytest.raises(ValueError, match="lives in RAM"):
                check_store_path("/dev/shm", 1 << 20)
