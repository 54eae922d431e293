"""Tier 2 — causal work balance, measured: a counting block backend records every kernel call
(device, block shape, mask) at run time, so the test sees what really executed, not the plan.

Claims checked (docs/contract.md): a fully masked block is never computed; zigzag computes half-size
blocks on every off-diagonal step, so every device does the same work; stripe excludes the
diagonal; contiguous device r computes r+1 blocks."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax import lax

import jax_impl
from jax_impl.block import BlockBackend, get_backend, register_backend
from seqplan.schedule import CAUSAL_MASK, FULL_MASK, STRICT_MASK, BlockMask

CALLS: list = []


def _record(kind: str, q, k, mask: BlockMask):
    def cb(device, qt, kt):
        CALLS.append((kind, int(device), int(qt), int(kt), mask))
    jax.debug.callback(cb, lax.axis_index("ring"), q.shape[1], k.shape[1])


def _counting_fwd(q, k, v, mask, scale):
    _record("fwd", q, k, mask)
    return get_backend("reference").fwd(q, k, v, mask, scale)


def _counting_bwd(do, q, k, v, o, lse, mask, scale, dlse=None):
    _record("bwd", q, k, mask)
    return get_backend("reference").bwd(do, q, k, v, o, lse, mask, scale, dlse)


register_backend(BlockBackend("counting", _counting_fwd, _counting_bwd))


def _calls(layout: str, ring: int, shard: int = 8):
    CALLS.clear()
    seq = ring * shard
    mesh = jax.make_mesh((ring,), ("ring",))
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, seq, 2, 8)), jnp.float32)

    def loss(q):
        o = jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, layout=layout, block_backend="counting")
        return jnp.sum(o.astype(jnp.float32))

    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    jax.effects_barrier()
    per_device = defaultdict(list)
    for kind, device, qt, kt, mask in CALLS:
        per_device[(kind, device)].append((qt, kt, mask))
    return per_device


def _area(blocks) -> float:
    """Visible (query, key) pairs a kernel call covers: causal/strict blocks count half."""
    return sum(qt * kt * (1.0 if mask == FULL_MASK else 0.5) for qt, kt, mask in blocks)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_zigzag_every_device_does_equal_work(ring, jax_devices):
    """Zigzag: one causal diagonal block, then R-1 half-size full blocks on every device."""
    calls = _calls("zigzag", ring)
    shard = 8
    for kind in ("fwd", "bwd"):
        for r in range(ring):
            blocks = calls[(kind, r)]
            assert len(blocks) == ring, (kind, r, blocks)
            assert blocks.count((shard, shard, CAUSAL_MASK)) == 1
            halves = [b for b in blocks if b[2] == FULL_MASK]
            assert len(halves) == ring - 1 and all(qt * kt == shard * shard // 2 for qt, kt, _ in halves)
        assert len({_area(calls[(kind, r)]) for r in range(ring)}) == 1


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_stripe_excludes_diagonal_of_later_stripes(ring, jax_devices):
    """Stripe: device r computes R triangular blocks; those from later stripes (r+1..R-1) are strict."""
    calls = _calls("stripe", ring)
    for kind in ("fwd", "bwd"):
        for r in range(ring):
            masks = [m for _, _, m in calls[(kind, r)]]
            assert len(masks) == ring
            assert masks.count(STRICT_MASK) == ring - 1 - r and masks.count(CAUSAL_MASK) == r + 1


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_contiguous_skips_fully_masked_blocks(ring, jax_devices):
    """Contiguous: device r computes its diagonal plus the r earlier shards, nothing from later
    shards (fully masked); total calls = R(R+1)/2 per pass, not R²."""
    calls = _calls("contiguous", ring)
    for kind in ("fwd", "bwd"):
        assert [len(calls[(kind, r)]) for r in range(ring)] == [r + 1 for r in range(ring)]
