"""pyproject's torch floor against the versions JetPack boards carry, read as packaging and as pip itself read them.

NVIDIA tags its builds as pre-releases (2.7.0a0+79aa17489c.nv25.04). The floor must keep every build transformers 5
runs with (pip would otherwise swap the board's torch for PyPI's CUDA 13 aarch64 one) and refuse the ones it turns
torch off for. pip is run for real against a virtualenv holding only an installed torch's metadata, with a generic
torch wheel on offer where PyPI's would be.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from oval_edge.tools.board_check.jetpack_torch import JETPACK_TORCH
from oval_edge.tools.board_check.requirement_sets import torch_floor

REPO = Path(__file__).resolve().parents[1]
# releases around the floor besides NVIDIA's: PyPI's, local CPU/CUDA tags, pre- and post-releases
OTHER_TORCH = ("2.5.1", "2.6.0", "2.6.0rc1", "2.6.0.post1", "2.6.0.dev20250101", "2.13.0+cpu", "2.8.0+cu126",
               "3.0.0a0")


def transformers_torch_minimum() -> Version:
    """The version below which transformers' is_torch_available() turns torch off, read from its source."""
    from transformers.utils import import_utils

    source = inspect.getsource(import_utils.is_torch_available)
    found = re.search(r'>= version\.parse\("([0-9.]+)"\)', source)
    if found is None:
        pytest.skip("transformers' is_torch_available no longer compares with version.parse(...); read it again")
    return Version(found.group(1))


@pytest.mark.parametrize("version", [*JETPACK_TORCH, *OTHER_TORCH])
def test_the_floor_keeps_what_transformers_runs_with_and_nothing_below(version):
    floor = torch_floor(REPO)
    runs = Version(version) >= transformers_torch_minimum()
    assert floor.contains(version, prereleases=True) == runs, (
        f"torch{floor} {'refuses' if runs else 'accepts'} {version}, which transformers "
        f"{'runs with' if runs else 'turns torch off for'}")


def test_a_jetpack_build_of_each_kind_is_on_each_side():
    """The version list exercises the case the floor is written for: NVIDIA pre-release tags on both sides."""
    floor = torch_floor(REPO)
    nvidia = [v for v in JETPACK_TORCH if Version(v).is_prerelease]
    assert {floor.contains(v, prereleases=True) for v in nvidia} == {True, False}


@pytest.fixture
def pip_with_torch(tmp_path):
    """pip (this interpreter's) against a pip-less venv whose only package is an installed torch's metadata, an
    offline index holding a generic torch 2.13.0 wheel, and no user configuration."""
    offer = tmp_path / "offer"
    offer.mkdir()
    with zipfile.ZipFile(offer / "torch-2.13.0-py3-none-any.whl", "w") as wheel:
        info = "torch-2.13.0.dist-info"
        wheel.writestr("torch/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    environment["PIP_CONFIG_FILE"] = os.devnull

    def run(installed: str, requirement: str, constraint: str | None = None):
        venv = tmp_path / f"venv-{len(list(tmp_path.iterdir()))}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / f"torch-{installed}.dist-info").mkdir()
        (site / f"torch-{installed}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {installed}\n")
        extra = []
        if constraint:
            (tmp_path / "constraint.txt").write_text(constraint + "\n")
            extra = ["-c", str(tmp_path / "constraint.txt")]
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                               "--dry-run", "--no-index", "--find-links", str(offer), "--report", "-", "-q",
                               *extra, requirement], capture_output=True, text=True, env=environment, timeout=120)
        if done.returncode != 0:
            return None, done.stderr
        return [item["metadata"]["version"] for item in json.loads(done.stdout)["install"]], done.stderr

    return run


def pyproject_torch() -> str:
    return f"torch{torch_floor(REPO)}"


@pytest.mark.parametrize("installed", [v for v in JETPACK_TORCH if torch_floor(REPO).contains(v, prereleases=True)])
def test_pip_keeps_a_jetpack_torch_the_floor_accepts(pip_with_torch, installed):
    to_install, errors = pip_with_torch(installed, pyproject_torch())
    assert to_install == [], (installed, to_install, errors)
    # the Makefile's constraint names the version with its local part, which pip matches exactly
    to_install, errors = pip_with_torch(installed, pyproject_torch(), constraint=f"torch=={installed}")
    assert to_install == [], (installed, to_install, errors)


def test_pip_would_replace_a_torch_below_the_floor_unless_the_install_constraint_holds_it(pip_with_torch):
    """Why the Makefile installs with -c torch-constraint.txt: without it pip swaps the board's torch for whatever
    the index offers; with it pip stops instead."""
    below = next(v for v in JETPACK_TORCH if not torch_floor(REPO).contains(v, prereleases=True))
    assert pip_with_torch(below, pyproject_torch())[0] == ["2.13.0"]
    to_install, errors = pip_with_torch(below, pyproject_torch(), constraint=f"torch=={below}")
    assert to_install is None and "torch" in errors, to_install


def test_pyproject_names_torch_once_with_a_floor_only():
    floor = torch_floor(REPO)
    assert [s.operator for s in floor] == [">="], "an upper bound would refuse the next JetPack torch"
    assert Requirement(pyproject_torch()).marker is None
