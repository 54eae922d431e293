"""The notebooks run top to bottom from a fresh kernel (nbclient), every code cell
executes, and every cell tagged ``figure`` produces a PNG.

Why: notebooks rot silently; "mesh-shape experiments" are one of the three things users come
for, so CI executes them exactly as a user would.

Each selected notebook starts executing when collection ends (``tests/multidevice/conftest.py``
calls ``start``), one after another in a background thread, each in its own fresh kernel process —
the same run as before, only begun earlier: the mesh-shapes notebook alone took 48 s of the suite's
time, and its kernel now works beside the tests that run meanwhile. Its test waits for its run
and checks it; run alone, or when nothing started it, a test executes its notebook itself."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


# figure-tagged cells per notebook (mesh_shapes' fourth plots the committed benchmark results)
FIGURES = {"bstar.ipynb": 5, "mesh_shapes.ipynb": 4, "documents.ipynb": 5}

_RUNS: dict[str, Future] = {}
_POOL: list[ThreadPoolExecutor] = []


def _execute(name: str):
    """``name`` executed top to bottom in a fresh python3 kernel; the executed notebook."""
    env = {**os.environ, "PYTHONPATH": str(ROOT),  # the kernel imports parity even without an install
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute(env=env)
    return nb


def start(names: list[str]) -> None:
    """Begin executing ``names`` in the background, in this order, one kernel at a time."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="notebooks"))
    for name in names:
        if name not in _RUNS:
            _RUNS[name] = _POOL[0].submit(_execute, name)


def stop() -> None:
    """Drop the runs not begun yet (a session that ends early); the one running finishes."""
    for pool in _POOL:
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("name", list(FIGURES))
def test_notebook_executes_and_draws_every_figure(name):
    run = _RUNS.pop(name, None)
    nb = run.result() if run is not None else _execute(name)  # a failing cell raises here, with its traceback
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    figures = [c for c in code if "figure" in c.metadata.get("tags", [])]
    assert len(figures) == FIGURES[name]
    for c in figures:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no figure from:\n{c.source[:200]}"
