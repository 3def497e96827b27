"""cpu_build's error messages name the real reason when a build or its self-check fails, even when something else
printed last: on an Arm board under qemu a oneDNN warning printed at exit was all the message said."""

from __future__ import annotations

import os
import shutil

import pytest

from oval_edge.cache_dir import CACHE_ENV
from oval_edge.kernels import cpu_build

NOISE = "onednn_verbose,info,cpu,warning: the ISA was not detected, using the default " + "." * 600


def test_a_compile_error_is_reported_when_warnings_follow_it(monkeypatch, tmp_path):
    """A compiler that prints a long warning after its error: the message still carries the `error:` line."""
    real = shutil.which("cc") or shutil.which("gcc")
    noisy = tmp_path / "noisy-cc"
    noisy.write_text(f'#!/bin/sh\n{real} "$@"; code=$?\necho "{NOISE}" >&2\nexit $code\n')
    noisy.chmod(0o755)
    broken = tmp_path / "broken.c"
    broken.write_text("int oval_scores_f32( {\n")
    monkeypatch.setattr(cpu_build, "SOURCES", (broken, *cpu_build.SOURCES[1:]))
    monkeypatch.setenv("CC", str(noisy))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"failed: .*broken\.c:1:\d+: error"):
        cpu_build.built_library()


def test_a_failing_self_check_names_the_check_not_the_last_line(monkeypatch, tmp_path):
    """A library whose scores are 1% off, checked in a child process that prints a warning to stderr at exit (a
    sitecustomize on the child's path: what oneDNN did under qemu): the message names the failing check."""
    source = cpu_build.SOURCES[0].read_text()  # score_kernels.c
    final = "return (log2f(total) + peak) * LN_2;"
    assert final in source
    skewed = tmp_path / "skewed.c"
    skewed.write_text(source.replace(final, "return (log2f(total) + peak) * LN_2 * 1.01f;"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import atexit, sys\natexit.register(lambda: print({NOISE!r}, "
                                           "file=sys.stderr))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(cpu_build, "SOURCES", (skewed, *cpu_build.SOURCES[1:]))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"exited 1\): disagrees with torch: oval_scores float") as raised:
        cpu_build.built_library()
    assert "onednn_verbose" not in str(raised.value)


def test_a_crashing_check_reports_its_exception():
    """A traceback's exception line is the reason, not the frames printed before it or a warning after it."""
    output = ("Traceback (most recent call last):\n  File \"cpu_check.py\", line 9, in <module>\n"
              "OSError: oval_kernels.so: cannot open shared object file\n" + NOISE + "\n")
    assert cpu_build.failure_reason(output) == "OSError: oval_kernels.so: cannot open shared object file"
    assert cpu_build.failure_reason("") == "no output"
    assert cpu_build.failure_reason("only a note\n") == "only a note"
