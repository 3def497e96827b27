"""The OVAL/dense crossover (issue 52): `crossover_length` on synthetic speeds, the per-device default against the
measurement it comes from (docs/crossover.md), `oval_from` through EngineConfig, the TOML and `serve --oval-from`,
and `oval-edge profile`'s measurement on the bundled model (slow)."""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from oval_edge.runtime.config_file import engine_kwargs, load_config_file
from oval_edge.runtime.engine.crossover import (
    DEFAULT_OVAL_FROM, FALLBACK_OVAL_FROM, NOISE_MARGIN, crossover_length, default_oval_from,
)

REPO = Path(__file__).resolve().parents[1]
LENGTHS = [256, 512, 1024, 2048, 4096]


# ---- crossover_length -------------------------------------------------------------------------------------------

def test_oval_never_wins_keeps_dense_through_the_longest_length():
    assert crossover_length(LENGTHS, [50, 60, 70, 80, 90], [100] * 5) == 4097


def test_oval_always_wins_is_oval_at_every_length():
    assert crossover_length(LENGTHS, [120, 110, 130, 150, 200], [100] * 5) == 0


def test_the_crossover_is_the_first_length_oval_keeps_up_from():
    # the CPU's shape: OVAL's scoring costs more than the pages it skips until ~1-2k tokens, dense slows linearly
    assert crossover_length(LENGTHS, [88, 90, 92, 94, 96], [110, 102, 93, 80, 60]) == 1024


def test_the_noise_margin_counts_a_near_tie_as_not_slower():
    dense = [100] * 5
    near, outside = 100 * (1 - NOISE_MARGIN) + 0.1, 100 * (1 - NOISE_MARGIN) - 0.1
    assert crossover_length(LENGTHS, [80, 90, near, 110, 120], dense) == 1024  # within the default margin
    assert crossover_length(LENGTHS, [80, 90, near, 110, 120], dense, margin=0.0) == 2048
    assert crossover_length(LENGTHS, [80, 90, outside, 110, 120], dense) == 2048  # just outside it
    assert crossover_length(LENGTHS, [80, 90, 96, 110, 120], dense, margin=0.05) == 1024


def test_a_lucky_short_length_does_not_pull_the_crossover_below_a_loss():
    # OVAL "wins" at 256 by noise, loses at 512: dense must still run at 512
    assert crossover_length(LENGTHS, [105, 80, 100, 110, 120], [100] * 5) == 1024
    # and a loss at the longest length keeps dense everywhere, whatever came before
    assert crossover_length(LENGTHS, [120, 120, 120, 120, 80], [100] * 5) == 4097


def test_one_length():
    assert crossover_length([512], [100], [100]) == 0
    assert crossover_length([512], [90], [100]) == 513


def test_the_result_keeps_the_rule_on_random_speeds():
    """Whatever the speeds: OVAL keeps up at the crossover and every longer length, and not at the one before."""
    rng = random.Random(52)
    for _ in range(500):
        n = rng.randint(1, 7)
        lengths = sorted(rng.sample(range(16, 9000), n))
        oval = [rng.uniform(50, 150) for _ in range(n)]
        dense = [rng.uniform(50, 150) for _ in range(n)]
        got = crossover_length(lengths, oval, dense)
        keeps = [o >= (1 - NOISE_MARGIN) * d for o, d in zip(oval, dense)]
        if got == 0:
            assert all(keeps)
        elif got == lengths[-1] + 1:
            assert not keeps[-1]
        else:
            i = lengths.index(got)
            assert i > 0 and all(keeps[i:]) and not keeps[i - 1]


@pytest.mark.parametrize("lengths, oval, dense, message", [
    ([], [], [], "at least one"),
    ([256, 512], [1.0], [1.0, 2.0], "one of each per length"),
    ([512, 256], [1.0, 1.0], [1.0, 1.0], "strictly increasing"),
    ([256, 256], [1.0, 1.0], [1.0, 1.0], "strictly increasing"),
    ([0, 256], [1.0, 1.0], [1.0, 1.0], "positive integers"),
    ([256, 512.0], [1.0, 1.0], [1.0, 1.0], "positive integers"),
    ([256, 512], [1.0, float("nan")], [1.0, 1.0], "oval_tps"),
    ([256, 512], [1.0, 1.0], [0.0, 1.0], "dense_tps"),
])
def test_bad_measurements_are_refused(lengths, oval, dense, message):
    with pytest.raises(ValueError, match=message):
        crossover_length(lengths, oval, dense)


def test_bad_margin_is_refused():
    with pytest.raises(ValueError, match="margin"):
        crossover_length([256], [1.0], [1.0], margin=1.0)


# ---- the per-device default -------------------------------------------------------------------------------------

def documented_cpu_measurement() -> tuple[list[int], list[float], list[float]]:
    """The table under docs/crossover.md's "## The CPU default" heading: `| context | OVAL tok/s | dense tok/s |
    ... |` rows."""
    text = (REPO / "docs" / "crossover.md").read_text().split("\n## The CPU default", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|", text, re.M)
    assert len(rows) >= 4, "docs/crossover.md lost its measured table"
    return [int(r[0]) for r in rows], [float(r[1]) for r in rows], [float(r[2]) for r in rows]


def test_the_cpu_default_is_what_the_documented_measurement_gives():
    lengths, oval, dense = documented_cpu_measurement()
    assert DEFAULT_OVAL_FROM["cpu"] == crossover_length(lengths, oval, dense)
    assert f"oval_from = {DEFAULT_OVAL_FROM['cpu']}" in (REPO / "docs" / "crossover.md").read_text()


def test_default_per_device_type():
    torch = pytest.importorskip("torch")
    assert default_oval_from(torch.device("cpu")) == default_oval_from("cpu") == DEFAULT_OVAL_FROM["cpu"]
    assert default_oval_from(torch.device("cuda", 1)) == default_oval_from("cuda:0") == DEFAULT_OVAL_FROM["cuda"]
    assert default_oval_from("mps") == FALLBACK_OVAL_FROM


# ---- EngineConfig, the TOML and the flag ------------------------------------------------------------------------

def test_engine_config_takes_a_length_zero_or_none():
    from oval_edge.runtime.engine.setup import EngineConfig, resolve_oval_from

    assert EngineConfig().oval_from is None
    assert resolve_oval_from(EngineConfig(), "cpu") == DEFAULT_OVAL_FROM["cpu"]
    assert resolve_oval_from(EngineConfig(oval_from=0), "cpu") == 0
    assert resolve_oval_from(EngineConfig(oval_from=3000), "cuda") == 3000
    for bad in (-1, True, 1.5, "512", 1 << 25):
        with pytest.raises(ValueError, match=r"oval_from=.* must be a context length in tokens"):
            EngineConfig(oval_from=bad)


def test_the_toml_key_reaches_the_engine_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[server]\noval_from = 1536\n")
    assert engine_kwargs(load_config_file(str(path)))["oval_from"] == 1536
    path.write_text("[server]\noval_from = -5\n")
    with pytest.raises(ValueError, match=r"\[server\] oval_from=-5 must be an integer in \[0, "):
        load_config_file(str(path))


def _spec(argv: list[str]):
    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_spec(parser.parse_args(argv))


def test_serve_flag_over_the_file_over_the_default(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[server]\noval_from = 2048\n")
    assert _spec([]).engine_config().oval_from is None
    assert _spec(["--config", str(config)]).engine_config().oval_from == 2048
    assert _spec(["--config", str(config), "--oval-from", "0"]).engine_config().oval_from == 0
    with pytest.raises(ValueError, match="oval_from=-1"):
        _spec(["--oval-from", "-1"])


def test_serve_help_says_what_the_flag_does_and_its_default():
    from oval_edge.runtime.server.options import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--oval-from TOKENS" in text and "run the dense step" in text
    assert f"{DEFAULT_OVAL_FROM['cpu']} tokens on a CPU" in text


# ---- oval-edge profile ------------------------------------------------------------------------------------------

def test_lengths_that_fit_the_pool_twice_and_the_token_limit():
    from oval_edge.tools.profile.crossover import usable_lengths

    assert usable_lengths(LENGTHS, 8192, 20000, 40) == LENGTHS
    assert usable_lengths(LENGTHS, 2100, 20000, 40) == [256, 512, 1024, 2048]  # 2048 + 40 <= 2100
    assert usable_lengths(LENGTHS, 8192, 4200, 40) == [256, 512, 1024, 2048]  # two pools of 2088 <= 4200
    assert usable_lengths(LENGTHS, 200, 20000, 40) == []


def test_the_cpu_clock_leaves_out_waiting_and_needs_one_cpu_thread():
    import time

    import torch

    from oval_edge.tools.profile.crossover import measure_crossover, thread_cpu_call

    assert thread_cpu_call(lambda: time.sleep(0.2)) < 0.05  # asleep: waiting, not this thread's work
    assert thread_cpu_call(lambda: sum(range(2_000_000))) > 0
    loaded = SimpleNamespace(device=torch.device("cpu"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="needs --device cpu and --threads 1"):
            measure_crossover(loaded, None, [1], [256], 1, 1, 256, clock="cpu")
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="clock='gpu' is unknown"):
        measure_crossover(loaded, None, [1], [256], 1, 1, 256, clock="gpu")


def test_profile_writes_oval_from_and_the_table(tmp_path, capsys):
    from oval_edge.tools.profile.choice import ProfileRow
    from oval_edge.tools.profile.command import _conclude
    from oval_edge.tools.profile.crossover import Crossover, LengthTimes

    row = ProfileRow(page_size=32, top_k=4, tokens_per_step=224, pages=100, pool_tokens=3200, max_context=3200,
                     summary_bytes=1, fits_context=True, decode_ms_median=10.0, decode_ms_p25=9.9,
                     decode_ms_p75=10.1, kl=0.01, top1=0.99)
    # step times in seconds: OVAL 10 ms at both lengths, dense 9 ms then 11 ms -> OVAL from 1024
    rows = [LengthTimes(512, [0.010] * 3, [0.009] * 3, 224.0, 512.0),
            LengthTimes(1024, [0.010] * 3, [0.011] * 3, 224.0, 1024.0)]
    crossover = Crossover(rows, crossover_length([512, 1024], [r.oval_tps for r in rows],
                                                 [r.dense_tps for r in rows]))
    args = SimpleNamespace(json_path=str(tmp_path / "p.json"), plot=None, write_config=str(tmp_path / "p.toml"),
                           model="default")
    loaded = SimpleNamespace(name="m", quant="auto", source=SimpleNamespace(path="/m.gguf"), device="cpu")
    s = {"max_kl": 0.1, "tokens_per_step": 224, "context": 512, "memory_budget": 2**30, "prefill_chunk": 256,
         "speed_tolerance": 0.1, "steps": 3, "top_ks": {32: 4}}
    record = {"title": "CPU host", "cpu": "x", "torch_threads": 1}
    assert _conclude(args, s, loaded, record, [row], 1.0, crossover) == 0
    out = capsys.readouterr().out
    assert "oval_from = 1024: OVAL is not slower than dense" in out
    cells = [line.replace("*", " ").split() for line in out.splitlines()]
    table = {c[0]: c[3] for c in cells if len(c) == 6 and c[0] in ("512", "1024")}
    assert table == {"512": "0.90", "1024": "1.10"}  # OVAL/dense: 100 / 111.1 tok/s, then 100 / 90.9
    assert load_config_file(str(tmp_path / "p.toml"))["server"]["oval_from"] == 1024
    report = json.loads((tmp_path / "p.json").read_text())["crossover"]
    assert report["oval_from"] == 1024 and [r["length"] for r in report["rows"]] == [512, 1024]
    assert report["rows"][1]["dense_tok_s"] == pytest.approx(1 / 0.011, abs=0.01)


@pytest.mark.slow
def test_profile_measures_oval_and_dense_on_the_bundled_model():
    """Real engines, real steps: the OVAL engine reads fewer K/V tokens than the dense one past the token budget,
    the figures come from the steps taken, and the crossover is crossover_length of them."""
    pytest.importorskip("gguf")
    from oval_edge.config import OvalConfig
    from oval_edge.runtime.model.loader import load_model
    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.tools.profile.crossover import measure_crossover

    try:
        resolve_model("default")
    except ValueError as exc:  # the model package is not installed
        pytest.skip(str(exc))
    loaded = load_model("default", "auto", "cpu")
    text_ids = list(range(1000, 1700))
    steps = []
    crossover = measure_crossover(loaded, OvalConfig(), text_ids, [512, 320], 1, 4, 128, steps.append)
    assert [r.length for r in crossover.rows] == [320, 512]
    for r in crossover.rows:
        assert len(r.oval_s) == len(r.dense_s) == 4 and min(r.oval_s + r.dense_s) > 0
        assert r.length < r.dense_read <= r.length + 6  # dense attends to every cached token (prompt + decoded)
        assert r.oval_read < r.dense_read * 0.75  # 28 of 30 layers read 224 tokens: sparse past the budget
    assert crossover.oval_from == crossover_length([320, 512], [r.oval_tps for r in crossover.rows],
                                                   [r.dense_tps for r in crossover.rows])
    assert sum(steps) >= 2 * 2 * 5  # both engines' decode steps (warm-up and timed) were reported
