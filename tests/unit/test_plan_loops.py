"""Tier 1 — the device-side document plans (``jax_impl.kernels.runs``) trace without loops on a GPU.

Why: ``jnp.searchsorted``'s default method is a while loop of log2(n) steps; on a GPU each step is
a few tiny kernels launched one after another, and a documents step plans its blocks with a dozen
searches forward and backward (on 4x H200 those steps sat idle 2.4-6.5 ms each, 2026-11-27). The
plans search through ``runs.searchsorted``, which takes the unrolled method off the CPU: under it a
plan's jaxpr must hold no loop at all — a plain ``jnp.searchsorted`` (or any other loop) added to
a plan fails here — and both methods must give the same plan."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

from jax_impl.kernels import runs


@pytest.fixture(autouse=True)
def _fresh_traces():
    """The plans' jitted helpers cache their traces by shape, not by search method: clear them on
    the way out, so no later test runs a trace made under the method patched here."""
    yield
    jax.clear_caches()


def _is_loop(eqn) -> bool:
    """A while loop, or a scan not unrolled whole (``unroll`` = ``length`` traces the steps
    straight: XLA drops the one-trip loop it lowers to — checked below on the compiled program)."""
    name = eqn.primitive.name
    return name == "while" or (name == "scan" and eqn.params["unroll"] < eqn.params["length"])


def _loops(jaxpr) -> list[str]:
    """Every loop in ``jaxpr`` and the jaxprs nested in it (cond branches, jit, custom rules)."""
    found = []
    for eqn in jaxpr.eqns:
        if _is_loop(eqn):
            found.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _loops(inner)
    return found


def _plans(ids, index):
    """The plans a documents step builds on the device: FA3's varlen offsets and their bounds, the
    token-index segments, the one call's prefix plans and their choice, the boundary runs."""
    offsets = runs.varlen_offsets(ids, ids, True, 16)
    segments = runs.index_segments(ids, ids, index, index)
    prefix = runs.prefix_plans(ids, ids, index, index)
    return offsets, segments, prefix, runs.boundary_runs(ids, ids), runs.packed_segments(ids, ids, True, 4)


def _inputs():
    lengths = [5, 1, 9, 3, 14, 2, 30]
    ids = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
    return jnp.asarray(ids), jnp.arange(ids.shape[1], dtype=jnp.int32)[None]


def test_the_plans_hold_a_loop_only_under_the_cpu_search_and_are_the_same_under_both(monkeypatch):
    traced = {}
    for method in ("scan", "scan_unrolled"):
        monkeypatch.setattr(runs, "search_method", lambda method=method: method)
        jax.clear_caches()  # the plans' jitted helpers were traced under the other method (a real run has one)
        loops = _loops(jax.make_jaxpr(_plans)(*_inputs()).jaxpr)
        compiled = jax.jit(_plans).lower(*_inputs()).compile()
        if method == "scan_unrolled":  # the GPU's: straight-line code, in the jaxpr and what XLA compiles
            assert loops == [] and " while(" not in compiled.as_text(), loops
        else:  # the CPU's (the checks above could not fail if this found none)
            assert loops and " while(" in compiled.as_text(), "the scan method traced no loop: nothing is proved"
        traced[method] = jax.tree.leaves(compiled(*_inputs()))
    assert len(traced["scan"]) == len(traced["scan_unrolled"]) > 0
    for a, b in zip(traced["scan"], traced["scan_unrolled"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_search_method_follows_the_backend():
    assert runs.search_method() == ("scan" if jax.default_backend() == "cpu" else "scan_unrolled")
