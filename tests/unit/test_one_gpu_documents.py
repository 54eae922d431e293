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
    monkeypatch.setattr(one_gpu_documents, "check", lambda mix, seq, backend, framework: row)
    one_gpu_documents.main(["--out", str(tmp_path), "--mixes", "short"])
    assert timed == []  # not timed: a fast wrong kernel is a bug, not a row


def test_the_table_shows_ratios_and_failures():
    rows = [{"kind": "time", "framework": "jax", "mix": "short", "seq": 32768, "documents": 35, "kernel": "fa3_varlen",
             "impl_ms": 6.0, "impl_tflops": 330.0, "anchor_kernel": "flash_mha_varlen", "anchor_ms": 5.4,
             "anchor_tflops": 370.0, "ratio": 0.9, "impl_fwd_ms": 1.7, "anchor_fwd_ms": 1.5, "fwd_ratio": 0.88,
             "anchor_verified": True, "impl_queued_ms": 5.3, "anchor_queued_ms": 4.9, "queued_ratio": 4.9 / 5.3},
            {**{"kind": "time", "framework": "torch", "mix": "short", "seq": 32768, "documents": 35, "kernel": "fa4",
                "impl_ms": 6.0, "impl_tflops": 330.0, "anchor_kernel": "fa4 varlen", "anchor_ms": 5.7,
                "anchor_tflops": 350.0, "ratio": 0.95, "impl_fwd_ms": 1.7, "anchor_fwd_ms": 1.6, "fwd_ratio": 0.94,
                "anchor_verified": True}},  # no queued columns: left blank, not zero
            {"kind": "time", "framework": "torch", "mix": "few-long", "seq": 32768, "error": "OutOfMemoryError"}]
    table = one_gpu_documents.markdown(rows, "cmd", {})
    assert "**0.900**" in table and "| torch | few-long | 32768 | | | OutOfMemoryError |" in table
    assert "| 5.30 / 4.90 | **0.925** | True |" in table and "| 0.940 |  |  | True |" in table
    assert all(line.count("|") == table.splitlines()[-1].count("|") for line in table.splitlines() if "32768" in line)


def test_torch_side_checks_and_streams_on_the_cpu(tmp_path):
    """torch_impl's check (the portable kernel in bf16 against itself in float32: the plumbing) and
    the compile stream's rows: each batch new ids, its longest run and the bucket FA4 would be
    asked for — no FA4 here, so no variants counted."""
    pytest.importorskip("torch")
    rows = one_gpu_documents.main(["--out", str(tmp_path), "--smoke", "--frameworks", "torch", "--mixes", "short",
                                   "--stream", "3", "--raw-stream", "2"])
    check, *stream = rows
    assert (check["framework"], check["kind"], check["passed"]) == ("torch", "check", True)
    checks = [r for r in stream if r["kind"] == "stream check"]  # each path checked before its batches
    assert [(r["bucketed"], r["passed"]) for r in checks] == [(True, True), (False, True)]
    stream = [r for r in stream if r["kind"] == "stream"]
    assert 0 < max(check["errors"].values()) <= 2e-2  # bf16 against float32: not zero, not wrong
    assert [(r["bucketed"], r["batch"]) for r in stream] == [(True, 0), (True, 1), (True, 2), (False, 0), (False, 1)]
    assert len({r["seed"] for r in stream}) == 5  # new ids every batch
    for r in stream:
        assert r["max_seqlen"] >= r["longest"] and r["fa4_variants"] is None
        assert (r["max_seqlen"] & (r["max_seqlen"] - 1) == 0 or r["max_seqlen"] == 512) if r["bucketed"] \
            else r["max_seqlen"] == r["longest"]
    assert "FA4's compile stream" in (tmp_path / "one-gpu-documents.md").read_text()


def test_a_wrong_torch_kernel_fails_its_check(monkeypatch):
    pytest.importorskip("torch")
    from benchmarks import one_gpu_documents_torch as side

    real = side._calls

    def skewed(backend):
        step, forward = real("reference")
        return (step if backend == "reference" else (lambda *a: (lambda o, *g: (o, g[0] * 1.1, *g[1:]))(*step(*a)))), \
            forward

    monkeypatch.setattr(side, "_calls", skewed)
    row = one_gpu_documents.check("short", 512, "skewed", "torch")
    assert not row["passed"] and row["errors"]["dq"] > 0.05 and row["errors"]["o"] < 2e-2


def test_an_unknown_framework_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--frameworks takes jax and torch, not 'tf'"):
        one_gpu_documents.main(["--out", str(tmp_path / "x"), "--smoke", "--frameworks", "jax,tf"])
    assert not (tmp_path / "x").exists()


def test_a_stream_path_that_fails_its_check_streams_nothing(monkeypatch):
    pytest.importorskip("torch")
    from benchmarks import one_gpu_documents_torch as side

    monkeypatch.setattr(side, "check_ids", lambda mix, ids, backend: {"kind": "check", "passed": False,
                                                                     "errors": {"o": 0.1}})
    rows = list(side.stream(512, 3, "reference", bucketed=False, seed0=0))
    assert [(r["kind"], r["passed"]) for r in rows] == [("stream check", False)]
