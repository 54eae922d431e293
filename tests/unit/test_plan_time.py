"""Tier 1 — ``benchmarks.plan_time`` (a new batch's host plan on torch's shared-prefix path), at toy
sizes: a row per mix lands as it finishes, with the prefix the layout promises and positive times,
and every timed call runs the planner (the times themselves are not checked: performance lives in
benchmarks)."""

from __future__ import annotations

import json


def test_rows_land_per_mix_and_every_timed_call_plans(tmp_path, monkeypatch):
    from benchmarks import plan_time
    from seqplan import shared

    splits, extents = [], []
    real_split, real_extent = shared.split_runs, shared.shared_extent

    def split(*a, **k):  # each timed call's plan: both parts planned (a prefix shorter than the shard)
        plan = real_split(*a, **k)
        splits.append(plan.shared is not None and plan.local is not None)
        return plan

    monkeypatch.setattr(plan_time, "split_runs", split)
    monkeypatch.setattr(plan_time, "shared_extent", lambda *a: extents.append(1) or real_extent(*a))
    assert plan_time.main(["--out", str(tmp_path), "--seq", "16384", "--mixes", "short,few-long", "--iters", "2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "plan-time.jsonl").read_text().splitlines()]
    assert [r["mix"] for r in rows] == ["short", "few-long"]
    for r in rows:  # at 16k over 4 the hybrid's prefix is 1,024 (short) and 4,096 (few-long) of 4,096
        assert 0 < r["shared_tokens"] <= 16384 // 4 and r["ring"] == 4
        assert all(r[k] > 0 for k in ("extent_ms", "plan_ms_device0", "plan_ms_device3"))
    # mixes x devices x (warm-up + iters) plans; the extent in each, and alone (warm-up + iters) per mix
    assert len(splits) == 2 * 2 * 3 and len(extents) == len(splits) + 2 * 3
    assert all(splits[:6])  # the short mix's prefix leaves a local part: both parts planned
