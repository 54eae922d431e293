"""The public JAX API in the ways users call it: Auto and Explicit mesh axes, eager and
jitted, ``jax.grad``, inputs of any sharding, and the per-algorithm functions inside a user's own
``shard_map`` with their own axis names."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from helpers import FULL

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_impl
from parity.core import reference

B, T, H, HK, D = 2, 32, 4, 2, 16


def _inputs(seed, layout="zigzag", ring=2, ulysses=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, T, HK, D)).astype(np.float32)
    perm = reference.layout_permutation(T, layout, ring, ulysses)
    want = reference.attention_forward(q, k, v, causal=True).o[:, perm]
    return (q[:, perm], k[:, perm], v[:, perm]), want


@pytest.mark.parametrize("axis_type,jit", [(AxisType.Auto, False), (AxisType.Auto, True), (AxisType.Explicit, True)]
                         + ([(AxisType.Explicit, False)] if FULL else []),  # eager on Explicit: --full (10 s)
                         ids=lambda p: {False: "eager", True: "jit"}.get(p, str(p).split(".")[-1].lower())
                         if isinstance(p, bool) else str(p).split(".")[-1].lower())
def test_auto_and_explicit_meshes_eager_and_jitted(axis_type, jit, seed, jax_devices):
    """Same answer (and a gradient) whichever axis types the mesh has and whether or not the call
    is jitted; the output comes back sharded over the mesh as docs/contract.md says."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "ring", "ulysses"), axis_types=(axis_type,) * 3)
    (q, k, v), want = _inputs(seed)
    fn = partial(jax_impl.sequence_parallel_attention, mesh=mesh, causal=True, layout="zigzag")
    fn = jax.jit(fn) if jit else fn
    with jax.set_mesh(mesh):
        o = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        grad = jax.grad(lambda q: jnp.sum(fn(q, jnp.asarray(k), jnp.asarray(v))))(jnp.asarray(q))
    np.testing.assert_allclose(np.asarray(o), want, rtol=2e-5, atol=2e-6)
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P("data", ("ring", "ulysses"), None, None)), 4)
    assert grad.shape == q.shape and np.all(np.isfinite(np.asarray(grad))) and np.any(np.asarray(grad) != 0)


def test_any_input_sharding_is_resharded(seed, jax_devices):
    """Inputs sharded some other way still give the answer: under jit, heads split over the
    mesh's devices and K/V replicated; eagerly, inputs committed to devices outside the mesh."""
    mesh = jax.make_mesh((2, 2), ("ring", "ulysses"), axis_types=(AxisType.Auto,) * 2)
    (q, k, v), want = _inputs(seed)
    fn = partial(jax_impl.sequence_parallel_attention, mesh=mesh, causal=True)
    q_heads = jax.device_put(q, NamedSharding(mesh, P(None, None, ("ring", "ulysses"), None)))
    k_rep, v_rep = (jax.device_put(x, NamedSharding(mesh, P())) for x in (k, v))
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q_heads, k_rep, v_rep)), want, rtol=2e-5, atol=2e-6)
    elsewhere = [jax.device_put(x, jax.devices()[7]) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(fn(*elsewhere)), want, rtol=2e-5, atol=2e-6)


def test_ring_attention_inside_user_shard_map_with_own_axis_names(seed, jax_devices):
    """``ring_attention`` and ``usp_attention`` are usable inside the user's shard_map over axes
    named as the user likes, alongside other mesh axes."""
    (q, k, v), want = _inputs(seed, layout="stripe", ring=4, ulysses=1)
    mesh = jax.make_mesh((2, 4), ("batch", "sp"), axis_types=(AxisType.Auto,) * 2)
    spec = P("batch", "sp", None, None)

    def per_device(q, k, v):
        assert q.shape == (B // 2, T // 4, H, D)  # q: [b/batch, t/sp, h, d]
        o, lse = jax_impl.ring_attention(q, k, v, "sp", causal=True, layout="stripe")
        assert lse.shape == (B // 2, H, T // 4) and lse.dtype == jnp.float32
        return o

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=True)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), want, rtol=2e-5, atol=2e-6)

    (q, k, v), want = _inputs(seed, layout="zigzag", ring=2, ulysses=4)
    mesh = jax.make_mesh((2, 4), ("outer", "inner"), axis_types=(AxisType.Auto,) * 2)
    spec = P(None, ("outer", "inner"), None, None)
    usp = partial(jax_impl.usp_attention, ring_axis="outer", ulysses_axis="inner", causal=True, layout="zigzag")
    f = jax.shard_map(lambda q, k, v: usp(q, k, v)[0], mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), want, rtol=2e-5, atol=2e-6)


def test_float16_inputs_run_and_stay_finite(seed, jax_devices):
    """float16 is an accepted dtype: it runs, accumulates in float32 and returns float16."""
    mesh = jax.make_mesh((4,), ("ring",), axis_types=(AxisType.Auto,))
    (q, k, v), want = _inputs(seed, layout="zigzag", ring=4, ulysses=1)
    o, lse = jax_impl.sequence_parallel_attention(*(jnp.asarray(x, jnp.float16) for x in (q, k, v)), mesh,
                                                  causal=True, return_lse=True)
    assert o.dtype == jnp.float16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), want, atol=2e-2)


def test_a_chunked_portable_block_differentiates_inside_shard_map(jax_devices):
    """Shards long enough that the portable kernel walks its keys in chunks (t · s > 2²⁰: 1152
    tokens a shard) under jax.grad inside shard_map: the backward's dq sum must be typed like q
    (plain zeros are unvarying; the scan rejected them — found 2026-11-25), and the gradients
    equal dense attention's."""
    mesh = jax.make_mesh((2,), ("ring",), devices=jax_devices[:2])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2 * 1152, 1, 8)), jnp.float32) for _ in range(3))
    ring = lambda q, k, v: jnp.sum(jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True,
                                                                        layout="contiguous") ** 2)
    dense = lambda q, k, v: jnp.sum(jax_impl.dense_attention(q, k, v, causal=True)[0] ** 2)
    got = jax.jit(jax.grad(ring, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(dense, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max() / jnp.abs(w).max()) < 1e-5
