"""`oval-edge bench`: correctness of what it computes and reports (never timing). The `--serve` load tool's tests
are in tests/test_load.py.

One test runs the real benchmark on a tiny case (two child processes load the bundled model); the rest check
the arithmetic (medians, ratios) and the run order.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from oval_edge.tools.bench import command as bench_command
from oval_edge.tools.bench.meters import MemoryMeter, TokenClock
from oval_edge.tools.bench.report import aggregate, effective_gb_s, format_table, label_rows, ratios, scaling
from oval_edge.tools.bench.runner import run_worker
from oval_edge.tools.bench.settings import (BenchSettings, group_pages_of, parse_engines, parse_int_list,
                                            prompt_length, schedule, with_groups)
from oval_edge.tools.bench.worker import runs_runtime

ROW_FIELDS = ("engine", "context", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "kv_bytes_per_step")


def _bench_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


# ---- the real thing, tiny --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_bench_writes_rows_ratios_and_runs(tmp_path, capsys):
    # 320 prompt tokens > OVAL's token budget (sink + 4 pages + window = 224), so OVAL really selects pages.
    # quant none: half the load time of nf4 (no quantizing), and the rows are the same either way. One thread:
    # on a shared CI machine two OpenMP threads stall on each other at every small op (it is not timed here).
    out = tmp_path / "bench.json"
    # oval_from=0: OVAL at every length (serve's default attends densely below the measured crossover).
    args = _bench_args(contexts="320", gen=4, runs=1, engines="oval,dense", device="cpu", quant="none", threads=1,
                       json_path=str(out), no_progress=True, oval_from=0)
    assert bench_command.run(args) == 0
    report = json.loads(out.read_text())
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"oval", "dense"}
    for row in rows.values():
        for name in ROW_FIELDS:
            assert row[name] is not None, name
        assert row["context"] == 320 and row["prompt_tokens"] == 320 and row["gen_tokens"] == 4
        assert row["threads"] == 1 and row["device"] == "cpu"
        assert row["runs_ok"] == 1 and row["decode_steps"] == 3
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
        # The process holds at least its own weights; the run peak never exceeds the whole-life peak.
        assert row["peak_rss_mb"] * 2**20 > row["weight_bytes"] > 0
        assert row["run_peak_rss_mb"] <= row["peak_rss_mb"]
        # One decode step's dispatched ops, counted past the timed steps: at least a few per layer of 30.
        assert row["ops_per_decode_step"] > 30 * 10
    # Dense reads every cached token of every layer at the last step: >= 323 tokens x K/V bytes per token
    # (SmolLM2: 30 layers x 3 KV heads x 64 dims, K and V, in the pool's dtype).
    per_token = 2 * 30 * 3 * 64 * {"float32": 4, "bfloat16": 2, "float16": 2}[rows["dense"]["kv_dtype"]]
    assert rows["dense"]["kv_bytes_per_step"] >= (320 + 4 - 1) * per_token
    assert rows["oval"]["kv_bytes_per_step"] < rows["dense"]["kv_bytes_per_step"]
    (ratio,) = report["ratios"]
    assert ratio["vs"] == "dense" and ratio["context"] == 320
    assert ratio["decode_tok_s_ratio"] == pytest.approx(rows["oval"]["decode_tok_s"] / rows["dense"]["decode_tok_s"])
    assert ratio["peak_rss_ratio"] == pytest.approx(rows["oval"]["peak_rss_mb"] / rows["dense"]["peak_rss_mb"])
    assert [r["engine"] for r in report["runs"]] == ["oval", "dense"]
    assert report["meta"]["gen"] == 4 and report["meta"]["engines"] == ["oval", "dense"]
    printed = capsys.readouterr().out
    assert "OVAL decode x" in printed and "oval" in printed and "dense" in printed


def test_failed_worker_becomes_an_error_row(tmp_path):
    job = {"engine": "no-such-engine", "context": 8, "run": 0, "threads": 1, "device": "cpu", "prompt_ids": [1]}
    row = run_worker(job, str(tmp_path), timeout_s=120)
    assert row["engine"] == "no-such-engine" and "unknown" in row["error"]
    rows = aggregate([row])
    assert rows[0]["runs_ok"] == 0 and rows[0]["decode_tok_s"] is None and rows[0]["errors"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_a_killed_bench(tmp_path):
    """SIGKILL on the parent (no cleanup runs) still ends the child that called die_with_parent."""
    child = ("import os, sys, time; from oval_edge.tools.bench.worker import die_with_parent; "
             "die_with_parent(int(sys.argv[1])); open(sys.argv[2], 'w').close(); time.sleep(120)")
    parent = ("import os, subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid()), sys.argv[1]]); "
              "print(p.pid, flush=True); time.sleep(120)")
    ready = tmp_path / "ready"
    bench = subprocess.Popen([sys.executable, "-c", parent, str(ready)], stdout=subprocess.PIPE, text=True)
    worker_pid = int(bench.stdout.readline())
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists() and _alive(worker_pid)
    bench.kill()
    bench.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid), "the worker outlived its bench"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaps yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_llamacpp_worker_modules_do_not_import_torch():
    # The llama.cpp run's peak RSS must be llama.cpp's own, not llama.cpp + torch.
    code = ("import sys, oval_edge.tools.bench.worker, oval_edge.tools.bench.peer_engines; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- arithmetic ----------------------------------------------------------------------------------------------
def _run(engine, context, run, decode, prefill=100.0, rss=500.0, kv=1000, weights=10_000, summary=0):
    return {"engine": engine, "context": context, "run": run, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "peak_rss_mb": rss, "run_peak_rss_mb": rss, "kv_bytes_per_step": kv, "summary_bytes_per_step": summary,
            "weight_bytes": weights, "prompt_tokens": context, "label": engine}


def test_aggregate_takes_medians_and_skips_failed_runs():
    runs = [_run("oval", 512, 0, 30.0, summary=300), _run("oval", 512, 1, 10.0, summary=500),
            _run("oval", 512, 2, 20.0, rss=700.0, summary=400), {"engine": "oval", "context": 512, "run": 3, "error": "boom"}]
    (row,) = aggregate(runs, bandwidth_gb_s=1.0)
    assert row["decode_tok_s"] == 20.0 and row["peak_rss_mb"] == 500.0 and row["summary_bytes_per_step"] == 400
    assert row["runs_ok"] == 3 and row["runs_failed"] == 1 and row["errors"] == ["boom"]
    assert row["decode_tok_s_runs"] == [30.0, 10.0, 20.0]
    # GB/s streams the weights once plus everything the step reads: K/V and the page summaries it scores
    assert row["effective_gb_s"] == pytest.approx((10_000 + 1000 + 400) * 20.0 / 1e9)
    assert row["bandwidth_fraction"] == pytest.approx(row["effective_gb_s"] / 1.0)
    assert effective_gb_s(None, 5, 0, 1.0) is None
    assert effective_gb_s(100, 5, None, 2.0) == pytest.approx(105 * 2.0 / 1e9)  # a row from before summaries


def test_a_hybrids_state_bytes_are_medianed_read_and_streamed():
    # A hybrid's layer states (DeltaNet/conv) are read every step beside K/V and summaries: they count in GB/s,
    # in the bytes-read ratio and in the table (a column of their own).
    runs = [dict(_run("oval", 512, i, 20.0, summary=400), state_bytes_per_step=state)
            for i, state in enumerate((2000, 3000, 2500))]
    (row,) = aggregate(runs, bandwidth_gb_s=1.0)
    assert row["state_bytes_per_step"] == 2500
    assert row["effective_gb_s"] == pytest.approx((10_000 + 1000 + 400 + 2500) * 20.0 / 1e9)
    dense = aggregate([dict(_run("dense", 512, 0, 10.0, kv=1000, summary=0), state_bytes_per_step=2500)])
    (vs,) = ratios([row] + dense)
    assert vs["read_bytes_ratio"] == pytest.approx((1000 + 400 + 2500) / (1000 + 2500))
    assert "state MiB/step" in format_table([row] + dense, [vs], {"device": "cpu"})


def test_table_has_kv_and_summary_columns_and_labels_a_synthetic_model():
    name = "SmolLM2-135M shape, random weights (seed 0), 32k positions (synthetic: speed only)"
    rows = label_rows(aggregate([_run("oval", 32768, 0, 30.0, kv=3 * 2**20, summary=2**20),
                                 {**_run("llama.cpp", 32768, 0, 10.0, kv=720 * 2**20),
                                  "kv_bytes_source": "computed: dense"}]), name, synthetic=True)
    assert all(r["model"] == name and r["synthetic"] for r in rows)
    got = {(r["vs"], r["context"]): r for r in ratios(rows)}
    assert got[("llama.cpp", 32768)]["read_bytes_ratio"] == pytest.approx(4 / 720)
    meta = {"model_name": name, "synthetic": True, "runs": 1, "gen": 64, "device": "cpu", "threads": 2,
            "bandwidth_gb_s": 100.0, "bandwidth_note": "given"}
    text = format_table(rows, ratios(rows), meta)
    lines = text.splitlines()
    assert lines[0] == f"model: {name}"
    head = lines[1].split("  ")
    assert "K/V MiB/step" in lines[1] and "summary MiB/step" in lines[1] and "GB/s" in head
    table_rows = [line for line in lines[3:5]]
    assert table_rows[0].startswith("32768") and "oval (synthetic)" in table_rows[0] and "3.00" in table_rows[0]
    assert "1.00" in table_rows[0]  # summary MiB/step of OVAL
    assert "llama.cpp (synthetic)" in table_rows[1] and "720.00*" in table_rows[1] and "0.00*" in table_rows[1]
    assert "(weight bytes + K/V bytes + summary bytes per step) x decode tok/s" in text
    assert "quality is not measured on it" in text
    plain = format_table(label_rows(aggregate([_run("oval", 512, 0, 30.0)]), "SmolLM2", synthetic=False), [],
                         {"model_name": "SmolLM2", "runs": 1})
    assert "synthetic" not in plain and "oval (synthetic)" not in plain


def test_ratios_are_oval_over_each_other_engine_at_the_same_context():
    rows = aggregate([_run("oval", 512, 0, 30.0, rss=600.0, kv=224), _run("dense", 512, 0, 20.0, rss=400.0, kv=512),
                      _run("hf", 512, 0, 10.0, rss=1200.0), _run("oval", 8192, 0, 27.0),
                      _run("llama.cpp", 8192, 0, 0.0)])
    got = {(r["vs"], r["context"]): r for r in ratios(rows)}
    assert set(got) == {("dense", 512), ("hf", 512), ("llama.cpp", 8192)}
    assert got[("dense", 512)]["decode_tok_s_ratio"] == pytest.approx(1.5)
    assert got[("dense", 512)]["peak_rss_ratio"] == pytest.approx(1.5)
    assert got[("dense", 512)]["kv_bytes_ratio"] == pytest.approx(224 / 512)
    assert got[("hf", 512)]["decode_tok_s_ratio"] == pytest.approx(3.0)
    assert got[("hf", 512)]["peak_rss_ratio"] == pytest.approx(0.5)
    assert got[("llama.cpp", 8192)]["decode_tok_s_ratio"] is None  # a zero rate gives no ratio, not a crash
    scale = {(s["engine"], s["context"]): s["decode_vs_base"] for s in scaling(rows)}
    assert scale[("oval", 8192)] == pytest.approx(0.9) and scale[("oval", 512)] == 1.0


def test_token_clock_splits_prefill_and_decode():
    clock = TokenClock()
    clock.start = 10.0
    clock.times, clock.token_ids = [12.0, 12.5, 13.0, 14.0], [5, 6, 7, 8]
    summary = clock.summary(prompt_tokens=100)
    assert summary["prefill_s"] == 2.0 and summary["prefill_tok_s"] == 50.0
    assert summary["decode_steps"] == 3 and summary["decode_s"] == 2.0 and summary["decode_tok_s"] == 1.5
    clock.times = clock.times[:1]
    with pytest.raises(RuntimeError, match="at least 2"):
        clock.summary(prompt_tokens=100)


def test_memory_meter_reports_whole_life_and_run_peaks():
    meter = MemoryMeter(cuda=False)
    ballast = bytearray(64 * 2**20)  # raise the load-time peak, then drop it before the "run"
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    del ballast
    meter.after_load()
    out = meter.finish()
    assert out["peak_rss_mb"] >= out["load_peak_rss_mb"] >= 64
    if out["run_peak_rss_mb"] is not None:  # /proc/self/clear_refs writable (Linux >= 4.0)
        assert out["run_peak_rss_mb"] < out["load_peak_rss_mb"]
    meter.freeze()  # what runs after a freeze (the op count's dispatch mode) is not measured
    late = bytearray(96 * 2**20)
    late[:: 4096] = b"x" * len(late[:: 4096])
    assert meter.finish() == meter.frozen
    del late


# ---- plan --------------------------------------------------------------------------------------------------
def test_schedule_alternates_engines_and_contexts_run_by_run():
    order = schedule((512, 2048), ("oval", "dense", "hf"), runs=2)
    assert [e for e, c, r in order if c == 512] == ["oval", "dense", "hf", "oval", "dense", "hf"]
    assert [r for e, c, r in order if c == 512] == [0, 0, 0, 1, 1, 1]
    assert len(order) == 12 and [c for _, c, _ in order] == [512] * 3 + [2048] * 3 + [512] * 3 + [2048] * 3
    assert [r for _, _, r in order] == [0] * 6 + [1] * 6  # the long context's runs sit between the short one's


def test_parsing_and_validation():
    assert parse_int_list("512, 2k,4096,512", "--contexts") == (512, 2048, 4096)
    with pytest.raises(ValueError, match="--contexts"):
        parse_int_list("512,abc", "--contexts")
    assert parse_engines("oval,dense", peers=True) == ("oval", "dense", "hf", "llama.cpp")
    assert parse_engines("oval,llamacpp", peers=False) == ("oval", "llama.cpp")
    with pytest.raises(ValueError, match="vllm"):
        parse_engines("oval,vllm", peers=False)
    with pytest.raises(ValueError, match="--gen=1"):
        BenchSettings(contexts=(512,), engines=("oval",), gen=1)
    with pytest.raises(ValueError, match="--contexts"):
        BenchSettings(contexts=(0,), engines=("oval",))
    with pytest.raises(ValueError, match="--synthetic-positions apply to --model synthetic-long only"):
        bench_command.build_settings(_bench_args(synthetic_positions=4096, device="cpu"))


def test_group_variants_name_their_scoring_and_run_in_this_runtime():
    """--group-pages 0,8: oval+groups@0 (flat scoring) and oval+groups@8 beside oval (the default config), run by
    this runtime; plain oval's jobs carry no group size, so the worker keeps OvalConfig's default."""
    engines = with_groups(("oval", "llama.cpp"), "0,8")
    assert engines == ("oval", "oval+groups@0", "oval+groups@8", "llama.cpp")
    assert [group_pages_of(e) for e in engines] == [None, 0, 8, None]
    assert runs_runtime({"engine": "oval+groups@0", "group_pages": 0})
    assert not runs_runtime({"engine": "llama.cpp", "group_pages": None})
    with pytest.raises(ValueError, match="--group-pages"):
        with_groups(("oval",), "1")


def test_prompt_is_shortened_only_past_the_models_positions():
    assert prompt_length(4096, 64, 8192) == 4096
    assert prompt_length(8192, 64, 8192) == 8127  # 64 generated + 1 counted step (its op count) fit the 8192
    assert prompt_length(8192, 64, None) == 8192
    with pytest.raises(ValueError, match="no room"):
        prompt_length(100, 9000, 8192)


@pytest.mark.slow
def test_schema_row_decodes_under_the_grammar(tmp_path):
    # oval and oval+schema alternate; a schema whose document ends before --gen tokens is an error row that says so.
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "minItems": 8, "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 999}}))
    out = tmp_path / "bench.json"
    args = _bench_args(contexts="64", gen=4, runs=1, engines="oval", device="cpu", quant="none", threads=1,
                       json_path=str(out), no_progress=True, schema=str(schema))
    assert bench_command.run(args) == 0
    report = json.loads(out.read_text())
    assert [r["engine"] for r in report["runs"]] == ["oval", "oval+schema"]
    constrained = next(r for r in report["rows"] if r["engine"] == "oval+schema")
    assert constrained["runs_ok"] == 1 and constrained["decode_tok_s"] > 0 and "JSON schema" in constrained["label"]
    assert report["ratios"][0]["vs"] == "oval+schema"
    schema.write_text(json.dumps({"enum": [1]}))  # "1" and the end of the document: two tokens
    bench_command.run(_bench_args(contexts="64", gen=4, runs=1, engines="oval", device="cpu", quant="none",
                                  threads=1, json_path=str(out), no_progress=True, schema=str(schema)))
    failed = next(r for r in json.loads(out.read_text())["runs"] if r["engine"] == "oval+schema")
    assert "--schema document ended" in failed["error"]


def test_schema_flag_validation(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--schema .*bad.json"):
        bench_command.build_settings(_bench_args(schema=str(bad), device="cpu"))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="an object"):
        bench_command.build_settings(_bench_args(schema=str(bad), device="cpu"))
    bad.write_text("{}")
    with pytest.raises(ValueError, match="keep oval"):
        bench_command.build_settings(_bench_args(schema=str(bad), device="cpu", engines="dense"))
    with pytest.raises(ValueError, match="exactly when --schema"):
        BenchSettings(contexts=(512,), engines=("oval", "oval+schema"))


def test_a_peers_computed_kv_reads_count_each_kind_of_layer():
    """The peers' K/V bytes (computed from the shape): Llama reads every layer over the whole context; Gemma-4-E2B
    reads 7 full layers (3 keeping K/V, 4 sharing it) of 1 x 512 over the context and 28 sliding ones of 1 x 256 over
    the 512-token window; Qwen3.5's DeltaNet layers read no K/V."""
    from pathlib import Path

    from oval_edge.tools.bench.command import dense_kv_elements
    from oval_edge.tools.bench.peer_engines import computed_kv_bytes
    from oval_edge.tools.plan.model import read_model_shape

    configs = Path(__file__).resolve().parent / "fixtures" / "configs"
    job = {"prompt_ids": [0] * 8000, "gen": 193}  # 8,192 cached tokens at the last step
    llama = dense_kv_elements(read_model_shape(str(configs / "Llama-3.2-1B-Instruct")))
    assert computed_kv_bytes(job | {"kv_elements_per_token": llama}, "float16") == 8192 * 2 * 16 * 8 * 64 * 2
    gemma = dense_kv_elements(read_model_shape(str(configs / "gemma-4-E2B-it")))
    assert computed_kv_bytes(job | {"kv_elements_per_token": gemma}, "float16") == \
        (8192 * 7 * 2 * 512 + 512 * 28 * 2 * 256) * 2
    qwen = dense_kv_elements(read_model_shape(str(configs / "Qwen3.5-0.8B")))
    assert computed_kv_bytes(job | {"kv_elements_per_token": qwen}, "float16") == 8192 * 6 * 2 * 2 * 256 * 2
