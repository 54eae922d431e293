"""Torch_impl rejects bad input with the same clear error on every rank of a 4-process
gloo world, before any collective (the collectives are replaced by a tripwire on each rank).
Shapes given here are *local* shards, as torch callers pass them, so "batch % data" cannot fail
here (the global batch is the local one times the data size); the JAX tier tests it."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from torch_tasks import bad_input_task

RING4 = (("ring", 4),)
F32 = ("float32",) * 3
CASES = [
    ("rank-3 q", RING4, (8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32, {}, "ValueError", "q must be rank-4"),
    ("mixed dtypes", RING4, (1, 8, 8, 16),) * 1 + ((1, 8, 8, 16), (1, 8, 8, 16), ("float32", "bfloat16", "float32"), {},
                                                  "TypeError", "share one dtype"),
    ("integer dtype", RING4, (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), ("int32",) * 3, {}, "TypeError",
     "dtype must be one of"),
    ("heads % kv_heads", RING4, (1, 8, 6, 16), (1, 8, 4, 16), (1, 8, 4, 16), F32, {}, "ValueError",
     "heads % kv_heads must be 0, got heads=6, kv_heads=4"),
    ("heads % ulysses", (("ulysses", 4),), (1, 8, 6, 16), (1, 8, 6, 16), (1, 8, 6, 16), F32, {}, "ValueError",
     "heads % 'ulysses' mesh size must be 0, got heads=6, ulysses=4"),
    ("zigzag seq", (("ring", 2), ("ulysses", 2)), (1, 9, 4, 16), (1, 9, 2, 16), (1, 9, 2, 16), F32, {"layout": "zigzag"},
     "ValueError", "seq_len % 8 must be 0 for layout 'zigzag' with ring=2, ulysses=2, got seq_len=36"),
    ("unknown layout", RING4, (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32, {"layout": "spiral"}, "ValueError",
     "layout must be one of"),
    ("negative scale", RING4, (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32, {"scale": -2.0}, "ValueError",
     "scale must be a finite positive"),
    ("negative softcap, USP", (("ring", 2), ("ulysses", 2)), (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32,
     {"softcap": -1.0}, "ValueError", "softcap must be a finite positive"),  # before Ulysses' all-to-all
    ("bool softcap", RING4, (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32, {"softcap": True}, "TypeError",
     "softcap must be None or a positive float"),
    ("double ring all-gather", (("ring_outer", 2), ("ring_inner", 2)), (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32,
     {"kv_exchange": "allgather"}, "ValueError", "has no double-ring form"),
    ("unknown block backend, USP", (("ring", 2), ("ulysses", 2)), (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32,
     {"block_backend": "nope"}, "ValueError", "unknown block backend 'nope'"),  # before Ulysses' all-to-all
    ("double ring zigzag seq", (("ring_outer", 2), ("ring_inner", 2)), (1, 9, 8, 16), (1, 9, 8, 16), (1, 9, 8, 16), F32,
     {"layout": "zigzag"}, "ValueError", "seq_len % 8 must be 0 for layout 'zigzag' with ring_outer*ring_inner=4"),
]


@pytest.mark.parametrize("desc,axes,qs,ks,vs,dtypes,kwargs,exc,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_same_error_on_every_rank(desc, axes, qs, ks, vs, dtypes, kwargs, exc, message, worlds):
    results = worlds(4).run(bad_input_task, qs, ks, vs, dtypes, axes, kwargs)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == exc and message in text, results[0]


def test_valid_input_reaches_the_tripwire(worlds):
    """The tripwire works: valid input gets past validation to the first collective."""
    results = worlds(4).run(bad_input_task, (1, 8, 8, 16), (1, 8, 8, 16), (1, 8, 8, 16), F32, RING4, {})
    assert all(kind == "AssertionError" and "collective was reached" in text for kind, text in results)
