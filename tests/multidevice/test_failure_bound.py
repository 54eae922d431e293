"""A rank that raises never leaves the others blocked forever: every world runs with a
bounded process-group timeout, so the peers stuck in a collective time out, the world reports
the first rank's error and is discarded.

Why: mismatched collectives hang ring-attention users' jobs (ring-flash-attention reports);
the harness must fail loudly instead. The bound here is liveness, not performance."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

import torch_tasks
from parity.runners.torch_world import TaskError, World

TIMEOUT_S = 5.0


def test_a_failing_rank_ends_the_run_within_the_timeout_bound():
    with World(2, "gloo", timeout_s=TIMEOUT_S) as world:
        start = time.monotonic()
        with pytest.raises(TaskError) as err:
            world.run(torch_tasks.rank0_fails_before_a_collective)
        elapsed = time.monotonic() - start
    assert err.value.rank == 0 and "rank 0 refuses its input" in str(err.value)
    assert elapsed < TIMEOUT_S + 60, f"the failure took {elapsed:.0f} s to surface"
