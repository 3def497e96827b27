"""Dockerfile.l4t's pip steps, read from the file: what the image installs, with which pip options.

Only what the resolution needs is read: the ARG defaults, each RUN instruction's `pip install` commands (shell
words after ${ARG} substitution), the folders they install from (a COPY destination or a `git clone` target) and
whether the instruction is an opt-in build (`if [ "${WITH_...}" = "1" ]`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

# pip options that take a value as the next word
VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-c", "--constraint", "-r", "--requirement",
                 "-f", "--find-links", "-t", "--target"}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "then", "else", "fi"}


@dataclass(frozen=True)
class PipStep:
    """One `pip install` of a RUN instruction. `requirements` are requirement strings; a folder it installs from is
    named by what is in it: PROJECT for the COPY of this repository, `name==tag` for a `git clone --branch tag`."""

    requirements: tuple[str, ...]
    no_deps: bool
    index_url: str | None
    opt_in: str | None  # the WITH_... build argument the step depends on, None when it always runs
    from_source: bool  # --no-build-isolation: pip builds what it installs
    from_clone: bool  # it installs a `git clone` of a release tag (the image compiles it)


PROJECT = "<this repository>"


def build_args(text: str) -> dict[str, str]:
    """`ARG NAME=value` defaults (an ARG without a default is left out)."""
    return dict(re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*$", text, flags=re.MULTILINE))


def instructions(text: str) -> list[str]:
    """Instructions with continuation lines joined (comment lines inside them dropped, as Docker does)."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    """${NAME} and $NAME replaced by ARG defaults; other variables (ENV ${PATH}, ...) are left as written."""
    def value(match: re.Match) -> str:
        return args.get(match.group(1) or match.group(2), match.group(0))
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", value, text)


def shell_words(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def folder_names(text: str, args: dict[str, str]) -> dict[str, str]:
    """Folder -> what a `pip install <folder>` there installs: PROJECT for where pyproject.toml is copied,
    `name==tag` for `git clone --branch tag <repo> /path/name`."""
    out = {}
    for line in instructions(text):
        words = shell_words(substitute(line, args))
        if words[:1] == ["COPY"] and "pyproject.toml" in words:
            out[words[-1].rstrip("/")] = PROJECT
        for i, word in enumerate(words[:-1]):
            if word == "clone" and "--branch" in words[i:]:
                tag = words[words.index("--branch", i) + 1]
                rest = [w for w in words[words.index("--branch", i) + 2:] if not w.startswith("-")]
                target = rest[1] if len(rest) > 1 and rest[1] not in SHELL_SEPARATORS else None
                if target:
                    out[target.rstrip("/")] = f"{Path(target).name}=={tag.lstrip('v')}"
    return out


def pip_steps(text: str) -> list[PipStep]:
    """Every `pip install` of every RUN instruction, in order."""
    args = build_args(text)
    folders = folder_names(text, args)
    steps = []
    for line in instructions(text):
        if not line.startswith("RUN "):
            continue
        opt_in = re.search(r'if \[ "\$\{(WITH_[A-Z0-9_]+)\}" = "1" \]', line)
        words = shell_words(substitute(line[4:], args))
        cwd = None
        for i, word in enumerate(words):
            if word == "cd" and i + 1 < len(words):
                cwd = words[i + 1]
            if word == "pip" and words[i + 1:i + 2] == ["install"]:
                steps.append(parse_install(words[i + 2:], cwd, folders, opt_in.group(1) if opt_in else None))
    return steps


def parse_install(words: list[str], cwd: str | None, folders: dict[str, str], opt_in: str | None) -> PipStep:
    requirements, options, index_url, from_clone = [], set(), None, False
    i = 0
    while i < len(words) and words[i] not in SHELL_SEPARATORS:
        word = words[i]
        if word in VALUE_OPTIONS:
            if word in ("-i", "--index-url"):
                index_url = words[i + 1]
            elif word not in ("-f", "--find-links", "-t", "--target", "--extra-index-url"):
                raise ValueError(f"Dockerfile.l4t: `pip install {word}` is not read by the board check; "
                                 "name the requirements on the command line")
            i += 2
            continue
        if word.startswith("-"):
            options.add(word.split("=")[0])
        else:
            if "$" in word:
                raise ValueError(f"Dockerfile.l4t: `pip install {word}` uses a variable with no ARG default")
            folder = (cwd or "/") if word == "." else word
            if word == "." or word.startswith("/"):
                if folder.rstrip("/") not in folders:
                    raise ValueError(f"Dockerfile.l4t: `pip install {word}` (in {folder}) installs a folder the "
                                     "board check cannot name: neither the COPY of pyproject.toml nor a git clone")
                word = folders[folder.rstrip("/")]
                from_clone = from_clone or word != PROJECT
            requirements.append(word)
        i += 1
    return PipStep(tuple(requirements), "--no-deps" in options, index_url, opt_in,
                   "--no-build-isolation" in options, from_clone)
