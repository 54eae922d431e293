"""How large JAX's packed-documents programs are, on the CPU: one attention call's forward and
backward over simulated devices on the FA3 varlen path, FlashAttention-3's FFI calls stood in for
by one opaque op each (a host callback, as the custom call is one op on the GPU) and the run lists'
searches unrolled as on the GPU — so the program is the GPU's minus its kernels: the run lists,
the packing, the switches, the fallbacks.

    python -m benchmarks.program_size --out DIR [--seq 16384] [--ring 4] [--mix short] [--paths ...]

Why: the 2-GPU whole-model step with segment ids compiled in 242 s against 5.5 s without
(12,375 fusions against 379; 2x H200, 2026-11-28), and the all-gather hybrid's rows took 25-40 s
each — device time spent compiling. A compile's cost follows the program's fusions, and those
can be counted here, in seconds, before a GPU is spent on them. Nothing is run (the stand-in
kernels return zeros; nothing here is a result to check): each row is trace + lower seconds,
CPU compile seconds, StableHLO lines and the optimized program's size
(``jax_compile_probe.program_size``), and how many run-time switches a step runs at most
(:func:`run_time_switches`: each one a wait for the GPU). Paths, each causal with the mix's ids (``balance.MIXES``):

- ``allgather-hybrid``: all-gather KV on the per-document hybrid by token index, the one call;
- ``allgather-hybrid-shared``: the same with only the shared prefixes gathered (two parts);
- ``ring-zigzag``: the ring on the static zigzag with the ids (the whole-model twin's attention);
- ``ring-document-zigzag``: the ring on the per-document zigzag by token index.

Rows land in ``DIR/program-size.jsonl`` as each finishes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

PATHS = ("allgather-hybrid", "allgather-hybrid-shared", "ring-zigzag", "ring-document-zigzag")


def gpu_program():
    """Make the CPU trace the GPU's program: flash_attn3_jax's FFI targets stood in for —
    ``jax.ffi.ffi_call`` returns one host callback of the declared result types (zeros), taking
    every operand: one op the compiler cannot see into, as the custom call is — and the run
    lists' searches traced the GPU's way (``runs.search_method``: unrolled; the CPU keeps a while
    loop). Returns a function that undoes both."""
    import jax
    import numpy as np

    from jax_impl.kernels import runs

    search = runs.search_method
    runs.search_method = lambda: "scan_unrolled"
    saved = {name: sys.modules.get(name) for name in ("flash_attn3_jax", "flash_attn3_jax.flash_hlo")}
    package = types.ModuleType("flash_attn3_jax")
    package.flash_hlo = types.ModuleType("flash_attn3_jax.flash_hlo")
    sys.modules.update({"flash_attn3_jax": package, "flash_attn3_jax.flash_hlo": package.flash_hlo})
    real = jax.ffi.ffi_call

    def ffi_call(name, result_types, **_):
        zeros = lambda *_: tuple(np.zeros(r.shape, r.dtype) for r in result_types)
        return lambda *operands, **attrs: jax.pure_callback(zeros, tuple(result_types), *operands)

    jax.ffi.ffi_call = ffi_call

    def undo():
        jax.ffi.ffi_call, runs.search_method = real, search
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    return undo


def run_time_switches(jaxpr) -> int:
    """The most ``lax.switch`` / ``lax.cond`` one execution of ``jaxpr`` (a closed or open jaxpr)
    runs: switches in sequence add up, a switch's branches count their worst, a ``scan`` body
    counts once per iteration (the ring's steps), and any other body (``jit``, ``shard_map``,
    ``custom_vjp``) counts once. A ``while`` loop's trip count is not static: a program with one
    is refused (ValueError). Each switch is an index that XLA copies to the host before it
    launches the branch (unless its conditionals run on the device), so each one is a wait for the
    GPU in every step (docs/decisions.md, "A device's own document block: one run-time switch a
    pass")."""
    total = 0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "while":
            raise ValueError("a while loop's trip count is not static: its switches cannot be counted")
        inner = [run_time_switches(p) for v in eqn.params.values() for p in (v if isinstance(v, (tuple, list)) else (v,))
                 if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]  # (closed) sub-jaxprs
        if name == "cond":
            total += 1 + max(inner, default=0)
        else:
            total += sum(inner) * (eqn.params["length"] if name == "scan" else 1)
    return total


def path_inputs(path: str, ids, ring: int):
    """(keyword arguments of ``sequence_parallel_attention``, its segment ids and token indices in
    layout order) for ``path`` on original-order ``ids`` [b, t]."""
    import numpy as np

    from seqplan.layouts import document_layout, hybrid_layout, layout_permutation, ring_shards
    from seqplan.shared import shared_bucket, shared_extent

    if path == "ring-zigzag":
        perm = np.broadcast_to(layout_permutation(ids.shape[1], "zigzag", ring), ids.shape)
        return dict(kv_exchange="ring", layout="zigzag"), np.take_along_axis(ids, perm, 1), None
    layout = document_layout(ids, ring) if path == "ring-document-zigzag" else hybrid_layout(ids, ring)
    laid = np.take_along_axis(ids, layout.perm, 1)
    kw = dict(kv_exchange="ring" if path.startswith("ring") else "allgather", layout="contiguous")
    if path == "allgather-hybrid-shared":
        kw["shared_tokens"] = shared_bucket(shared_extent(ring_shards(laid, ring)), ids.shape[1] // ring)
    return kw, laid, layout.token_index


def measure(path: str, seq: int, ring: int, mix: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> dict:
    """One row: ``path``'s forward + backward (``jax.grad`` of the output's sum) lowered and compiled."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.jax_compile_probe import program_size
    from jax_impl.api import sequence_parallel_attention
    from parity.probes.balance import MIXES
    from seqplan.layouts import pad_documents

    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    (pattern,) = [m for m in MIXES if m.name == mix] or [None]
    if pattern is None:
        raise ValueError(f"mix must be one of {[m.name for m in MIXES]}, got {mix!r}")
    ids = pad_documents(np.asarray(pattern.segment_ids(seq))[None], ring)[0][:, :seq].astype(np.int32)
    kw, laid, index = path_inputs(path, ids, ring)
    if ring > len(jax.devices()):
        raise ValueError(f"ring={ring} needs {ring} devices, JAX has {len(jax.devices())}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ring]), ("ring",))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, seq, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:])

    def loss(q, k, v, laid, index):
        o = sequence_parallel_attention(q, k, v, mesh, causal=True, block_backend="fa3_varlen", segment_ids=laid,
                                        token_index=index, **kw)
        return jnp.sum(o.astype(jnp.float32))

    args = (q, k, v, jnp.asarray(laid), None if index is None else jnp.asarray(index, jnp.int32))
    switches = run_time_switches(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {"path": path, "seq": seq, "ring": ring, "mix": mix, "shared_tokens": kw.get("shared_tokens"),
            "trace_lower_s": round(traced - start, 2), "compile_s": round(done - traced, 2),
            "stablehlo_lines": lowered.as_text().count("\n"), "run_time_switches": switches,
            **program_size(compiled.as_text()),
            "jax": jax.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.program_size", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, default=16384, help="tokens (one row; the short mix's shared prefix is a quarter "
                    "of the shard at 16k over 4 devices, the whole shard below)")
    ap.add_argument("--ring", type=int, default=4, help="simulated CPU devices on the ring axis")
    ap.add_argument("--mix", default="short", help="a parity.probes.balance mix")
    ap.add_argument("--paths", default=",".join(PATHS))
    a = ap.parse_args(argv)
    from parity.core.devices import configure_jax_devices

    configure_jax_devices("cpu")  # 8 simulated devices, before JAX starts (a test session has them already)
    a.out.mkdir(parents=True, exist_ok=True)
    undo = gpu_program()
    try:
        for path in a.paths.split(","):
            row = measure(path, a.seq, a.ring, a.mix)
            print(json.dumps(row), flush=True)
            with (a.out / "program-size.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        undo()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
