"""Tier 1 — benchmarks.jax_compile_probe, the GPU question "where does the JAX whole-model step's
compile time go?": on the CPU its smoke run compiles the tiny model's step under each variant and
checks the first variant's gradients against the float64 step and every other variant's against
the first's; a variant whose gradients differ is reported unchecked (the probe's own check, planted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from benchmarks import jax_compile_probe


def _rows(out):
    return [json.loads(line) for line in (out / "compile-probe.jsonl").read_text().splitlines()]


def test_every_variant_is_compiled_timed_and_checked_against_the_first(tmp_path, monkeypatch):
    real = jax_compile_probe.loss_and_grads
    calls = []

    def planted(program, params, batch, options):  # the second variant's gradients come back scaled
        loss, grads = real(program, params, batch, options)
        calls.append(options)
        if len(calls) == 2:
            import jax

            grads = jax.tree.map(lambda g: g * 1.1, grads)
        return loss, grads

    monkeypatch.setattr(jax_compile_probe, "loss_and_grads", planted)
    # two of the three variants: the third compiles and runs as the second does (≈ 7 s more)
    assert jax_compile_probe.main(["--smoke", "--seq", "64", "--variants", "autotune,untuned",
                                   "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    assert [r["variant"] for r in rows] == ["autotune", "untuned"]
    assert [r["checked"] for r in rows] == [True, False]
    assert rows[0]["errors"]["float64_worst_ratio"] <= 1.0  # the reference: against the float64 step
    assert rows[1]["errors"]["grads"] > jax_compile_probe.TOLERANCE
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 and r["reference"] == "autotune" for r in rows)
