"""jetson/run-container.sh runs a fake `docker` (first on PATH) that records its argv: the mounts a restart needs
(the cache volume at the image's OVAL_EDGE_CACHE, the owner's models folder), a model of the owner's own passed
to `serve` and `plan`, and the owner's home found through sudo (where HOME is root's)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "jetson" / "run-container.sh"
CACHE = "/var/cache/oval-edge"  # the image's ENV OVAL_EDGE_CACHE (tests/test_dockerfile.py checks it there)


def fake_docker(bin_dir: Path, record: Path) -> None:
    """A `docker` that writes its arguments as a JSON list to `record` and exits 0."""
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)


def host(tmp_path: Path) -> Path:
    """A recorded host: alice (uid 1000, home under the root) with ~/oval-edge/models holding a GGUF file and an HF
    folder, and a jtop group; no jtop socket."""
    root = tmp_path / "host"
    home = root / "home" / "alice"
    (home / "oval-edge" / "models" / "Qwen3-4B").mkdir(parents=True)
    (home / "oval-edge" / "models" / "llama-3.2-1b.Q4_K_M.gguf").write_bytes(b"GGUF")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(f"root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::{home}:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\njtop:x:988:\n")
    return root


def run_container(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    record = tmp_path / "docker-argv.json"
    record.unlink(missing_ok=True)
    if not (tmp_path / "bin").exists():
        fake_docker(tmp_path / "bin", record)
    full_env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "LANG": "C", **env}
    result = subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=60)
    return result, json.loads(record.read_text()) if record.exists() else None


def mounts(argv: list[str]) -> dict[str, str]:
    """container path -> 'source[:options]' of every -v."""
    pairs = [argv[n + 1] for n, arg in enumerate(argv) if arg == "-v"]
    return {pair.split(":")[1]: pair.split(":", 1)[0] + "".join(":" + o for o in pair.split(":")[2:]) for pair in pairs}


def test_serve_mounts_the_cache_volume_and_the_owners_models_folder(tmp_path):
    root = host(tmp_path)
    result, argv = run_container(tmp_path, "--", "--config", "/config/oval-edge.toml", OVAL_ROOT=str(root),
                                 USER="alice", HOME=str(tmp_path / "elsewhere"))
    assert result.returncode == 0, result.stderr
    assert argv[:2] == ["run", "--rm"]  # the container goes, the named volume stays
    volumes = mounts(argv)
    assert volumes[CACHE] == "oval-edge-cache" and f"OVAL_EDGE_CACHE={CACHE}" in argv
    assert volumes["/models"] == f"{root}/home/alice/oval-edge/models:ro"
    image = argv.index("oval-edge:l4t")
    assert argv[image + 1:] == ["--host", "0.0.0.0", "--port", "8000", "--config", "/config/oval-edge.toml"]
    assert all(arg.startswith("-") or argv[n - 1].startswith("-") for n, arg in enumerate(argv[1:image], 1))


@pytest.mark.parametrize("mode, command", [([], ["--host", "0.0.0.0", "--port", "8000"]),
                                           (["--plan"], ["plan", "--device", "auto", "--write-config",
                                                         "/config/oval-edge.toml"])])
@pytest.mark.parametrize("model", ["llama-3.2-1b.Q4_K_M.gguf", "Qwen3-4B"])
def test_a_model_of_the_owners_own_is_passed_from_models(tmp_path, mode, command, model):
    root = host(tmp_path)
    env = {"OVAL_ROOT": str(root), "USER": "alice", "HOME": str(tmp_path), "OVAL_CONFIG_DIR": str(tmp_path)}
    result, argv = run_container(tmp_path, *mode, "--model", model, **env)
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("oval-edge:l4t") + 1:] == [*command, "--model", f"/models/{model}"]
    assert mounts(argv)["/models"].endswith("/home/alice/oval-edge/models:ro")


def test_under_sudo_the_models_folder_is_the_invoking_users(tmp_path):
    root = host(tmp_path)
    result, argv = run_container(tmp_path, "--model", "Qwen3-4B", OVAL_ROOT=str(root), USER="root", HOME="/root",
                                 SUDO_USER="alice")
    assert result.returncode == 0, result.stderr
    assert mounts(argv)["/models"] == f"{root}/home/alice/oval-edge/models:ro"


def test_settings_move_the_port_the_cache_and_the_models(tmp_path):
    root, models = host(tmp_path), tmp_path / "ssd-models"
    models.mkdir()
    result, argv = run_container(tmp_path, OVAL_ROOT=str(root), USER="alice", OVAL_PORT="8080", OVAL_BIND="0.0.0.0",
                                 OVAL_CACHE_VOLUME="/ssd/oval-cache", OVAL_MODELS_DIR=str(models))
    assert result.returncode == 0, result.stderr
    assert mounts(argv)[CACHE] == "/ssd/oval-cache" and mounts(argv)["/models"] == f"{models}:ro"
    assert argv[argv.index("-p") + 1] == "0.0.0.0:8080:8000"


@pytest.mark.parametrize("model, message", [("missing.gguf", "does not exist"), ("../secret", "a name inside"),
                                            ("/etc/passwd", "a name inside")])
def test_a_model_that_is_not_in_the_models_folder_is_refused(tmp_path, model, message):
    result, argv = run_container(tmp_path, "--model", model, OVAL_ROOT=str(host(tmp_path)), USER="alice")
    assert result.returncode == 2 and message in result.stderr and argv is None


def test_without_a_models_folder_only_the_cache_is_mounted(tmp_path):
    root = host(tmp_path)
    result, argv = run_container(tmp_path, OVAL_ROOT=str(root), USER="bob", HOME=str(tmp_path / "bob"))
    assert result.returncode == 0, result.stderr
    assert "/models" not in mounts(argv) and CACHE in mounts(argv)
    assert "no models folder" in result.stderr and "mkdir -p" in result.stderr


def test_print_shows_the_same_line_and_runs_nothing(tmp_path):
    root = host(tmp_path)
    result, argv = run_container(tmp_path, "--print", "--model", "Qwen3-4B", OVAL_ROOT=str(root), USER="alice")
    assert result.returncode == 0 and argv is None
    line = result.stdout.strip()
    assert line.startswith("docker run --rm --runtime nvidia ") and line.endswith("--model /models/Qwen3-4B")
    assert f"-v oval-edge-cache:{CACHE}" in line and f"-v {root}/home/alice/oval-edge/models:/models:ro" in line
