"""Bad input fails loudly, naming the constraint and the numbers, before any collective.
``jax.shard_map`` is replaced by a tripwire, so a check that ran too late fails the test."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import AxisType

import jax_impl


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _x(b=2, t=32, h=8, d=16, dtype=jnp.float32):
    return jnp.ones((b, t, h, d), dtype)


@pytest.fixture
def no_collectives(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("shard_map was reached: validation must come first")
    monkeypatch.setattr(jax, "shard_map", tripwire)


RING4 = ((4,), ("ring",))
CASES = [
    # (description, mesh, q, k, v, kwargs, exception, message fragment)
    ("rank-3 q", RING4, _x()[0], _x(), _x(), {}, ValueError, "q must be rank-4"),
    ("mixed dtypes", RING4, _x(), _x(dtype=jnp.bfloat16), _x(), {}, TypeError, "share one dtype"),
    ("integer dtype", RING4, *(_x().astype(jnp.int32),) * 3, {}, TypeError, "dtype must be one of"),
    ("k/v shapes differ", RING4, _x(), _x(h=4), _x(h=2), {}, ValueError, "k and v must have the same shape"),
    ("seq differs", RING4, _x(), _x(t=16), _x(t=16), {}, ValueError, "agree in batch, seq and head_dim"),
    ("head_dim differs", RING4, _x(), _x(d=8), _x(d=8), {}, ValueError, "agree in batch, seq and head_dim"),
    ("heads % kv_heads", RING4, _x(h=6), _x(h=4), _x(h=4), {}, ValueError, "heads % kv_heads must be 0, got heads=6, kv_heads=4"),
    ("heads % ulysses", ((4,), ("ulysses",)), _x(h=6), _x(h=6), _x(h=6), {}, ValueError,
     "heads % 'ulysses' mesh size must be 0, got heads=6, ulysses=4"),
    ("kv_heads vs ulysses", ((4,), ("ulysses",)), _x(h=12), _x(h=6), _x(h=6), {}, ValueError, "kv_heads=6, ulysses=4"),
    ("zigzag seq % 2RU", ((2, 2), ("ring", "ulysses")), _x(t=36), _x(t=36, h=2), _x(t=36, h=2), {"layout": "zigzag"},
     ValueError, "seq_len % 8 must be 0 for layout 'zigzag' with ring=2, ulysses=2, got seq_len=36"),
    ("stripe seq % RU", RING4, _x(t=30), _x(t=30), _x(t=30), {"layout": "stripe"}, ValueError, "seq_len % 4 must be 0"),
    ("batch % data", ((2, 2), ("data", "ring")), _x(b=3), _x(b=3), _x(b=3), {}, ValueError,
     "batch % 'data' mesh size must be 0, got batch=3, data=2"),
    ("unknown axis", ((2, 2), ("ring", "tensor")), _x(), _x(), _x(), {}, ValueError, "unknown mesh axis names ['tensor']"),
    ("unknown layout", RING4, _x(), _x(), _x(), {"layout": "spiral"}, ValueError, "layout must be one of"),
    ("unknown kv_exchange", RING4, _x(), _x(), _x(), {"kv_exchange": "gossip"}, ValueError, "kv_exchange must be one of"),
    ("negative scale", RING4, _x(), _x(), _x(), {"scale": -1.0}, ValueError, "scale must be a finite positive"),
    ("zero softcap", RING4, _x(), _x(), _x(), {"softcap": 0.0}, ValueError, "softcap must be a finite positive"),
    ("string softcap", ((2, 2), ("ring", "ulysses")), _x(), _x(), _x(), {"softcap": "50"}, TypeError,
     "softcap must be None or a positive float"),
    ("double ring half", ((4,), ("ring_outer",)), _x(), _x(), _x(), {}, ValueError, "needs both mesh axes"),
    ("double ring and ring", ((2, 2, 2), ("ring", "ring_outer", "ring_inner")), _x(), _x(), _x(), {}, ValueError,
     "cannot be combined with the double ring"),
    ("double ring of size 1", ((4, 1), ("ring_outer", "ring_inner")), _x(), _x(), _x(), {}, ValueError,
     "of size >= 2 each, got 4 x 1"),
    ("double ring all-gather", ((2, 2), ("ring_outer", "ring_inner")), _x(), _x(), _x(), {"kv_exchange": "allgather"},
     ValueError, "has no double-ring form"),
    ("double ring zigzag seq", ((2, 2, 2), ("ring_outer", "ring_inner", "ulysses")), _x(t=36), _x(t=36, h=2), _x(t=36, h=2),
     {}, ValueError, "seq_len % 16 must be 0 for layout 'zigzag' with ring_outer*ring_inner=4, ulysses=2"),
]


@pytest.mark.parametrize("desc,mesh,q,k,v,kwargs,exc,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_any_collective(desc, mesh, q, k, v, kwargs, exc, message, no_collectives, jax_devices):
    with pytest.raises(exc) as info:
        jax_impl.sequence_parallel_attention(q, k, v, _mesh(*mesh), **kwargs)
    assert message in str(info.value), str(info.value)


def test_valid_input_does_reach_shard_map(no_collectives, jax_devices):
    """The tripwire itself works: a valid call gets past validation and hits it."""
    with pytest.raises(AssertionError, match="shard_map was reached"):
        jax_impl.sequence_parallel_attention(_x(), _x(), _x(), _mesh(*RING4))


def test_layout_permutation_rejects_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        jax_impl.layout_permutation(16, "spiral", 2)
    with pytest.raises(ValueError, match="seq_len % 8 must be 0"):
        jax_impl.layout_permutation(12, "zigzag", 4)
    assert np.array_equal(jax_impl.layout_permutation(8, "contiguous", 4), np.arange(8))
