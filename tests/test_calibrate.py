"""`oval-edge calibrate` (issue 10): the statistics are the true dense-attention ones, the scorer fit uses the
runtime's score, the fit learns a step-dependent window, and a short calibration writes a module that loads and
eta / rank into a config that `serve --config` reads. The window policies of `oval-edge eval` use the module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oval_reference import output_metric
from transformers import LlamaConfig, LlamaForCausalLM

from oval_edge import OvalConfig
from oval_edge.cli import main
from oval_edge.geometry import KVGeometry
from oval_edge.kv.pool import PagePool
from oval_edge.kv.records.summaries import oval_summary
from oval_edge.runtime.config_file import load_config_file, oval_config
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.engine.forward.step_policy import StepPolicy
from oval_edge.runtime.model.loader import LoadedModel
from oval_edge.runtime.model.origin.source import ModelSource
from oval_edge.sparse.scoring import score_pages
from oval_edge.sparse.window_module import ModuleCard, load_module, save_module
from oval_edge.tools.calibrate.capture import capture, layer_queries, window_targets
from oval_edge.tools.calibrate.fit import FitSettings, fit_module, fit_report, heldout_mask
from oval_edge.tools.calibrate.report import update_config
from oval_edge.tools.calibrate.run import CalibrationSettings, calibrate
from oval_edge.tools.calibrate.scorer import ScorerTally, page_scores
from oval_edge.tools.eval.fidelity import run_fidelity
from oval_edge.tools.eval.policies import build_policies
from oval_edge.tools.eval.report import fidelity_records, fidelity_table, write_plot
from oval_edge.tools.eval.runtime import geometry_for


def tiny_loaded() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, None, ModelSource("/nonexistent", None, "tiny"), "none", torch.device("cpu"),
                       torch.float32, 0, 0.0)


def tiny_settings(**changes) -> CalibrationSettings:
    config = OvalConfig(page_size=16, top_k=2, window_min=16, window_max=16, dense_layers=1, kv_dtype="float32")
    values = dict(config=config, window_range=(4, 32), start=64, stride=2, scorer_stride=4, etas=(0.0, 0.5, 1.0),
                  ranks=(2, 4), width=8, fit=FitSettings(steps=60, batch=64))
    values.update(changes)
    return CalibrationSettings(**values)


# ---- statistics --------------------------------------------------------------------------------------------------

def test_window_targets_are_those_of_dense_attention():
    torch.manual_seed(1)
    n, kv_heads, group, d, P = 96, 2, 2, 8, 16
    keys = torch.randn(n, kv_heads, d)
    positions = torch.tensor([40, 63, 95])
    queries = 2 * torch.randn(3, kv_heads * group, d)
    config = OvalConfig(page_size=P, window_min=16, window_max=16)
    share, reach, scale = 0.7, 24, d**-0.5
    targets = window_targets(queries, keys, positions, config, share, reach, scale, chunk=2)
    for s, t in enumerate(positions.tolist()):
        for h in range(kv_heads):
            probs = torch.stack([torch.softmax(queries[s, h * group + g] @ keys[: t + 1, h].T * scale, 0)
                                 for g in range(group)]).mean(0)  # [t + 1]: the group's mean attention
            local = [probs[t - dist].item() if t - dist >= P else 0.0 for dist in range(reach)]  # sink: page 0
            total, running, want = sum(local), 0.0, None
            for dist, m in enumerate(local):
                running += m
                if running >= share * total:
                    want = dist + 1
                    break
            assert targets[s, h].item() == want


def test_scorer_fit_scores_pages_and_measures_the_output_as_the_runtime_does():
    torch.manual_seed(2)
    pages, kv_heads, P, d, group, r = 6, 2, 16, 16, 3, 4
    n = pages * P
    geometry = KVGeometry(1, kv_heads, d, P, "float32", ("oval",), r)
    pool = PagePool(geometry, pages, eta=0.5)
    metric = output_metric(1, kv_heads, d)  # [1, Hkv, D, D]: the output projection's G^{1/2} stand-in
    pool.set_output_metric(list(metric))
    keys, values = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    pool.allocate("s", n)
    step = pool.prepare(["s"], [n])
    pool.write(0, step, keys, values)
    pool.commit(step)  # seals every page: the pool's own summaries
    q = 3 * torch.randn(7, kv_heads, group, d)
    table = torch.tensor(pool.page_table("s"))[None].expand(7, -1)
    runtime = score_pages("oval", q, pool.summaries, 0, table, 0.25)  # the runtime's scorer
    kp = keys.view(pages, P, kv_heads, d).transpose(1, 2).reshape(-1, P, d)  # [Np * Hkv, P, D] as pages
    vp = values.view(pages, P, kv_heads, d).transpose(1, 2).reshape(-1, P, d)
    mean, basis_t, coords_t = oval_summary(kp, vp, r, 0.5, metric[0].repeat(pages, 1, 1))
    got = page_scores(q, mean.view(pages, kv_heads, d), basis_t.view(pages, kv_heads, r, d),
                      coords_t.view(pages, kv_heads, r, P), 0.25)
    torch.testing.assert_close(got, runtime, atol=1e-4, rtol=1e-4)
    # Output error of one decode step at position t, by brute force over the runtime's selection.
    t, config = n - 1, OvalConfig(page_size=P, top_k=2, window_min=16, window_max=16)
    tally = ScorerTally([0.5], [r], config, d)
    tally.add(q[:1].flatten(1, 2), keys, values, torch.tensor([t]), torch.tensor([False]), 0.25, metric=metric[0])
    start = min(t + 1 - 16, (t // P) * P)
    err = norm = 0.0
    for h in range(kv_heads):
        candidates = [p for p in range(1, pages) if p * P < start]
        chosen = sorted(candidates, key=lambda p: -runtime[0, h, p].item())[:2]
        keep = torch.tensor([i < P or i >= start or (i // P in chosen) for i in range(t + 1)])
        for g in range(group):
            logits = 0.25 * keys[: t + 1, h] @ q[0, h, g]
            dense = torch.softmax(logits, 0) @ values[: t + 1, h]
            sparse = torch.softmax(logits.masked_fill(~keep, float("-inf")), 0) @ values[: t + 1, h]
            err += (sparse - dense).pow(2).sum().item()
            norm += dense.pow(2).sum().item()
    assert tally.result().table[0]["error_calibration"] == pytest.approx(err / norm, rel=1e-4)


def test_recorded_states_rebuild_the_queries_the_runtime_decodes_with():
    loaded = tiny_loaded()
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(3))
    cap = capture(loaded, ids.tolist(), 16)
    config = OvalConfig(page_size=16, top_k=8, window_min=16, window_max=16, dense_layers=1, kv_dtype="float32")
    pool = PagePool(geometry_for(loaded.config, 16, 4), 8)
    runner = PagedLlama(loaded.model, pool, config)
    seen = {}

    def record(layer, grouped, page_table, sealed, lengths):  # the static step's scorer input (step_policy.py)
        seen[layer] = grouped.reshape(grouped.shape[0], -1, grouped.shape[-1]).clone()  # [1, Hq, D]
        return torch.zeros(1, 2, page_table.shape[1])

    decoder = runner.static_decoder(StepPolicy(scores=record), rows=1)
    pool.allocate("s", 100)
    step = pool.prepare(["s"], [99])
    runner.forward(step, ids[:99], decode=False)
    pool.commit(step)
    decoder.decode(["s"], [int(ids[99])])
    assert sorted(seen) == [1, 2, 3]
    for layer, q in seen.items():
        torch.testing.assert_close(layer_queries(cap, layer, torch.tensor([99])), q, atol=1e-4, rtol=1e-4)


# ---- the fit ---------------------------------------------------------------------------------------------------

def test_fit_learns_a_window_that_depends_on_the_state_and_beats_a_per_head_constant():
    torch.manual_seed(4)
    samples, layers, hidden_size = 800, 2, 16
    hidden = torch.randn(samples, layers, hidden_size)
    positions = torch.arange(samples) * 3
    # Head 0 needs a window set by the state; head 1 a constant one: the best step-blind rule misses head 0.
    u = torch.sigmoid(2 * hidden[..., 0])  # [S, Ls]
    targets = torch.stack([8 + u * 48, torch.full_like(u, 20.0)], dim=-1)  # [S, Ls, 2] tokens in [8, 56]
    card = ModuleCard(model="synthetic", num_layers=3, hidden_size=hidden_size, kv_heads=2, first_layer=1,
                      width=16, window_range=(8, 56))
    train = ~heldout_mask(positions)
    module = fit_module(card, hidden, positions, targets, train, FitSettings(steps=400, batch=128, noise=0.1))
    held = fit_report(module, hidden, positions, targets, train)["heldout"]
    assert held["mae_tokens"] < 0.6 * held["mae_per_head_constant"], held
    assert held["r2"] > held["r2_per_head_constant"] + 0.3, held


# ---- end to end ------------------------------------------------------------------------------------------------

def test_calibrate_writes_a_loadable_module_and_eta_rank_into_a_config(tmp_path):
    loaded = tiny_loaded()
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    result = calibrate(loaded, ids, tiny_settings(), show_progress=False)
    card = result.module.card
    assert card.calibrated and card.first_layer == 1 and card.window_range == (4, 32)
    assert (card.eta, card.rank) == (result.scorer.eta, result.scorer.rank)
    assert result.scorer.eta in (0.0, 0.5, 1.0) and result.scorer.rank in (2, 4)
    assert len(result.scorer.table) == 6 * 3 + 1  # every (eta, rank, record) and the oracle
    oracle = result.scorer.table[-1]["error_calibration"]
    assert all(0 <= oracle <= row["error_calibration"] for row in result.scorer.table)  # top-k by mass: the floor
    error = {(row["eta"], row["rank"], row["record"]): row["error_calibration"] for row in result.scorer.table}
    chosen, reference = result.scorer.record, error[(card.eta, card.rank, "float")]
    assert error[(card.eta, card.rank, chosen)] <= 1.02 * reference  # the frozen record is within tolerance ...
    compact = ("int4", "int8", "float")
    assert all(error[(card.eta, card.rank, fmt)] > 1.02 * reference  # ... and none more compact is
               for fmt in compact[: compact.index(chosen)])
    assert result.report["heldout"]["positions"] > 0 and result.report["calibration"]["positions"] > 0
    path = save_module(result.module, str(tmp_path / "window.safetensors"))
    back = load_module(path, model_config=loaded.config, model_name="tiny")
    assert back.card == card
    config_path = str(tmp_path / "oval-edge.toml")
    (tmp_path / "oval-edge.toml").write_text('[model]\nquant = "nf4"\n\n[oval]\ntop_k = 6\n')
    update_config(config_path, card.eta, card.rank, record=result.scorer.record)
    sections = load_config_file(config_path)
    oval = oval_config(sections)
    assert (oval.eta, oval.rank, oval.top_k, oval.window_module) == (card.eta, card.rank, 6, None)
    assert oval.record == result.scorer.record
    assert sections["model"]["quant"] == "nf4"  # the rest of the file is kept
    update_config(config_path, card.eta, card.rank, (path, 8, 48))
    oval = oval_config(load_config_file(config_path))
    assert (oval.window_module, oval.window_min, oval.window_max) == (path, 8, 48)


def test_eval_window_policies_use_the_module_and_stay_exact_when_the_budget_covers_the_context(tmp_path):
    loaded = tiny_loaded()
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(6)).tolist()
    module = calibrate(loaded, ids, tiny_settings(), show_progress=False).module
    windows = {"entropy": (4, 32), "module": (4, 32)}
    base = OvalConfig(page_size=16, top_k=1, window_min=16, window_max=16, dense_layers=1, kv_dtype="float32")
    policies = build_policies(["oval", "entropy", "module"], [1], [0.5], windows)
    assert [p.label for p in policies] == ["dense", "oval eta=0.5 k=1", "entropy W4-32 k=1", "module W4-32 k=1"]
    rows = run_fidelity(loaded, ids, 260, base, policies, [16], show_progress=False, window_module=module)
    for row in rows[2:]:
        assert 4 <= row.window_mean <= 32 and row.tokens_attended is not None
    assert rows[1].window_mean == 16
    assert rows[2].window_mean != rows[3].window_mean  # two different window rules really ran
    records = fidelity_records(rows)
    table = fidelity_table(records)
    assert "module W4-32" in table and f"{rows[3].tokens_attended:.0f}/{rows[3].window_mean:.0f}" in table
    write_plot(str(tmp_path / "eval.png"), records, "tiny")  # window rows plotted at what they attended
    assert records[3]["window_range"] == (4, 32) and records[3]["window_mean"] == rows[3].window_mean
    full = run_fidelity(loaded, ids, 260, dataclasses.replace(base, top_k=17), build_policies(
        ["module"], [17], [0.5], windows), [16], show_progress=False, window_module=module)
    assert full[1].kl <= 1e-6 and full[1].top1 == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--window-range", "64,16"], "--window-range"),
    (["--share", "1.5"], "--share"),
    (["--text", "/nonexistent/text.txt"], "--text"),
    (["--enable-module"], "--write-config"),
    (["--length", "256", "--start", "300"], "--start"),
])
def test_bad_calibrate_options_fail_before_the_model_loads(argv, message, capsys):
    assert main(["calibrate", "--out", "/tmp/unused.safetensors", *argv]) == 2
    assert message in capsys.readouterr().err


def test_eval_module_policy_needs_a_module_file(capsys):
    assert main(["eval", "--policies", "oval,module"]) == 2
    assert "--window-module" in capsys.readouterr().err
