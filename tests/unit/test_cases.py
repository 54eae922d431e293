"""The case matrix the parity tiers run really has the coverage their docstrings claim."""

from __future__ import annotations

import itertools

from parity.core.cases import (
    HEAD_DIMS,
    HEAD_LAYOUTS,
    KV_EXCHANGES,
    LAYOUTS,
    MATRIX_DTYPES,
    MESHES,
    full_matrix,
    pairwise_matrix,
)


def _factors(case):
    heads = next(n for n, hk in HEAD_LAYOUTS.items() if hk == (case.heads, case.kv_heads))
    mesh = (case.ring, case.ulysses) + ((case.ring_outer,) if case.ring_outer > 1 else ())
    return {"layout": case.layout, "causal": case.causal, "mesh": mesh, "heads": heads,
            "head_dim": case.head_dim, "dtype": case.dtype, "kv_exchange": case.kv_exchange}


def _has_single_ring(mesh) -> bool:
    return mesh[0] > 1 and len(mesh) == 2


def test_pairwise_matrix_covers_every_pair_and_every_mesh_triple():
    """All-gather KV on a mesh without a ring is the ring computation, and has no double-ring form,
    so those pairs do not exist."""
    values = {"layout": LAYOUTS, "causal": (False, True), "mesh": MESHES, "heads": tuple(HEAD_LAYOUTS),
              "head_dim": HEAD_DIMS, "dtype": MATRIX_DTYPES, "kv_exchange": KV_EXCHANGES}
    chosen = [_factors(c) for c in pairwise_matrix()]
    for a, b in itertools.combinations(values, 2):
        seen = {(c[a], c[b]) for c in chosen}
        possible = {(x, y) for x, y in itertools.product(values[a], values[b])
                    if not ({a: x, b: y}.get("kv_exchange") == "allgather"
                            and not _has_single_ring({a: x, b: y}.get("mesh", (2, 1))))}
        assert seen == possible, (a, b)
    assert not any(c["kv_exchange"] == "allgather" and not _has_single_ring(c["mesh"]) for c in chosen)
    assert {c["mesh"] for c in chosen if len(c["mesh"]) == 3} == {(4, 1, 2), (4, 2, 2)}  # double ring 2x2, 2x2 x u2
    assert {(c["layout"], c["causal"], c["mesh"]) for c in chosen} == set(
        itertools.product(LAYOUTS, (False, True), MESHES))
    assert len(full_matrix()) == 1944 and len({c.name for c in full_matrix()}) == 1944
