"""The notebooks run top to bottom from a fresh kernel (nbclient), every code cell
executes, and every cell tagged ``figure`` produces a PNG.

Why: notebooks rot silently; "mesh-shape experiments" are one of the three things users come
for, so CI executes them exactly as a user would."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


# figure-tagged cells per notebook (mesh_shapes' fourth plots the committed benchmark results)
FIGURES = {"bstar.ipynb": 5, "mesh_shapes.ipynb": 4, "documents.ipynb": 5}


@pytest.mark.parametrize("name", list(FIGURES))
def test_notebook_executes_and_draws_every_figure(name, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports parity even without an install
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    figures = [c for c in code if "figure" in c.metadata.get("tags", [])]
    assert len(figures) == FIGURES[name]
    for c in figures:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no figure from:\n{c.source[:200]}"
