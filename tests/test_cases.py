"""Tier 1 — the case matrix the parity tiers run really has the coverage their docstrings claim."""

from __future__ import annotations

import itertools

from parity.cases import DTYPES, HEAD_DIMS, HEAD_LAYOUTS, LAYOUTS, MESHES, full_matrix, pairwise_matrix


def _factors(case):
    heads = next(n for n, hk in HEAD_LAYOUTS.items() if hk == (case.heads, case.kv_heads))
    return {"layout": case.layout, "causal": case.causal, "mesh": (case.ring, case.ulysses), "heads": heads,
            "head_dim": case.head_dim, "dtype": case.dtype}


def test_pairwise_matrix_covers_every_pair_and_every_mesh_triple():
    values = {"layout": LAYOUTS, "causal": (False, True), "mesh": MESHES, "heads": tuple(HEAD_LAYOUTS),
              "head_dim": HEAD_DIMS, "dtype": DTYPES}
    chosen = [_factors(c) for c in pairwise_matrix()]
    for a, b in itertools.combinations(values, 2):
        seen = {(c[a], c[b]) for c in chosen}
        assert seen == set(itertools.product(values[a], values[b])), (a, b)
    assert {(c["layout"], c["causal"], c["mesh"]) for c in chosen} == set(
        itertools.product(LAYOUTS, (False, True), MESHES))
    assert len(full_matrix()) == 1080 and len({c.name for c in full_matrix()}) == 1080
