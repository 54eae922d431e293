"""Tier 1 — the case matrix the parity tiers run really has the coverage their docstrings claim."""

from __future__ import annotations

import itertools

from parity.cases import DTYPES, HEAD_DIMS, HEAD_LAYOUTS, KV_EXCHANGES, LAYOUTS, MESHES, full_matrix, pairwise_matrix


def _factors(case):
    heads = next(n for n, hk in HEAD_LAYOUTS.items() if hk == (case.heads, case.kv_heads))
    return {"layout": case.layout, "causal": case.causal, "mesh": (case.ring, case.ulysses), "heads": heads,
            "head_dim": case.head_dim, "dtype": case.dtype, "kv_exchange": case.kv_exchange}


def test_pairwise_matrix_covers_every_pair_and_every_mesh_triple():
    """All-gather KV on a mesh without a ring is the ring computation, so those pairs do not exist."""
    values = {"layout": LAYOUTS, "causal": (False, True), "mesh": MESHES, "heads": tuple(HEAD_LAYOUTS),
              "head_dim": HEAD_DIMS, "dtype": DTYPES, "kv_exchange": KV_EXCHANGES}
    chosen = [_factors(c) for c in pairwise_matrix()]
    for a, b in itertools.combinations(values, 2):
        seen = {(c[a], c[b]) for c in chosen}
        possible = {(x, y) for x, y in itertools.product(values[a], values[b])
                    if not ({a: x, b: y}.get("kv_exchange") == "allgather" and {a: x, b: y}.get("mesh", (2,))[0] == 1)}
        assert seen == possible, (a, b)
    assert not any(c["kv_exchange"] == "allgather" and c["mesh"][0] == 1 for c in chosen)
    assert {(c["layout"], c["causal"], c["mesh"]) for c in chosen} == set(
        itertools.product(LAYOUTS, (False, True), MESHES))
    assert len(full_matrix()) == 1728 and len({c.name for c in full_matrix()}) == 1728
