"""What `pip install .` installs: the wheel built from the source folders holds every package and data file.

The test suite itself runs on an editable install, which reads the source folders directly, so a package or data
file that the wheel lacks passes every other test (#56: five subpackages were missing and `oval-edge serve` could
not start). The wheel is built from a copy of what Dockerfile.l4t copies, without build isolation when this
environment's setuptools meets the build-system requirement (about a second), else with it (pip's cache).
tools/check_wheel.sh installs the wheel in a fresh venv and serves from it (CI, after `make test`).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# source folder -> installed package (the mapping setup.py applies)
ROOTS = {"oval_edge": "oval_edge", "runtime": "oval_edge.runtime", "tools": "oval_edge.tools",
         "jetson": "oval_edge.jetson"}
# what Dockerfile.l4t copies into the image to `pip install` (tests/test_dockerfile.py checks it does)
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", *ROOTS)
NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
CHECKOUT_ONLY = REPO / "tools" / "experiments"  # one-question experiments: run from a checkout, not shipped


def installed_name(path: Path) -> str:
    """The wheel's name for a file of the source folders: runtime/model/x.py -> oval_edge/runtime/model/x.py."""
    folder, *rest = path.resolve().relative_to(REPO).parts
    return "/".join([*ROOTS[folder].split("."), *rest])


def source_files() -> list[Path]:
    """What the wheel must ship: every source file but the checkout-only experiments."""
    return sorted(p for folder in ROOTS for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
                  and p.suffix not in (".pyc", ".pyo") and CHECKOUT_ONLY not in p.parents)


def isolation_flag() -> list[str]:
    """--no-build-isolation when this environment's setuptools satisfies pyproject's build requirement."""
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    wanted = next(Requirement(r) for r in requires if Requirement(r).name == "setuptools")
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if wanted.specifier.contains(have, prereleases=True) else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if not (REPO / name).exists():  # e.g. no setup.py: the build is pyproject.toml's alone
            continue
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=NOT_SOURCE)
        else:
            shutil.copy2(REPO / name, src / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation_flag(), "-w", str(work / "dist"),
               str(src)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (work / "dist").glob("oval_edge-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_every_package_and_module_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    packages = [p.parent for folder in ROOTS for p in (REPO / folder).rglob("__init__.py")
                if p.parent != CHECKOUT_ONLY and CHECKOUT_ONLY not in p.parents]
    assert len(packages) >= 20, packages  # the walk sees the source folders
    missing = [installed_name(p) for p in packages if installed_name(p / "__init__.py") not in names]
    assert not missing, f"packages not in the wheel: {missing}"
    modules = [installed_name(p) for p in source_files() if p.suffix == ".py"]
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules not in the wheel: {missing}"


def test_package_data_ships(wheel):
    names = set(wheel.namelist())
    data = [installed_name(p) for p in source_files() if p.suffix != ".py"]
    for expected in ("oval_edge/kernels/score_kernels.c", "oval_edge/kernels/kernel_math.h",
                     "oval_edge/runtime/model/templates/chatml-tools.jinja", "oval_edge/jetson/setup-board.sh",
                     "oval_edge/jetson/k8s/base/daemonset.yaml", "oval_edge/jetson/k8s/base/oval-edge.toml",
                     "oval_edge/tools/data/botchan_ch1-2.txt", "oval_edge/tools/check_wheel.sh"):
        assert expected in data, expected  # the walk finds each kind of data file
    missing = [d for d in data if d not in names]
    assert not missing, f"data files not in the wheel: {missing}"


def test_files_the_code_reads_at_run_time_ship(wheel):
    # Located next to the code (Path(__file__)-relative), so they must be in the package, not just in the checkout.
    from oval_edge.kernels.cpu_build import HEADERS, SOURCES
    from oval_edge.runtime.model.tokenizer import SHIPPED_TEMPLATES
    from oval_edge.tools.eval.text import SHIPPED_TEXT
    from oval_edge.tools.load.multiturn import TEXT

    read = [*SOURCES, *HEADERS, *SHIPPED_TEMPLATES.values(), Path(SHIPPED_TEXT), TEXT]
    missing = [installed_name(p) for p in read if installed_name(p) not in set(wheel.namelist())]
    assert not missing, f"read at run time, not in the wheel: {missing}"


def test_the_experiments_stay_in_the_checkout(wheel):
    experiments = [p for p in CHECKOUT_ONLY.rglob("*.py")]
    assert len(experiments) >= 5, experiments  # the folder exists and holds them
    assert not [n for n in wheel.namelist() if n.startswith("oval_edge/tools/experiments/")]


def test_the_wheel_installs_only_the_oval_edge_namespace(wheel):
    # runtime/, tools/ and jetson/ must not land in site-packages as top-level packages of those generic names.
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"oval_edge"}
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "oval-edge = oval_edge.cli:main" in entry_points
