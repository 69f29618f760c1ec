"""Every notebook in notebooks/ runs top to bottom (its own asserts included).

Code cells are executed in order in one namespace, as a kernel would: this keeps CI free of Jupyter
(nbclient/ipykernel stay in the ``notebooks`` extra for people who open them).
"""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[code cell {i}]", "exec"), namespace)
    assert "all stages agree" in capsys.readouterr().out or path.name != "quickstart.ipynb"
