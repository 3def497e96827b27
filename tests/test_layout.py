"""The shape of the code ([R-layout]): folders that name the architecture, small files, no import cycles, and entry
points that stay free of torch.

Imports are read from the source (top-level and inside functions alike: a lazy import still ties two modules
together), so the check covers code that no test happens to run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# source folder -> installed package name (setup.py's package-dir)
ROOTS = {"oval_edge": "oval_edge", "runtime": "oval_edge.runtime", "tools": "oval_edge.tools",
         "jetson": "oval_edge.jetson"}
# Backstops, not targets ([R-code-shape]): ~300 lines and ~12 modules a folder are the guide, cohesion first; these
# catch only the file or folder that has clearly taken on a second job.
MAX_LINES = 400
MAX_MODULES_PER_FOLDER = 16
JETSON_ROOT = REPO / "tests" / "fixtures" / "jetson" / "orin_nano_8gb_super_r36"


def source_modules() -> dict[str, Path]:
    """Installed module name -> its file, for every module of the four source folders."""
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            # `from package import module` imports that module; `from module import name` the module itself
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle():
    known = source_modules()
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert sum(len(edges) for edges in graph.values()) > 100  # the reader sees the project's imports
    assert "oval_edge.kernels.cpu" in graph["oval_edge.sparse.scoring"]  # lazy and relative imports count too
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_files_stay_small_and_folders_name_the_architecture():
    long = {str(p.relative_to(REPO)): n for p in source_modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines: each has taken on a second job; split it by job"
    crowded = {}
    for folder in ROOTS:
        for directory in [REPO / folder, *(p for p in (REPO / folder).rglob("*") if p.is_dir())]:
            modules = [p for p in directory.glob("*.py") if p.name != "__init__.py"]
            if modules and not (directory / "__init__.py").exists():
                crowded[str(directory.relative_to(REPO))] = "modules outside a package"
            elif len(modules) > MAX_MODULES_PER_FOLDER:
                crowded[str(directory.relative_to(REPO))] = len(modules)
    assert crowded == {}
    for package, path in source_modules().items():  # every room says what it owns
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), f"{package} has no docstring"


def test_entry_points_that_need_no_model_import_no_torch():
    # `oval-edge --help`, `oval-edge plan` (--help and a plan for a named module) and the device probe run where
    # torch may not even be installed yet (a fresh Jetson, the container's first steps).
    code = (
        "import contextlib, io, runpy, sys\n"
        "from oval_edge.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['--help'], ['plan', '--help'], ['plan', '--device', 'orin-nano-8gb']):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "        assert 'torch' not in sys.modules, argv\n"
        f"    sys.argv = ['probe', {str(JETSON_ROOT)!r}]\n"
        "    runpy.run_module('oval_edge.jetson.probe', run_name='__main__')\n"
        "assert 'torch' not in sys.modules, 'python -m oval_edge.jetson.probe'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
