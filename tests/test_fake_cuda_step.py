"""The engine's static decode step on a fake `cuda` device (tests/fake_cuda.py): what a Jetson would run, traced on
a CPU-only torch at SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads, vocab 49,152), NF4 weights
through bitsandbytes, the default OVAL config at an 8k context, three rows of 6,000, 2,500 and 90 tokens in the
batch bucket of 4. Both decode paths: the Triton kernels (their launches recorded, not run) and the torch ops a
torch without Triton runs (stock JetPack torch has none).

Checked in the step (StaticStep.forward, the function a CUDA graph captures): no op mixes devices, nothing crosses
between host and device, the host never waits for a device value, and the kernel launches per step stay within a
budget per path (LAUNCH_BUDGETS; at 2875b6f, counted as now, the Triton path took 1,278 and the torch path 2,231).
A batch of short rows takes a narrow page-table width on the torch path, and decode_graph_bytes' count of the torch
step's temporaries (oval_edge/step_memory.py) stays within its tolerance of the peak measured here at batch 1 and 4,
2k and 8k. PackedScorer (the torch path's scorer) is checked against record_scores here. docs/gpu-step.md says
where the launches go.

Run with -s to see the counts per path.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fake_cuda import (CudaBindings, StepAudit, answer_like_an_orin, clear_triton_loaders, fake_linear4bit, fake_mode,
                       stub_triton_launches)

# Measured 663 and 1,414 (budgets ~1% above; the targets: 700 and 1,500). They were 678 and 1,719 with the
# int4 record scorer at 27 launches a sparse layer (18 now, test_packed_scorer_launches_18_kernels_...), the
# attention's scale a multiply of its own (inside the GEMM now) and the plan's sink, window and short-row slots
# indexed in three passes (one now); docs/gpu-step.md says where the rest goes.
LAUNCH_BUDGETS = {"triton": 670, "torch": 1430}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
CONTEXT = 8192
ROWS = (("a", 6000), ("b", 2500), ("c", 90))  # one long, one medium, one short row: a bucket of 4, one row padded


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory) -> str:
    """SmolLM2-135M's shapes with random bf16 weights, saved as a Hugging Face folder with the bundled tokenizer."""
    import transformers

    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("smollm2-shapes")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOLLM2))
    model.to(torch.bfloat16).eval().save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(path)
    return str(path)


class StepTrace:
    """One static step of the fake-CUDA engine: its audit, what the bindings saw, the Triton launches' devices."""

    def __init__(self, engine, audit: StepAudit, bindings: CudaBindings, syncs: list, triton_devices: list,
                 outputs) -> None:
        self.engine, self.audit, self.bindings, self.syncs = engine, audit, bindings, syncs
        self.triton_devices, self.outputs = triton_devices, outputs

    def problems(self) -> list[str]:
        a, b = self.audit, self.bindings
        off = [f"Triton {name} with tensors on {devices}" for name, devices in self.triton_devices
               if devices != ("cuda",)]
        return ([f"mixed devices: {m}" for m in a.mixed] + [f"copy: {c}" for c in a.copies + b.copies]
                + [f"host read: {r}" for r in a.host_reads + b.host_reads + self.syncs] + off)


def trace_static_step(folder: str, triton: bool, rows=ROWS, context: int = CONTEXT) -> StepTrace:
    """Load the engine on the fake device (Triton kernels stubbed, or switched off), make the rows' sequences (host
    bookkeeping and sealing on fake tensors) and run StaticStep.forward once under the audit."""
    from oval_edge import OvalConfig
    from oval_edge.runtime import Engine, EngineConfig
    from oval_edge.runtime.model import decoder_build, weight_stream
    from oval_edge.runtime.model.quantize import import_bitsandbytes

    import_bitsandbytes()  # before torch.cuda says yes: its CPU build registers the ops (with fake kernels)
    syncs: list = []
    audits: list = []
    triton_devices: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OVAL_EDGE_NATIVE", "0")  # the C kernels are CPU code: nothing of theirs runs on a GPU
        patch.setenv("OVAL_EDGE_WEIGHT_CACHE", "0")
        patch.setenv("OVAL_EDGE_TRITON", "1" if triton else "0")
        answer_like_an_orin(patch, syncs)
        if triton:
            pytest.importorskip("triton")
            stub_triton_launches(patch, audits, triton_devices)
        clear_triton_loaders()
        for cls in (weight_stream.SafetensorsWeights, weight_stream.GGUFWeights):  # file reads stay real tensors
            for name in ("read", "read_rows"):
                patch.setattr(cls, name, _real_read(getattr(cls, name)))
        patch.setattr(decoder_build, "linear4bit", fake_linear4bit)
        bindings = CudaBindings()
        try:
            with fake_mode(), bindings:
                engine = Engine.load(folder, quant="nf4", device="cuda", oval=OvalConfig(),
                                     config=EngineConfig(num_pages=1100, max_batch=4, max_model_len=context,
                                                         cuda_graphs=False, prefix_cache=False))
                for seq_id, length in rows:
                    assert engine.pool.allocate(seq_id, length + 64) is not None
                    engine.pool.advance([seq_id], [length])
                step = engine.static.load([sid for sid, _ in rows], [11 + i for i in range(len(rows))])
                bindings.host_reads.clear()
                bindings.copies.clear()
                del syncs[:]
                audit = StepAudit()
                audits.append(audit)
                bindings.audits.append(audit)
                with torch.inference_mode(), audit:  # as the engine runs it (StaticDecoder.decode)
                    outputs = step.forward()
                audits.clear()
                bindings.audits.clear()
                trace = StepTrace(engine, audit, bindings, list(syncs), triton_devices, outputs)
                trace.width = step.width
                return trace
        finally:
            clear_triton_loaders()


def _real_read(read):
    def real(self, *args):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return read(self, *args)
    return real


@pytest.fixture(scope="module")
def torch_ops_step(smollm2_folder) -> StepTrace:
    return trace_static_step(smollm2_folder, triton=False)


@pytest.fixture(scope="module")
def triton_step(smollm2_folder) -> StepTrace:
    return trace_static_step(smollm2_folder, triton=True)


def _report(label: str, trace: StepTrace) -> str:
    top = ", ".join(f"{name.removeprefix('aten.').removesuffix('.default')} {count}"
                    for name, count in trace.audit.launches.most_common(8))
    return (f"[{label}] launches per step: {trace.audit.total} (budget {LAUNCH_BUDGETS[label]}); "
            f"temporaries peak {trace.audit.peak / 2**20:.1f} MiB; most launched: {top}")


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_the_static_step_on_cuda_stays_on_the_device_within_its_launch_budget(path, request):
    trace = request.getfixturevalue("triton_step" if path == "triton" else "torch_ops_step")
    logits, stats = trace.outputs
    assert logits.device.type == "cuda" and tuple(logits.shape) == (4, SMOLLM2["vocab_size"])
    assert stats.device.type == "cuda"
    assert trace.problems() == []
    if path == "triton":  # the Triton kernels did run (stubbed), on CUDA tensors only
        launched = {name for name, _ in trace.triton_devices}
        assert {"_oval_kernel", "_attend_kernel"} <= launched, launched
    else:
        assert not any(name.startswith("triton.") for name in trace.audit.launches)
    print(_report(path, trace))
    assert trace.audit.total <= LAUNCH_BUDGETS[path], _report(path, trace)


def test_a_short_batch_on_the_torch_path_takes_a_narrow_step(smollm2_folder, torch_ops_step, triton_step):
    """The torch ops score every listed page and the dense layers read the whole table: a batch of short rows takes
    the narrowest page-table width bucket holding it (StaticDecoder.widths), not max_model_len's 256 pages."""
    short = trace_static_step(smollm2_folder, triton=False, rows=(("a", 900), ("b", 90)))
    assert torch_ops_step.width == 256 and triton_step.width == 256 and short.width == 32  # 901 tokens: 29 pages
    assert short.problems() == []
    print(f"[torch, rows of 900 and 90] launches {short.audit.total}, temporaries peak "
          f"{short.audit.peak / 2**20:.1f} MiB (8k-wide step: {torch_ops_step.audit.peak / 2**20:.1f} MiB)")
    assert short.audit.peak < torch_ops_step.audit.peak / 4


@pytest.mark.parametrize("batch,context", [(1, 2048), (4, 2048), (1, 8192), (4, 8192)])
def test_decode_graph_bytes_counts_the_torch_steps_temporaries(smollm2_folder, torch_ops_step, batch, context):
    """step_peak_bytes (what decode_graph_bytes adds to the graphs' outputs) against the peak of the bytes the
    torch-ops step allocates, measured in the trace, with rows long enough for the widest page table."""
    from oval_edge.geometry import KVGeometry
    from oval_edge.step_memory import STEP_BYTES_TOLERANCE, step_peak_bytes

    rows = (("a", context - 100), ("b", context // 3), ("c", 90), ("d", 500))[:batch]
    trace = torch_ops_step if (batch, context) == (4, CONTEXT) else \
        trace_static_step(smollm2_folder, triton=False, rows=rows, context=context)
    geometry = trace.engine.pool.geometry
    assert isinstance(geometry, KVGeometry) and geometry.record == "int4"
    act = torch.finfo(trace.engine.runner.decoder.norm.weight.dtype).bits // 8
    s = SMOLLM2
    want = step_peak_bytes(s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["vocab_size"],
                           geometry, batch, context, act)
    print(f"[torch, batch {batch}, {context} tokens] temporaries peak measured {trace.audit.peak / 2**20:.2f} MiB, "
          f"step_peak_bytes {want / 2**20:.2f} MiB")
    assert abs(want - trace.audit.peak) <= STEP_BYTES_TOLERANCE * trace.audit.peak


def int4_layer(seed: int, dtype: torch.dtype):
    """One layer's int4 records of 40 pages (3 KV heads, D = 64, r = 8, P = 32; random keys' records), a query
    [4, 3, 3, 64] in `dtype` and a page table [4, 17] listing some of the pages."""
    from oval_edge.kv.records import page_record

    generator = torch.Generator().manual_seed(seed)
    heads, pages, rank, dim, page = 3, 40, 8, 64, 32
    basis = torch.linalg.qr(torch.randn(heads, pages, dim, rank, generator=generator)).Q.transpose(-1, -2)
    stored = page_record.encode(torch.randn(heads, pages, dim, generator=generator), basis,
                                3 * torch.randn(heads, pages, rank, page, generator=generator), "int4", torch.float32)
    records = page_record.LayerRecords(stored["mean"], stored["basis"], stored["coords"], stored["scales"])
    q = torch.randn(4, heads, 3, dim, generator=generator).to(dtype)
    return records, q, torch.randint(0, pages, (4, 17), generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_scorer_scores_int4_records_as_record_scores_does(dtype):
    from oval_edge.kv.records.page_record import Rotations
    from oval_edge.sparse.packed_scores import PackedScorer
    from oval_edge.sparse.scoring import record_scores

    records, q, table = int4_layer(0, dtype)
    scorer = PackedScorer(q.shape[-1], 0.125, "cpu", Rotations())
    assert scorer.takes(records)
    torch.testing.assert_close(scorer(q, records, table), record_scores(q, records, table, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_rotations_are_built_once_per_dim_device_and_dtype():
    from oval_edge.kv.records.page_record import Rotations, rotation

    rotations = Rotations()
    first = rotations.get(96, "cpu")
    assert rotations.get(96, torch.device("cpu")) is first
    torch.testing.assert_close(first, rotation(96))
    assert rotations.get(96, "cpu", torch.bfloat16).dtype == torch.bfloat16
    built: list = []  # the other constants (PackedScorer's level table): one build per name and device
    table = rotations.constant("table", "cpu", lambda device: built.append(device) or torch.ones(3, device=device))
    assert rotations.constant("table", torch.device("cpu"), lambda device: torch.zeros(3)) is table
    assert built == [torch.device("cpu")]


def test_packed_scorer_launches_18_kernels_a_layer_none_hidden():
    """The torch path's scorer per sparse layer: 18 launches, and none hidden inside an op: no lookup indexes with
    int32 codes (aten's `index` converts them to int64 first, one more kernel and buffer than the audit sees) and
    no batched matmul operand whose batch dims cannot be merged into one stride (torch.matmul copies it first)."""
    from oval_edge.kv.records.page_record import Rotations
    from oval_edge.sparse.packed_scores import PackedScorer

    records, q, table = int4_layer(1, torch.bfloat16)
    scorer = PackedScorer(q.shape[-1], 0.125, "cpu", Rotations())
    assert scorer.takes(records)  # builds the tables: a step only reads them
    hidden: list[str] = []

    class Hidden(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.int32 for i in args[1]):
                hidden.append("index with int32 indices")
            if name == "aten.matmul.default" and args[0].dim() > 3 and not all(
                    _batch_merges(t) for t in args if t.dim() > 2):
                hidden.append(f"matmul copying an operand of strides {[t.stride() for t in args]}")
            return func(*args, **(kwargs or {}))

    audit = StepAudit()
    with torch.inference_mode(), audit, Hidden():
        scorer(q, records, table)
    assert hidden == []
    assert audit.total == 18, audit.launches


def _batch_merges(t: torch.Tensor) -> bool:
    """Whether the batch dims of a batched matmul operand [..., m, n] merge into one stride (as torch.matmul reshapes
    them for its bmm) without a copy."""
    sizes, strides = t.shape[:-2], t.stride()[:-2]
    return all(size == 1 or stride == strides[i + 1] * sizes[i + 1]
               for i, (size, stride) in enumerate(zip(sizes[:-1], strides[:-1])))


@pytest.mark.parametrize("kind", ["qwen3_5", "lfm2", "gemma4"])
@pytest.mark.parametrize("triton", [False, True])
def test_a_hybrid_or_gemma4_step_on_cuda_stays_on_the_device(tmp_path, kind, triton):
    """Qwen3.5 / LFM2 (state layers updating each row's state slot in place, a gated full-attention layer) and
    Gemma 4 (rings of head dim 64 beside pages of 128, shared layers reading their sources, per-layer inputs) on the
    fake CUDA device, NF4 weights, rows of 900 and 90 tokens in a bucket of 2: no op mixes devices, nothing crosses
    between host and device, the host never waits."""
    import transformers

    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=4, vocab_size=49152, max_position_embeddings=2048)
    if kind == "lfm2":
        config = transformers.Lfm2Config(**shape, layer_types=["conv", "full_attention", "conv", "full_attention"])
    elif kind == "gemma4":
        config = transformers.Gemma4TextConfig(
            **(shape | dict(num_hidden_layers=6)), head_dim=64, global_head_dim=128, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
            hidden_size_per_layer_input=64, vocab_size_per_layer_input=49152, use_double_wide_mlp=True,
            final_logit_softcapping=30.0, pad_token_id=0)
    else:
        config = transformers.Qwen3_5TextConfig(**shape, head_dim=64, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=64,
                                                linear_value_head_dim=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().save_pretrained(tmp_path)
    load_tokenizer(resolve_model("default")).save_pretrained(tmp_path)
    trace = trace_static_step(str(tmp_path), triton=triton, rows=(("a", 900), ("b", 90)), context=2048)
    logits, stats = trace.outputs
    assert logits.device.type == "cuda" and tuple(logits.shape) == (2, 49152)
    assert trace.problems() == []
    if kind == "gemma4":
        assert trace.engine.pool.geometry.shared == ((4, 2), (5, 3))
        return
    assert trace.engine.pool.states is not None and any(op.state is not None for op in trace.engine.runner.ops)
    if triton and kind == "qwen3_5":  # the DeltaNet step through triton_delta: 3 layers, one launch each
        launched = [name for name, _ in trace.triton_devices]
        assert launched.count("_delta_step_kernel") == 3, launched
