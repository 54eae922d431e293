"""Shared gloo worlds for the torch tests: one world per size, started once per test session."""

from __future__ import annotations

import pytest

from parity import torch_world


@pytest.fixture(scope="session")
def worlds():
    pytest.importorskip("torch")
    yield torch_world.get_world
    torch_world.close_worlds()
