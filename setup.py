"""The wheel's packages and data files, found in the four source folders; all metadata is in pyproject.toml.

The folders install as one namespace (runtime/ as oval_edge.runtime, ...). setuptools' own discovery
([tool.setuptools.packages.find]) cannot put a folder under another package's name, and a hand-written list in
pyproject.toml drifted from the folders until `pip install .` could not serve (#56). So here every folder holding an
__init__.py is a package, and every other file in or below a package's folder ships with that package.
"""

import os
import warnings

from setuptools import find_packages, setup

# `pip install -e .` (what `make serve` runs) ended with setuptools' "Editable installation" banner, asking to beware
# of folders in the working directory named like the package: the one such folder here, oval_edge/, is that
# package's own source, so it asked for nothing. pip shows what the build warns even with -q; this one is dropped
# (tests/test_quiet_start.py builds the wheel and the editable wheel and expects no warning from either).
warnings.filterwarnings("ignore", message="Editable installation")

# source folder -> the package it installs as
ROOTS = {"oval_edge": "oval_edge", "runtime": "oval_edge.runtime", "tools": "oval_edge.tools",
         "jetson": "oval_edge.jetson"}
# One-question experiments run from a checkout (tools/experiments/__init__.py says why); the wheel leaves them out.
CHECKOUT_ONLY = "oval_edge.tools.experiments"


def is_data(name: str) -> bool:
    """Modules ship as modules; byte code and hidden files (editors', the OS's) never ship."""
    return not (name.endswith((".py", ".pyc", ".pyo")) or name.startswith("."))


def find_layout() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Package name -> its folder, and package name -> its data files relative to that folder (a file belongs to
    the nearest package folder above it: templates/, data/ and k8s/ are plain folders inside packages)."""
    packages: dict[str, str] = {}
    for folder, root in ROOTS.items():
        found = {root: folder, **{f"{root}.{name}": os.path.join(folder, *name.split("."))
                                  for name in find_packages(where=folder)}}
        clash = sorted(packages.keys() & found.keys())
        if clash:  # e.g. an oval_edge/runtime package would hide the runtime/ folder
            raise SystemExit(f"setup.py: packages found in two source folders: {clash}")
        packages.update(found)
    package_of = {os.path.normpath(folder): name for name, folder in packages.items()}
    data: dict[str, list[str]] = {}
    for root_folder in ROOTS:
        for folder, dirs, files in os.walk(root_folder):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            owner = os.path.normpath(folder)
            while owner not in package_of:
                owner = os.path.dirname(owner)
            data.setdefault(package_of[owner], []).extend(
                os.path.relpath(os.path.join(folder, name), owner).replace(os.sep, "/")
                for name in sorted(files) if is_data(name))
    packages = {name: folder for name, folder in packages.items()
                if name != CHECKOUT_ONLY and not name.startswith(CHECKOUT_ONLY + ".")}
    return packages, {name: files for name, files in sorted(data.items()) if files and name in packages}


packages, package_data = find_layout()
setup(packages=sorted(packages), package_dir={root: folder for folder, root in ROOTS.items()},
      package_data=package_data)
