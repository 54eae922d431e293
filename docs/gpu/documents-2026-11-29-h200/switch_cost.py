"""Issue 46, one H200, 2026-11-29 (fourth session): what one run-time switch costs a jitted step on
the GPU as its branch count grows — one switch of N branches against a switch of A branches whose
every branch holds a switch of B (A·B = N leaves), the index read from device data, each branch one
small elementwise kernel. Why: one (slots × bound) switch of ~220 branches made the 32k short
mix's backward 0.5 ms slower than the nested 10 × 29 it replaced (pairs.py, run.sh STEPS=ab).

    python docs/gpu/documents-2026-11-29-h200/switch_cost.py --out DIR [--smoke]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax


def flat(n):
    branches = [lambda x, i=i: x * (i + 1.0) for i in range(n)]
    return lambda x, at: x * 2.0 if n == 1 else lax.switch(at[0], branches, x)


def nested(a, b):
    def outer(i):
        inner = [lambda x, j=j: x * (i * b + j + 1.0) for j in range(b)]
        return lambda x, at: lax.switch(at[1], inner, x, )
    branches = [outer(i) for i in range(a)]
    return lambda x, at: lax.switch(at[0], [lambda x, br=br: br(x, at) for br in branches], x)


def timed(fn, x, at, iters, factor: float):
    """The step's first result checked (the branch ``at`` picks multiplies by ``factor``: exact in
    float32), then timed."""
    step = jax.jit(fn)
    start = time.perf_counter()
    got = jax.block_until_ready(step(x, at))
    compile_s = time.perf_counter() - start
    if not bool(jnp.all(got == x * factor)):
        raise AssertionError(f"the switch ran the wrong branch: expected x * {factor}")
    for _ in range(10):
        jax.block_until_ready(step(x, at))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(x, at))
        times.append((time.perf_counter() - start) * 1e6)
    start = time.perf_counter()
    jax.block_until_ready([step(x, at) for _ in range(20)])
    return {"us_median": statistics.median(times), "us_min": min(times), "queued_us_per_call":
            (time.perf_counter() - start) * 1e6 / 20, "compile_s": compile_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    x = jnp.ones((1 << (12 if a.smoke else 20),), jnp.float32)
    iters = 20 if a.smoke else 300
    cases = [("flat", n, None) for n in (1, 2, 10, 40, 100, 220)] + [("nested", 10, 22), ("nested", 10, 4)]
    rows = []
    for kind, n, inner in cases:
        fn = flat(n) if kind == "flat" else nested(n, inner)
        leaves = n if inner is None else n * inner
        at = jnp.asarray([min(3, n - 1), min(2, (inner or 1) - 1)], jnp.int32)  # on the device: read back per call
        i, j = (int(a) for a in at)
        factor = 2.0 if kind == "flat" and n == 1 else (i + 1.0 if inner is None else i * inner + j + 1.0)
        row = {"kind": kind, "branches": n, "inner": inner, "leaves": leaves, "checked": True,
               **timed(fn, x, at, iters, factor)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "switch-cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
