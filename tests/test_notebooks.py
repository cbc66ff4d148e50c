"""The Colab notebooks run top to bottom (outputs are stripped in git)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_stripped_python_that_compiles():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name}: strip outputs"
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("!", "%")))
            compile(source, f"{path.name}[code cell {i}]", "exec")


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: pathlib.Path, tmp_path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
