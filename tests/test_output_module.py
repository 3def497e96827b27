"""The output-aware window module (issue 10): its windows stay in range, it is refused until calibrated, it is off
in training mode, the runtime uses its windows (and stays exact when the budget covers the context), and its ONNX
export agrees with PyTorch at any batch size."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oval_edge import OvalConfig
from oval_edge.cli import main
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.config_file import load_config_file
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.engine.forward.step_policy import StepPolicy, WindowModuleInput
from oval_edge.sparse.window_module import (ModuleCard, OutputAwareModule, WindowHook, load_module, save_module,
                                            window_hook, window_lengths)
from oval_edge.tools.eval.runtime import geometry_for
from oval_edge.tools.export_onnx import check_onnx, export_onnx


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def tiny_card(**changes) -> ModuleCard:
    values = dict(model="tiny", num_layers=4, hidden_size=64, kv_heads=2, first_layer=1, width=8, bins=8,
                  max_position=2048, calibrated=True, window_range=(4, 40))
    values.update(changes)
    return ModuleCard(**values)


def spread_module(card: ModuleCard, seed: int = 1) -> OutputAwareModule:
    """Random weights scaled up so that reaches spread over [0, 1] (a fresh init sits near one value)."""
    torch.manual_seed(seed)
    module = OutputAwareModule(card)
    with torch.no_grad():
        module.w2.mul_(6.0)
        module.b2.normal_(0.0, 2.0)
    return module.eval()


# ---- the window it yields --------------------------------------------------------------------------------------

@pytest.mark.parametrize("lo,hi", [(3, 4), (3, 64), (16, 128), (64, 256)])
def test_windows_stay_in_range_and_never_below_three(lo, hi):
    module = spread_module(tiny_card())
    hook = WindowHook(module, lo, hi)
    x = 5 * torch.randn(257, 64)
    step = type("Step", (), {"positions": torch.randint(0, 2048, (257,)), "lengths": torch.zeros(257)})()
    windows = torch.stack([hook(layer, x, step) for layer in range(1, 4)])  # [3, 257, Hkv]
    assert windows.dtype == torch.long and windows.shape == (3, 257, 2)
    assert int(windows.min()) >= max(3, lo) and int(windows.max()) <= hi
    assert windows.unique().numel() >= min(3, hi - lo + 1)  # the module really varies the window
    edges = window_lengths(torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0]), lo, hi)
    assert edges.tolist() == [lo, lo, lo + round(0.5 * (hi - lo)), hi, hi]
    assert hook(0, x, step) is None  # dense layer: no weights for it


def test_window_is_linear_in_the_normalised_entropy_plus_offset():
    module = spread_module(tiny_card())
    hidden, positions = torch.randn(6, 3, 64), torch.randint(0, 2048, (6,))
    weights, offset, reach = module(hidden, positions)
    entropy = -(weights * weights.log()).sum(-1) / torch.log(torch.tensor(8.0))
    torch.testing.assert_close(reach, (entropy + offset).clamp(0, 1))
    assert offset.abs().max() <= 0.5
    per_layer = torch.stack([module.layer_reach(layer, hidden[:, layer - 1], positions) for layer in (1, 2, 3)], 1)
    torch.testing.assert_close(per_layer, reach, atol=1e-6, rtol=0)


# ---- refused until calibrated; off in training ----------------------------------------------------------------

def test_untrained_weights_are_refused_at_load_pointing_to_calibrate(tmp_path):
    untrained = OutputAwareModule(tiny_card(calibrated=False))
    path = save_module(untrained, str(tmp_path / "untrained.safetensors"))
    with pytest.raises(ValueError, match="untrained.*oval-edge calibrate"):
        load_module(path)
    with pytest.raises(ValueError, match="not calibrated.*oval-edge calibrate"):
        WindowHook(untrained, 16, 64)
    with pytest.raises(ValueError, match="does not exist.*oval-edge calibrate"):
        load_module(str(tmp_path / "missing.safetensors"))
    assert main(["export-onnx", "--module", path]) == 2
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an oval-edge window module.*oval-edge calibrate"):
        load_module(str(tmp_path / "other.safetensors"))


def test_a_calibrated_file_loads_and_is_checked_against_the_model(tmp_path):
    module = spread_module(tiny_card())
    path = save_module(module, str(tmp_path / "m.safetensors"))
    model = tiny_model()
    back = load_module(path, model_config=model.config, model_name="tiny")
    hidden, positions = torch.randn(3, 3, 64), torch.arange(3)
    for got, want in zip(back(hidden, positions), module(hidden, positions)):
        torch.testing.assert_close(got, want)
    other = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="another model geometry.*kv_heads 2 != 4"):
        load_module(path, model_config=other)
    with pytest.raises(ValueError, match="calibrated for model 'tiny', not 'other'"):
        load_module(path, model_name="other")


def test_training_mode_disables_the_module():
    module = spread_module(tiny_card())
    hook = WindowHook(module, 4, 40)
    x = torch.randn(2, 64)
    step = type("Step", (), {"positions": torch.tensor([100, 200]), "lengths": torch.zeros(2)})()
    assert hook(2, x, step) is not None
    module.train()
    assert hook(2, x, step) is None
    module.eval()
    assert hook(2, x, step) is not None


# ---- in the runtime ---------------------------------------------------------------------------------------------

def _decode(model, config: OvalConfig, window, ids: torch.Tensor, prefix: int, steps: int, attention="oval"):
    """Dense prefill of ids[:prefix], then `steps` static decode steps with `window` as the step's window input
    (None: the config's rule); returns the logits and each step's sparse-layer selections."""
    pool = PagePool(geometry_for(model.config, config.page_size, config.rank, kinds=("oval",)), 16)
    runner = PagedLlama(model, pool, config, attention=attention)
    picked = []
    decoder = runner.static_decoder(StepPolicy(window=window, selected=lambda layer, q, sel: picked.append(sel)),
                                    rows=1)
    pool.allocate("s", prefix + steps)
    step = pool.prepare(["s"], [prefix])
    runner.forward(step, ids[:prefix], decode=False)
    pool.commit(step)
    logits, selections = [], []
    for pos in range(prefix, prefix + steps):
        out, _, lengths = decoder.decode(["s"], [int(ids[pos])])
        pool.advance(["s"], lengths)
        logits.append(out[0])
        selections.append(list(picked))
        picked.clear()
    return torch.stack(logits), selections


def test_runtime_uses_the_module_windows_and_training_mode_falls_back_to_the_config_rule():
    model = tiny_model()
    config = OvalConfig(page_size=16, top_k=1, window_min=4, window_max=40, dense_layers=1, kv_dtype="float32")
    module = spread_module(tiny_card(), seed=3)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    hook = WindowModuleInput(WindowHook(module, config.window_min, config.window_max))
    seen = []

    def recording(layer, x, positions):
        windows = hook(layer, x, positions)
        if windows is not None:
            seen.append(windows)
        return windows

    with_module, selections = _decode(model, config, recording, ids, 150, 6)
    sparse = [sel.window for step in selections for sel in step]  # layers 1..3 (layer 0 is dense)
    assert len(sparse) == len(seen) == 18
    for got, want in zip(sparse, seen):
        assert torch.equal(got, want)
    module.train()
    fallback, selections_train = _decode(model, config, hook, ids, 150, 6)
    plain, selections_plain = _decode(model, config, None, ids, 150, 6)
    torch.testing.assert_close(fallback, plain, atol=0, rtol=0)
    assert not torch.allclose(with_module, plain, atol=1e-4)  # the module's windows changed the decode


def test_runtime_decode_with_the_module_stays_exact_when_the_budget_covers_the_context():
    model = tiny_model()
    # token budget (1 + 8) * 16 + 64 = 208 >= 200 tokens: every row attends densely, module or not.
    config = OvalConfig(page_size=16, top_k=8, window_min=4, window_max=64, dense_layers=1, kv_dtype="float32")
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(5))
    hook = WindowModuleInput(WindowHook(spread_module(tiny_card(), seed=4), config.window_min, config.window_max))
    with_module, _ = _decode(model, config, hook, ids, 180, 20)
    dense, _ = _decode(model, config, None, ids, 180, 20, attention="dense")
    assert (with_module - dense).abs().max() <= 1e-4


def test_config_wiring_validates_and_resolves_the_module_path(tmp_path):
    with pytest.raises(ValueError, match="window_module is set but window_min = window_max = 64"):
        OvalConfig(window_module="m.safetensors")
    with pytest.raises(ValueError, match="window_module=.* must be the path"):
        OvalConfig(window_module="", window_min=16, window_max=128)
    assert OvalConfig().window_module is None  # off by default
    save_module(spread_module(tiny_card()), str(tmp_path / "m.safetensors"))
    (tmp_path / "c.toml").write_text('[oval]\nwindow_module = "m.safetensors"\nwindow_min = 8\nwindow_max = 32\n')
    oval = OvalConfig.from_dict(load_config_file(str(tmp_path / "c.toml"))["oval"])
    assert oval.window_module == str(tmp_path / "m.safetensors")
    hook = window_hook(oval, tiny_model().config, "tiny")
    assert (hook.window_min, hook.window_max) == (8, 32)


# ---- ONNX -------------------------------------------------------------------------------------------------------

def test_onnx_export_matches_pytorch_at_two_batch_sizes_and_passes_the_checker(tmp_path):
    pytest.importorskip("onnxruntime")
    module = spread_module(tiny_card(num_layers=6, first_layer=2, kv_heads=2, hidden_size=64, width=16))
    path = export_onnx(module, str(tmp_path / "m.onnx"))
    diffs = check_onnx(module, path, batches=(1, 5))  # runs onnx.checker.check_model(full_check=True) first
    assert set(diffs) == {1, 5} and max(diffs.values()) <= 1e-5, diffs
    import onnx

    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert any(p.key == "oval_edge_window_module" for p in model.metadata_props)


def test_export_onnx_command_writes_and_checks(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    path = save_module(spread_module(tiny_card()), str(tmp_path / "m.safetensors"))
    assert main(["export-onnx", "--module", path, "--check-batches", "2,3"]) == 0
    out = capsys.readouterr().out
    assert "onnx.checker: ok" in out and "batch 3" in out and (tmp_path / "m.onnx").exists()
