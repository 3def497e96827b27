"""CUDA-only checks, run by `make gpu-check` (tools/gpu_check.py) on a machine with a GPU; skipped everywhere else.

- the bundled model loads in NF4 through bitsandbytes' CUDA kernels, its projections bound as Chunked4bit, whose
  chunked calls give the module's own output;
- the static step replayed from CUDA graphs gives the logits of the same step run eager (fp16 and bf16, 1e-3);
- the engine decodes the same greedy tokens with and without graphs, and graphs hold no page after a request;
- the Triton kernels (when Triton is installed) agree with the torch ops on the GPU.
The CPU halves of these paths (bucket choice, buffer reuse, fallbacks) are tests/test_cuda_paths.py.
"""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

OVAL = OvalConfig(page_size=32, top_k=4, window_min=64, window_max=64)
PROMPT_TOKENS = 700  # past the 224-token budget (sink 32 + 4 x 32 + window 64): the sparse layers select pages


def engine(dtype: str, graphs: bool, max_batch: int = 2):
    from oval_edge.runtime import Engine, EngineConfig

    return Engine.load("default", quant="nf4", device="cuda", oval=OVAL, dtype=dtype,
                       config=EngineConfig(max_batch=max_batch, num_pages=128, max_model_len=2048,
                                           cuda_graphs=graphs))


def prefill(engine, seq_id: str, ids: torch.Tensor) -> None:
    pool = engine.pool
    assert pool.allocate(seq_id, 2048) is not None
    for start in range(0, len(ids), 256):
        chunk = ids[start:start + 256]
        step = pool.prepare([seq_id], [len(chunk)])
        engine.runner.forward(step, chunk.to(engine.loaded.device), decode=False)
        pool.commit(step)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_graph_replay_logits_equal_the_eager_step(dtype):
    graphed, eager = engine(dtype, True), engine(dtype, False)
    assert graphed.static.graphs is not None and graphed.static.graphs.buckets == (1, 2)
    assert eager.static.graphs is None
    ids = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    for e in (graphed, eager):
        prefill(e, "a", ids)
        prefill(e, "b", ids[:400])
    token = [int(ids[-1]), int(ids[399])]
    worst = 0.0
    for _ in range(12):
        out = []
        for e in (graphed, eager):
            logits, _, lengths = e.static.decode(["a", "b"], token)
            e.pool.advance(["a", "b"], lengths)
            out.append(logits.clone())
        worst = max(worst, (out[0] - out[1]).abs().max().item())
        token = out[1].argmax(-1).tolist()
    assert worst <= 1e-3, f"graph replay differs from the eager step by {worst:.2e} (limit 1e-3)"


def test_greedy_tokens_with_and_without_graphs_and_no_page_leak():
    from oval_edge.runtime import SamplingParams

    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    outputs = []
    for graphs in (True, False):
        e = engine("auto", graphs)
        free = e.pool.num_free
        request = e.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        assert request.finish_reason == "length" and e.pool.num_free == free
        outputs.append(request.output_ids)
    assert outputs[0] == outputs[1]


def test_nf4_loads_on_cuda_and_chunked_projection_matches_the_module():
    from oval_edge.runtime.model.loader import load_model
    from oval_edge.runtime.model.projections import Chunked4bit, bind_projection

    loaded = load_model("default", "nf4", "cuda")
    assert loaded.dtype == (torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16)
    assert loaded.weight_bytes < 200 * 2**20  # 135M parameters: 4-bit layers + a 16-bit embedding
    module = next(m for m in loaded.model.modules() if hasattr(getattr(m, "weight", None), "quant_state"))
    bound = bind_projection(module)
    assert isinstance(bound, Chunked4bit)
    with torch.inference_mode():
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, module.in_features, device="cuda", dtype=loaded.dtype)
            torch.testing.assert_close(bound(x), module(x), rtol=2e-2, atol=2e-2)


def test_triton_kernels_agree_with_the_torch_ops_on_the_gpu():
    from oval_edge.kernels.gpu import gpu_kernels
    from oval_edge.sparse.attention import attend, gather_rows
    from oval_edge.kernels.cpu_check import random_records
    from oval_edge.sparse.scoring import record_scores

    kernels = gpu_kernels(torch.device("cuda"))
    if kernels is None:
        pytest.skip("Triton is absent or failed its self-check (the startup log says why): torch ops run")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        b, hkv, group, d, page, r, pages, width = 3, 3, 3, 64, 32, 4, 64, 40
        q = torch.randn(b, hkv, group, d, device="cuda", dtype=dtype, generator=g)
        table = torch.randint(0, pages, (b, width), device="cuda", generator=g)
        counts = torch.tensor([width, 17, 5], device="cuda")
        live = torch.arange(width, device="cuda")[None, None, :] < counts[:, None, None]
        for fmt in ("float", "int8", "int4"):
            cpu_records = random_records(torch.Generator().manual_seed(1), hkv, pages, r, d, page, fmt, dtype)
            records = type(cpu_records)(*(t.cuda() if t is not None else None for t in cpu_records))
            got = kernels.oval_scores(q, records, table, 0.125, counts)
            want = record_scores(q, records, table, 0.125)
            torch.testing.assert_close(got[live.expand_as(got)], want[live.expand_as(want)], rtol=2e-2, atol=5e-2)
        rows = pages * hkv * page
        k_rows = torch.randn(rows, d, device="cuda", dtype=dtype, generator=g)
        v_rows = torch.randn(rows, d, device="cuda", dtype=dtype, generator=g)
        for slots in (224, 4096):  # a sparse layer's selection; a dense layer at long context (split-K)
            flat = torch.randint(0, rows, (b, hkv, slots), device="cuda", generator=g)
            valid = torch.rand(b, hkv, slots, device="cuda", generator=g) > 0.2
            valid[..., 0] = True
            qa = q.reshape(b, hkv * group, d)
            got = kernels.attend_slots(qa, k_rows, v_rows, flat, valid, 0.125, None)
            k, v = gather_rows(k_rows, v_rows, flat)
            torch.testing.assert_close(got, attend(qa, k, v, valid, 0.125), rtol=2e-2, atol=2e-2)
