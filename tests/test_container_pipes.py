"""No pipe into a reader that stops early where pipefail is on (Dockerfile.l4t's SHELL, the scripts' `set -o`).

`cmd | grep -q x` under pipefail: grep exits at the first match, cmd's next write gets SIGPIPE, and the pipe's
status becomes 141, so the step fails at random (7 and 10 in 200 builds of the old ldconfig check). Neither
hadolint nor shellcheck (even --enable=all) has a rule for it, so this file holds one: a scan of the shell text
for `| grep -q/-m`, `| head`, plus running the Dockerfile's own check steps against fake commands whose output
goes on after the match, which fails the old steps every time and must never fail the new ones.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from test_dockerfile import DOCKERFILE, REPO, parse_dockerfile

# A pipe (not ||) into grep with -q/-m/--quiet/--silent/--max-count among its options, or into head.
EARLY_READER = re.compile(
    r"(?<!\|)\|(?!\|)\s*(?:grep\b[^|;&)]*?\s(?:-[A-Za-z]*[qm]|--(?:quiet|silent|max-count))|head\b)")
PIPEFAIL = re.compile(r"set\s+-[A-Za-z]*o\s+pipefail|set\s+-o\s+pipefail|\"-o\",\s*\"pipefail\"")


def early_exit_pipes(text: str) -> list[str]:
    """'line N: text' for every pipe into an early reader, when the text turns pipefail on (comment lines skipped)."""
    code = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if not line.lstrip().startswith("#")]
    if not any(PIPEFAIL.search(line) for _, line in code):
        return []
    return [f"line {n}: {line.strip()}" for n, line in code if EARLY_READER.search(line)]


def test_the_scan_finds_early_readers_only_under_pipefail():
    old_step = 'SHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN ldconfig -p | grep -q \'libcudss.so.0\'\n'
    assert early_exit_pipes(old_step) == ["line 2: RUN ldconfig -p | grep -q 'libcudss.so.0'"]
    script = "set -euo pipefail\nid -nG | tr ' ' '\\n' | grep -qx jtop\nv=$(sed -n p f | head -n 1)\nx | grep -m1 y\n"
    assert len(early_exit_pipes(script)) == 3
    assert early_exit_pipes(script.replace("set -euo pipefail", "set -eu")) == []
    fine = 'set -o pipefail\nx="$(ldconfig -p)" && grep -q libc <<< "$x"\na || grep -q b c\ngetent group x | cut -d: -f3\n'
    assert early_exit_pipes(fine) == []


# The container's files. tools/check_wheel.sh and tools/install_torch.sh still read a `sed | head -n 1` (one line
# of output, so a SIGPIPE there is unlikely, not impossible); add them once they read as host-lib.sh does.
CONTAINER_FILES = [DOCKERFILE, *sorted((REPO / "jetson").glob("*.sh")), REPO / "tools" / "check_container_steps.sh"]


@pytest.mark.parametrize("path", CONTAINER_FILES, ids=lambda p: p.name)
def test_no_pipe_into_an_early_reader_under_pipefail(path):
    assert early_exit_pipes(path.read_text()) == []


def run_steps(marker: str, stop: str | None = None, dockerfile: str | None = None) -> str:
    """The `&&` steps of the Dockerfile's RUN holding `marker`, from the first that mentions it up to (not
    including) the first mentioning `stop`: the check as the image runs it, without what needs the board."""
    text = DOCKERFILE.read_text() if dockerfile is None else dockerfile
    run = next(i.args for i in parse_dockerfile(text) if i.keyword == "RUN" and marker in i.args)
    steps = [step.strip() for step in run.split(" && ")]
    first = next(n for n, step in enumerate(steps) if marker in step)
    last = next((n for n, step in enumerate(steps) if stop and n > first and stop in step), len(steps))
    return " && ".join(steps[first:last])


def fake_command(folder: Path, name: str, first_lines: list[str], exit_code: int = 0) -> None:
    """`name` prints first_lines, then (exit_code 0) becomes a writer of 200,000 more lines (~6 MB, far past the
    64 KiB pipe buffer), as ldconfig is one process writing its whole cache: a reader that quits at the first
    lines leaves it writing into a closed pipe, and SIGPIPE ends it with 141."""
    path = folder / name
    body = "".join(f"printf '%s\\n' '{line}'\n" for line in first_lines)
    tail = f"exit {exit_code}" if exit_code else "exec seq -f '        libfiller%g.so (libc6,AArch64) => /filler' 200000"
    path.write_text(f"#!/bin/bash\n{body}{tail}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_under_pipefail(steps: str, bin_dir: Path, cwd: Path) -> int:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-o", "pipefail", "-c", steps], cwd=cwd, env=env, capture_output=True,
                          timeout=60).returncode


LIBRARIES = ["\tlibcusparseLt.so.0 (libc6,AArch64) => /usr/lib/aarch64-linux-gnu/libcusparseLt/12/libcusparseLt.so.0",
             "\tlibcudss.so.0 (libc6,AArch64) => /usr/lib/aarch64-linux-gnu/libcudss/12/libcudss.so.0"]


def test_library_check_passes_when_found_and_fails_when_missing_or_broken(tmp_path):
    steps = run_steps("ldconfig -p")
    assert "libcusparseLt.so.0" in steps and "libcudss.so.0" in steps, steps
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "ldconfig", LIBRARIES)
    for attempt in range(5):  # with the old `ldconfig -p | grep -q` this was 141 at the first attempt
        assert run_under_pipefail(steps, bin_dir, tmp_path) == 0, (attempt, steps)
    fake_command(bin_dir, "ldconfig", LIBRARIES[:1])
    assert run_under_pipefail(steps, bin_dir, tmp_path) == 1  # libcudss missing: the build stops here
    fake_command(bin_dir, "ldconfig", LIBRARIES, exit_code=3)
    assert run_under_pipefail(steps, bin_dir, tmp_path) != 0  # a failing ldconfig still fails the build


def test_sm87_check_passes_when_found_and_fails_without_sm87(tmp_path):
    steps = run_steps("cuobjdump", stop="pip install")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "cuobjdump", ["ELF file    1: libbitsandbytes_cuda126.1.sm_87.cubin"])
    for attempt in range(5):
        assert run_under_pipefail(steps, bin_dir, tmp_path) == 0, (attempt, steps)
    fake_command(bin_dir, "cuobjdump", ["ELF file    1: libbitsandbytes_cuda126.1.sm_80.cubin"])
    assert run_under_pipefail(steps, bin_dir, tmp_path) == 1
