"""A pull resumes an interrupted download with a Range request (a dropped connection inside one run, and a pull
stopped by Ctrl-C and run again), and refuses, before downloading, a model the device cannot hold, naming what fits.
Against the local Hub stand-in (tests/hub_standin.py)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hub_standin import HubStandIn, hub_env, pull, start

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "tiny-llama-Q4_K_M.gguf"
MiB = 1 << 20
HUB_CHUNK = 10 * MiB  # huggingface_hub writes a download in chunks of this size: what a resume starts after


@pytest.fixture
def hub(tmp_path):
    weights = tmp_path / "weights.gguf"  # 24 MiB: past two of the hub's write chunks
    weights.write_bytes(FIXTURE.read_bytes() + np.random.default_rng(0).bytes(24 * MiB))
    standin = HubStandIn()
    standin.add("tiny/resume-GGUF", {"tiny-Q8_0.gguf": weights})
    server = start(standin)
    yield standin
    standin.released.set()
    server.shutdown()


def test_a_dropped_connection_resumes_with_a_range_request(hub, tmp_path):
    hub.cut["tiny-Q8_0.gguf"] = 12 * MiB
    result = pull(hub, tmp_path, "tiny/resume-GGUF:Q8_0", "--force")
    assert result.returncode == 0, result.stdout + result.stderr
    ranges = [r.headers.get("range") for r in hub.gets("tiny-Q8_0.gguf")]
    assert ranges == [None, f"bytes={HUB_CHUNK}-"], ranges  # the second request asks only for the rest
    local = Path(result.stdout.strip().splitlines()[-2])
    assert local.read_bytes() == hub.repos["tiny/resume-GGUF"]["tiny-Q8_0.gguf"].read_bytes()


def test_a_pull_stopped_by_ctrl_c_resumes_where_it_stopped(hub, tmp_path):
    source = hub.repos["tiny/resume-GGUF"]["tiny-Q8_0.gguf"]
    part = (tmp_path / "hub" / "models--tiny--resume-GGUF" / "blobs"
            / (hashlib.sha256(source.read_bytes()).hexdigest() + ".part"))
    hub.stall["tiny-Q8_0.gguf"] = 12 * MiB
    # The stand-in stalls at 12 MiB until released. The hub's read timeout bounds both sides of the Ctrl-C below:
    # before it, the stall must outlast the wait for the partial file (10 s, the default, was too short on a loaded
    # machine: the pull resumed within its run first); after it, pull waits for the stalled read to time out before
    # it reports what it kept. 30 s leaves room for both within the minute given to communicate.
    env = hub_env(hub, tmp_path, HF_HUB_DOWNLOAD_TIMEOUT="30")
    # SIGINT as a terminal gives it: a test worker (pytest-xdist) may ignore SIGINT, and a child inherits that
    child = subprocess.Popen([sys.executable, "-m", "oval_edge.cli", "pull", "tiny/resume-GGUF:Q8_0", "--force"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= HUB_CHUNK):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)  # the user's Ctrl-C
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    hub.released.set()
    assert child.returncode == 130, out + err
    assert "interrupted with 10.00 MiB kept: run `oval-edge pull tiny/resume-GGUF:Q8_0` again to resume" in err
    assert part.stat().st_size == HUB_CHUNK

    again = pull(hub, tmp_path, "tiny/resume-GGUF:Q8_0", "--force")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming tiny-Q8_0.gguf at {HUB_CHUNK} of {source.stat().st_size} bytes" in again.stdout
    assert hub.gets("tiny-Q8_0.gguf")[-1].headers.get("range") == f"bytes={HUB_CHUNK}-"
    assert Path(again.stdout.strip().splitlines()[-2]).read_bytes() == source.read_bytes()
    assert not part.exists()


def write_header_only_gguf(path: Path) -> int:
    """A Llama-3-8B-shaped GGUF with Q8_0 projections whose tensor data is a hole: its header says 8.5 GB of weights,
    the disk holds 20 KB. Returns the file's size."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quant_shape_to_byte_shape

    hidden, ffn, layers, kv_rows, vocab = 4096, 14336, 32, 1024, 128256
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 8192),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, 32), (writer.add_head_count_kv, 8), (writer.add_vocab_size, vocab)):
        add(value)
    data = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal data
        shape = quant_shape_to_byte_shape((rows, cols), GGMLQuantizationType.Q8_0)
        writer.add_tensor_info(name, shape, np.uint8, int(np.prod(shape)), raw_dtype=GGMLQuantizationType.Q8_0)
        data += int(np.prod(shape)) + 32  # + alignment

    matrix("token_embd.weight", vocab, hidden)
    matrix("output.weight", vocab, hidden)
    for i in range(layers):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_rows, hidden), ("attn_v", kv_rows, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                 ("ffn_down", hidden, ffn)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    size = path.stat().st_size + data
    os.truncate(path, size)
    return size


def test_a_model_the_device_cannot_hold_is_refused_before_downloading(tmp_path):
    big = tmp_path / "big.gguf"
    size = write_header_only_gguf(big)
    hub = HubStandIn()
    hub.add("big/model-GGUF", {"model-Q8_0.gguf": big, "model-Q4_K_M.gguf": FIXTURE})
    server = start(hub)
    try:
        result = pull(hub, tmp_path / "home", "big/model-GGUF:Q8_0", "--device", "orin-nano-4gb")
    finally:
        server.shutdown()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert "does not fit Jetson Orin Nano 4GB" in result.stderr and "weights alone take 8." in result.stderr
    assert "smaller files in this repo whose weights fit the budget: big/model-GGUF:Q4_K_M (748" in result.stderr
    reads = [r.headers.get("range") for r in hub.gets("model-Q8_0.gguf")]
    assert reads and all(r is not None and r.startswith("bytes=0-") and int(r[8:]) < 64 * MiB for r in reads), reads
    assert size > 8e9 and not (tmp_path / "home" / "hub" / "models--big--model-GGUF" / "blobs").exists()
