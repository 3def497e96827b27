"""The page store on disk as `serve` runs it: its flags and [server] keys, the startup report, /metrics, and a
request longer than the in-memory pool served over HTTP.

The tiny random Llama (test_static_step.tiny_folder) with a pool of 40 pages of 16 tokens (640 tokens in memory) and
an 8 MiB store: a ~1200-token prompt spills its older sealed pages to the file, and decode recalls what selection
names. The store lives in pytest's tmp_path (a real drive here, not tmpfs).
"""

from __future__ import annotations

import argparse
import gc
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_support import ServerThread, get, metrics, post
from test_static_step import OVAL, tiny_folder  # noqa: F401 (fixture)

from oval_edge.kv.store.page_file import mount_of
from oval_edge.kv.store.stats import RECALL_BUCKETS
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.server.app import ServerSettings, create_app
from oval_edge.runtime.server.options import add_engine_arguments, describe_spec, engine_spec
from oval_edge.runtime.server.serve import startup_report

pytestmark = pytest.mark.slow
NUM_PAGES = 40
STORE_SIZE = 8 << 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def store_engine(folder: str, store_dir, **config) -> Engine:
    # 40 frames >= 2 rows x (1 sink + 2 window + 2) kept pages + one 64-token chunk (setup.check_resident)
    settings = dict(num_pages=NUM_PAGES, max_batch=2, prefill_chunk=64, kv_store=str(store_dir),
                    kv_store_size=STORE_SIZE) | config
    return Engine.load(folder, quant="none", device="cpu", oval=OVAL, config=EngineConfig(**settings))


def _store_files(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".store"))


def _long_text(engine: Engine, tokens: int) -> str:
    """Varied English-like text of about `tokens` tokens (numbers keep pages from repeating)."""
    words, i = [], 0
    while len(engine.tokenizer.encode(" ".join(words))) < tokens:
        words.append(f"Item {i} of the list is a {('red', 'blue', 'green', 'small')[i % 4]} box on shelf {i * 7}.")
        i += 1
    return " ".join(words)


# ---- flags and config keys -----------------------------------------------------------------------------------
def test_flags_parse_into_the_engine_config(tmp_path):
    args = ["--kv-store", str(tmp_path), "--kv-store-size", "64MiB", "--pool-tokens", "2048",
            "--kv-recall-pages", "24", "--kv-store-checksums"]
    config = engine_spec(_parser().parse_args(args)).engine_config()
    assert (config.kv_store, config.kv_store_size, config.pool_tokens, config.recall_pages,
            config.kv_store_checksums) == (str(tmp_path), 64 << 20, 2048, 24, True)
    plain = engine_spec(_parser().parse_args([])).engine_config()
    assert (plain.kv_store, plain.kv_store_size, plain.pool_tokens, plain.recall_pages,
            plain.kv_store_checksums) == (None, None, None, None, False)


def test_config_file_keys_and_flags_over_them(tmp_path):
    (tmp_path / "nvme").mkdir()
    (tmp_path / "c.toml").write_text('[server]\nkv_store = "nvme"\nkv_store_size = "32MiB"\npool_tokens = 1024\n'
                                     'recall_pages = 8\nkv_store_checksums = true\n')
    spec = engine_spec(_parser().parse_args(["--config", str(tmp_path / "c.toml")]))
    config = spec.engine_config()  # a relative kv_store is taken relative to the config file's folder
    assert (config.kv_store, config.kv_store_size, config.pool_tokens, config.recall_pages,
            config.kv_store_checksums) == (str(tmp_path / "nvme"), 32 << 20, 1024, 8, True)
    over = engine_spec(_parser().parse_args(["--config", str(tmp_path / "c.toml"), "--kv-store-size", "48MiB",
                                             "--pool-tokens", "512", "--no-kv-store-checksums"])).engine_config()
    assert (over.kv_store_size, over.pool_tokens, over.recall_pages, over.kv_store_checksums) == (48 << 20, 512, 8,
                                                                                                  False)
    assert f"kv store {tmp_path / 'nvme'} (32.00 MiB)" in describe_spec(spec)


@pytest.mark.parametrize("args,words", [
    (["--pool-tokens", "0"], "pool_tokens=0 must be a positive integer"),
    (["--kv-recall-pages", "0"], "recall_pages=0 must be a positive integer"),
    (["--kv-store-size", "0"], "--kv-store-size='0' must be > 0 bytes"),
    (["--kv-store-size", "lots"], "--kv-store-size='lots' is not a size"),
    (["--kv-store", "/nonexistent-drive/kv"], "does not exist"),
    (["--kv-store", "{tmp}", "--kv-store-size", "1000TiB"], "lower kv_store_size or free space"),
    (["--kv-store", "{tmp}", "--decode-step", "compiled"], "kv_store needs the eager decode"),
    (["--kv-store", "{tmp}", "--device", "cuda"], "kv_store is not built for device='cuda'"),
])
def test_bad_values_are_refused_before_loading(tmp_path, args, words):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        engine_spec(_parser().parse_args(args))
    assert _store_files(tmp_path) == []  # validation creates nothing


def test_a_store_in_ram_is_refused():
    if not os.path.isdir("/dev/shm") or mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    with pytest.raises(ValueError, match="tmpfs.*lives in RAM.*NVMe"):
        engine_spec(_parser().parse_args(["--kv-store", "/dev/shm", "--kv-store-size", "1MiB"]))


@pytest.mark.parametrize("table,words", [
    ('kv_store_size = 0', r"\[server\] kv_store_size=0 must be > 0 bytes"),
    ('pool_tokens = 0', r"\[server\] pool_tokens=0 must be an integer"),
    ('recall_pages = "8"', r"\[server\] recall_pages='8' must be an integer"),
    ('kv_store_checksums = 1', r"\[server\] kv_store_checksums=1 must be true or false"),
    ('kv_store = ""', r"\[server\] kv_store='' must be a non-empty string"),
])
def test_bad_config_keys_name_the_key(tmp_path, table, words):
    (tmp_path / "c.toml").write_text(f"[server]\n{table}\n")
    with pytest.raises(ValueError, match=words):
        engine_spec(_parser().parse_args(["--config", str(tmp_path / "c.toml")]))


# ---- the store's file --------------------------------------------------------------------------------------
def test_the_store_file_is_removed_when_closed_or_collected(tiny_folder, tmp_path):  # noqa: F811
    engine = store_engine(tiny_folder, tmp_path)
    (name,) = _store_files(tmp_path)
    assert engine.pool.store.store.path == str(tmp_path / name)
    assert os.path.getsize(tmp_path / name) == engine.pool.store.store.size_bytes  # created at full size
    engine.pool.store.store.close()
    assert _store_files(tmp_path) == []
    engine.pool.store.store.close()  # idempotent
    again = tmp_path / "again"
    again.mkdir()
    engine = store_engine(tiny_folder, again)
    assert len(_store_files(again)) == 1
    del engine
    gc.collect()
    assert _store_files(again) == []


# ---- served ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store_server(tiny_folder, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("kv-store")
    engine = store_engine(tiny_folder, folder)
    with ServerThread(create_app(ServerSettings(model_name="tiny"), lambda: engine)) as running:
        running.wait_ready()
        yield running, engine, folder
    engine.pool.store.store.close()


def test_startup_report_says_where_the_store_is(store_server, tmp_path):
    _, engine, folder = store_server
    spec = engine_spec(_parser().parse_args(["--kv-store", str(tmp_path), "--kv-store-size", "8MiB"]))
    report = startup_report(engine, spec, "http://127.0.0.1:1", False)
    store = engine.pool.store
    (line,) = [ln for ln in report.splitlines() if ln.startswith("  KV store  ")]
    assert str(folder) in line and "/s;" in line and f"{store.recall_pages} recall frames per layer" in line
    assert f"resident {NUM_PAGES * 16} tokens + stored up to {store.blocks * 16} tokens" in line
    (capacity,) = [ln for ln in report.splitlines() if ln.startswith("  capacity  ")]
    assert f"{NUM_PAGES} pages x 16 tokens = {NUM_PAGES * 16} tokens in memory + {store.blocks} pages" in capacity
    assert store.store.read_throughput > 0


def test_a_prompt_longer_than_the_pool_is_served_and_counted(store_server):
    server, engine, _ = store_server
    before = metrics(server.url)
    assert before["oval_edge_kv_store_enabled"] == 1
    assert before["oval_edge_kv_store_pages_total"] == engine.pool.store.blocks > 0
    assert before["oval_edge_kv_pages_total"] == NUM_PAGES
    prompt = _long_text(engine, 1200)
    assert len(engine.tokenizer.encode(prompt)) > NUM_PAGES * 16 + 500  # well past the 640 in-memory tokens
    response = post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                          "ignore_eos": True}, timeout=300)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] > NUM_PAGES * 16
    values = metrics(server.url)
    stats = engine.pool.store.stats
    assert values["oval_edge_kv_store_spills_total"] == stats.spills > 0
    assert values["oval_edge_kv_store_written_bytes_total"] == stats.spills * engine.pool.store.store.block_bytes
    assert values["oval_edge_kv_store_read_bytes_total"] == stats.bytes_read > 0
    assert values["oval_edge_kv_store_mirror_reads_total"] == stats.mirror_reads > 0  # the dense layers' reads
    reads = stats.recall_hits + stats.recall_misses
    assert values["oval_edge_kv_store_recall_misses_total"] == stats.recall_misses
    assert values["oval_edge_kv_store_recall_hit_ratio"] == pytest.approx(stats.recall_hits / reads if reads else 0)
    assert values["oval_edge_kv_store_reads_per_step"] > 0
    # The request is done: its stored blocks went back, its frames are free or cached for a prefix hit.
    assert values["oval_edge_kv_pages_stored"] == engine.pool.store.stored_pages() == 0
    assert values["oval_edge_kv_pages_resident"] == 0
    assert values["oval_edge_kv_store_enabled"] == 1


def test_the_read_latency_histogram_parses(store_server):
    server, engine, _ = store_server
    if not engine.pool.store.stats.bytes_read:  # run alone (not after the long request above): read something
        response = post(server.url + "/v1/completions", json={"prompt": _long_text(engine, 1200), "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True}, timeout=300)
        assert response.status_code == 200, response.text
    families = {f.name: f for f in text_string_to_metric_families(get(server.url + "/metrics").text)}
    family = families["oval_edge_kv_store_read_seconds"]
    assert family.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
    assert [float(le) for le, _ in buckets] == [*RECALL_BUCKETS, float("inf")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative
    samples = {s.name: s.value for s in family.samples if not s.name.endswith("_bucket")}
    latency = engine.pool.store.stats.latency
    assert samples["oval_edge_kv_store_read_seconds_count"] == counts[-1] == sum(latency[:-1]) > 0
    assert samples["oval_edge_kv_store_read_seconds_sum"] == pytest.approx(latency[-1]) and latency[-1] > 0


def test_without_a_store_the_series_are_zero(tiny_folder):  # noqa: F811
    engine = Engine.load(tiny_folder, quant="none", device="cpu", oval=OVAL,
                         config=EngineConfig(num_pages=NUM_PAGES, max_batch=2))
    with ServerThread(create_app(ServerSettings(model_name="tiny"), lambda: engine)) as server:
        server.wait_ready()
        values = metrics(server.url)
    names = ("kv_store_enabled", "kv_pages_stored", "kv_store_pages_total", "kv_store_spills_total",
             "kv_store_read_bytes_total", "kv_store_recall_hit_ratio", "kv_store_reads_per_step",
             "kv_store_read_seconds_count", "kv_store_read_seconds_sum")
    assert {name: values[f"oval_edge_{name}"] for name in names} == dict.fromkeys(names, 0.0)
    assert values["oval_edge_kv_store_read_seconds_bucket{le=+Inf}"] == 0
