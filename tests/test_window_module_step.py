"""The calibrated window module inside the static decode step ([R-static-step], [R-window-module]).

An engine with `window_module` set runs the one static step with the module's windows as a step input: the startup
report says so, the step reads no tensor on the host and keeps its ops at every length, it traces whole under
torch.compile(fullgraph=True) with no recompiles, and its logits equal the eager reference (tests/eager_decode.py)
given the same module as its per-layer window.
"""

from __future__ import annotations

import os

import pytest
import torch
from eager_decode import eager_decode
from test_static_step import ADAPTIVE, engine_for, prefill, static_step, tiny_folder, traced_step  # noqa: F401

from oval_edge.runtime.engine.forward.static_step import StaticDecoder
from oval_edge.sparse.window_module import ModuleCard, OutputAwareModule, WindowHook, save_module


@pytest.fixture(scope="module")
def module_config(tiny_folder, tmp_path_factory):  # noqa: F811
    """ADAPTIVE (windows in [16, 48]) with a calibrated-looking module for the tiny Llama (3 layers, hidden 128)."""
    card = ModuleCard(model=os.path.basename(tiny_folder), num_layers=3, hidden_size=128, kv_heads=2, first_layer=1,
                      width=8, bins=8, max_position=4096, calibrated=True, window_range=(16, 48))
    torch.manual_seed(5)
    module = OutputAwareModule(card)
    with torch.no_grad():  # spread the reaches over [0, 1]: a fresh init predicts about one window everywhere
        module.w2.mul_(6.0)
        module.b2.normal_(0.0, 2.0)
    path = save_module(module.eval(), str(tmp_path_factory.mktemp("module") / "module.safetensors"))
    return ADAPTIVE.replace(window_module=path)


def test_the_engine_runs_the_static_step_with_the_module_and_reads_no_host_value(tiny_folder, module_config,
                                                                                   monkeypatch):
    engine = engine_for(tiny_folder, oval=module_config)
    report = engine.describe_decode_step()
    assert report.startswith("static step") and "window module" in report
    assert engine.static.policy.graph_safe()  # would be captured into CUDA graphs on CUDA
    for seq_id, length in (("a", 299), ("b", 699)):
        prefill(engine, seq_id, length, seed=length)
    traces = [traced_step(engine, ["a"], [7], monkeypatch), traced_step(engine, ["b"], [8], monkeypatch)]
    for trace in traces:
        assert trace.host_reads == [] and trace.device_copies == []
    assert traces[0].calls == traces[1].calls  # the same ops and shapes at 300 and 700 tokens


def test_module_windows_in_the_static_step_equal_the_eager_reference(tiny_folder, module_config):
    static, eager = engine_for(tiny_folder, oval=module_config), engine_for(tiny_folder, oval=module_config)
    hook = static.static.policy.window.hook  # the module the engine loaded
    seq_ids = ["short", "long", "longer"]
    for engine in (static, eager):
        for seq_id, length in zip(seq_ids, (20, 400, 900)):
            prefill(engine, seq_id, length, seed=length)
    tokens, windows = [3, 4, 5], []
    for _ in range(20):
        logits, stats = static_step(static, seq_ids, tokens)
        step = eager.pool.prepare(seq_ids, [1] * 3)
        want, want_stats, rows = eager_decode(eager.runner, step, torch.tensor(tokens),
                                              window=WindowHook(hook.module, 16, 48))
        eager.pool.commit(step)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        assert stats.attended_tokens == want_stats.attended_tokens
        windows.append(stats.window_mean)
        tokens = want.argmax(-1).tolist()
    plain = engine_for(tiny_folder, oval=ADAPTIVE)  # not vacuous: the module's windows differ from the entropy rule
    for seq_id, length in zip(seq_ids, (20, 400, 900)):
        prefill(plain, seq_id, length, seed=length)
    _, plain_stats = static_step(plain, seq_ids, [3, 4, 5])
    assert plain_stats.window_mean != pytest.approx(windows[0])


def test_the_step_with_the_module_compiles_whole_without_recompiles(tiny_folder, module_config):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = (engine_for(tiny_folder, oval=module_config, max_batch=1) for _ in range(2))
    compiled.static = StaticDecoder(compiled.runner, 1, compiled.token_limit(), compile_backend="aot_eager",
                                    policy=compiled.static.policy)
    for engine in (eager, compiled):
        prefill(engine, "r", 300)
    token = 5
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(60):  # crosses pages: new sealed pages, more candidates
            want, _ = static_step(eager, ["r"], [token])
            got, _ = static_step(compiled, ["r"], [token])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            token = int(want[0].argmax())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
