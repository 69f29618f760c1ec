"""Every notebook in notebooks/ runs top to bottom (its own asserts included).

Code cells are executed in order in one namespace, as a kernel would: this keeps CI free of Jupyter
(nbclient/ipykernel stay in the ``notebooks`` extra for people who open them). A notebook that plots writes its PNG
where ``FZERO_LOSS_PNG`` says: here, into the test's temporary directory, never into the checkout.
"""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys, monkeypatch, tmp_path):
    png = tmp_path / f"{path.stem}_loss.png"
    monkeypatch.setenv("FZERO_LOSS_PNG", str(png))
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[code cell {i}]", "exec"), namespace)
    printed = capsys.readouterr().out
    if path.name == "quickstart.ipynb":
        assert "all stages agree" in printed
        assert f"loss curves: {png}" in printed  # the loss curves of the four stages, as a PNG
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
