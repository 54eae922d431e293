"""Tier ``multidevice`` (marker ``multidevice``): everything that needs a mesh — jax_impl on 8
simulated CPU devices, torch_impl in gloo worlds of 1-8 processes — against the float64 oracle
and each other: the all-pairs parity matrix, the harness itself, communication accounting, the
training steps, determinism, numerics at the edge and at scale, validation before collectives,
and the notebooks. It is the bulk of the suite's time (budget in docs/testing.md)."""

import os

import notebook_runs


def pytest_collection_finish(session):
    """Start the selected notebook tests' notebooks now, in the background (tests/notebook_runs.py),
    so that their kernels work beside the tests that run before theirs. Under pytest-xdist every
    worker collects every test: the controlling process starts them instead (tests/conftest.py)."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    notebook_runs.start([item.callspec.params["name"] for item in session.items
                         if item.path.name == "test_notebooks.py" and hasattr(item, "callspec")])


def pytest_sessionfinish(session):
    notebook_runs.stop()
