"""What torch's host pays to plan a NEW batch of packed documents: one device's plans on the
all-gather shared-prefix path (``seqplan.shared.shared_extent`` — the check of the promised
prefix — and ``seqplan.shared.split_runs``, both parts' one-call runs), from the batch's laid-out
ids, with nothing cached. Host only: no GPU, no framework.

    python -m benchmarks.plan_time --out DIR [--seq 131072] [--ring 4] [--mixes short,heavy-tail,few-long]

Why: torch remembers each plan by the ids' content (``seqplan.documents.cached_plan``), and the
driver's rows repeat one batch's ids every step, so they time the plan once and the cache after
that. A training step with new ids pays the plan on every rank, while the GPU waits: run this on
the GPU machine's host for its number (docs/decisions.md, "Plans for a new batch"). Rows (median
of ``--iters`` after one warm-up call, in ms) land in ``DIR/plan-time.jsonl`` as each finishes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import MeshSpec, Problem, lay_out, row_problem
from seqplan.shared import ring_shards, shared_extent, split_runs

LAYOUT = "document-hybrid-shared"


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):  # the planners themselves, not torch's cache in front of them: each call a new batch's
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def plan_row(mix: str, seq: int, ring: int, iters: int) -> dict:
    """One mix's row: the shared prefix P, and the plan's cost for device 0 and the last device."""
    spec = MeshSpec(f"ring-agkv-r{ring}")
    problem = row_problem(Problem(seq=seq, heads=1, kv_heads=1, head_dim=8, documents=mix), spec, LAYOUT)
    laid = lay_out(problem, spec, LAYOUT)
    ids_all, index_all = ring_shards(laid.segment_ids, ring), ring_shards(laid.token_index, ring)
    shared = laid.shared["shared_tokens"]

    def plan(device: int):
        return lambda: (shared_extent(ids_all), split_runs(ids_all, index_all, device=device, shared_tokens=shared,
                                                           layout="contiguous"))

    row = {"mix": mix, "seq": seq, "ring": ring, "layout": LAYOUT, "shared_tokens": shared, "iters": iters,
           "extent_ms": _median_ms(lambda: shared_extent(ids_all), iters)}
    row.update({f"plan_ms_device{d}": _median_ms(plan(d), iters) for d in (0, ring - 1)})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--ring", type=int, default=4)
    ap.add_argument("--mixes", default="short,heavy-tail,few-long")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for mix in a.mixes.split(","):
        row = plan_row(mix, a.seq, a.ring, a.iters)
        print(json.dumps(row), flush=True)
        with open(out / "plan-time.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
