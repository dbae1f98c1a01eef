"""The README's Python runs as written: its ```python blocks, in order, in one namespace."""

import re
from pathlib import Path

import pytest

import udnn_lab as ul

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_the_readme_has_python_blocks_to_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3 and "ul.trace(model, x" in blocks[0] and "ul.train(" in blocks[0]
    assert "ul.measure(work)" in blocks[1] and "ul.train(" in blocks[2]
    text = README.read_text()
    assert text.startswith("# udnn_lab\n") and text.index("make test") < text.index("## Your own model")


def test_the_readmes_python_runs_as_written():
    namespace: dict = {}
    for number, block in enumerate(python_blocks(README.read_text()), start=1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    assert isinstance(namespace["graph"], ul.Graph) and isinstance(namespace["measured"], ul.Measurement)
    assert isinstance(namespace["hw"], ul.Hardware) and isinstance(namespace["plan"], ul.Plan)
    assert namespace["measured"].summary(namespace["graph"])["peak_relative_error"] <= 0.01
    assert len(namespace["run"].steps) == 3
    assert namespace["smaller"].budget_bytes == namespace["step"].peak_bytes // 2


@pytest.mark.parametrize("page", DOCS, ids=lambda path: path.name)
def test_the_docs_pages_python_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a page writes (a saved plan, a trainer's output) goes there
    namespace: dict = {}
    for number, block in enumerate(python_blocks(page.read_text()), start=1):
        exec(compile(block, f"{page.name} python block {number}", "exec"), namespace)
