"""The notebooks' runs for ``tests/multidevice/test_notebooks.py``: each notebook executed top to
bottom in a fresh python3 kernel (nbclient), as a user runs it, begun in the background as soon as
the selected tests are known so that its kernel works beside the tests that run meanwhile.

Two places start them: in a plain run, the session itself when collection ends
(``tests/multidevice/conftest.py``); under pytest-xdist (``-n 2``, the README's command), the
controlling process — which runs no test — when the first worker reports its collection
(``tests/conftest.py``), writing each executed notebook (or its error) into the directory named by
:data:`RUNS_DIR`, where the worker that draws the notebook's test reads it. Each worker starting
its own would run every notebook twice."""

from __future__ import annotations

import os
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS_DIR = "RINGBRIDGE_NOTEBOOK_RUNS"  # environment variable: the xdist controller's output directory
TEST_ID = "test_notebooks.py::test_notebook_executes_and_draws_every_figure["

_RUNS: dict[str, Future] = {}
_POOL: list[ThreadPoolExecutor] = []


def execute(name: str):
    """``name`` executed top to bottom in a fresh python3 kernel; the executed notebook."""
    import nbclient
    import nbformat

    env = {**os.environ, "PYTHONPATH": str(ROOT),  # the kernel imports parity even without an install
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute(env=env)
    return nb


def start(names: list[str]) -> None:
    """Begin executing ``names`` in this process's background, in this order, one kernel at a time."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="notebooks"))
    for name in names:
        if name not in _RUNS:
            _RUNS[name] = _POOL[0].submit(execute, name)


def stop() -> None:
    """Drop the runs not begun yet (a session that ends early); the one running finishes."""
    for pool in _POOL:
        pool.shutdown(wait=False, cancel_futures=True)


def start_into(names: list[str], directory: Path) -> None:
    """Execute ``names`` one after another in a background thread, each into ``directory/NAME``
    (the executed notebook) or ``directory/NAME.error`` (the traceback), written whole and then
    renamed, so a reader never sees half a file."""
    import nbformat

    def run():
        for name in names:
            try:
                text, suffix = nbformat.writes(execute(name)), ""
            except Exception:  # noqa: BLE001 — the test that reads it reports it
                text, suffix = traceback.format_exc(), ".error"
            partial = directory / f".{name}.partial"
            partial.write_text(text)
            partial.rename(directory / f"{name}{suffix}")

    threading.Thread(target=run, name="notebooks", daemon=True).start()


def result(name: str):
    """The executed notebook ``name``: from the xdist controller's directory when one is set
    (waiting for it), else from this process's background run, else executed here and now. A
    notebook that failed raises here, with its traceback."""
    import nbformat

    directory = os.environ.get(RUNS_DIR)
    if directory:
        done, failed = Path(directory) / name, Path(directory) / f"{name}.error"
        deadline = time.monotonic() + 1800
        while not (done.exists() or failed.exists()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller's run of {name} did not finish within 30 minutes")
            time.sleep(0.5)
        if failed.exists():
            raise RuntimeError(f"{name} failed in the controller's kernel:\n{failed.read_text()}")
        return nbformat.reads(done.read_text(), as_version=4)
    run = _RUNS.pop(name, None)
    return run.result() if run is not None else execute(name)
