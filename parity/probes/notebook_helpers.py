"""Helpers the notebooks (``notebooks/*.ipynb``) call, so that each cell is one idea: mesh
factorizations, per-device causal work from the step plan, bytes (model and measured), errors
against the oracle, and benchmark result files when they exist. jax_impl is imported by the
functions that replay its step plan, so this module imports without it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..accounting.model import attention_traffic
from ..core.cases import Case
from ..core.names import LAYOUTS
from ..runners.base import FRAMEWORKS, Unavailable, load_runner
from ..runners.pipeline import check_case

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def factorizations(n: int) -> list[tuple[int, int]]:
    """Every (ring, ulysses) with ring · ulysses = n, ring-heavy first."""
    return [(n // u, u) for u in range(1, n + 1) if n % u == 0]


def _area(block) -> float:
    """Score entries a block kernel computes, as a fraction of a full shard × shard block; a
    causal or strict block counts half (flash kernels skip fully masked tiles)."""
    from seqplan.schedule import FULL_MASK, Part

    if block is None:
        return 0.0

    def frac(part):
        return 1.0 if part is Part.ALL else 0.5

    return frac(block.q_part) * frac(block.kv_part) * (1.0 if block.mask == FULL_MASK else 0.5)


def ring_work(layout: str, ring: int, causal: bool = True) -> list[float]:
    """Attention work of each ring device over all its steps (units: one full shard block),
    from the schedule both frameworks execute (``device_visits``)."""
    from seqplan.schedule import device_visits, ring_schedule

    schedule = ring_schedule(layout, causal, ring)
    return [sum(_area(visit.block) for visit in device_visits(schedule, r)) for r in range(ring)]


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
                from ..runners.jax_runner import measure_attention_traffic
            else:
                from ..runners.torch_runner import measure_attention_traffic
            got = measure_attention_traffic(case)
            row[f"{framework}_fwd"], row[f"{framework}_bwd"] = float(got.bytes("fwd")), float(got.bytes("bwd"))
            row[f"{framework}_equal"] = got == model
        rows.append(row)
    return rows


def max_errors(case: Case, seed: int = 0) -> dict[str, float]:
    """Max relative error (max |x − ref| / max |ref| over o, lse, dq, dk, dv) vs the float64
    oracle, per framework that ran (``check_case``, CPU)."""
    import numpy as np

    from ..core.inputs import make_inputs, oracle

    x = make_inputs(case, seed)
    ref = oracle(case, x)
    out = {}
    for framework in FRAMEWORKS:
        runner = load_runner(framework)
        side = None if isinstance(runner, Unavailable) else check_case(case, runner, x=x, ref=ref)
        if side is not None and side.results:
            out[framework] = max(float(np.max(np.abs(side.results[t] - ref[t])) / np.max(np.abs(ref[t]))) for t in ref)
    return out


def benchmark_rows() -> list[dict]:
    """Rows of every benchmark result JSON under benchmarks/results/ (empty when none exist),
    packed-document and window rows left out."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")) if RESULTS.exists() else []:
        data = json.loads(path.read_text())
        for row in data.get("rows", []):
            extra = row.get("extra") or {}
            if extra.get("documents", "none") != "none" or extra.get("window"):
                continue  # masked rows count TFLOP/s on the mask area: not comparable by mesh shape
            rows.append({**row, "file": path.name})
    return rows


__all__ = ["LAYOUTS", "factorizations", "ring_work", "imbalance", "bytes_table", "max_errors", "benchmark_rows"]
