"""Tier 1 — windowed runs of the benchmark driver are measured against a window kernel.

Why: a run with ``--window`` skips the unmasked ceilings (their FLOPs are not the window's), so
until now its rows had no efficiency at all; issue 47 asks for the windowed rows against each
framework's own fused sliding window on one GPU (``*_window_anchor``, checked at 4096 tokens
before it is timed). A row must be divided by its own framework's anchor with its own window, a
forward-only row by none (the anchors time forward + backward), and a torch anchor must be the
fastest *verified* kernel — an unchecked fast kernel is not a ceiling."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.common import Problem, window_anchored
from benchmarks.run import add_efficiency


def _row(framework, tflops, window=(4096, 0), fwd_only=False, documents="none"):
    return {"framework": framework, "strategy": "ring", "layout": "zigzag", "seq_len": 131072, "devices": 4,
            "ulysses": 1, "ring": 4, "fwd_only": fwd_only, "ms_per_iter": 10.0, "tflops_per_gpu": tflops,
            "verified": True, "note": "", "extra": {"documents": documents, "window": list(window) if window else None,
                                                      "fit_ring": 0, "fit_multiple": 1}}


def test_windowed_rows_are_over_their_own_frameworks_window_anchor_with_the_same_window():
    rows = [_row("torch_impl", 200.0), _row("jax_impl", 400.0), _row("jax_impl", 300.0, window=(1024, 0)),
            _row("jax_impl", 100.0, fwd_only=True),
            _row("torch_window_anchor", 250.0), _row("jax_window_anchor", 500.0),
            _row("torch_cudnn_ceiling", 900.0, window=None)]  # an unmasked ceiling: never a window row's
    out = add_efficiency(rows)
    assert out[0]["efficiency"] == pytest.approx(0.8)  # torch over torch's anchor
    assert out[1]["efficiency"] == pytest.approx(0.8)  # JAX over JAX's
    assert out[2]["efficiency"] is None  # another window: no anchor for it
    assert out[3]["efficiency"] is None  # forward only: the anchors time forward + backward
    assert out[4]["efficiency"] == pytest.approx(1.0) and out[5]["efficiency"] == pytest.approx(1.0)


def test_document_rows_keep_their_varlen_anchors():
    rows = [_row("torch_impl", 100.0, window=None, documents="short"),
            _row("torch_varlen_anchor", 400.0, window=None, documents="short"), _row("torch_window_anchor", 50.0)]
    assert add_efficiency(rows)[0]["efficiency"] == pytest.approx(0.25)


@pytest.mark.parametrize(("window", "documents", "ceiling", "multi", "expected"), [
    (4096, "none", 32768, False, True),
    (None, "none", 32768, False, False),  # unmasked: the ceilings
    (4096, "short", 32768, False, False),  # documents: the varlen anchors on their ids
    (4096, "none", 0, False, False),  # --ceiling-seq 0: no single-GPU rows
    (4096, "none", 32768, True, False),  # JAX multi-controller: no single-GPU rows
])
def test_which_runs_time_window_anchors(window, documents, ceiling, multi, expected):
    args = argparse.Namespace(window=window, documents=documents, ceiling_seq=ceiling, multi_controller=multi)
    assert window_anchored(args) is expected


def test_the_anchor_is_the_fastest_verified_kernel():
    """``common.best_anchor``, which both sides' varlen and window anchors go through."""
    from benchmarks.common import best_anchor

    problem = Problem(seq=32768, heads=32, kv_heads=8, window=(4096, 0))

    def result(ms, verified=True):
        return lambda p: {"kernel": f"k{ms}", "verified": verified, "fwd_bwd_ms": ms}

    def broken(p):
        raise ImportError("flash-attn-4 not installed")

    row = best_anchor("torch_window_anchor", problem, {"fa2": result(10.0), "fa4": result(5.0, verified=False)})
    assert row.extra["kernel"] == "k10.0" and row.verified and row.ms_per_iter == 10.0  # the fast one failed its check
    assert row.tflops_per_gpu == pytest.approx(problem.flops(False) / 10e-3 / 1e12)
    row = best_anchor("torch_window_anchor", problem, {"fa2": result(10.0), "fa4": broken})
    assert row.extra["kernel"] == "k10.0" and "ImportError" in row.extra["candidates"]["fa4"]["error"]
    row = best_anchor("torch_window_anchor", problem, {"fa2": result(10.0, verified=False)})
    assert not row.verified and row.tflops_per_gpu is None and "NOT VERIFIED" in row.note  # no verified kernel: no ceiling
