"""Tier 1 — ``benchmarks.layouts.summarize``: the issue-36 table from replay rows — busiest / mean
device (time_balance), the busiest against the anchor ÷ R (the fitted ids' anchor for per-row
layouts, the raw mix's for static ones) and against the static zigzag's busiest; a layout with a
device missing or unverified is not verified. Hand-made rows: the arithmetic is what is tested."""

from __future__ import annotations

import pytest

from benchmarks.layouts import markdown, summarize


def _rows(layout, ms, verified=True):
    rows = []
    for device, t in enumerate(ms):
        for fwd_only in (True, False):
            rows.append({"framework": "torch_impl_replay", "layout": layout, "fwd_only": fwd_only,
                         "ms_per_iter": t / 3 if fwd_only else t, "verified": verified,
                         "extra": {"replay_device": device, "documents": "short"}})
    return rows


def test_summary_arithmetic():
    anchors = {"torch": {"short": {"fitted": {"fwd_bwd_ms": 80.0, "kernel": "FA2", "verified": True},
                                   "raw": {"fwd_bwd_ms": 40.0, "kernel": "FA2", "verified": True}}}}
    rows = _rows("zigzag", [10, 20, 30, 40]) + _rows("document-zigzag", [21, 22, 23, 22])
    rows += _rows("document-hybrid", [21, 22, 23], verified=True)  # one device missing
    table = {e["layout"]: e for e in summarize(anchors, rows, ring=4)}
    z, d, h = table["zigzag"], table["document-zigzag"], table["document-hybrid"]
    assert z["time_balance"] == pytest.approx(40 / 25) and z["busiest_vs_anchor_share"] == pytest.approx(40 / 10)
    assert d["time_balance"] == pytest.approx(23 / 22) and d["busiest_vs_anchor_share"] == pytest.approx(23 / 20)
    assert d["busiest_vs_zigzag"] == pytest.approx(23 / 40) and d["verified"]
    assert not h["verified"]  # three of four devices
    assert "document-zigzag" in markdown(list(table.values()), 4)
