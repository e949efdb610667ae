"""The launcher package stands alone: nothing under engine/ imports the gateway package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

ENGINE = REPO / "engine"


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path`` (a module of ``package``), relative ones
    resolved, ``importlib.import_module("...")`` and ``__import__("...")`` included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def test_no_engine_module_imports_the_gateway() -> None:
    """No import statement (static, relative or importlib) under engine/ names gateway."""
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10, files
    offending = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in files
        for line, module in imported_modules(path, ".".join(path.relative_to(REPO).parts[:-1]))
        if module == "gateway" or module.startswith("gateway.")
    ]
    assert offending == []


def test_the_scanner_sees_a_gateway_import(tmp_path: Path) -> None:
    """The scanner flags each import form, so the layering test cannot pass vacuously."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "import gateway.config\n"
        "from gateway import app\n"
        "from ..gateway import keys\n"
        "import importlib\n"
        "importlib.import_module('gateway.metrics')\n"
    )
    modules = [module for _line, module in imported_modules(sample, "engine.sim")]
    assert modules == [
        "gateway.config",
        "gateway",
        "engine.gateway",
        "importlib",
        "gateway.metrics",
    ]


def test_launcher_commands_load_without_the_gateway_package() -> None:
    """Importing the launcher's modules in a fresh interpreter never loads gateway.*."""
    code = (
        "import sys, engine.cli, engine.supervise, engine.preflight, engine.sim\n"
        "print(sorted(m for m in sys.modules if m == 'gateway' or m.startswith('gateway.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
