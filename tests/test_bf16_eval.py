"""`oval-edge eval --dtype`: fidelity with bf16 activations (what CUDA runs) beside fp32, on the CPU.

`--dtype float32,bfloat16` loads the bundled model (as serve loads it: the GGUF's own blocks) once per dtype and
decodes both in lockstep (tools/eval/fidelity.py): every row against the fp32 dense reference (KL), and against the
dense row of its own activations and K/V storage (KL own). These tests run it end to end through the CLI, check the
bf16 lane against `--dtype bfloat16` alone (the lockstep must not change a lane's numbers), and bound what bf16
costs at the eval's forward (the eager paged forward, not the static step: tests/test_bf16_static_step.py).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from oval_edge.cli import main

TEXT = Path(__file__).resolve().parent.parent / "tools" / "data" / "botchan_ch1-2.txt"
# 96 teacher-forced steps at 544-639 tokens; page 16, k 2, window 32: 80 tokens read per step, sparse throughout
SETTINGS = ["--tasks", "fidelity", "--policies", "oval", "--text", str(TEXT), "--length", "640", "--start", "544",
            "--page-size", "16", "--top-k", "2", "--window", "32", "--kv-dtype", "bfloat16", "--no-exact",
            "--no-progress"]
# KL(fp32 dense || bf16 dense), nats per step, at these settings: measured 0.0009 (docs/bf16.md); the static step's
# test measured 0.0006-0.0015 over longer runs. ~3x the worst of those; a bf16 RoPE-angle bug measured ~1.0.
DENSE_KL_BOUND = 0.005
# OVAL's own cost (KL own of the oval row) under bf16 against under fp32: measured 0.118 vs 0.117. bf16
# must not change what OVAL costs by more than a quarter.
OVAL_OWN_CHANGE = 0.25


def eval_rows(folder: Path, dtype: str) -> tuple[list[dict], str]:
    """The fidelity rows (JSON) and the printed output of one eval run with --dtype `dtype`."""
    out, printed = folder / f"{dtype}.json", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["eval", "--dtype", dtype, "--json", str(out), *SETTINGS]) == 0
    return [r for r in json.loads(out.read_text()) if r["task"] == "fidelity"], printed.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{'both': rows of --dtype float32,bfloat16, 'both table': what it printed, 'bf16': rows of --dtype bfloat16}."""
    folder = tmp_path_factory.mktemp("bf16-eval")
    both, printed = eval_rows(folder, "float32,bfloat16")
    return {"both": both, "both table": printed, "bf16": eval_rows(folder, "bfloat16")[0]}


def row(rows: list[dict], policy: str, activations: str) -> dict:
    found = [r for r in rows if r["policy"] == policy and r["activations"] == activations]
    assert len(found) == 1, (policy, activations, rows)
    return found[0]


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "half"], "--dtype"),
    (["--dtype", "float32,bf16"], "--dtype"),
])
def test_bad_dtype_fails_before_the_model_loads(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_eval_prints_both_activations_side_by_side(runs):
    rows, table = runs["both"], runs["both table"]
    assert [(r["policy"], r["activations"], r["kv_dtype"]) for r in rows] == [
        ("dense", "float32", "bfloat16"), ("oval", "float32", "bfloat16"),
        ("dense", "bfloat16", "bfloat16"), ("oval", "bfloat16", "bfloat16")]
    header = next(line for line in table.splitlines() if line.startswith("policy"))
    assert " act " in header and "KL own" in header
    assert sum(" bf16 " in line for line in table.splitlines() if line.startswith(("dense", "oval"))) >= 2
    for r in rows:  # KL own: from the dense row of the row's own activations (and K/V storage)
        assert r["steps"] == 96
        assert r["kl_own"] == 0.0 if r["policy"] == "dense" else r["kl_own"] > 0.0
    assert row(rows, "oval", "bfloat16")["tokens_per_step"] == 80


@pytest.mark.slow
def test_a_lane_in_lockstep_computes_what_it_computes_alone(runs):
    """The bf16 lane beside fp32 gives the bf16-only run's numbers: its own model and its own (bf16) prefix."""
    for policy in ("dense", "oval"):
        beside, alone = row(runs["both"], policy, "bfloat16"), row(runs["bf16"], policy, "bfloat16")
        assert beside["ppl"] == pytest.approx(alone["ppl"], rel=1e-9)
        assert beside["kl_own"] == pytest.approx(alone["kl_own"], rel=1e-9, abs=1e-12)
        assert beside["tokens_attended"] == alone["tokens_attended"]


@pytest.mark.slow
def test_bf16_costs_dense_little_and_leaves_ovals_own_cost_alone(runs):
    rows = runs["both"]
    dense16, oval32, oval16 = row(rows, "dense", "bfloat16"), row(rows, "oval", "float32"), row(rows, "oval", "bfloat16")
    print(f"\nbf16 dense: KL {dense16['kl']:.5f}, top-1 {dense16['top1']:.3f}; oval KL own fp32 "
          f"{oval32['kl_own']:.5f}, bf16 {oval16['kl_own']:.5f}")
    assert 0 < dense16["kl"] <= DENSE_KL_BOUND  # 0: the bf16 lane would not have run in bf16
    assert dense16["top1"] >= 0.9
    assert abs(oval16["kl_own"] - oval32["kl_own"]) <= OVAL_OWN_CHANGE * oval32["kl_own"]
