"""Where JAX's one-device document step loses to FlashAttention-3's varlen kernel (issue 46, item 4
and its one-GPU target): 32k tokens, 32 / 8 heads, d 128, bf16, causal, fwd+bwd, the ``mix`` and
``heavy-tail`` ids. Per mix, in one process on one GPU:

- ``check``: the library's path (``sequence_parallel_attention`` on a one-device mesh, ``auto``) at
  4096 tokens of the same pattern against the float32 portable kernel (o, dq, dk, dv);
- ``anchor``: ``flash_mha_varlen`` with the exact offsets and longest document (its own vjp);
- ``library``: the library's path at 32k (forward, forward + backward);
- the backward taken apart on the same block: FA3's varlen backward bound directly (``varlen_bwd``)
  on the exact runs, on the library's run slots with the exact bound, on the slots with the
  ladder's bound — and the run-list planning alone (what ``dispatch`` computes per call);
- an XLA profile (``jax.profiler``) of three library steps and three anchor steps: GPU time per
  kernel name, written as it comes.

``SEQ`` (default 32768) and ``MIXES`` (default ``mix,heavy-tail``) pick the problems;
``PROFILE=0`` and ``PARTS=0`` leave out the profiles and the backward taken apart.
``BASE=dir`` also times the library path of another checkout (``dir`` first on the path) in a
child process, so before / after come from one machine. Library rows carry the step's
temporary buffers as XLA plans them (``step_temp_gib``; added for the lse-buffer change). Rows go to $OUT/jax-docs-1gpu.jsonl as
they are measured.

    python docs/gpu/jax-documents-2026-11-26-h100/2026-11-26-jax-docs-1gpu.py [--smoke] [--library-only]"""

import dataclasses
import glob
import gzip
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

from parity.core.devices import configure_jax_devices

smoke = "--smoke" in sys.argv
configure_jax_devices("cpu" if smoke else "gpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_impl  # noqa: E402
from benchmarks.common import Problem  # noqa: E402
from benchmarks.masked import jax_ms  # noqa: E402
from jax_impl.kernels import runs as runs_mod  # noqa: E402
from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd  # noqa: E402
from seqplan.schedule import BlockMask, MaskKind  # noqa: E402

T, CHECK_T, H, HK, D = (1024, 256, 4, 2, 16) if smoke else (int(os.environ.get("SEQ", 32768)), 4096, 32, 8, 128)
DT = jnp.float16 if smoke else jnp.bfloat16
MIXES = tuple(os.environ.get("MIXES", "mix,heavy-tail").split(","))
OUT = os.environ.get("OUT", "/tmp")
gpu = not smoke
if os.environ.get("EMULATE") == "1":  # the CPU smoke of the GPU branch: FA3's varlen ops emulated
    from pytest import MonkeyPatch

    sys.path.insert(0, "tests")
    import fa3_ops

    fa3_ops.emulate(MonkeyPatch())
    gpu = True
SCALE = D ** -0.5
MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ring",))


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "jax-docs-1gpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def ms(fn, *args) -> float:
    """Median wall ms of ten calls after two warm-ups (``benchmarks.masked.jax_ms``)."""
    return jax_ms(fn, *args, iters=10, warmup=2)


def inputs(t: int):
    keys = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(k, (1, t, H, D)).astype(DT) for k in keys[:2])
    k, v = (jax.random.normal(kk, (1, t, HK, D)).astype(DT) for kk in keys[2:])
    return q, k, v, do


def library_programs():
    """(forward, forward + backward) of the library's one-device document path; ids an argument."""
    attention = lambda q, k, v, ids: jax_impl.sequence_parallel_attention(
        q, k, v, MESH, causal=True, layout="contiguous", segment_ids=ids, block_backend="auto" if gpu else "reference")

    def step(q, k, v, do, ids):
        o, pull = jax.vjp(lambda q, k, v: attention(q, k, v, ids), q, k, v)
        return o, pull(do)

    return jax.jit(attention), jax.jit(step)


def check(mix: str) -> dict:
    """The library's path at CHECK_T tokens against the float32 portable kernel."""
    ids = jnp.asarray(Problem(seq=CHECK_T, documents=mix).segment_ids())
    q, k, v, do = inputs(CHECK_T)
    _, step = library_programs()
    o, (dq, dk, dv) = step(q, k, v, do, ids)
    mask, seg = BlockMask(MaskKind.CAUSAL, documents=True), (ids, ids)
    o_r, lse_r = reference_block_fwd(q, k, v, mask, SCALE, segments=seg)
    grads_r = reference_block_bwd(do, q, k, v, o_r.astype(DT), lse_r, mask, SCALE, segments=seg)
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    errors = {"o": rel(o, o_r), **{n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_r)}}
    return {"errors": errors, "verified": all(e <= 2e-2 for e in errors.values())}


def exact_cu(ids: np.ndarray):
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    lengths = np.diff(np.r_[starts, len(ids)])
    return jnp.asarray(np.r_[starts, len(ids)].astype(np.int32)), int(lengths.max()), len(starts)


def anchor(ids: np.ndarray, q, k, v, do) -> dict:
    from flash_attn3_jax import flash_mha_varlen

    cu, longest, _ = exact_cu(ids)
    fwd = jax.jit(lambda q, k, v: flash_mha_varlen(q[0], k[0], v[0], cu, cu, max_seqlen_q=longest,
                                                   max_seqlen_k=longest, softmax_scale=SCALE, is_causal=True))

    def step(q, k, v, do):
        o, pull = jax.vjp(fwd, q, k, v)
        return o, pull(do[0])

    return {"fwd_ms": ms(fwd, q, k, v), "fwd_bwd_ms": ms(jax.jit(step), q, k, v, do)}, jax.jit(step)


def backward_parts(ids: np.ndarray, q, k, v, do) -> dict:
    """FA3's varlen backward on this block bound directly, on three run lists, and the planning."""
    from jax_impl.kernels.fa3_varlen import varlen_bwd, varlen_fwd

    seg = jnp.asarray(ids[None])
    cu, longest, n_docs = exact_cu(ids)
    slots = min(m for m in runs_mod.VARLEN_RUN_SLOTS if m >= n_docs)
    bound = min(b for b in runs_mod.length_ladder(T) if b >= longest)
    planned = jax.jit(lambda s: runs_mod.varlen_offsets(s, s, True, slots))(seg)
    exact = dataclasses.replace(planned, cu_q=cu, cu_k=cu)  # the same block as the anchor's 10 sequences
    fwd = jax.jit(lambda q, k, v, r: varlen_fwd(q, k, v, True, SCALE, r))
    o, lse = fwd(q, k, v, planned)
    row = {"documents": n_docs, "slots": slots, "longest": longest, "ladder_bound": bound,
           "fwd_slots_ms": ms(fwd, q, k, v, planned), "fwd_exact_ms": ms(fwd, q, k, v, exact)}
    bwd = jax.jit(lambda do, q, k, v, o, lse, r: varlen_bwd(do, q, k, v, o, lse, True, SCALE, r))
    for name, r in (("bwd_exact_runs_exact_bound_ms", exact.bounded(longest, longest)),
                    ("bwd_slots_exact_bound_ms", planned.bounded(longest, longest)),
                    ("bwd_slots_ladder_bound_ms", planned.bounded(bound, bound)),
                    ("bwd_slots_no_bound_ms", planned)):
        row[name] = ms(bwd, do, q, k, v, o, lse, r)
    pow2 = 1 << (n_docs - 1).bit_length()  # a finer slot ladder's size for this block
    if pow2 != slots:
        finer = jax.jit(lambda s: runs_mod.varlen_offsets(s, s, True, pow2))(seg)
        row["pow2_slots"] = pow2
        row["fwd_pow2_slots_ms"] = ms(fwd, q, k, v, finer)
        row["bwd_pow2_slots_ladder_bound_ms"] = ms(bwd, do, q, k, v, o, lse, finer.bounded(bound, bound))
    expressible = jax.jit(lambda s: (runs_mod.expressible(s, s, True), runs_mod.varlen_offsets(s, s, True, slots)))
    row["plan_ms"] = ms(expressible, seg)
    return row


def kernel_times(trace_dir: str) -> dict:
    """GPU time per kernel name (ms, summed over the traced steps) from the profile's trace."""
    found = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        return {"error": f"no trace under {trace_dir}: {sorted(glob.glob(trace_dir + '/**', recursive=True))[:10]}"}
    with gzip.open(found[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and "/device:GPU" in names.get(e.get("pid"), ""):
            totals[e["name"][:90]] += e.get("dur", 0) / 1e3
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:25]
    return {"total_ms": round(sum(totals.values()), 3), "kernels": {n: round(t, 3) for n, t in top}}


def profile(name: str, fn, *args) -> dict:
    trace_dir = os.path.join("/tmp/jaxprof", name)
    jax.block_until_ready(fn(*args))
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(3):
                jax.block_until_ready(fn(*args))
        return kernel_times(trace_dir)
    except Exception as err:  # noqa: BLE001 — a profiler that cannot start is a row, not a crash
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def library_row(mix: str, tag: str) -> None:
    problem = Problem(seq=T, documents=mix)
    ids = problem.segment_ids()
    q, k, v, do = inputs(T)
    fwd, step = library_programs()
    seg = jnp.asarray(ids)
    began = time.perf_counter()
    o, grads = jax.block_until_ready(step(q, k, v, do, seg))  # the compilation (and one step)
    compile_s = time.perf_counter() - began
    # a digest of the outputs, to compare two checkouts' paths (equal kernels and runs: equal sums)
    digest = [float(jnp.abs(x.astype(jnp.float32)).sum()) for x in (o, *grads)]
    fwd_ms, step_ms = ms(fwd, q, k, v, seg), ms(step, q, k, v, do, seg)
    memory = step.lower(q, k, v, do, seg).compile().memory_analysis()  # XLA's plan for the step's buffers
    temp_gb = None if memory is None else round(memory.temp_size_in_bytes / 2**30, 3)
    emit({"step_temp_gib": temp_gb,
          "part": "library", "code": tag, "module": jax_impl.__file__, "mix": mix, "seq": T, "fwd_ms": fwd_ms,
          "fwd_bwd_ms": step_ms, "tflops_fwd_bwd": problem.flops(False) / step_ms / 1e9,
          "step_compile_s": round(compile_s, 2), "digest_o_dq_dk_dv": digest})
    if "--library-only" not in sys.argv and gpu and not smoke and os.environ.get("PROFILE", "1") == "1":
        emit({"part": "profile", "code": tag, "mix": mix, "what": "library", **profile(f"lib-{tag}-{mix}", step, q, k,
                                                                                          v, do, seg)})


def main() -> None:
    tag = os.environ.get("CODE", "head")
    if "--library-only" in sys.argv:
        for mix in MIXES:
            library_row(mix, tag)
        return
    emit({"part": "machine", "device": str(jax.devices()[0].device_kind), "jax": jax.__version__})
    for mix in MIXES:
        emit({"part": "check", "mix": mix, **check(mix)})
        library_row(mix, tag)
        if not gpu:
            continue
        ids = Problem(seq=T, documents=mix).segment_ids()[0]
        q, k, v, do = inputs(T)
        problem = Problem(seq=T, documents=mix)
        if not smoke:
            row, step = anchor(ids, q, k, v, do)
            emit({"part": "anchor", "mix": mix, "seq": T, **row,
                  "tflops_fwd_bwd": problem.flops(False) / row["fwd_bwd_ms"] / 1e9})
            if os.environ.get("PROFILE", "1") == "1":
                emit({"part": "profile", "mix": mix, "what": "anchor", **profile(f"anchor-{mix}", step, q, k, v, do)})
        if os.environ.get("PARTS", "1") == "1":
            emit({"part": "backward_parts", "mix": mix, "seq": T, **backward_parts(ids, q, k, v, do)})
    base = os.environ.get("BASE")
    if base:  # the other checkout's library path, same machine, a child process
        env = {**os.environ, "PYTHONPATH": f"{base}:{os.environ.get('PYTHONPATH', '')}", "CODE": "base"}
        subprocess.run([sys.executable, __file__, "--library-only", *(["--smoke"] if smoke else [])], env=env,
                       check=False)


if __name__ == "__main__":
    main()
