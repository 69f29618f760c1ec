"""The packages' layers ([tool.importlinter] in pyproject.toml), checked with import-linter's ``lint-imports``: a
package imports only from the layers below its own, so there is no import cycle between packages."""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("importlinter", reason="import-linter is a test dependency: pip install -e '.[test]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint(root: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())", "--no-cache"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_packages_keep_their_layers():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_an_import_against_the_layers_is_reported(tmp_path):
    # a copy of the package in which the collectives (fzero.mesh) import the step package above them
    shutil.copytree(os.path.join(ROOT, "fzero"), tmp_path / "fzero", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    with open(tmp_path / "fzero" / "mesh" / "_comm.py", "a") as f:
        f.write("\nimport fzero.step._pool  # against the layers\n")
    proc = _lint(str(tmp_path))
    assert proc.returncode != 0
    assert "fzero.mesh is not allowed to import fzero.step" in proc.stdout, proc.stdout[-3000:]


def _private_imports(root: str) -> list[tuple[str, int, str]]:
    """Imports, in the package under ``root``, of another fzero subpackage's private module or private name
    (``from fzero.step._pool import Pool``, ``from fzero.step import _usage``): (file, line, what)."""
    import ast

    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, root).split(os.sep)
            own = parts[0] if len(parts) > 1 else None
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("fzero."):
                    continue
                pkg, *rest = node.module.split(".")[1:]
                if pkg == own or not os.path.isdir(os.path.join(root, pkg)):
                    continue
                private = [m for m in rest if m.startswith("_")] + [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    found.append((os.path.relpath(path, root), node.lineno, f"from {node.module} import {private}"))
    return found


def test_a_package_uses_another_only_through_what_its_init_names():
    # each subpackage's __init__.py names what the others may use; its modules are its own
    assert _private_imports(os.path.join(ROOT, "fzero")) == []


def test_an_import_of_another_packages_private_module_is_found(tmp_path):
    shutil.copytree(os.path.join(ROOT, "fzero"), tmp_path / "fzero", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "fzero" / "zero" / "_jit.py", "a") as f:
        f.write("\nfrom fzero.step._pool import Pool  # past the step package's __init__\n")
    found = _private_imports(str(tmp_path / "fzero"))
    assert [(path, what) for path, _, what in found] == [(os.path.join("zero", "_jit.py"), "from fzero.step._pool import ['_pool']")]


def test_the_step_the_transforms_and_the_collectives_type_check_and_a_part_that_breaks_its_protocol_is_found(tmp_path):
    """mypy over [tool.mypy]'s files (fzero/step, fzero/zero, fzero/mesh/_comm.py), in a copy of the package with one
    planted error: a grads part where the step wants a params part. The plant is the only error mypy reports, so the
    package itself type-checks, and the parts' Protocols are what it checks against."""
    pytest.importorskip("mypy", reason="mypy is a test dependency: pip install -e '.[test]'")
    shutil.copytree(os.path.join(ROOT, "fzero"), tmp_path / "fzero", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    with open(tmp_path / "fzero" / "step" / "_parts.py", "a") as f:
        f.write("\n\n_PLANTED: ParamsPart = GradsAllReduce()  # not a params part\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "_parts.py" in errors[0] and "ParamsPart" in errors[0], errors
