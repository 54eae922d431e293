"""Tier 2 — the ``python -m parity`` entry point end to end on a few cases: it runs, writes both
reports, counts a missing framework as skipped (never passed), and exits non-zero on failure."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from parity import cli  # noqa: E402


def test_cli_runs_filtered_cases_and_writes_reports(tmp_path, jax_devices, capsys):
    code = cli.main(["--filter", "ring-r2 zigzag", "--frameworks", "jax", "--seed", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, capsys.readouterr().out
    assert report["seed"] == 3 and report["summary"]["passed"] == len(report["results"]) >= 2
    assert (tmp_path / "report.md").read_text().count("| passed |") == report["summary"]["passed"]


def test_cli_fails_when_a_case_fails(tmp_path, jax_devices, monkeypatch):
    """A runner that returns wrong numbers makes the run exit 1 and names the tensor."""
    import parity.run_jax as run_jax

    real = run_jax.run_case
    monkeypatch.setattr(run_jax, "run_case", lambda case, x, **kw: {**real(case, x), "dv": real(case, x)["dv"] * 1.01})
    code = cli.main(["--filter", "ring-r2 zigzag-causal", "--frameworks", "jax", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert code == 1
    assert all(r["status"] == "failed" and "dv:" in r["detail"] and "o:" not in r["detail"] for r in results)


def test_cli_list_prints_case_names(capsys):
    assert cli.main(["list", "--filter", "usp"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all(n.startswith("usp-") for n in names)
