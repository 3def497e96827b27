"""Pull a safetensors folder from the local Hub stand-in, then `oval-edge serve --model <the pulled id>` (a real
server process, no network: HF_HUB_OFFLINE) answers a chat completion with it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from hub_standin import HubStandIn, hub_env, pull, start

pytestmark = pytest.mark.slow


def tiny_llama_folder(path) -> None:
    """A 2-layer Llama with the bundled model's tokenizer and chat template, saved as transformers saves it."""
    import torch
    import transformers

    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=49152,
                                      max_position_embeddings=1024)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(path)


def test_serve_a_pulled_folder_by_its_hub_id(tmp_path):
    folder = tmp_path / "src"
    tiny_llama_folder(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not fetched")  # a second weight format the pull leaves behind
    hub = HubStandIn()
    hub.add("tiny/llama-chat", {p.name: p for p in folder.iterdir()})
    server = start(hub)
    try:
        pulled = pull(hub, tmp_path / "home", "tiny/llama-chat")
    finally:
        server.shutdown()
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert not hub.gets("pytorch_model.bin")

    env = {**hub_env(hub, tmp_path / "home", HF_HUB_OFFLINE="1"), "OVAL_EDGE_CACHE": str(tmp_path / "cache")}
    child = subprocess.Popen([sys.executable, "-m", "oval_edge.cli", "serve", "--model", "tiny/llama-chat",
                              "--port", "0", "--device", "cpu", "--max-context", "256"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            assert child.poll() is None and time.monotonic() < deadline, lines
            line = child.stdout.readline().rstrip("\n")
            lines.append(line)
            if "listening on http://" in line:
                url = line[line.index("http://"):].split()[0].rstrip(",;")
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert child.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.1)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny/llama-chat"]
        body = {"model": "tiny/llama-chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["model"] == "tiny/llama-chat" and answer["usage"]["completion_tokens"] >= 1
        assert answer["choices"][0]["message"]["role"] == "assistant"
        print(json.dumps(answer))  # the served completion, for the report (pytest -s)
    finally:
        child.kill()
        child.wait()
