"""What each Jetson install asks pip for: the serve-only board install and the L4T image, read from the files that
drive them (pyproject.toml, the Makefile, Dockerfile.l4t), so the check follows every change to those files."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from .dockerfile import PROJECT, build_args, pip_steps
from .jetpack_torch import JETPACK_TORCH

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


@dataclass(frozen=True)
class RequirementSet:
    """One install, as the resolver takes it.

    requirements: resolved with their dependencies (markers are evaluated by the resolver, for its target);
    no_deps: resolved to a wheel, dependencies not followed (`pip install --no-deps`);
    provided: name -> versions already on the machine (torch from JetPack): never resolved, and every requirement
      on that name must accept each version;
    sdists: names the install builds from PyPI's source distribution on purpose (pure Python, no wheel);
    compiled_here: names the image compiles from a git tag: resolved only for their metadata and dependencies;
    skipped: steps not resolved, with why (opt-in builds).
    """

    name: str
    requirements: tuple[str, ...]
    no_deps: tuple[str, ...] = ()
    provided: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sdists: frozenset[str] = frozenset()
    compiled_here: frozenset[str] = frozenset()
    skipped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for text in (*self.requirements, *self.no_deps):
            Requirement(text)  # raises InvalidRequirement naming the string
        if any(canonicalize_name(n) != n for n in (*self.provided, *self.sdists, *self.compiled_here)):
            raise ValueError("provided, sdists and compiled_here take canonical names (lower case, dashes)")
        if not all(self.provided.values()):
            raise ValueError("every provided package needs at least one version")


def project_requirements(repo: Path, extras: tuple[str, ...] = ()) -> list[str]:
    """pyproject.toml's dependencies plus those of `extras`, markers kept."""
    project = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise ValueError(f"pyproject.toml has no extra {unknown}; it has {sorted(optional)}")
    return [*project["dependencies"], *(r for extra in extras for r in optional[extra])]


def torch_floor(repo: Path) -> SpecifierSet:
    torch = [Requirement(r) for r in project_requirements(repo) if Requirement(r).name == "torch"]
    if len(torch) != 1:
        raise ValueError("pyproject.toml must name torch once in its dependencies (the floor the board needs)")
    return torch[0].specifier


def board_install(repo: Path, extras: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> RequirementSet:
    """`make serve` on a Jetson (tools/install_torch.sh, then the Makefile's installs): torch is the board's, any
    JetPack build the floor accepts or the image's; numpy is pinned as the image pins it."""
    args = build_args((repo / "Dockerfile.l4t").read_text(encoding="utf-8"))
    floor = torch_floor(repo)
    boards = tuple(v for v in JETPACK_TORCH if floor.contains(v, prereleases=True))
    torch = tuple(dict.fromkeys((args["TORCH_VERSION"], *boards)))
    model = re.search(r"^MODEL_PACKAGE \?= (\S+)$", (repo / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    if model is None:
        raise ValueError("the Makefile sets no MODEL_PACKAGE ?= <the bundled model's package>")
    # pyproject's own torch requirement stays: the resolver checks it against the board's versions
    requirements = project_requirements(repo, extras)
    return RequirementSet(
        name="board install (make serve)" + (f" with [{','.join(extras)}]" if extras else ""),
        requirements=(*requirements, f"numpy=={args['NUMPY_VERSION']}", *also),
        no_deps=(model.group(1),), provided={"torch": torch})


def container(repo: Path) -> RequirementSet:
    """Dockerfile.l4t's pip steps in order: a step with its own --index-url provides what it installs (torch from
    the Jetson index), the COPY of this repository stands for pyproject.toml's dependencies."""
    requirements: list[str] = []
    no_deps: list[str] = []
    provided: dict[str, tuple[str, ...]] = {}
    sdists, compiled, skipped = set(), set(), []
    for step in pip_steps((repo / "Dockerfile.l4t").read_text(encoding="utf-8")):
        if step.opt_in:
            skipped.append(f"{' '.join(step.requirements)} (opt-in: --build-arg {step.opt_in}=1)")
            continue
        for text in step.requirements:
            if text == PROJECT:
                requirements += project_requirements(repo)
                continue
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            if step.index_url:
                provided[name] = tuple(s.version for s in requirement.specifier if s.operator == "==")
                continue
            if name in provided:
                continue  # already installed from its own index; this step fetches only its dependencies
            if step.from_clone:
                compiled.add(name)
            elif step.from_source:
                sdists.add(name)
            (no_deps if step.no_deps else requirements).append(text)
    return RequirementSet(name="L4T image (Dockerfile.l4t)", requirements=tuple(requirements),
                          no_deps=tuple(no_deps), provided=provided, sdists=frozenset(sdists),
                          compiled_here=frozenset(compiled), skipped=tuple(skipped))
