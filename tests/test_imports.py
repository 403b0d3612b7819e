"""Every trtspec import in the package and in the lab (the root lab/) resolves, including the
lazy ones inside functions (model code that runs only inside tritonserver or on a GPU is not
imported by other tests, nor are most benchmark scripts)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import trtspec

PACKAGE = Path(trtspec.__file__).parent


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("trtspec"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("trtspec"):
                    yield node.lineno, a.name, []


def test_every_trtspec_import_resolves():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE.parent / "lab").glob("*.py")):
        for line, module, names in _imports(path):
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as err:
                if (err.name or "").startswith("trtspec"):
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({err})")
                # else: the module exists but needs what only its runtime has
                # (triton_python_backend_utils inside tritonserver, tensorrt_llm on a GPU)
                continue
            for name in names:
                if not hasattr(mod, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ModuleNotFoundError as err:
                        if (err.name or "").startswith("trtspec"):
                            missing.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module}.{name}")
    assert not missing, "imports that would fail at run time:\n" + "\n".join(missing)


def test_the_testing_contract_covers_every_product_module():
    """The contract that keeps the product off trtspec.testing names every top-level module
    but testing itself, so a new room is covered the day it is added."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c.get("forbidden_modules") == ["trtspec.testing"]]
    top = {
        f"trtspec.{p.stem if p.is_file() else p.name}"
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    assert set(contract["source_modules"]) == top - {"trtspec.__init__", "trtspec.testing"}


def test_the_lab_is_a_package_the_product_never_imports():
    """lab/ runs as `python -m lab.NAME` and is imported as `lab.NAME` (by its scripts and by
    tests): a sibling imported by its plain name resolves only for a script run by path, so no
    lab module does that. trtspec never imports the lab: no import names it, and the
    import-linter contract that forbids it covers the whole package."""
    import tomllib

    lab = PACKAGE.parent / "lab"
    own = {p.stem for p in lab.glob("*.py")}
    assert "_common" in own and "figures" in own  # the lab is where this test looks
    plain, climbing = [], []
    for path in sorted(lab.glob("*.py")) + sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "lab" else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            plain += [f"{where}: {n}" for n in names if path.parent == lab and n.split(".")[0] in own]
            climbing += [f"{where}: {n}" for n in names if path.is_relative_to(PACKAGE) and n.split(".")[0] == "lab"]
            missing = [n for n in names if n.startswith("lab.") and n.split(".")[1] not in own]
            assert not missing, f"{where}: no lab module {missing}"
    assert plain == [] and climbing == []
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    assert any(c.get("source_modules") == ["trtspec"] and c.get("forbidden_modules") == ["lab"] for c in contracts)
    assert "lab" in config["tool"]["importlinter"]["root_packages"]


def test_no_product_test_imports_the_lab():
    """The product's tests (tests/) check the product: what they share with the lab lives in
    trtspec/testing, and a test of a lab script is the lab's (lab/tests)."""
    tests = PACKAGE.parent / "tests"
    borrowed = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            borrowed += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "lab"]
    assert borrowed == []
