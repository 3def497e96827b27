"""Resolve a RequirementSet for a Target with pip, markers evaluated for the target.

pip's --platform/--python-version choose wheel tags but evaluate markers for the machine pip runs on, so a
one-shot `pip install --dry-run` here would pull x86-64-only packages (triton) and drop Python-3.10-only ones
(tomli). The resolution therefore runs in passes: pip picks one version per name (--no-deps, tags of the target),
this module reads each pick's Requires-Dist from pip's report, evaluates the markers for the target and adds what
applies; it stops when a pass adds nothing. A pass asks pip only about requirements it has not asked before. Every requirement seen stays in force, so each pick satisfies all of
them, and pip's error names the package when no wheel does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from .requirement_sets import RequirementSet
from .target import Target

MAX_PASSES = 25


class ResolutionError(RuntimeError):
    """The install cannot be resolved for the target; the message says which package and why."""


@dataclass(frozen=True)
class Pick:
    """pip's choice for one name: version, the file it would download and its Requires-Dist."""

    name: str
    version: str
    url: str
    requires_dist: tuple[str, ...]

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1].split("#", 1)[0]

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")


# (requirement lines, names allowed as sdists, target) -> name -> Pick
PipChooser = Callable[[list[str], frozenset[str], Target], dict[str, Pick]]


@dataclass
class Wanted:
    """Everything asked of one name so far."""

    specifier: SpecifierSet = field(default_factory=SpecifierSet)
    extras: frozenset[str] = frozenset()
    by: list[str] = field(default_factory=list)

    def line(self, name: str) -> str:
        extras = f"[{','.join(sorted(self.extras))}]" if self.extras else ""
        return f"{name}{extras}{self.specifier}"


@dataclass(frozen=True)
class Resolution:
    picks: dict[str, Pick]  # the install: every name reachable from the set's requirements
    provided_checks: list[str]  # "torch>=2.4,<3 (bitsandbytes 0.50.2): accepts 2.8.0, ..."
    passes: int


def pip_choose(lines: list[str], sdists: frozenset[str], target: Target) -> dict[str, Pick]:
    """One pass: `pip install --dry-run --no-deps` for the target's tags, read from pip's JSON report."""
    with tempfile.TemporaryDirectory(prefix="oval-board-check.") as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q",
                   "--disable-pip-version-check", "--report", str(report), *target.pip_arguments(),
                   *(f"--no-binary={name}" for name in sorted(sdists)), *lines]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            # pip's list of versions it skipped for another Python is long and says nothing about the failure
            errors = [line for line in done.stderr.splitlines()
                      if line.startswith("ERROR") and not line.startswith("ERROR: Ignored the following")]
            raise ResolutionError("\n".join(errors or done.stderr.splitlines()[-5:]))
        data = json.loads(report.read_text(encoding="utf-8"))
    return {canonicalize_name(item["metadata"]["name"]): Pick(
        canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"], item["download_info"]["url"],
        tuple(item["metadata"].get("requires_dist", ()))) for item in data["install"]}


def resolve(request: RequirementSet, target: Target, choose: PipChooser = pip_choose) -> Resolution:
    wanted: dict[str, Wanted] = {}
    provided_checks: list[str] = []
    refused: list[str] = []
    no_deps = {canonicalize_name(Requirement(text).name) for text in request.no_deps}

    def want(requirement: Requirement, by: str) -> bool:
        """Record a requirement; True when it asks for something new."""
        name = canonicalize_name(requirement.name)
        if name in request.provided:
            versions = request.provided[name]
            if requirement.url:
                refused.append(f"{by} wants {requirement} from a URL instead of the board's {name}")
            bad = [v for v in versions if not requirement.specifier.contains(v, prereleases=True)]
            line = f"{name}{requirement.specifier or ' (any)'} ({by})"
            if bad:
                refused.append(f"{line} refuses the board's {name} {', '.join(bad)}: pip would replace it")
            provided_checks.append(f"{line}: accepts {', '.join(versions)}")
            return False
        new = name not in wanted
        entry = wanted.setdefault(name, Wanted())
        old = (str(entry.specifier), entry.extras)
        entry.specifier &= requirement.specifier
        entry.extras |= frozenset(requirement.extras)
        if by not in entry.by:
            entry.by.append(by)
        return new or old != (str(entry.specifier), entry.extras)

    for text in (*request.requirements, *request.no_deps):
        requirement = Requirement(text)
        if target.applies(requirement):
            want(requirement, request.name)

    # pip --no-deps picks each line on its own, so a line asked once is not asked again: a pass asks pip only about
    # new or narrowed requirements (and builds a source distribution's metadata once)
    known: dict[str, Pick] = {}
    for passes in range(1, MAX_PASSES + 1):
        lines = {name: entry.line(name) for name, entry in sorted(wanted.items())}
        ask = [line for line in lines.values() if line not in known]
        if ask:
            try:
                chosen = choose(ask, request.sdists, target)
            except ResolutionError as error:
                raise ResolutionError(explain(str(error), wanted, target)) from None
            known.update((lines[name], pick) for name, pick in chosen.items() if name in lines)
        picks = {name: known[line] for name, line in lines.items()}
        grew = False
        for pick in picks.values():
            if pick.name in no_deps:
                continue
            for text in pick.requires_dist:
                requirement = Requirement(text)
                if target.applies(requirement, wanted[pick.name].extras):
                    grew |= want(requirement, f"{pick.name} {pick.version}")
        if refused:
            raise ResolutionError("; ".join(dict.fromkeys(refused)))
        if not grew:
            return Resolution(reachable(request, picks, target, wanted), list(dict.fromkeys(provided_checks)),
                              passes)
    raise ResolutionError(f"no stable resolution after {MAX_PASSES} passes: {sorted(wanted)}")


def reachable(request: RequirementSet, picks: dict[str, Pick], target: Target,
              wanted: dict[str, Wanted]) -> dict[str, Pick]:
    """The picks the set's requirements reach through the final picks' dependencies, each checked to be a wheel
    (or a source build the install names)."""
    no_deps = {canonicalize_name(Requirement(t).name) for t in request.no_deps}
    todo = [canonicalize_name(Requirement(t).name) for t in (*request.requirements, *request.no_deps)
            if target.applies(Requirement(t))]
    seen: dict[str, Pick] = {}
    while todo:
        name = todo.pop()
        if name in seen or name in request.provided:
            continue
        pick = picks[name]
        seen[name] = pick
        if not pick.is_wheel and name not in request.sdists:
            raise ResolutionError(f"{name} {pick.version} would be built from {pick.filename} on the board: no "
                                  f"{target.describe()} wheel")
        if name not in no_deps:
            todo += [canonicalize_name(r.name) for r in map(Requirement, pick.requires_dist)
                     if target.applies(r, wanted[name].extras)]
    return dict(sorted(seen.items()))


def explain(pip_error: str, wanted: dict[str, Wanted], target: Target) -> str:
    """pip's error with who asked for the package it names."""
    named = re.search(r"satisfies the requirement ([A-Za-z0-9._-]+)", pip_error)
    name = canonicalize_name(named.group(1)) if named else None
    if name in wanted:
        entry = wanted[name]
        return (f"no {target.describe()} wheel of {entry.line(name)} (asked for by "
                f"{', '.join(entry.by)}). pip said:\n{pip_error}")
    return f"pip could not resolve for {target.describe()}:\n{pip_error}"
