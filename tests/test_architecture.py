"""The structure of docs/ARCHITECTURE.md, held against the code.

- the import-linter contracts of pyproject.toml (layers that import downwards only, imports inside
  functions included; stapoctl never imports benchmarks), so a new back-up import fails CI with
  the contract's name;
- no import circle between files, even inside one layer (where the layer contract allows imports
  both ways) and behind a lazy import: the file-to-file graph is built from the source;
- no module over 400 lines and no function over 60, the sizes the redesign brought them under.

Each check is also run against a small package made here with the fault in it, so none of them
passes by finding nothing.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stapoctl"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


# -- the file-to-file import graph -----------------------------------------------------------------
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[Path, set[Path]]:
    """File → the files it imports, from every import statement (inside functions too).

    `from a.b import c` points at a/b/c.py when that is a module, else at a/b/__init__.py;
    `import a.b` at a/b.py or a/b/__init__.py; no implicit edge to parent packages."""
    root = package.parent
    files = {_module_name(p, root): p for p in package.rglob("*.py")}

    def file_of(name: str):
        return files.get(name)

    graph: dict[Path, set[Path]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        out: set[Path] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out.update(f for a in node.names if (f := file_of(a.name)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    target = file_of(f"{module}.{alias.name}") or file_of(module)
                    if target:
                        out.add(target)
        out.discard(path)
        graph[path] = out
    return graph


def circles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(found: list[list[Path]], root: Path) -> str:
    return "; ".join(" ↔ ".join(str(p.relative_to(root)) for p in c) for c in found)


def test_no_import_circle_between_files():
    found = circles(import_graph(PACKAGE))
    assert not found, f"import circle(s) between files: {_describe(found, ROOT)}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_circle_finder_sees_a_lazy_circle_and_the_edge_rule(tmp_path):
    pkg = _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/a/__init__.py": "from toy.a import helpers\n",  # a/__init__ → a/helpers (a module)
        "toy/a/helpers.py": "def f():\n    from toy.b import g  # lazy: Python never sees this circle\n",
        "toy/b/__init__.py": "from toy.b.impl import g\n",     # b/__init__ → b/impl
        "toy/b/impl.py": "from ..a import helpers\ng = 1\n",   # relative, back to a/helpers
        "toy/c.py": "import toy.b.impl\n",                     # not in the circle
    }) / "toy"
    graph = import_graph(pkg)
    assert graph[pkg / "a/helpers.py"] == {pkg / "b/__init__.py"}  # `from toy.b import g`: g is no module
    assert graph[pkg / "c.py"] == {pkg / "b/impl.py"}  # no implicit edge to toy/b/__init__.py
    [circle] = circles(graph)
    assert circle == sorted([pkg / "a/helpers.py", pkg / "b/__init__.py", pkg / "b/impl.py"])
    assert "toy/a/helpers.py" in _describe([circle], tmp_path)


# -- the import-linter contracts -------------------------------------------------------------------
def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache", "--config", str(cwd / "pyproject.toml")], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_import_linter_contracts_are_kept():
    res = _lint_imports(ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("where, line, contract", [
    # the lowest layer reaching up into the trainer from inside a function
    ("stapoctl/config/validate.py", "def _up():\n    from stapoctl.trainer import driver  # noqa\n",
     "imports downwards only"),
    ("stapoctl/losses/api.py", "def _bench():\n    import benchmarks._suite  # noqa\n", "never imports the benchmarks"),
])
def test_import_linter_refuses_a_back_up_import(tmp_path, where, line, contract):
    shutil.copytree(PACKAGE, tmp_path / "stapoctl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "_suite.py").write_text("")
    with open(tmp_path / where, "a", encoding="utf-8") as fh:
        fh.write("\n\n" + line)
    res = _lint_imports(tmp_path)
    assert res.returncode != 0
    assert f"{contract}" in res.stdout and "BROKEN" in res.stdout, res.stdout[-3000:]


# -- sizes ------------------------------------------------------------------------------------------
def oversized(package: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES (decorators and
    docstring counted)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(package.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}(): {length} lines")
    return found


def test_no_module_or_function_over_its_size():
    found = oversized(PACKAGE)
    assert not found, "split along what it does: " + "; ".join(found)


def test_size_check_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    pkg = _write(tmp_path, {"toy/__init__.py": "", "toy/m.py": f"@staticmethod\ndef long():\n{body}\n"}) / "toy"
    assert oversized(pkg) == [f"toy/m.py:2 long(): {MAX_FUNCTION_LINES + 2} lines"]
