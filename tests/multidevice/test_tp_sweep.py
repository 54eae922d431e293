"""The FSDP × TP B* sweep (``parity.capacity.tp_sweep``) on gloo: the command the GPUs run.

Why: the calculator's FSDP × TP closed form is what ``python -m parity bstar`` answers with; this
command is its only check against a measured step, so its rows, its knee and its check before
timing must be right before any GPU time is spent on them."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from parity.capacity import tp_sweep


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_sweep_checks_the_step_then_times_every_batch_beside_the_closed_form(framework, worlds, jax_devices):
    if framework == "torch":
        worlds(4)
    emitted = []
    result = tp_sweep.measure(tp_sweep.SMALL_SWEEP, "cpu", emit=emitted.append, framework=framework)
    assert "hardware" in emitted[0] and emitted[1]["verify"] and emitted[-1]["summary"] == "fsdp_tp"
    assert result["verified"]["passed"], result["verified"]
    rows = result["rows"]
    assert [r["tokens_per_device"] for r in rows] == list(tp_sweep.SMALL_SWEEP.tokens)
    host = emitted[2]
    assert host["host_floor"] == "fsdp_tp" and host["tokens_per_device"] == tp_sweep.SMALL_SWEEP.host_tokens
    assert len(host["timings_s"]) == 2 and host["seconds"] == min(host["timings_s"])  # the faster of two
    assert emitted[3:-1] == rows  # handed out one by one, as measured
    for r in rows:
        assert r["verified"] and r["measured_s"] > 0 and r["framework"] == framework
        assert 0 < r["bound_overlap_s"] <= r["bound_serial_s"] <= r["predicted_s"]
        assert r["host_floor_s"] == host["seconds"] and r["predicted_s"] == max(host["seconds"], r["bound_serial_s"])
    s = result["summary"]
    assert s["predicted_bstar"] == max(s["predicted_bstar_sum"], s["bstar_host"])
    per_token = [r["measured_s"] / r["tokens_per_device"] for r in rows]
    assert per_token[rows.index(next(r for r in rows if r["tokens_per_device"] == s["measured_knee"]))] <= 1.1 * min(
        per_token)
    assert all(s[f"predicted_bstar_{form}"] >= 0 or math.isinf(s[f"predicted_bstar_{form}"]) for form in ("sum", "max"))
    assert "B* sweep" in tp_sweep.markdown(result)


def test_a_wrong_gradient_fails_the_check_before_timing(worlds, monkeypatch):
    """A planted error in one gradient (a real bug's shape: a TP shard's dW summed twice) fails."""
    from parity.training import torch_step

    worlds(4)
    honest = torch_step.run_step

    def doubled(case, inputs, devices="cpu"):
        out = honest(case, inputs, devices=devices)
        return out if case.devices == 1 else {**out, "dw1": out["dw1"] * 2}

    monkeypatch.setattr(torch_step, "run_step", doubled)
    verdict = tp_sweep.verify(tp_sweep.SMALL_SWEEP.check(), "cpu")
    assert not verdict["passed"] and verdict["worst"] == "dw1", verdict


def test_the_host_floor_moves_b_star_to_where_the_serial_bound_reaches_it():
    """The host floor's B*: 0 below the bound's start, else the B where L·(m + c + (a + y)·B) equals it."""
    from parity.capacity.bstar import Hardware

    hw = Hardware("toy", 100e12, {k: 50e9 for k in ("all-gather", "reduce-scatter", "all-reduce", "p2p",
                                                     "all-to-all")}, 1e12)
    sweep = tp_sweep.TPSweep()
    at = lambda b: tp_sweep.bounds(sweep, hw, b)["bound_serial_s"]
    assert tp_sweep.host_bstar(sweep, hw, 0.5 * at(0)) == 0.0
    b = tp_sweep.host_bstar(sweep, hw, at(3000))
    assert math.isclose(b, 3000, rel_tol=1e-9), b


def test_a_row_at_or_below_the_host_floors_size_is_refused_before_any_work():
    from dataclasses import replace

    with pytest.raises(ValueError, match="must be below every row"):
        tp_sweep.measure(replace(tp_sweep.SMALL_SWEEP, tokens=(4, 8)), "cpu")
