"""The notebooks run top to bottom from a fresh kernel (nbclient), every code cell
executes, and every cell tagged ``figure`` produces a PNG.

Why: notebooks rot silently; "mesh-shape experiments" are one of the three things users come
for, so CI executes them exactly as a user would.

Each selected notebook starts executing as soon as the selected tests are known, one after another
in a background thread, each in its own fresh kernel process (``tests/notebook_runs.py``: in the
session itself, or under pytest-xdist in its controlling process) — the same run, only begun
earlier: the mesh-shapes notebook alone took 48 s of the suite's time, and its kernel works beside
the tests that run meanwhile. Its test waits for its run and checks it; run alone, or when nothing
started it, a test executes its notebook itself."""

from __future__ import annotations

import pytest

pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

import notebook_runs

# figure-tagged cells per notebook (mesh_shapes' fourth plots the committed benchmark results)
FIGURES = {"bstar.ipynb": 5, "mesh_shapes.ipynb": 4, "documents.ipynb": 5}


@pytest.mark.parametrize("name", list(FIGURES))
def test_notebook_executes_and_draws_every_figure(name):
    nb = notebook_runs.result(name)  # a failing cell raises here, with its traceback
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    figures = [c for c in code if "figure" in c.metadata.get("tags", [])]
    assert len(figures) == FIGURES[name]
    for c in figures:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no figure from:\n{c.source[:200]}"
