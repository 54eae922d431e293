"""Torch ranks that pass *different* inputs (local shape, dtype, options): with
``RINGBRIDGE_CHECK_RANKS=1`` every rank raises the same ValueError naming what differs, before
validation and before any attention collective; without it a K/V shape mismatch still ends
within the process-group timeout bound instead of hanging (a q-only or options mismatch would go
unnoticed without the check: the documented limitation, docs/decisions.md).

Why: each torch rank validates only its own shards, so a rank-dependent bug in a data loader
(one rank's batch truncated, one rank in fp16) reaches the ring's send/recv, where
ring-flash-attention users see hangs. JAX cannot have this failure: its inputs are global arrays."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

import torch_tasks
from parity.runners.torch_world import TaskError, World

RING4 = (("ring", 4),)
USP = (("ring", 2), ("ulysses", 2))
MISMATCHES = [
    ("one rank's seq", RING4, {2: {"q_seq": 4}}, "q shape: from (1, 4, 4, 8) to (1, 8, 4, 8)"),
    ("one rank's dtype", USP, {3: {"dtype": "bfloat16"}},
     "dtypes (index in ('float32', 'bfloat16', 'float16')): from (0, 0, 0) to (1, 1, 1)"),
    ("one rank's causal flag", USP, {0: {"causal": False}},
     "causal, layout, kv_exchange, return_lse: from (0, 0, 0, 0) to (1, 0, 0, 0)"),
]


@pytest.mark.parametrize("desc,axes,overrides,message", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_the_rank_check_raises_the_same_error_on_every_rank(desc, axes, overrides, message, worlds):
    results = worlds(4).run(torch_tasks.mismatched_inputs_task, axes, overrides, True)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == "ValueError" and "ranks of the mesh disagree" in text and message in text, results[0]


def test_the_rank_check_passes_agreeing_ranks(worlds):
    """The check is not a tripwire: ranks that agree run attention and backward to the end."""
    assert worlds(4).run(torch_tasks.mismatched_inputs_task, USP, {}, True) == [(None, "no error")] * 4


def test_without_the_check_a_mismatch_still_ends_within_the_timeout_bound():
    """Unchecked, ranks sending K/V of different sizes get an error or a collective timeout, never a hang."""
    timeout = 5.0
    with World(2, "gloo", timeout_s=timeout) as world:
        start = time.monotonic()
        try:
            results = world.run(torch_tasks.mismatched_inputs_task, (("ring", 2),), {1: {"kv_seq": 4}}, False)
        except TaskError as err:
            results = err
        elapsed = time.monotonic() - start
    assert isinstance(results, TaskError) or any(kind is not None for kind, _ in results), results
    assert elapsed < timeout + 60, f"the mismatch took {elapsed:.0f} s to surface"
