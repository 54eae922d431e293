"""Tier 1 — benchmarks.program_size, the CPU count of what JAX's packed-documents programs make
XLA compile (the GPU's program minus FA3's kernels): its rows, and the property it was built to
keep — the backward's length bounds cost one kernel call each, not a copy of the run lists,
packing and scatter around it (``runs.length_choice``; before 2026-11-28 they did: the all-gather
hybrid's fusions at 16k tokens fell 1,696 -> 420 when that changed)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from benchmarks import program_size


def _row(path, monkeypatch, ladder=None, seq=1024, ring=2):
    from jax_impl.kernels import runs

    with monkeypatch.context() as patch:
        if ladder is not None:
            patch.setattr(runs, "prefix_length_ladder", ladder)
        undo = program_size.gpu_program()
        try:
            return program_size.measure(path, seq, ring, "short")
        finally:
            undo()


def test_a_length_bound_adds_a_kernel_call_not_the_code_around_it(monkeypatch):
    import jax

    real_ffi = jax.ffi.ffi_call
    one = _row("allgather-hybrid", monkeypatch, ladder=lambda n: (n,))
    many = _row("allgather-hybrid", monkeypatch)  # (256, 384, 512, 768, 1024): five bounds
    assert jax.ffi.ffi_call is real_ffi  # the stand-in is undone
    assert many["custom_calls"] > one["custom_calls"]  # each bound is its own kernel call ...
    assert many["fusions"] <= 1.1 * one["fusions"], (one["fusions"], many["fusions"])  # ... and little else
    assert one["hlo_lines"] > 0 and one["compile_s"] > 0 and one["path"] == "allgather-hybrid"


def test_rows_are_written_as_they_finish_and_bad_names_are_refused(tmp_path):
    import json

    assert program_size.main(["--out", str(tmp_path), "--seq", "256", "--ring", "2",
                              "--paths", "allgather-hybrid-shared"]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "program-size.jsonl").read_text().splitlines()]
    assert row["path"] == "allgather-hybrid-shared" and row["shared_tokens"] and row["custom_calls"] > 0
    # the one call: its plan forward and its plan backward (at 256 tokens one length bound: no bound switch)
    assert row["run_time_switches"] == 2
    with pytest.raises(ValueError, match="path must be one of"):
        program_size.measure("ring-hybrid", 512, 2, "short")
    with pytest.raises(ValueError, match="mix must be one of"):
        program_size.measure("ring-zigzag", 512, 2, "mixed")


def _gathers_of(jaxpr, shape, inside_cond=False, found=None):
    """(outside, inside) counts of ``gather`` equations reading an operand of ``shape``: at the
    program's level, and inside a ``cond`` / ``switch`` branch."""
    found = found if found is not None else {False: 0, True: 0}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather" and tuple(eqn.invars[0].aval.shape) == shape:
            found[inside_cond] += 1
        for param in eqn.params.values():
            subs = param if isinstance(param, (list, tuple)) else [param]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _gathers_of(inner, shape, inside_cond or eqn.primitive.name == "cond", found)
    return found[False], found[True]


def test_the_one_calls_keys_are_packed_once_outside_its_plan_switch(monkeypatch):
    """Every plan that fits holds the same runs over the same key capacity, so the one call packs
    its keys and values once, before the switch picks a plan (``fa3_varlen.plans_packed_kv``) —
    not once per plan inside each branch (a copy of the gather per slot count, 2026-11-28) — in its
    forward and in its backward (one call, RINGBRIDGE_BACKWARD_GROUPS=1)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels import fa3_varlen, runs

    b, t, s, h, hk, d = 1, 16, 64, 2, 1, 8
    monkeypatch.setenv("RINGBRIDGE_BACKWARD_GROUPS", "1")
    # the kernels' outputs only: the test reads the program
    monkeypatch.setattr(fa3_varlen, "forward_ffi", lambda q, k_p, v_p, cu_q, cu_k, shape, *a: (
        q, jnp.zeros(shape, jnp.float32)))
    monkeypatch.setattr(fa3_varlen, "_bwd_call", lambda do, q, k_p, v_p, *a: (q, k_p, v_p))
    q_index, kv_index = jnp.arange(s - t, s)[None], jnp.arange(s)[None]
    fallback_fwd = lambda q: (q, jnp.zeros((b, h, t), jnp.float32))
    fallback_bwd = lambda q, k: (q, jnp.zeros(k.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32))

    def forward(q, k, v, q_ids, kv_ids):
        plans = runs.prefix_plans(q_ids, kv_ids, q_index, kv_index)
        return fa3_varlen.one_call_forward(q, k, v, 0.5, plans, lambda: fallback_fwd(q))

    def backward(q, k, v, q_ids, kv_ids):
        plans = runs.prefix_plans(q_ids, kv_ids, q_index, kv_index)
        lse = jnp.zeros((b, h, t), jnp.float32)
        return fa3_varlen.one_call_backward(q, q, k, v, q, lse, 0.5, plans, lambda: fallback_bwd(q, k))

    q = jnp.zeros((b, t, h, d), jnp.bfloat16)
    kv = jnp.zeros((b, s, hk, d), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 8)[None]
    assert len(runs.prefix_plans(ids[:, s - t:], ids, q_index, kv_index)) > 1
    for call in (forward, backward):
        jaxpr = jax.make_jaxpr(call)(q, kv, kv, ids[:, s - t:], ids).jaxpr
        # keys and values, once each, outside every branch
        assert _gathers_of(jaxpr, (b * s, hk, d)) == (2, 0), call.__name__


def test_run_time_switches_counts_what_one_execution_runs():
    """Switches in sequence add up, a switch counts its worst branch, a scan's body counts once per
    iteration (a ring's steps); a while loop (no static trip count) is refused, not undercounted."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def nested(x):  # one switch, its second branch one more
        return lax.cond(x > 0, lambda x: lax.cond(x > 1, jnp.sin, jnp.cos, x), jnp.tan, x)

    def stepped(x):  # three steps of a scan, each the nested switch, then one more
        x, _ = lax.scan(lambda c, _: (nested(c), None), x, None, length=3)
        return lax.cond(x > 0, jnp.sin, jnp.cos, x)

    count = lambda fn: program_size.run_time_switches(jax.make_jaxpr(fn)(1.0))
    assert (count(nested), count(stepped), count(jnp.sin)) == (2, 7, 0)
    with pytest.raises(ValueError, match="while loop"):
        count(lambda x: lax.while_loop(lambda c: c < 3, lambda c: nested(c) + 1, x))


def test_a_shared_prefix_sorts_for_its_shared_part_and_promise_not_its_local_part(monkeypatch):
    """The shared-prefix call's local part reads the shard's own keys in place
    (``runs.own_key_plans``): its plan sorts nothing, where the ranked plan sorted its ids twice —
    on 4x H200 each large sort was cub's radix sort between command buffers, the GPUs idle
    0.3–0.7 ms after it (docs/gpu/documents-2026-11-29-evening-h200x4.md). What sorts is the shared
    part's plan (its ids ranked, its keys ordered: ``runs._row_prefix``) and the promise check
    (``allgather._shared_prefix_holds``): three sorts, where the ranked local plan made five."""
    shared = _row("allgather-hybrid-shared", monkeypatch, ladder=lambda n: (n,), seq=4096)  # 1,280 of 2,048 shared
    assert 0 < shared["shared_tokens"] < shared["seq"] // shared["ring"]  # both parts present
    assert shared["sorts"] == 3, shared["sorts"]
