"""Tier 1 — every driver row times its step a second way, queued (the host running ahead, as in a
training loop) beside the waited median (which also pays the host's launch and the wait's wake-up
every step: docs/gpu/host-gaps-2026-11-29-h200.md). On the CPU: a JAX row measured end to end,
and an anchor's queued time carried into its row — only where the anchor measured one."""

from __future__ import annotations

import pytest

from benchmarks.common import Problem, Row, anchor_row

PROBLEM = Problem(seq=256, heads=2, kv_heads=1, head_dim=16)


def test_a_jax_row_has_its_queued_time_beside_the_waited_median():
    jax = pytest.importorskip("jax")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import bench_jax

    one = NamedSharding(bench_jax.device_mesh({}, jax.devices()), P())
    row = Row("jax_probe", "single", "-", PROBLEM.seq, 1, 1, 1, False)
    attention = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    row = bench_jax._measure(row, PROBLEM, attention, one, iters=3, warmup=1)
    assert row.note in ("", None) and row.ms_per_iter > 0
    assert 0 < row.extra["queued_ms"] < 20 * row.ms_per_iter  # measured, on the step's own scale


def test_an_anchor_row_keeps_its_queued_time_only_where_it_measured_one():
    checked = {"kernel": "k", "verified": True, "verified_at_4096": {"o": 1e-3}, "fwd_ms": 1.0, "fwd_bwd_ms": 3.0}
    assert anchor_row("a", PROBLEM, dict(checked, fwd_bwd_queued_ms=2.5)).extra["queued_ms"] == 2.5
    assert "queued_ms" not in anchor_row("a", PROBLEM, checked).extra
    assert "queued_ms" not in anchor_row("a", PROBLEM, dict(checked, fwd_bwd_queued_ms=2.5), fwd_only=True).extra


def test_queued_efficiency_is_taken_at_both_sides_queued_times():
    from benchmarks.run import add_efficiency, markdown

    base = {"strategy": "ring", "layout": "zigzag", "seq_len": 4096, "ulysses": 1, "ring": 4, "fwd_only": False}
    ceiling = dict(base, framework="jax_cudnn_ceiling", tflops_per_gpu=500.0, ms_per_iter=10.0, extra={"queued_ms": 9.0})
    row = dict(base, framework="jax_impl", tflops_per_gpu=400.0, ms_per_iter=5.0, extra={"queued_ms": 4.0})
    older = dict(base, framework="jax_impl", tflops_per_gpu=400.0, ms_per_iter=5.0, extra={})  # no queued time
    rows = add_efficiency([ceiling, row, older])
    assert rows[1]["efficiency"] == pytest.approx(0.8) and rows[2]["efficiency"] == pytest.approx(0.8)
    assert rows[1]["queued_efficiency"] == pytest.approx((400 * 5 / 4) / (500 * 10 / 9))  # 0.9
    assert rows[2]["queued_efficiency"] is None
    table = markdown(rows, {"date": "d", "machine": "m", "command": "c", "versions": {}}).splitlines()
    header = next(line for line in table if line.startswith("| framework"))
    assert all(line.count("|") == header.count("|") for line in table if line.startswith("| jax"))
    assert sum("| 4.00 |" in line and "| 0.80 | 0.90 |" in line for line in table) == 1  # queued ms, both ratios


def test_a_failing_queued_timing_keeps_the_row():
    from benchmarks.common import record_queued

    row = Row("jax_impl", "ring", "zigzag", 256, 1, 4, 1, False)
    record_queued(row, lambda: 1 / 0)
    assert "queued_ms" not in row.extra and row.extra["queued_error"].startswith("ZeroDivisionError")
    record_queued(row, lambda: 2.345678)
    assert row.extra["queued_ms"] == 2.3457


def test_no_queued_ratio_over_a_reference_timed_only_in_part():
    """A framework's best ceiling taken over the kernels that have a queued time would be the
    best of a subset (on 11-28 torch's fastest ceiling, FA4's, had none): no ratio then."""
    from benchmarks.run import add_efficiency

    base = {"strategy": "single", "layout": "-", "seq_len": 4096, "ulysses": 1, "ring": 1, "fwd_only": False}
    slow = dict(base, framework="torch_cudnn_ceiling", tflops_per_gpu=500.0, ms_per_iter=10.0, extra={"queued_ms": 9.0})
    fast = dict(base, framework="torch_fa4_ceiling", tflops_per_gpu=600.0, ms_per_iter=8.3, extra={})
    row = dict(base, framework="torch_impl", strategy="ring", ring=4, tflops_per_gpu=450.0, ms_per_iter=5.0,
               extra={"queued_ms": 4.5})
    rows = add_efficiency([slow, fast, row])
    assert rows[2]["efficiency"] == pytest.approx(0.75) and rows[2]["queued_efficiency"] is None
    fast["extra"]["queued_ms"] = 8.0
    assert add_efficiency([slow, fast, row])[2]["queued_efficiency"] == pytest.approx((450 * 5 / 4.5) / (600 * 8.3 / 8))


def test_a_row_that_fails_its_check_keeps_no_time_queued_or_waited():
    from benchmarks.verify import mark

    row = Row("jax_impl", "ring", "zigzag", 256, 1, 4, 1, False, ms_per_iter=5.0, extra={"queued_ms": 4.0})
    mark(row, (False, "dq error 1e-1"))
    assert row.ms_per_iter is None and "queued_ms" not in row.extra and row.note.startswith("NOT VERIFIED")
