from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _quickstart_in_compat(path: Path):
    """Notebook 00 is in the compatibility subset that make test-compat runs on the oldest torch."""
    return pytest.param(path, id=path.stem, marks=pytest.mark.compat if path.stem == "00_quickstart" else ())


@pytest.mark.parametrize("path", [_quickstart_in_compat(p) for p in NOTEBOOKS])
def test_notebook_runs_headless(path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    charts = [o for cell in notebook.cells for o in cell.get("outputs", [])
              if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert charts, "no chart was rendered"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_are_committed_small_without_outputs(path):
    """An executed notebook keeps its charts, with their JavaScript, in its outputs and widget state (the quickstart
    grew to 6.6 MB): the repository keeps the source only. Clear the outputs before committing."""
    notebook = nbformat.read(path, as_version=4)
    assert path.stat().st_size < 64 * 1024, f"{path.name} is {path.stat().st_size} bytes"
    assert not [cell for cell in notebook.cells if cell.get("outputs") or cell.get("execution_count")]
    assert "widgets" not in notebook.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_title_says_what_a_document_number_is(path):
    """'document 004' alone means nothing to a reader: a title names what the document is about instead."""
    notebook = nbformat.read(path, as_version=4)
    title = notebook.cells[0].source.splitlines()[0]
    assert "document" not in title.lower(), title
    text = notebook.cells[0].source
    assert "ocument 00" not in text or "research documents" in text, text
