"""Helpers the notebooks (``notebooks/*.ipynb``) call, so that each cell is one idea: mesh
factorizations, per-device causal work from the step plan, bytes (model and measured), errors
against the oracle, and benchmark result files when they exist.
"""

from __future__ import annotations

import json
from pathlib import Path

from jax_impl.schedule import FULL_MASK, LAYOUTS, Part, step_plan

from .accounting import attention_traffic
from .cases import Case

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def factorizations(n: int) -> list[tuple[int, int]]:
    """Every (ring, ulysses) with ring · ulysses = n, ring-heavy first."""
    return [(n // u, u) for u in range(1, n + 1) if n % u == 0]


def _area(block) -> float:
    """Score entries a block kernel computes, as a fraction of a full shard × shard block; a
    causal or strict block counts half (flash kernels skip fully masked tiles)."""
    if block is None:
        return 0.0
    frac = lambda part: 1.0 if part is Part.ALL else 0.5  # noqa: E731
    return frac(block.q_part) * frac(block.kv_part) * (1.0 if block.mask == FULL_MASK else 0.5)


def ring_work(layout: str, ring: int, causal: bool = True) -> list[float]:
    """Attention work of each ring device over all its steps (units: one full shard block),
    replaying the step plan both frameworks execute."""
    plan = step_plan(layout, causal)
    work = []
    for r in range(ring):
        total = _area(plan.local)
        for step in range(1, ring):
            src = (r - step) % ring
            total += _area(plan.from_earlier if src < r else plan.from_later)
        work.append(total)
    return work


def imbalance(work: list[float]) -> float:
    """max / mean: the step time is set by the busiest device."""
    return max(work) / (sum(work) / len(work))


def bytes_table(n: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: str = "float32",
                measure: tuple[str, ...] = ("jax", "torch")) -> list[dict]:
    """Per-device bytes per pass for every factorization of ``n``: the model, and each
    framework's measurement (JAX HLO; torch trace)."""
    rows = []
    for ring, uly in factorizations(n):
        case = Case(ring=ring, ulysses=uly, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        model = attention_traffic(case)
        row = {"mesh": f"r{ring}×u{uly}", "case": case, "model_fwd": float(model.bytes("fwd")),
               "model_bwd": float(model.bytes("bwd"))}
        for framework in measure:
            if framework == "jax":
                from . import run_jax as runner

                got = runner.measure_attention_traffic(case)
            else:
                from . import run_torch as runner

                got = runner.measure_attention_traffic(case)
            row[f"{framework}_fwd"], row[f"{framework}_bwd"] = float(got.bytes("fwd")), float(got.bytes("bwd"))
            row[f"{framework}_equal"] = got == model
        rows.append(row)
    return rows


def max_errors(case: Case, seed: int = 0) -> dict[str, float]:
    """Max relative error (max |x − ref| / max |ref| over o, lse, dq, dk, dv) vs the float64
    oracle, per framework that ran."""
    import numpy as np

    from .cli import load_runner, run_side
    from .inputs import make_inputs, oracle

    x = make_inputs(case, seed)
    ref = oracle(case, x)
    out = {}
    for framework in ("jax", "torch"):
        runner, _ = load_runner(framework)
        side = run_side(case, runner, x, ref, "cpu") if runner else None
        if side is not None and side.results:
            out[framework] = max(float(np.max(np.abs(side.results[t] - ref[t])) / np.max(np.abs(ref[t]))) for t in ref)
    return out


def benchmark_rows() -> list[dict]:
    """Rows of every benchmark result JSON under benchmarks/results/ (empty when none exist)."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")) if RESULTS.exists() else []:
        data = json.loads(path.read_text())
        for row in data.get("rows", []):
            rows.append({**row, "file": path.name})
    return rows


__all__ = ["LAYOUTS", "factorizations", "ring_work", "imbalance", "bytes_table", "max_errors", "benchmark_rows"]
