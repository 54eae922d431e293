"""Issue 46, one GPU: JAX's whole-sequence document block past 64 documents (runs.VARLEN_RUN_SLOTS).

1. Check: jax_impl on one device (the whole sequence is one causal block, as each device's block
   under Ulysses) with ``fa3_varlen`` at 8192 tokens, 8 / 2 heads, d 128, bf16, for 40, 100, 200
   and 300 documents, against the portable kernel in float32 on the same (upcast) inputs:
   relative max error of o, dq, dk, dv (≤ 2e-2 passes). 100 and 200 take the new 256-slot
   branch; 300 still the portable kernel.
2. Time (only if every check passed): the same call on the balance mixes at ``SEQS`` (default
   32768 and 131072) against flash_attn3_jax's ``flash_mha_varlen`` on the same ids
   (``benchmarks.masked.jax_anchor``), fwd+bwd, 32 / 8 heads.

    JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:. python docs/gpu/documents-2026-11-26-h200x4/2026-11-26-h200-run-slots.py
    SMOKE=1 PYTHONPATH=. python docs/gpu/documents-2026-11-26-h200x4/2026-11-26-h200-run-slots.py    # CPU, reference only
Rows go to $OUT/run-slots.json as they come.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
import jax.numpy as jnp  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
import numpy as np  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
from jax.sharding import Mesh, NamedSharding  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
from jax.sharding import PartitionSpec as P  # noqa: E402 — JAX_PLATFORMS first (SMOKE)

import jax_impl  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
from benchmarks.common import Problem  # noqa: E402 — JAX_PLATFORMS first (SMOKE)
from benchmarks.documents import mix_names  # noqa: E402 — JAX_PLATFORMS first (SMOKE)

OUT = Path(os.environ.get("OUT", "/tmp")) / "run-slots.json"
BACKEND = "reference" if SMOKE else "fa3_varlen"
rows: list[dict] = []


def save(row: dict) -> None:
    rows.append(row)
    OUT.write_text(json.dumps(rows, indent=1))
    print(row, flush=True)


def ids_with(n_docs: int, seq: int, seed: int) -> np.ndarray:
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq), n_docs - 1, replace=False))
    return np.repeat(np.arange(n_docs, dtype=np.int32), np.diff(np.r_[0, cuts, seq]))[None]


mesh = Mesh(np.array(jax.devices()[:1]), ("ring",))
seq_spec = NamedSharding(mesh, P(None, "ring"))


def attention(backend, ids):
    def run(q, k, v, ids):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="contiguous",
                                                    block_backend=backend, segment_ids=ids)
    return run


def step(backend):
    run = attention(backend, None)

    def both(q, k, v, do, ids):
        o, pull = jax.vjp(lambda q, k, v: run(q, k, v, ids), q, k, v)
        return o, *pull(do)
    return jax.jit(both)


def check(n_docs: int, seq: int = 512 if SMOKE else 8192, heads=8, kv_heads=2, d=128) -> bool:
    keys = jax.random.split(jax.random.key(n_docs), 4)
    q, do = (jax.random.normal(x, (1, seq, heads, d), jnp.float32) for x in keys[:2])
    k, v = (jax.random.normal(x, (1, seq, kv_heads, d), jnp.float32) for x in keys[2:])
    ids = jax.device_put(ids_with(n_docs, seq, n_docs), seq_spec)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v, do)]
    got = step(BACKEND)(*low, ids)
    want = step("reference")(*[x.astype(jnp.float32) for x in low], ids)
    errors = {name: float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
              for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    passed = all(np.isfinite(e) and e <= 2e-2 for e in errors.values())
    save({"kind": "check", "documents": n_docs, "seq": seq, "backend": BACKEND, "errors": errors, "passed": passed})
    return passed


def timed(mix: str, seq: int, iters: int = 5) -> None:
    from benchmarks.masked import jax_anchor

    problem = Problem(seq=seq, heads=32, kv_heads=8, documents=mix)
    ids_np = problem.segment_ids()
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(x, (1, seq, 32, 128), jnp.bfloat16) for x in keys[:2])
    k, v = (jax.random.normal(x, (1, seq, 8, 128), jnp.bfloat16) for x in keys[2:])
    ids = jax.device_put(ids_np, seq_spec)
    fn = step("auto")
    began = time.perf_counter()
    jax.block_until_ready(fn(q, k, v, do, ids))
    compile_s = time.perf_counter() - began
    for _ in range(2):
        jax.block_until_ready(fn(q, k, v, do, ids))
    times = []
    for _ in range(iters):
        began = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, do, ids))
        times.append(1e3 * (time.perf_counter() - began))
    ms = float(np.median(times))
    anchor = jax_anchor(seq, 32, 8, 128, problem=problem)
    starts = np.flatnonzero(np.r_[True, ids_np[0, 1:] != ids_np[0, :-1]])
    save({"kind": "time", "mix": mix, "seq": seq, "documents": len(starts), "jax_impl_ms": ms,
          "compile_s": compile_s, "jax_impl_tflops": problem.flops(False) / ms / 1e9,
          "anchor_ms": anchor["fwd_bwd_ms"], "anchor_verified": anchor["verified"],
          "anchor_tflops": anchor["tflops_fwd_bwd"], "ratio": anchor["fwd_bwd_ms"] / ms})


if __name__ == "__main__":
    ok = all([check(n) for n in ((40, 100) if SMOKE else (40, 100, 200, 300))])
    if ok and not SMOKE:
        for seq in (int(s) for s in os.environ.get("SEQS", "32768,131072").split(",")):
            for mix in mix_names():
                try:
                    timed(mix, seq)
                except Exception as err:  # noqa: BLE001 — one row failing keeps the others
                    save({"kind": "time", "mix": mix, "seq": seq, "error": f"{type(err).__name__}: {err}"[:300]})
