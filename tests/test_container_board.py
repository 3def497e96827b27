"""jetson/setup-board.sh on this host (not a Jetson) and on files recorded on a Jetson Orin Nano (OVAL_ROOT): what it
reports, that it changes nothing, the folders it names for the user who ran it (through sudo too, where HOME is
root's), and the jetson-stats version story: the image's client version is Dockerfile.l4t's ARG, and a host service
of another major.minor is reported with both ways out."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from test_dockerfile import DOCKERFILE, arg_defaults, parse_dockerfile

REPO = Path(__file__).resolve().parents[1]
SETUP_BOARD = REPO / "jetson" / "setup-board.sh"
JTOP_PIN = arg_defaults(parse_dockerfile(DOCKERFILE.read_text()), 0)["JETSON_STATS_VERSION"]


def run_setup_board(tmp_path: Path, *args: str, root: Path | None = None, **env_extra: str
                    ) -> subprocess.CompletedProcess:
    """Run setup-board.sh with its own empty HOME, TMPDIR and working folder, which must stay empty."""
    sandbox = {name: tmp_path / name for name in ("home", "tmp", "cwd")}
    for folder in sandbox.values():
        folder.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(sandbox["home"]), "TMPDIR": str(sandbox["tmp"]),
           "USER": "alice", "LANG": "C", **env_extra}
    if root is not None:
        env["OVAL_ROOT"] = str(root)
    result = subprocess.run(["bash", str(SETUP_BOARD), *args], cwd=sandbox["cwd"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert [str(p) for f in sandbox.values() for p in f.rglob("*")] == [], "setup-board.sh wrote files"
    return result


@pytest.mark.parametrize("where", ["this host", "an empty root"])
def test_setup_board_off_jetson_says_so_and_writes_nothing(tmp_path, where):
    root = None
    if where == "an empty root":
        root = tmp_path / "empty"
        root.mkdir()
    elif Path("/etc/nv_tegra_release").exists():
        pytest.skip("this host is a Jetson; the recorded-board test covers the Jetson branch")
    result = run_setup_board(tmp_path, root=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Not on a Jetson:") and "Nothing was checked or changed." in result.stdout
    assert "multi-user.target" in result.stdout and "docker run" in result.stdout


def test_setup_board_apply_off_jetson_refuses(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_setup_board(tmp_path, "--apply", root=tmp_path / "empty")
    assert result.returncode == 1 and "--apply ignored" in result.stdout


# Recorded on a Jetson Orin Nano 8 GB dev kit (L4T r36, CUDA 12.6.68): `cat /etc/nv_tegra_release` (R36.4.7 as
# shipped with JetPack 6.2.1), `cat /proc/device-tree/model` and `cat /proc/meminfo`.
NV_TEGRA_RELEASE = (
    "# R36 (release), REVISION: 4.7, GCID: 42132812, BOARD: generic, EABI: aarch64, DATE: Thu Sep 18 22:54:44 UTC 2025\n"
    "# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\nTARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
DEVICE_TREE_MODEL = "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\0"
MEMINFO = """MemTotal:        7802736 kB
MemFree:         3668508 kB
MemAvailable:    6245596 kB
Buffers:          633812 kB
Cached:          2193460 kB
SwapCached:         1212 kB
SwapTotal:       3901344 kB
SwapFree:        3608100 kB
Shmem:            156444 kB
CmaTotal:         262144 kB
CmaFree:               0 kB
"""
# That board's swap was JetPack's default zram (lsblk: zram0-5 of 635M each, [SWAP]); the kernel's /proc/swaps
# table for it, with the sizes adding up to SwapTotal above (6 x 650224 kB) and nvzramconfig's priority 5.
SWAPS = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + "".join(
    f"/dev/zram{n}                              partition\t650224\t\t48874\t\t5\n" for n in range(6))
# JetPack's /etc/docker/daemon.json as nvidia-container-toolkit writes it: the runtime is there, not the default.
DAEMON_JSON = '{\n    "runtimes": {\n        "nvidia": {\n            "args": [],\n            "path": "nvidia-container-runtime"\n        }\n    }\n}\n'


# jetson-stats' package as `sudo pip3 install` leaves it on JetPack 6's Python 3.10 (only the line read here).
JTOP_INIT = "usr/local/lib/python3.10/dist-packages/jtop/__init__.py"


def recorded_board(root: Path, jtop_version: str | None = None) -> Path:
    files = {"etc/nv_tegra_release": NV_TEGRA_RELEASE, "proc/device-tree/model": DEVICE_TREE_MODEL,
             "proc/meminfo": MEMINFO, "proc/swaps": SWAPS, "etc/docker/daemon.json": DAEMON_JSON,
             "etc/group": "root:x:0:\nvideo:x:44:alice\njtop:x:988:\n",
             "etc/passwd": "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000:Alice:/home/alice:/bin/bash\n"}
    if jtop_version:
        files[JTOP_INIT] = f'__author__ = "Raffaello Bonghi"\n__version__ = "{jtop_version}"\n'

    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(content)
    (root / "run").mkdir()
    with socket.socket(socket.AF_UNIX) as server:  # the jtop service's socket file, as the service leaves it
        server.bind(str(root / "run" / "jtop.sock"))
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_mode, p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_setup_board_reads_a_recorded_jetson_and_changes_nothing(tmp_path):
    root = recorded_board(tmp_path / "board")
    before = snapshot(root)
    result = run_setup_board(tmp_path, root=root)
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert snapshot(root) == before
    assert "L4T R36.4.7 (JetPack 6)" in out and "Orin Nano Engineering Reference Developer Kit Super" in out
    assert "MemTotal 7619 MiB, MemAvailable 6099 MiB, SwapTotal 3809 MiB" in out
    assert out.count("[warn] /dev/zram") == 6 and "sudo systemctl disable nvzramconfig" in out
    assert "swap on NVMe" in out and "default-runtime is 'not set'" in out
    assert "alice is not in group jtop" in out and "sudo usermod -aG jtop alice" in out
    run_line = next(line for line in out.splitlines() if line.strip().startswith("run:"))
    for part in ("--runtime nvidia", "-v /run/jtop.sock:/run/jtop.sock", "--group-add 988",
                 "-v /etc/nv_tegra_release:/etc/nv_tegra_release:ro", "-p 127.0.0.1:8000:8000",
                 "oval-edge:l4t --host 0.0.0.0 --port 8000 --config /config/oval-edge.toml"):
        assert part in run_line, (part, run_line)
    assert "Nothing was changed" in out
    assert "mkdir -p /home/alice/oval-edge /home/alice/oval-edge/models" in out  # alice's, from /etc/passwd
    assert f"sudo pip3 install jetson-stats=={JTOP_PIN} && sudo jtop --install-service" not in out  # jtop is there


def test_setup_board_under_sudo_names_the_invoking_users_folders(tmp_path):
    root = recorded_board(tmp_path / "board")
    result = run_setup_board(tmp_path, root=root, SUDO_USER="alice", USER="root")  # HOME is the sandbox, as /root
    assert result.returncode == 0, result.stderr
    assert "mkdir -p /home/alice/oval-edge /home/alice/oval-edge/models" in result.stdout
    assert "-v /home/alice/oval-edge:/config" in result.stdout and str(tmp_path / "home") not in result.stdout


@pytest.mark.parametrize("host_version", ["4.3.2", JTOP_PIN, JTOP_PIN.rsplit(".", 1)[0] + ".0", None])
def test_setup_board_compares_the_hosts_jetson_stats_with_the_images(tmp_path, host_version):
    result = run_setup_board(tmp_path, root=recorded_board(tmp_path / "board", host_version))
    out = result.stdout
    assert result.returncode == 0, result.stderr
    if host_version is None:
        assert "host jetson-stats version not found" in out and f"the image's client is {JTOP_PIN}" in out
    elif host_version.rsplit(".", 1)[0] == JTOP_PIN.rsplit(".", 1)[0]:
        assert f"[ok]   host jetson-stats {host_version} matches the image's client {JTOP_PIN}" in out
    else:
        assert f"[warn] host jetson-stats {host_version}, image's client {JTOP_PIN}" in out
        assert f"sudo pip3 install jetson-stats=={JTOP_PIN} && sudo jtop --install-service" in out
        assert f"--build-arg JETSON_STATS_VERSION={host_version}" in out


def test_setup_board_without_jtop_installs_the_images_version(tmp_path):
    root = recorded_board(tmp_path / "board")
    (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:alice\n")
    result = run_setup_board(tmp_path, root=root)
    assert "no jtop group" in result.stdout
    assert f"sudo pip3 install jetson-stats=={JTOP_PIN} && sudo jtop --install-service" in result.stdout


def test_setup_board_refuses_apply_on_recorded_files(tmp_path):
    root = recorded_board(tmp_path / "board")
    before = snapshot(root)
    result = run_setup_board(tmp_path, "--apply", root=root)
    assert result.returncode == 2 and "only changes the live system" in result.stderr
    assert snapshot(root) == before
