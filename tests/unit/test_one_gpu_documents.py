"""Tier 1 — benchmarks/one_gpu_documents.py, the one-GPU documents target's driver: on the CPU its checks
run (the portable kernel against itself in float32: the plumbing, not a kernel), a wrong kernel
fails its check and is not timed, and the rows land as JSON and a table."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from benchmarks import one_gpu_documents


def test_smoke_writes_a_passed_check_per_mix(tmp_path):
    rows = one_gpu_documents.main(["--out", str(tmp_path), "--smoke", "--mixes", "short,mix"])
    assert [(r["kind"], r["mix"], r["passed"]) for r in rows] == [("check", "short", True), ("check", "mix", True)]
    assert json.loads((tmp_path / "one-gpu-documents.json").read_text()) == rows
    assert "| short | 512 |" in (tmp_path / "one-gpu-documents.md").read_text()


def test_a_wrong_kernel_fails_its_check_and_is_not_timed(tmp_path, monkeypatch):
    real = one_gpu_documents._mesh_call

    def skewed(backend):  # o off by 10 %: what a kernel with a wrong mask or scale would give
        step, forward = real("reference")
        if backend == "reference":
            return step, forward
        return (lambda *a: (lambda o, *g: (o * 1.1, *g))(*step(*a))), forward

    monkeypatch.setattr(one_gpu_documents, "_mesh_call", skewed)
    row = one_gpu_documents.check("short", 512, "skewed")
    assert not row["passed"] and row["errors"]["o"] > 0.05 and row["errors"]["dq"] < 2e-2
    timed = []
    monkeypatch.setattr(one_gpu_documents, "timed", lambda *a, **k: timed.append(a) or {"kind": "time"})
    monkeypatch.setattr(one_gpu_documents, "check", lambda mix, seq, backend: row)
    one_gpu_documents.main(["--out", str(tmp_path), "--mixes", "short"])
    assert timed == []  # not timed: a fast wrong kernel is a bug, not a row


def test_the_table_shows_ratios_and_failures():
    rows = [{"kind": "time", "mix": "short", "seq": 32768, "documents": 35, "kernel": "fa3_varlen", "jax_impl_ms": 6.0,
             "jax_impl_tflops": 330.0, "anchor_ms": 5.4, "anchor_tflops": 370.0, "ratio": 0.9, "jax_impl_fwd_ms": 1.7,
             "anchor_fwd_ms": 1.5, "fwd_ratio": 0.88, "anchor_verified": True},
            {"kind": "time", "mix": "few-long", "seq": 32768, "error": "XlaRuntimeError: out of memory"}]
    table = one_gpu_documents.markdown(rows, "cmd", {})
    assert "**0.900**" in table and "XlaRuntimeError: out of memory" in table
