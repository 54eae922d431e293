"""Tier 1 — benchmarks.gqa_probe, the GPU question "does the SDPA op take GQA K/V as they are?",
answered on the CPU's op: its check must tell a right grouping from a wrong one, since a GPU row
that says "passed" decides whether the aten adapters stop expanding K/V (issue 47)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from benchmarks import gqa_probe

ARGS = SimpleNamespace(seq=64, check_seq=48, heads=4, kv_heads=2, head_dim=16, iters=1)


def _rows(op_pairs, monkeypatch, op="aten_cpu"):
    monkeypatch.setattr(gqa_probe, "aten_ops", lambda name: op_pairs[name])
    rows = []
    gqa_probe.probe(op, ARGS, torch.device("cpu"), torch.float32, rows.append)
    return rows


def test_the_cpu_op_takes_grouped_heads_and_is_timed(monkeypatch):
    from torch_impl.kernels.aten import aten_ops
    rows = _rows({"aten_cpu": aten_ops("aten_cpu")}, monkeypatch)
    assert [r.phase for r in rows] == ["check", "time"]
    assert rows[0].passed and rows[0].worst_error_unexpanded < 1e-4
    assert rows[1].expanded_ms > 0 and rows[1].unexpanded_ms > 0


def test_an_op_that_groups_heads_the_wrong_way_fails_and_is_not_timed(monkeypatch):
    """Query head i against K/V head i mod hk (not i // group): same shapes, wrong numbers."""
    from torch_impl.kernels.aten import aten_ops
    fwd, bwd = aten_ops("aten_cpu")

    def tile(x, h):
        return x.repeat(1, h // x.shape[1], 1, 1) if x.shape[1] != h else x

    def wrong_fwd(q, k, v, causal, scale):
        return fwd(q, tile(k, q.shape[1]), tile(v, q.shape[1]), causal, scale)

    def wrong_bwd(do, q, k, v, o, lse, causal, scale):
        h, hk = q.shape[1], k.shape[1]
        dq, dk, dv = bwd(do, q, tile(k, h), tile(v, h), o, lse, causal, scale)[:3]
        fold = lambda x: x.reshape(x.shape[0], h // hk, hk, *x.shape[2:]).sum(1)
        return dq, fold(dk), fold(dv)

    rows = _rows({"aten_cpu": (wrong_fwd, wrong_bwd)}, monkeypatch)
    assert len(rows) == 1 and rows[0].runs_unexpanded and not rows[0].passed


def test_an_op_that_refuses_grouped_heads_is_reported_not_raised(monkeypatch):
    from torch_impl.kernels.aten import aten_ops
    fwd, bwd = aten_ops("aten_cpu")

    def strict_fwd(q, k, v, causal, scale):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal query")
        return fwd(q, k, v, causal, scale)

    rows = _rows({"aten_cpu": (strict_fwd, bwd)}, monkeypatch)
    assert len(rows) == 1 and rows[0].runs_unexpanded is False and "heads" in rows[0].error


def test_main_writes_its_rows_as_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    gqa_probe.main(["--smoke"])
    data = json.loads((tmp_path / "gqa_probe.json").read_text())
    assert data["rows"][0]["op"] == "aten_cpu" and data["rows"][0]["phase"] == "check"
