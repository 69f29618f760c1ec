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
