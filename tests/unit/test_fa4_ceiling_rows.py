"""Tier 1 — torch's FlashAttention-4 ceiling rows (benchmarks/bench_torch.py), on the CPU with the
kernel stubbed: issue 47 holds torch's rows to its framework's *best* kernel, FA4 where installed,
so a verified FA4 result must become a ceiling the efficiency column uses, an unverified one must
not, and a machine without flash-attn-4 must lose no row of the SDPA ceilings."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks import bench_torch, masked
from benchmarks.common import Problem
from benchmarks.run import add_efficiency

PROBLEM = Problem(seq=4096, heads=8, kv_heads=2)


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setattr(bench_torch, "_rank", lambda: 0)
    monkeypatch.setattr(bench_torch.dist, "barrier", lambda *a, **k: None)


def _stub(monkeypatch, result=None, raises=None):
    def fake(seq, heads, kv_heads, d, iters, warmup):
        if raises is not None:
            raise raises
        return result
    monkeypatch.setattr(masked, "fa4_dense_anchor", fake)


def test_a_verified_fa4_kernel_is_a_torch_ceiling(rank0, monkeypatch):
    result = masked._anchor_result(masked.FA4_DENSE_KERNEL, PROBLEM, {"o": 1e-3, "dq": 2e-2}, 1.0, 3.0)
    assert result["verified"] and result["tflops_fwd"] == pytest.approx(PROBLEM.flops(True) / 1e-3 / 1e12)
    _stub(monkeypatch, result)
    rows = bench_torch._fa4_ceiling_rows(PROBLEM, 5, 2)
    assert [(r.framework, r.fwd_only) for r in rows] == [("torch_fa4_ceiling", True), ("torch_fa4_ceiling", False)]
    assert rows[1].tflops_per_gpu == pytest.approx(PROBLEM.flops(False) / 3e-3 / 1e12)
    impl = {"framework": "torch_impl", "fwd_only": False, "tflops_per_gpu": rows[1].tflops_per_gpu / 2, "extra": {}}
    sdpa = {"framework": "torch_cudnn_ceiling", "fwd_only": False, "tflops_per_gpu": rows[1].tflops_per_gpu / 4,
            "extra": {}}
    out = add_efficiency([r.to_dict() for r in rows] + [sdpa, impl])
    assert out[-1]["efficiency"] == pytest.approx(0.5)  # over FA4, the faster of the two ceilings


def test_an_unverified_fa4_kernel_gives_no_throughput(rank0, monkeypatch):
    result = masked._anchor_result(masked.FA4_DENSE_KERNEL, PROBLEM, {"o": 1e-3, "dq": 0.3}, 1.0, 3.0)
    assert not result["verified"]  # one error above 2e-2 fails the check
    _stub(monkeypatch, result)
    rows = bench_torch._fa4_ceiling_rows(PROBLEM, 5, 2)
    assert len(rows) == 2 and all(r.tflops_per_gpu is None and "NOT VERIFIED" in r.note for r in rows)


def test_without_flash_attn_4_there_is_no_row(rank0, monkeypatch):
    _stub(monkeypatch, raises=ImportError("no module named flash_attn"))
    assert bench_torch._fa4_ceiling_rows(PROBLEM, 5, 2) == []


def test_a_failing_kernel_is_a_row_with_its_error(rank0, monkeypatch):
    _stub(monkeypatch, raises=RuntimeError("JIT failed"))
    rows = bench_torch._fa4_ceiling_rows(PROBLEM, 5, 2)
    assert len(rows) == 2 and all("JIT failed" in r.note and r.tflops_per_gpu is None for r in rows)
