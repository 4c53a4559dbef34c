"""Run every notebook in notebooks/ top to bottom, one test per notebook (marked ``slow``).

The kernel is this interpreter (``sys.executable``), registered under a
temporary kernel spec: the ``python3`` spec that ipykernel installs runs
whatever ``python`` is first on ``PATH``, which in a venv that is not
activated is not the one with sharetree installed.
"""

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
KERNEL = "sharetree-test-python"
CELL_TIMEOUT_S = 300
MAX_OUTPUT_BYTES = 200_000  # what a notebook may print when run (a plot or two, small tables)


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "sharetree tests",
                "language": "python",
            }
        )
    )
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), old]))
    yield KERNEL
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "03_flat_vector.ipynb"} <= names


@pytest.mark.slow  # 10-40 s a notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    stored = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not stored, f"{path.name} is committed with outputs: clear them before saving"
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any exception
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert not errors
    size = len(json.dumps([c.outputs for c in nb.cells if c.cell_type == "code"]))
    assert size < MAX_OUTPUT_BYTES, f"{path.name} prints {size:,} bytes of output"
