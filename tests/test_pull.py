"""`oval-edge pull org/repo[:quant]` and `--model org/repo`: which files a repo name picks, and pulls against a local
Hub stand-in (tests/hub_standin.py; no network): a GGUF by quant, a safetensors folder without the other weight
formats, HF_TOKEN sent, HF_HUB_OFFLINE and an unreachable Hub answered with what to do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hub_standin import HubStandIn, pull, start
from oval_edge.runtime.model.origin.hub import HubId, choose_files, parse_hub_id, quant_label

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "tiny-llama-Q4_K_M.gguf"
GGUF_REPO = {"Tiny-Llama-Q4_K_M.gguf": 10, "tiny-llama.Q8_0.gguf": 20, "tiny-llama-iq4_xs.gguf": 8,
             "mmproj-tiny-f16.gguf": 5, "big/tiny-Q6_K-00001-of-00002.gguf": 30,
             "big/tiny-Q6_K-00002-of-00002.gguf": 30, "README.md": 1}


def test_a_hub_name_is_not_a_path():
    assert parse_hub_id("bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m") == HubId(
        "bartowski/Llama-3.2-1B-Instruct-GGUF", "q4_k_m")
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == HubId("HuggingFaceTB/SmolLM2-135M-Instruct")
    for local in ("default", "model.gguf", "./org/repo", "/models/org/repo", "~/org/repo", "a/b/c", "org/repo:"):
        assert parse_hub_id(local) is None, local


def test_a_quant_tag_picks_one_gguf_in_any_case():
    assert quant_label("x/Meta-Llama-3.1-8B-Instruct-IQ4_XS.gguf") == "IQ4_XS"
    assert quant_label("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert choose_files(HubId("o/r", "q8_0"), GGUF_REPO).files == ("tiny-llama.Q8_0.gguf",)
    assert choose_files(HubId("o/r", "IQ4_XS"), GGUF_REPO).files == ("tiny-llama-iq4_xs.gguf",)
    picked = choose_files(HubId("o/r"), GGUF_REPO)  # no tag: Q4_K_M, named in the id it is served under
    assert picked.files == ("Tiny-Llama-Q4_K_M.gguf",) and str(picked.hub_id) == "o/r:Q4_K_M"
    assert choose_files(HubId("o/r", "tiny-llama.Q8_0.gguf"), GGUF_REPO).sizes == (20,)


@pytest.mark.parametrize("tag, words", [
    ("Q5_K_M", ["'Q5_K_M' matches no GGUF file", "o/r:Q4_K_M", "o/r:Q8_0", "o/r:IQ4_XS"]),
    ("tiny", ["'tiny' matches several files"]),
    ("Q6_K", ["split into 2 files", "llama-gguf-split --merge"]),
])
def test_a_tag_that_names_no_single_file_lists_what_there_is(tag, words):
    with pytest.raises(ValueError) as error:
        choose_files(HubId("o/r", tag), GGUF_REPO)
    assert all(w in str(error.value) for w in words), error.value
    assert "mmproj" not in str(error.value)  # a vision projector is not a model to pick


def test_no_tag_and_no_q4_k_m_asks_for_one():
    with pytest.raises(ValueError, match="no single Q4_K_M one; name one, e.g.: o/r:Q2_K, o/r:Q8_0"):
        choose_files(HubId("o/r"), {"m-Q8_0.gguf": 1, "m-Q2_K.gguf": 1})


def test_a_folder_takes_config_tokenizer_and_safetensors_only():
    listing = {"config.json": 1, "generation_config.json": 1, "tokenizer.json": 1, "tokenizer_config.json": 1,
               "model-00001-of-00002.safetensors": 5, "model-00002-of-00002.safetensors": 5,
               "model.safetensors.index.json": 1, "pytorch_model.bin": 9, "onnx/model.onnx": 9,
               "original/consolidated.00.pth": 9, "model-Q4_K_M.gguf": 3, "README.md": 1}
    picked = choose_files(HubId("o/r"), listing)
    assert picked.kind == "folder" and picked.total_bytes == 15
    assert set(picked.files) == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                 "model.safetensors.index.json"}
    assert choose_files(HubId("o/r", "Q4_K_M"), listing).files == ("model-Q4_K_M.gguf",)  # a tag asks for the GGUF
    with pytest.raises(ValueError, match="weights only as .bin; oval-edge reads"):
        choose_files(HubId("o/r"), {"config.json": 1, "pytorch_model.bin": 9})
    with pytest.raises(ValueError, match="no GGUF files, so ':Q4_K_M' names nothing"):
        choose_files(HubId("o/r", "Q4_K_M"), {"config.json": 1, "model.safetensors": 9})


@pytest.fixture
def hub():
    standin = HubStandIn()
    standin.add("tiny/llama-GGUF", {"tiny-llama-Q4_K_M.gguf": FIXTURE, "tiny-llama-Q8_0.gguf": FIXTURE})
    server = start(standin)
    yield standin
    server.shutdown()


def test_pull_a_gguf_by_quant_then_find_it_offline(hub, tmp_path, monkeypatch):
    pulled = pull(hub, tmp_path, "tiny/llama-GGUF:q4_k_m", "--device", "orin-nano-8gb", HF_TOKEN="hf_standin")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    path = Path(pulled.stdout.strip().splitlines()[-2])
    assert path.name == "tiny-llama-Q4_K_M.gguf" and str(path).startswith(str(tmp_path / "hub"))
    assert path.read_bytes() == FIXTURE.read_bytes()
    assert "fits Jetson Orin Nano 8GB" in pulled.stdout and "serve --model tiny/llama-GGUF:q4_k_m" in pulled.stdout
    assert not hub.gets("tiny-llama-Q8_0.gguf")  # only the chosen file travels
    sent = [r.headers.get("authorization") for r in hub.requests if "tiny/llama-GGUF" in r.path]
    assert sent and all(a == "Bearer hf_standin" for a in sent), sent  # HF_TOKEN on every call, header read too

    again = pull(hub, tmp_path, "tiny/llama-GGUF", HF_HUB_OFFLINE="1")  # no tag: the pulled Q4_K_M
    assert again.returncode == 0 and "HF_HUB_OFFLINE is set" in again.stdout and str(path) in again.stdout

    import huggingface_hub.constants
    from oval_edge.runtime.model.origin.source import resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("tiny/llama-GGUF:Q4_K_M")  # what serve does, with no network
    assert source.path == str(path) and source.name == "tiny/llama-GGUF:Q4_K_M"
    with pytest.raises(ValueError, match=r"'Q8_0' matches no GGUF file.*oval-edge pull tiny/llama-GGUF:Q8_0"):
        resolve_model("tiny/llama-GGUF:Q8_0")  # on the Hub, but not pulled


def test_serve_names_the_pull_to_run_for_a_model_never_pulled(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from oval_edge.runtime.model.origin.source import resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"has not been pulled into .*run `oval-edge pull org/model:Q4_K_M` first"):
        resolve_model("org/model:Q4_K_M")


def test_offline_and_not_pulled_says_how_to_get_it(hub, tmp_path):
    result = pull(hub, tmp_path, "tiny/llama-GGUF:Q8_0", HF_HUB_OFFLINE="1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "HF_HUB_OFFLINE is set, so tiny/llama-GGUF:Q8_0 cannot be downloaded" in result.stderr
    assert "unset HF_HUB_OFFLINE" in result.stderr and not hub.requests


def test_an_unreachable_hub_is_named_with_what_to_check(tmp_path):
    closed = HubStandIn(url="http://127.0.0.1:9")  # nothing listens on the discard port
    result = pull(closed, tmp_path, "tiny/llama-GGUF:Q4_K_M", timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot reach the Hugging Face Hub at http://127.0.0.1:9" in result.stderr
    assert "HF_ENDPOINT" in result.stderr


@pytest.mark.parametrize("name, words", [
    ("nobody/nothing", "no model repo nobody/nothing at"),
    ("tiny/llama-GGUF:Q3_K_S", "'Q3_K_S' matches no GGUF file in tiny/llama-GGUF; available: "
                               "tiny/llama-GGUF:Q4_K_M, tiny/llama-GGUF:Q8_0"),
    ("not-a-name", "is not a Hub model name"),
])
def test_a_bad_name_is_refused_saying_what_to_change(hub, tmp_path, name, words):
    result = pull(hub, tmp_path, name)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert words in result.stderr, result.stderr
    assert not (tmp_path / "hub" / "models--tiny--llama-GGUF" / "blobs").exists()


def test_pull_a_folder_leaves_other_weight_formats(hub, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    for name, text in {"config.json": '{"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64, '
                                      '"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}',
                       "tokenizer.json": "{}", "model.safetensors": "w" * 64, "pytorch_model.bin": "b" * 64,
                       "original/consolidated.pth": "p"}.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    hub.add("tiny/folder", {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()})
    result = pull(hub, tmp_path / "home", "tiny/folder", "--device", "orin-nano-4gb")
    assert result.returncode == 0, result.stdout + result.stderr
    local = Path(result.stdout.strip().splitlines()[-2])
    assert sorted(os.listdir(local)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not hub.gets("pytorch_model.bin") and not hub.gets("consolidated.pth")
