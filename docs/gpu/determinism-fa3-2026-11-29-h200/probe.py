"""Is FlashAttention-3's deterministic backward (flash_attn3_jax's FFI ``flash_mha_bwd``, attribute
``deterministic``) bitwise reproducible, and what does it cost — for jax_impl's ``fa3`` (dense)
and ``fa3_varlen`` (packed documents) blocks? Today ``deterministic=True`` in JAX routes dense
blocks to cuDNN and document blocks to the portable kernel, because both FA3 backends always call
the backward with ``deterministic=False`` (docs/decisions.md). Measured before any route changes.

Run with ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` (XLA's own ops deterministic: the scatters
of a document block's dK / dV). The API is called with ``deterministic=False`` so that it does not
refuse the named FA3 backends; the probe sets the kernel's attribute itself, by wrapping
``jax.ffi.ffi_call`` for ``flash_mha_bwd`` while each variant is traced (``kernel_det``).

Per case (causal 32k; documents: the ``short`` and ``few-long`` balance mixes at 32k), 32 / 8
heads, d 128, bf16, one GPU, jax_impl on a one-device mesh, fwd+bwd:
1. check: the variant at 8,192 tokens, 8 / 2 heads, against the portable kernel in float32 on the
   same (upcast) inputs and ids: relative max error of o, dq, dk, dv (≤ 2e-2 passes; a failing
   variant is not repeated or timed);
2. repeats: 5 steps on identical inputs, each of o, dq, dk, dv bitwise equal to the first's;
3. time: median of 10 after 3 warm-up steps (each waited for).

    XLA_FLAGS=--xla_gpu_deterministic_ops=true python docs/gpu/determinism-fa3-2026-11-29-h200/probe.py OUT_DIR
    python docs/gpu/determinism-fa3-2026-11-29-h200/probe.py OUT_DIR --smoke     (CPU: the portable kernel, small)
"""

import contextlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jax_impl
from benchmarks.common import Problem
from benchmarks.masked import jax_ms
from benchmarks.one_gpu_documents import PASS
from parity.probes.determinism import TENSORS


@contextlib.contextmanager
def kernel_det(value: bool | None):
    """While tracing: every ``flash_mha_bwd`` FFI call gets ``deterministic=value`` (None: as is)."""
    original = jax.ffi.ffi_call

    def wrapped(target, *args, **kwargs):
        call = original(target, *args, **kwargs)
        if target != "flash_mha_bwd" or value is None:
            return call
        return lambda *operands, **attrs: call(*operands, **{**attrs, "deterministic": value})

    jax.ffi.ffi_call = wrapped
    try:
        yield
    finally:
        jax.ffi.ffi_call = original


def step_fn(backend: str, det: bool | None, ids):
    """jax_impl fwd+bwd on a one-device mesh, traced (and compiled) now under ``kernel_det(det)``."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("ring",))

    def step(q, k, v, do, ids):
        attention = lambda q, k, v: jax_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=True, layout="contiguous", block_backend=backend, segment_ids=ids,
            deterministic=False)
        o, pull = jax.vjp(attention, q, k, v)
        return (o, *pull(do))

    jitted = jax.jit(step)
    compiled = {}

    def call(q, k, v, do):
        if q.shape not in compiled:  # traced, lowered and compiled under the wrapper, once a shape
            with kernel_det(det):
                lowered = jitted.lower(q, k, v, do, ids)
            text = lowered.as_text()
            call.attributes = {"deterministic_true": text.count("deterministic = true"),
                               "deterministic_false": text.count("deterministic = false")}
            compiled[q.shape] = lowered.compile()
        return compiled[q.shape](q, k, v, do, ids)

    call.attributes = {}
    return call


def inputs(seq, heads, kv_heads, d, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(x, (1, seq, heads, d)).astype(jnp.bfloat16) for x in keys[:2])
    k, v = (jax.random.normal(x, (1, seq, kv_heads, d)).astype(jnp.bfloat16) for x in keys[2:])
    return q, k, v, do


def ids_of(mix: str | None, seq: int):
    return None if mix is None else jnp.asarray(Problem(seq=seq, heads=8, kv_heads=2, documents=mix).segment_ids(),
                                                jnp.int32)


def main(out: Path, smoke: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    seq, check_seq, heads, kv_heads = (256, 128, 4, 2) if smoke else (32768, 8192, 32, 8)
    cases = [("causal", None, ["fa3", "cudnn"]), ("short", "short", ["fa3_varlen"]),
             ("few-long", "few-long", ["fa3_varlen"])]
    if smoke:
        cases = [("causal", None, ["reference"]), ("short", "short", ["reference"])]
    rows = out / "rows.jsonl"
    for case, mix, backends in cases:
        for backend in backends:
            for det in ((None,) if backend in ("cudnn", "reference") else (False, True)):
                row = {"case": case, "backend": backend, "kernel_deterministic": det, "seq": seq}
                try:
                    low = inputs(check_seq, 8, 2, 128, seed=1)
                    small = ids_of(mix, check_seq)
                    got = step_fn(backend, det, small)(*low)
                    want = step_fn("reference", None, small)(*(x.astype(jnp.float32) for x in low))
                    row["errors"] = {t: float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
                                     for t, g, w in zip(TENSORS, got, want)}
                    row["verified"] = all(np.isfinite(e) and e <= PASS for e in row["errors"].values())
                    if row["verified"]:
                        args = inputs(seq, heads, kv_heads, 128, seed=0)
                        fn = step_fn(backend, det, ids_of(mix, seq))
                        runs = [[np.asarray(x.astype(jnp.float32)) for x in fn(*args)] for _ in range(5)]
                        row["bitwise_same"] = {t: all(np.array_equal(r[i], runs[0][i]) for r in runs[1:])
                                               for i, t in enumerate(TENSORS)}
                        row["ms"] = jax_ms(fn, *args, iters=10, warmup=3)
                        row["ffi_attributes"] = fn.attributes  # the kernel's flag as compiled: the wrapper took
                except Exception as err:  # noqa: BLE001 — a variant that fails is a row saying so
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                with rows.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--smoke" in sys.argv[2:])
