"""Test-session setup: 8 simulated CPU devices for JAX (set before JAX starts) and strict JAX
numerics, so that an accidental rank broadcast fails instead of silently computing something;
the ``--seed`` and ``--full`` options; the tier markers (a test's folder is its tier, see
docs/testing.md); and the session fixtures ``seed``, ``jax_devices`` and ``worlds``. Helpers
that are not fixtures live in ``tests/helpers.py``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from parity.core.devices import configure_jax_devices

configure_jax_devices("cpu")  # before JAX is imported anywhere (and at LLVM optimization level 0: see there)

import numpy as np
import pytest

import notebook_runs

try:
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
except ImportError:  # the torch-only install still runs the pure and torch tiers
    jax = None

# One XLA compilation per distinct program in the session: the tests build many programs that are
# the same program again (the same control or oracle in many cases, eager ops repeated, a step
# compiled by one test and audited by the next) — ≈ 40 s of the CPU run's compiling on 2 cores.
# JAX's compilation cache, in a directory of this session's own (empty at its start, removed at
# its end: nothing carries over between runs), keyed on the program, the XLA flags, the compile
# options and the devices; a program with host callbacks is never cached (JAX's rule). CPU only:
# the GPU tier compiles as before.
_XLA_CACHE = None
if jax is not None and os.environ.get("JAX_PLATFORMS") == "cpu":
    _XLA_CACHE = tempfile.mkdtemp(prefix="ringbridge-xla-cache-")
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # the key includes source locations and name scopes: parity.accounting.hlo_cost classifies
    # by scope name, so two programs differing only there must not share the first one's HLO
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)

TIERS = ("unit", "multidevice", "gpu", "property")  # folder name == marker name


def _xdist_controller(config) -> bool:
    """This process distributes the tests to pytest-xdist workers (``-n N``) and runs none."""
    return bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_configure(config):
    # one seed for the whole run: pytest-xdist's workers read their --seed default from this variable
    os.environ.setdefault("RINGBRIDGE_SEED", str(config.getoption("--seed")))
    if _xdist_controller(config):  # the notebooks run here, into a directory the workers read
        os.environ[notebook_runs.RUNS_DIR] = tempfile.mkdtemp(prefix="ringbridge-notebooks-")
    if config.getoption("--full"):  # before collection imports the test modules that read it
        os.environ["RINGBRIDGE_FULL"] = "1"


def pytest_unconfigure(config):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    if _xdist_controller(config):
        shutil.rmtree(os.environ.pop(notebook_runs.RUNS_DIR), ignore_errors=True)


_NOTEBOOKS_STARTED: list = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on its controller: a worker's collected test ids
def pytest_xdist_node_collection_finished(node, ids):
    """Start the selected notebooks once, when the first worker reports its collection (every
    worker collects the same tests): tests/notebook_runs.py."""
    if _NOTEBOOKS_STARTED:
        return
    names = [i.split(notebook_runs.TEST_ID, 1)[1][:-1] for i in ids if notebook_runs.TEST_ID in i]
    _NOTEBOOKS_STARTED.append(True)
    if names:
        notebook_runs.start_into(names, Path(os.environ[notebook_runs.RUNS_DIR]))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier (its folder under tests/)."""
    here = Path(__file__).parent
    for item in items:
        parts = Path(item.path).relative_to(here).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


def pytest_report_header(config):
    from helpers import FULL

    seed = config.getoption("--seed")
    lines = [f"ringbridge: seed {seed} (pass --seed N to reproduce), full matrix: {FULL}"]
    if jax is not None:
        lines.append(f"jax {jax.__version__}: {len(jax.devices())} {jax.devices()[0].platform} devices")
    return lines


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="the full case matrix (marked slow) and 1000 fuzz "
                     "examples (same as RINGBRIDGE_FULL=1)")
    parser.addoption("--seed", type=int, default=int(os.environ.get("RINGBRIDGE_SEED", np.random.SeedSequence().entropy % 2**31)),
                     help="seed of the random inputs (fresh each run unless given)")


@pytest.fixture(scope="session")
def seed(request) -> int:
    return request.config.getoption("--seed")


@pytest.fixture(scope="session")
def jax_devices():
    if jax is None:
        pytest.skip("jax is not installed")
    devices = jax.devices()
    assert len(devices) >= 8, f"tests need 8 JAX devices, got {len(devices)}: XLA_FLAGS was set too late"
    return devices


@pytest.fixture(scope="session")
def worlds():
    """``get_world``: gloo worlds shared by the whole session, one per size, closed at its end."""
    pytest.importorskip("torch")
    from parity.runners import torch_world

    yield torch_world.get_world
    torch_world.close_worlds()
