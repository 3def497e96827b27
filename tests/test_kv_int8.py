"""kv_dtype='int8' (oval_edge/kv/int8.py): the row quantizer's error bound, the pool's codes, scales and key staging
(summaries from full-precision keys), the CPU kernel against the torch reference on int8 rows, the budget and
bytes-per-step arithmetic, the refused combinations, and a served greedy request end to end over real HTTP.
(The Triton kernel's int8 variant is checked under the interpreter in test_triton_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from oval_edge.config import OvalConfig
from oval_edge.geometry import KV_SCALE_BYTES, KVGeometry, stage_pages_for
from oval_edge.pool_sizing import size_pool
from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.kv.int8 import dequantize_rows, quantize_rows
from oval_edge.kv.pool import PagePool
from oval_edge.sparse.attention import attend, attend_rows, gather_rows

INT8 = OvalConfig(page_size=16, rank=4, kv_dtype="int8", group_pages=0)  # flat, as the bundled model's pool


def _geometry(kv_dtype: str, layers: int = 2, kv_heads: int = 2, head_dim: int = 64, **kw) -> KVGeometry:
    config = INT8.replace(kv_dtype=kv_dtype, **kw)
    return KVGeometry.for_oval(layers, kv_heads, head_dim, config, config.pool_dtype("cpu"), ("oval", "quest"))


def _filled(kv_dtype: str, tokens: int = 40, stage_pages: int | None = 4, seed: int = 0):
    """A pool with one sequence of `tokens` random K/V in every layer, and those K/V [layers, tokens, Hkv, D]."""
    g = _geometry(kv_dtype)
    pool = PagePool(g, 8, stage_pages=stage_pages)
    assert pool.allocate("a", tokens) is not None
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(g.layers, tokens, g.kv_heads, g.head_dim, generator=gen) * 3
    values = torch.randn(g.layers, tokens, g.kv_heads, g.head_dim, generator=gen)
    step = pool.prepare(["a"], [tokens])
    for layer in range(g.layers):
        pool.write(layer, step, keys[layer], values[layer])
    pool.commit(step)
    return pool, step, keys, values


def test_round_trip_error_is_within_half_a_step_of_each_rows_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(64, 64, generator=gen) * 10 ** torch.linspace(-4, 4, 64)[:, None],
                   torch.zeros(1, 64), torch.full((1, 64), -7.5)])
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (66,)
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    back = dequantize_rows(codes, scales)
    err = (back - x).abs()
    assert bool((err <= scales[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all())
    assert bool((err.amax(-1) <= x.abs().amax(-1) / 254 * (1 + 1e-5) + 1e-30).all())  # relative to the row's peak
    assert torch.equal(back[64], torch.zeros(64)) and torch.allclose(back[65], x[65])  # zero and constant rows exact


def test_pool_holds_codes_and_scales_and_summaries_equal_the_bfloat16_pools():
    pool8, step, keys, _ = _filled("int8")
    pool16, _, _, _ = _filled("bfloat16")
    assert pool8.k.dtype == pool8.v.dtype == torch.int8
    assert pool8.int8.k_scale.shape == (2, 8, 2, 16) and pool8.int8.staging.misses == 0
    rows = step.write_slots  # [tokens * Hkv]
    back = dequantize_rows(pool8.k_rows[1][rows], pool8.scale_rows[1][0][rows])
    want = keys[1].reshape(-1, 64)
    assert (back - want).abs().max() <= want.abs().amax(-1).max() / 254 + 1e-6
    # Two pages sealed, from the staged keys: the records and quest bounds of the bfloat16 pool, bit for bit.
    for name, stored in pool16.summaries.items():
        assert torch.equal(pool8.summaries[name], stored), name
    assert pool8.int8.staging._slot_of.keys() == {pool8.page_table("a")[2]}  # only the open page keeps a slot
    pool8.free("a")
    pool8.check_invariants()
    assert not pool8.int8.staging._slot_of and len(pool8.int8.staging._free) == 4
    assert int((pool8.int8.staging.page_slot != 4).sum()) == 0  # every page points at the overflow slot again


def test_a_full_staging_seals_from_the_dequantized_keys_and_counts_it():
    pool, _, keys, _ = _filled("int8", tokens=64, stage_pages=2)  # 4 pages written in one step, 2 staging slots
    assert pool.int8.staging.misses == 2
    exact, _, _, _ = _filled("bfloat16", tokens=64)
    pages = pool.page_table("a")
    mean, want = pool.summaries["kmax"][:, pages].float(), exact.summaries["kmax"][:, pages].float()
    assert torch.equal(mean[:, :2], want[:, :2])  # the staged pages: exact
    peak = float(keys.abs().max())  # the others: within half an int8 step plus a bfloat16 rounding, not lost
    assert 0 < (mean[:, 2:] - want[:, 2:]).abs().max() <= peak / 254 + peak * 2 ** -8
    pool.free("a")
    pool.check_invariants()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_attention_over_int8_rows_equals_the_reference_on_dequantized_rows(path, monkeypatch):
    if path == "native" and cpu_kernels() is None:
        pytest.skip("no C compiler: the native kernels are off")
    if path == "torch":
        monkeypatch.setattr("oval_edge.sparse.attention.decode_kernels", lambda device: None)
    pool, step, keys, values = _filled("int8")
    gen = torch.Generator().manual_seed(3)
    flat = step.write_slots.view(40, 2).T[None].repeat(2, 1, 1)  # [B=2, Hkv, T=40]
    valid = torch.rand(2, 2, 40, generator=gen) < 0.8
    valid[..., 0] = True
    q = torch.randn(2, 6, 64, generator=gen)
    for layer in range(2):
        got = attend_rows(q, pool.k_rows[layer], pool.v_rows[layer], flat, valid, 0.125,
                          scales=pool.scale_rows[layer])
        k, v = (dequantize_rows(rows[flat], s[flat]) for rows, s in zip((pool.k_rows[layer], pool.v_rows[layer]),
                                                                        pool.scale_rows[layer]))
        assert torch.allclose(got, attend(q, k, v, valid, 0.125), atol=2e-6, rtol=1e-5)
        exact = attend(q, keys[layer].transpose(0, 1)[None].expand(2, -1, -1, -1),
                       values[layer].transpose(0, 1)[None].expand(2, -1, -1, -1), valid, 0.125)
        assert (got - exact).abs().max() < 0.06  # near the unquantized attention (keys of std 3: logit errors ~0.1)
    k, v = gather_rows(pool.k_rows[0], pool.v_rows[0], flat, pool.scale_rows[0])
    assert k.dtype == torch.float32 and k.shape == (2, 2, 40, 64)


def test_native_kernel_declines_int8_rows_without_their_scales():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the native kernels are off")
    pool, step, _, _ = _filled("int8")
    flat = step.write_slots.view(40, 2).T[None]
    valid = torch.ones_like(flat, dtype=torch.bool)
    q = torch.randn(1, 6, 64)
    assert kernels.attend_slots(q, pool.k_rows[0], pool.v_rows[0], flat, valid, 0.125) is None
    short = (pool.scale_rows[0][0][:10], pool.scale_rows[0][1][:10])
    assert kernels.attend_slots(q, pool.k_rows[0], pool.v_rows[0], flat, valid, 0.125, scales=short) is None


def test_budget_arithmetic_counts_int8_codes_and_scales():
    smol = dict(layers=30, kv_heads=3, head_dim=64, page_size=32)
    g8, g16, g32 = (_geometry(d, **{k: smol[k] for k in ("layers", "kv_heads", "head_dim")}, page_size=32)
                    for d in ("int8", "bfloat16", "float32"))
    assert g8.kv_row_bytes == 64 + KV_SCALE_BYTES and g16.kv_row_bytes == 128
    assert g8.kv_bytes_per_token == 2 * 30 * 3 * 68
    assert g8.summary_bytes_per_page == g16.summary_bytes_per_page  # summaries stay bfloat16 on the CPU
    budget, weights = 1 << 30, 200 << 20
    pages = {d: size_pool(budget, weights, g).pages for d, g in (("int8", g8), ("bf16", g16), ("fp32", g32))}
    assert g16.kv_bytes_per_token / g8.kv_bytes_per_token == 128 / 68  # K/V alone: 1.88x the tokens
    # Whole pages (K/V + the int4 oval records and the bfloat16 quest summaries, which int8 K/V leaves as they are):
    # 1.78x bfloat16, 3.51x float32.
    assert 1.75 < pages["int8"] / pages["bf16"] < 1.82 and 3.45 < pages["int8"] / pages["fp32"] < 3.55
    assert g8.stage_bytes(10) == 11 * 30 * 3 * 32 * 64 * 2 and g16.stage_bytes(10) == 0
    assert stage_pages_for(g8, max_batch=4, step_tokens=260) == 8 + 9


def test_unsupported_combinations_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="kv_dtype='int4' is unknown.*int8"):
        OvalConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="sliding-window layers"):
        KVGeometry.for_oval(4, 2, 64, INT8, "bfloat16", ring=((1, 3), 128))
    with pytest.raises(ValueError, match="stage_pages"):
        PagePool(_geometry("int8"), 8, stage_pages=-1)
    assert INT8.pool_dtype("cpu") == "bfloat16" and INT8.pool_dtype("cuda", "bfloat16") == "bfloat16"


@pytest.mark.slow
def test_a_served_greedy_request_with_int8_kv_works_end_to_end():
    from test_server_support import TEST_OVAL, ServerThread, loaded_model, metrics, post, wait_pages_free

    from oval_edge.runtime.engine.engine import Engine, EngineConfig
    from oval_edge.runtime.server.app import ServerSettings, create_app

    config = EngineConfig(max_batch=2, max_queue=4, num_pages=48, max_model_len=512, prefill_chunk=64)
    with pytest.raises(ValueError, match="decode_step='compiled' does not take kv_dtype='int8'"):
        Engine(loaded_model(), TEST_OVAL.replace(kv_dtype="int8"), EngineConfig(num_pages=8, decode_step="compiled"))
    engine = Engine(loaded_model(), TEST_OVAL.replace(kv_dtype="int8"), config)
    assert engine.pool.k.dtype == torch.int8 and engine.pool.int8.staging.slots == 2 * 2 + -(-66 // 16)
    reference = Engine(loaded_model(), TEST_OVAL.replace(kv_dtype="bfloat16"), config)
    with ServerThread(create_app(ServerSettings(model_name="smol-int8", max_tokens_limit=64),
                                 lambda: engine)) as server:
        server.wait_ready()
        body = {"prompt": "The capital of France is Paris. The capital of Italy is", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}
        response = post(server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 40 and answer["choices"][0]["text"].strip()
        values = wait_pages_free(server.url)
        # The last decode step's K/V bytes: int8 codes + a 4-byte scale per row read, K and V.
        read = values["oval_edge_kv_bytes_read_last_step"]
        assert read > 0 and read % (2 * (64 + KV_SCALE_BYTES)) == 0
        assert engine.pool.int8.staging.misses == 0 and not engine.pool.int8.staging._slot_of
    ids = engine.loaded.tokenizer.encode(body["prompt"])
    from oval_edge.runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    int8_tokens, bf16_tokens = (e.generate(ids, params).output_ids for e in (engine, reference))
    assert len(int8_tokens) == len(bf16_tokens) == 40
    same = next((i for i, (a, b) in enumerate(zip(int8_tokens, bf16_tokens)) if a != b), 40)
    assert same >= 4, (int8_tokens, bf16_tokens)  # greedy starts as bfloat16's (then may drift: 135M, top_k=1)
