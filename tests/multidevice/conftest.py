"""Tier ``multidevice`` (marker ``multidevice``): everything that needs a mesh — jax_impl on 8
simulated CPU devices, torch_impl in gloo worlds of 1-8 processes — against the float64 oracle
and each other: the all-pairs parity matrix, the harness itself, communication accounting, the
training steps, determinism, numerics at the edge and at scale, validation before collectives,
and the notebooks. It is the bulk of the suite's time (budget in docs/testing.md)."""

_NOTEBOOKS: list = []  # the test module whose notebooks were started


def pytest_collection_finish(session):
    """Start the selected notebook tests' notebooks now, in the background (tests/multidevice/
    test_notebooks.py: each in a fresh kernel process, as a user runs it), so that their kernels
    work beside the tests that run before theirs."""
    if session.config.option.collectonly:
        return
    items = [item for item in session.items if item.path.name == "test_notebooks.py" and hasattr(item, "callspec")]
    if items:
        _NOTEBOOKS.append(items[0].module)
        items[0].module.start([item.callspec.params["name"] for item in items])


def pytest_sessionfinish(session):
    for module in _NOTEBOOKS:
        module.stop()
