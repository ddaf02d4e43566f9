"""Every import of the stapoctl package is declared: each top-level module it imports (imports
inside functions included) maps, through `importlib.metadata.packages_distributions()`, to a
dependency or an extra of pyproject.toml, or is the standard library. A module that only arrives
through another package (psutil through ray, yaml through transformers) goes when that package's
next release drops it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict) -> set[str]:
    """Normalised distribution names of the dependencies and of every extra."""
    from packaging.requirements import Requirement

    project = pyproject["project"]
    texts = list(project.get("dependencies", []))
    texts += [t for extra in project.get("optional-dependencies", {}).values() for t in extra]
    return {_normal(Requirement(t).name) for t in texts}


def imports(package: Path) -> dict[str, str]:
    """Top-level module → where it is first imported (`file:line`), relative imports skipped."""
    out: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                out.setdefault(name.split(".")[0], f"{path.relative_to(package.parent)}:{node.lineno}")
    return out


def undeclared(package: Path, pyproject: dict) -> list[str]:
    deps = declared(pyproject)
    dists = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imports(package).items()):
        if module == package.name or module in sys.stdlib_module_names:
            continue
        found = dists.get(module)
        if not found:
            problems.append(f"{where}: {module} comes from no installed distribution")
        elif not {_normal(d) for d in found} & deps:
            problems.append(f"{where}: {module} ({', '.join(found)}) is not declared in pyproject.toml")
    return problems


def test_every_import_of_the_package_is_declared():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert undeclared(ROOT / "stapoctl", pyproject) == []


def test_a_fabricated_undeclared_import_fails(tmp_path):
    pkg = tmp_path / "fab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os\nimport rich.console\nfrom . import sub\nimport fab.sub\n")
    (pkg / "sub" / "__init__.py").write_text(textwrap.dedent("""
        from collections import abc

        def late():
            import typer  # an extra's
            from yaml import safe_load  # installed (through others), declared nowhere here
            import no_such_module_anywhere
    """))
    pyproject = {"project": {"dependencies": ["rich>=13"], "optional-dependencies": {"cli": ["typer"]}}}
    assert undeclared(pkg, pyproject) == [
        "fab/sub/__init__.py:7: no_such_module_anywhere comes from no installed distribution",
        "fab/sub/__init__.py:6: yaml (PyYAML) is not declared in pyproject.toml",
    ]
    pyproject["project"]["dependencies"].append("pyyaml")
    assert undeclared(pkg, pyproject) == [
        "fab/sub/__init__.py:7: no_such_module_anywhere comes from no installed distribution"]
