"""Tier 1 — benchmarks.program_size, the CPU count of what JAX's packed-documents programs make
XLA compile (the GPU's program minus FA3's kernels): its rows, and the property it was built to
keep — the backward's length bounds cost one kernel call each, not a copy of the run lists,
packing and scatter around it (``runs.length_choice``; before 2026-11-28 they did: the all-gather
hybrid's fusions at 16k tokens fell 1,696 -> 420 when that changed)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from benchmarks import program_size


def _row(path, monkeypatch, ladder=None):
    from jax_impl.kernels import runs

    with monkeypatch.context() as patch:
        if ladder is not None:
            patch.setattr(runs, "prefix_length_ladder", ladder)
        undo = program_size.gpu_program()
        try:
            return program_size.measure(path, 1024, 2, "short")
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
    with pytest.raises(ValueError, match="path must be one of"):
        program_size.measure("ring-hybrid", 512, 2, "short")
    with pytest.raises(ValueError, match="mix must be one of"):
        program_size.measure("ring-zigzag", 512, 2, "mixed")
