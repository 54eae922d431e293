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


def test_compile_only_rows_carry_no_step_time_and_no_check(tmp_path):
    """``--compile-only``: a compile's seconds, nothing computed — so no step time and no
    ``checked`` that could read as a verified number."""
    assert jax_compile_probe.main(["--smoke", "--seq", "64", "--variants", "untuned", "--compile-only",
                                   "--out", str(tmp_path)]) == 0
    (row,) = _rows(tmp_path)
    assert row["compile_s"] > 0 and not {"step_ms", "checked", "errors"} & set(row)
    assert row["hlo_lines"] > 100 and row["fusions"] > 0  # the compiled program's size, read from its text


def test_program_size_counts_the_ops_a_compile_emits():
    text = "\n".join(["ENTRY main {", "  %f = f32[2] fusion(%a), kind=kLoop", "  %w = (s32[]) while(%t), body=b",
                      "  %c = f32[2] conditional(%p, %x, %y)", "  %k = f32[2] custom-call(%a), custom_call_target=\"x\"",
                      "  %g = f32[2] fusion(%f), kind=kLoop", "  %s = (s32[8], s32[8]) sort(%i, %j), dimensions={0}",
                      "}"])
    assert jax_compile_probe.program_size(text) == {"hlo_lines": 7, "fusions": 2, "while_loops": 1,
                                                    "conditionals": 1, "custom_calls": 1, "sorts": 1}


def test_pass_times_sum_each_pass_over_its_runs_in_seconds():
    """XLA's timer lines (the format of hlo_pass_pipeline.cc's VLOG 1), each unit to seconds, one
    pass's runs summed, the longest first; other lines ignored."""
    log = "\n".join([
        "I1128 12:39:58.042917 1 hlo_pass_pipeline.cc:176] HLO pass: fusion time: 1.5 s (1.5 s) (cumulative: 1 s)",
        "I1128 12:39:58.042917 1 hlo_pass_pipeline.cc:176] HLO pass: cse time: 250 ms (250 ms) (cumulative: 1 s)",
        "I1128 12:39:58.042917 1 hlo_pass_pipeline.cc:176] HLO pass: fusion time: 2 min (2 min) (cumulative: 1 s)",
        "I1128 12:39:58.042917 1 hlo_pass_pipeline.cc:176] HLO pass: dce time: 6 us (6 us) (cumulative: 1 s)",
        "I1128 12:39:58.042931 1 hlo_pass_pipeline.cc:181]   HLO pass strip-memory-placement-annotations",
    ])
    times = jax_compile_probe.pass_times(log)
    assert list(times) == ["fusion", "cse", "dce"]
    assert times["fusion"] == pytest.approx(121.5) and times["cse"] == pytest.approx(0.25)
    assert times["dce"] == pytest.approx(6e-6)
    assert list(jax_compile_probe.pass_times(log, top=1)) == ["fusion"]


def test_no_ids_compiles_another_program_than_the_rows_ids(tmp_path):
    """``--no-ids`` must change what is compiled (the question it asks is whether the document path
    costs the compile): on two simulated devices the program with the rows' ids holds the document
    path's conditionals, the one without has fewer, and each row says which it compiled."""
    for flags, out in (([], tmp_path / "ids"), (["--no-ids"], tmp_path / "no-ids")):
        assert jax_compile_probe.main(["--smoke", "--seq", "64", "--devices", "2", "--variants", "untuned",
                                       "--compile-only", "--out", str(out), *flags]) == 0
    (ids,), (no_ids,) = _rows(tmp_path / "ids"), _rows(tmp_path / "no-ids")
    assert ids["ids"] is True and no_ids["ids"] is False
    assert ids["conditionals"] > no_ids["conditionals"] and ids["hlo_lines"] > no_ids["hlo_lines"]
