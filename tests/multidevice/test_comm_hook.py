"""Unit — the communication hook (``comm.Comm`` installed with ``comm.using``): every transfer of
ring, all-gather KV and the double ring goes through it, the backward's included (it uses the
Comm of its config), in both frameworks; and what the hook returns is what the loops use."""

from __future__ import annotations

import numpy as np
import pytest


def _jax_run(mesh_shape, axes, comm, kv_exchange="ring"):
    import jax
    import jax.numpy as jnp

    import jax_impl
    from jax_impl.comm import using

    mesh = jax.make_mesh(mesh_shape, axes)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((1, 16, 2, 8)), jnp.float32) for i in range(3))

    def loss(q, k, v):
        o = jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="zigzag", kv_exchange=kv_exchange)
        return jnp.sum(o * o), o

    with using(comm):
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


def _recording_comm():
    from jax_impl.comm import Comm

    class Recording(Comm):
        seen: list

        def __init__(self):
            self.seen = []

        def shift(self, tree, hop, axes):
            self.seen.append(hop.value)
            return super().shift(tree, hop, axes)

        def gather(self, x, axis_name):
            self.seen.append("gather")
            return super().gather(x, axis_name)

        def scatter(self, x_all, axis_name):
            self.seen.append("scatter")
            return super().scatter(x_all, axis_name)

    return Recording()


@pytest.mark.parametrize("name,mesh_shape,axes,kv_exchange,want", [
    ("double_ring", (2, 2), ("ring_outer", "ring_inner"), "ring", {"outer", "inner", "diagonal"}),
    ("ring", (4,), ("ring",), "ring", {"ring"}),
    ("allgather", (4,), ("ring",), "allgather", {"gather", "scatter"}),
])
def test_jax_hook_sees_every_strategys_transfers(name, mesh_shape, axes, kv_exchange, want, jax_devices):
    """JAX traces each hop kind (scanned steps once per trace); the hook sees all of them."""
    comm = _recording_comm()
    _jax_run(mesh_shape, axes, comm, kv_exchange)
    assert set(comm.seen) == want, comm.seen


def test_jax_loops_use_what_the_hook_returns(jax_devices):
    """A hook that moves nothing (every hop returns the buffer unchanged) changes the double
    ring's output and gradients: the loops compute with the hook's result, not around it."""
    from jax_impl.comm import Comm

    class Stay(Comm):
        def shift(self, tree, hop, axes):
            return tree

    o_real, g_real = _jax_run((2, 2), ("ring_outer", "ring_inner"), Comm())
    o_stay, g_stay = _jax_run((2, 2), ("ring_outer", "ring_inner"), Stay())
    assert not np.allclose(np.asarray(o_real), np.asarray(o_stay))
    assert not np.allclose(np.asarray(g_real[1]), np.asarray(g_stay[1]))


def test_torch_hook_sees_every_strategys_transfers(worlds):
    """torch: installed around the forward only, the hook also carries the backward's hops
    (inner, diagonal for the double ring; the dK/dV ring hops; the reduce-scatter)."""
    from torch_tasks import recorded_transfers_task

    per_rank = worlds(4).run(recorded_transfers_task)
    for seen in per_rank:
        assert set(seen["double_ring"]["forward"]) == {"outer", "inner"}
        assert set(seen["double_ring"]["backward"]) == {"outer", "inner", "diagonal"}
        assert set(seen["ring"]["forward"]) == {"ring"} and set(seen["ring"]["backward"]) == {"ring"}
        assert seen["allgather"]["forward"] == ["gather", "gather"] and seen["allgather"]["backward"] == ["scatter"] * 2
