"""The case matrix the parity tiers run really has the coverage their docstrings claim."""

from __future__ import annotations

import functools
import itertools

from parity.core import cases as matrix
from parity.core.cases import (
    DOCUMENT_PATTERNS,
    HEAD_DIMS,
    HEAD_LAYOUTS,
    KV_EXCHANGES,
    LAYOUTS,
    MATRIX_DTYPES,
    MESHES,
    RING_SCHEDULES,
    SOFTCAP,
    WINDOWS,
    document_cases,
    full_matrix,
    softcap_cases,
    strategy_name,
    token_index_cases,
    window_cases,
)


@functools.cache
def _pairwise() -> tuple:
    return tuple(matrix.pairwise_matrix())


def pairwise_matrix() -> list:
    """``parity.core.cases.pairwise_matrix()``, built once for this module's tests (1.2 s a build on
    2 cores, seven uses); it is a pure function of the factor lists (no seed): the tests below
    compare its slices with the case lists it is built from."""
    return list(_pairwise())


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
    chosen = [_factors(c) for c in pairwise_matrix()
              if c.documents == "none" and c.window is None and not c.sinks and c.softcap is None]
    for a, b in itertools.combinations(values, 2):
        seen = {(c[a], c[b]) for c in chosen}
        possible = {(x, y) for x, y in itertools.product(values[a], values[b])
                    if not ({a: x, b: y}.get("kv_exchange") == "allgather"
                            and not _has_single_ring({a: x, b: y}.get("mesh", (2, 1))))}
        assert seen == possible, (a, b)
    assert not any(c["kv_exchange"] == "allgather" and not _has_single_ring(c["mesh"]) for c in chosen)
    assert {c["mesh"] for c in chosen if len(c["mesh"]) == 3} == {(4, 1, 2), (4, 2, 2)}  # double ring 2x2, 2x2 x u2
    assert {(c["layout"], c["causal"], c["mesh"]) for c in chosen} == set(
        itertools.product(LAYOUTS, (False, True), MESHES))  # the full matrix's 1944: the next test


def test_full_matrix_runs_every_document_pattern_window_sinks_and_softcap_with_everything():
    """The cross product times the five document values, four windows, sinks off / on and the
    soft-cap off / on (the plain 1944 first, every uncapped case before the capped ones); the
    default matrix is a subset of it."""
    everything, tokens = full_matrix(), token_index_cases()
    assert [c.name for c in everything[-len(tokens):]] == [c.name for c in tokens]  # appended, not crossed
    assert len({c.name for c in everything}) == len(everything)
    full = everything[:-len(tokens)]
    assert len(full) == 5 * 4 * 2 * 2 * 1944 and not any(c.token_index for c in full)
    assert all(c.documents == "none" and c.window is None and not c.sinks for c in full[:1944])
    assert all(c.softcap is None for c in full[:len(full) // 2]) and all(c.softcap == SOFTCAP
                                                                         for c in full[len(full) // 2:])
    plain = {tuple(_factors(c).values()) for c in full[:1944]}
    assert len(plain) == 1944
    groups: dict = {}
    for c in full:
        groups.setdefault((c.documents, c.window, c.sinks, c.softcap), set()).add(tuple(_factors(c).values()))
    for key in itertools.product(("none", *DOCUMENT_PATTERNS), WINDOWS, (False, True), (None, SOFTCAP)):
        assert groups.pop(key) == plain, key
    assert not groups
    assert {c.name for c in pairwise_matrix()} <= {c.name for c in everything}


def test_document_cases_meet_every_pattern_layout_causal_and_strategy():
    """At most 16 cases (the default run's budget); the coverage document_cases promises."""
    docs = document_cases()
    assert 12 <= len(docs) <= 16 and all(c.documents != "none" and c.batch == 2 for c in docs)
    assert all(c.window is None and not c.sinks for c in docs)
    names = [c.name for c in pairwise_matrix()]
    end = len(names) - len(window_cases()) - len(softcap_cases()) - len(token_index_cases())
    assert names[end - len(docs):end] == [c.name for c in docs]
    seen = {(c.documents, f, v) for c in docs for f, v in _factors(c).items()}
    for pattern in DOCUMENT_PATTERNS:
        for factor, values in (("layout", LAYOUTS), ("causal", (False, True)), ("dtype", MATRIX_DTYPES),
                               ("heads", tuple(HEAD_LAYOUTS))):
            assert {(pattern, factor, v) for v in values} <= seen, (pattern, factor)
        assert any(c.documents == pattern and c.causal and c.ring >= 4 and strategy_name(c) in RING_SCHEDULES
                   for c in docs), pattern
    loops = [c for c in docs if strategy_name(c) in RING_SCHEDULES]
    assert {(strategy_name(c), c.layout) for c in loops} == set(itertools.product(RING_SCHEDULES, LAYOUTS))
    assert {(c.layout, c.causal) for c in loops} == set(itertools.product(LAYOUTS, (False, True)))
    assert {strategy_name(c) for c in docs if c.causal} == {
        "ring", "ring-agkv", "ulysses", "usp", "usp-agkv", "double_ring", "double_ring_usp"}
    assert {c.ring for c in docs if strategy_name(c) == "ring" and c.causal} == {1, 2, 4, 8}


def test_window_cases_meet_every_window_strategy_layout_and_sinks_as_promised():
    """At most 14 cases, in the default matrix before the soft-capped ones; the coverage
    window_cases promises."""
    wins = window_cases()
    assert len(wins) <= 14 and all((c.window is not None or c.sinks) and c.softcap is None for c in wins)
    names = [c.name for c in pairwise_matrix()]
    end = len(names) - len(softcap_cases()) - len(token_index_cases())
    assert names[end - len(wins):end] == [c.name for c in wins]
    assert all(c.devices > 1 for c in wins)
    windowed = [c for c in wins if c.window is not None]
    for window in WINDOWS[1:]:
        mine = [c for c in windowed if c.window == window]
        assert {c.causal for c in mine} == {False, True} and {c.layout for c in mine} == set(LAYOUTS), window
        assert any(c.ring >= 4 and strategy_name(c) in RING_SCHEDULES for c in mine), window
    assert any(c.window == WINDOWS[2] and c.ring == 8 for c in windowed)  # wide: three shards of 8 tokens back
    assert {strategy_name(c) for c in windowed} == {
        "ring", "ring-agkv", "ulysses", "usp", "usp-agkv", "double_ring", "double_ring_usp"}
    loops = [c for c in windowed if strategy_name(c) in RING_SCHEDULES]
    assert {(strategy_name(c), c.layout) for c in loops} == set(itertools.product(RING_SCHEDULES, LAYOUTS))
    assert {(strategy_name(c), c.causal) for c in loops} == set(itertools.product(RING_SCHEDULES, (False, True)))
    assert {strategy_name(c) for c in loops if c.layout == "contiguous" and c.causal} == set(RING_SCHEDULES)
    assert {(c.layout, c.causal) for c in windowed} == set(itertools.product(LAYOUTS, (False, True)))
    assert {c.sinks for c in windowed} == {False, True} and any(c.documents != "none" for c in windowed)
    assert {c.dtype for c in windowed} == set(MATRIX_DTYPES)
    sunk = [c for c in wins if c.sinks]
    assert {c.window is None for c in sunk} == {False, True}
    assert {strategy_name(c) for c in sunk} == {s for s in (strategy_name(c) for c in windowed)}
    assert {c.causal for c in sunk} == {False, True} and {c.dtype for c in sunk} == set(MATRIX_DTYPES)
    assert {_factors(c)["heads"] for c in sunk} == set(HEAD_LAYOUTS)
    assert {c.documents != "none" for c in sunk} == {False, True}


def test_softcap_cases_meet_every_strategy_and_mask_as_promised():
    """At most 8 cases, in the default matrix before the token-index ones, all capped at SOFTCAP: every strategy, causal
    and not, every layout, float32 and bf16, MHA / GQA / MQA, with and without a window, sinks and
    documents; the first two (the default tier's sample) are a ring without Ulysses with every
    mask in bf16, and a USP in float32."""
    caps = softcap_cases()
    assert len(caps) <= 8 and all(c.softcap == SOFTCAP and c.devices > 1 for c in caps)
    end = len(pairwise_matrix()) - len(token_index_cases())
    assert [c.name for c in pairwise_matrix()][end - len(caps):end] == [c.name for c in caps]
    assert {strategy_name(c) for c in caps} == {
        "ring", "ring-agkv", "ulysses", "usp", "usp-agkv", "double_ring", "double_ring_usp"}
    for factor, values in (("causal", (False, True)), ("layout", LAYOUTS), ("dtype", MATRIX_DTYPES),
                           ("heads", tuple(HEAD_LAYOUTS))):
        assert {_factors(c)[factor] for c in caps} == set(values), factor
    for has in (lambda c: c.window is not None, lambda c: c.sinks, lambda c: c.documents != "none"):
        assert {has(c) for c in caps} == {False, True}
    first, second = caps[:2]
    assert first.ulysses == 1 and first.window and first.sinks and first.documents != "none"
    assert first.dtype == "bfloat16" and second.ulysses > 1 and second.dtype == "float32"
    from parity.cli import select_cases

    assert [c.name for c in select_cases(False, "softcap")] == [first.name, second.name]
    assert [c.name for c in select_cases(False, "softcap", masks="all")] == [c.name for c in caps]


def test_token_index_cases_are_last_and_two_are_sampled_as_promised():
    """Last in the all-pairs matrix: packed documents (or one a row) in the per-document zigzag,
    every one with two rows; the first two (what the default report and test tier run) are causal,
    one without Ulysses in float32 and one through USP in bf16; all of them reach the ring loop,
    all-gather KV, the double ring and Ulysses, causal and not, a window and sinks."""
    tokens = token_index_cases()
    assert [c.name for c in pairwise_matrix()][-len(tokens):] == [c.name for c in tokens]
    assert all(c.token_index and c.batch == 2 and c.documents != "none" and c.devices > 1 for c in tokens)
    first, second = tokens[:2]
    assert first.causal and first.ulysses == 1 and first.dtype == "float32"
    assert second.causal and second.ulysses > 1 and second.dtype == "bfloat16"
    assert {"ring", "ring-agkv", "usp", "double_ring_usp"} <= {strategy_name(c) for c in tokens}
    assert {c.causal for c in tokens} == {False, True}
    assert any(c.window for c in tokens) and any(c.sinks for c in tokens)
    from parity.cli import select_cases

    assert [c.name for c in select_cases(False, "token-index")] == [first.name, second.name]
    assert [c.name for c in select_cases(False, "token-index", masks="all")] == [c.name for c in tokens]
