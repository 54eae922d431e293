"""Issue 46, one H200, 2026-11-29 (fifth session): ``benchmarks/mesh_profile_jax.py`` (verify on the
mesh, time, trace) on a variant of the library, to see how XLA's per-execution host work scales
with the program's kernel call sites. ``VARIANT``:

- ``base``: the library as committed.
- ``coarse4``: a causal block's backward length ladder cut to n/8, n/4, n/2, n (4 bounds a slot
  count instead of 29 at 32k: 40 backward FFI call sites instead of 290) — a diagnostic of the
  host's cost per call site, not a proposal (the kernel then launches idle tiles).
- ``noprune``: the library with every bound compiled at every slot count, as before this session
  (``runs.length_choice`` ignoring its ``least``): 290 backward call sites at 32k against 222.
- ``anchor``: no library: flash_attn3_jax's ``flash_mha_varlen`` fwd+bwd on the same ids, checked
  (``benchmarks.masked.jax_anchor``: against the portable kernel at 4,096 tokens), timed as the
  profile times a path (waited, queued) and traced the same way, into TRACE_DIR.

    VARIANT=coarse4 MIXES=short PATHS=ring-r1:contiguous SEQ=32768 OUT=DIR python .../hostvar.py
    VARIANT=noprune TARGET=docs python .../hostvar.py --out DIR --mixes short   (one_gpu_documents instead)
"""

import json
import os
import sys
import time

VARIANT = os.environ.get("VARIANT", "base")


def anchor(out_dir: str, seq: int, mix: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flash_attn3_jax import flash_mha_varlen

    from benchmarks.common import Problem
    from benchmarks.masked import jax_anchor
    from benchmarks.mesh_profile_jax import step_times

    heads, kv_heads, d = 32, 8, 128
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents=mix)
    checked = jax_anchor(seq, heads, kv_heads, d, problem=problem)  # checks at 4096, then times
    ids = problem.segment_ids()[0]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    cu = jnp.asarray(np.r_[starts, seq].astype(np.int32))
    longest = int(np.diff(np.r_[starts, seq]).max())
    keys = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(kk, (seq, heads, d)).astype(jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (seq, kv_heads, d)).astype(jnp.bfloat16) for kk in keys[2:])
    fwd = lambda q, k, v: flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                           softmax_scale=d**-0.5, is_causal=True)

    @jax.jit
    def both(q, k, v, do):
        o, pull = jax.vjp(fwd, q, k, v)
        return o, pull(do)

    args = (q, k, v, do)
    times = step_times(both, args, warmup=3)  # as ran on 11-29 but for its dispatch field, measured since
    trace_dir = f"/tmp/jaxprof-4gpu/{mix}-anchor"
    with jax.profiler.trace(trace_dir):
        for _ in range(3):
            jax.block_until_ready(both(*args))
            time.sleep(0.03)
    row = {"mix": mix, "seq": seq, "anchor": checked, **times, "trace_dir": trace_dir}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{mix}-anchor.json"), "w") as f:
        json.dump(row, f, indent=1, default=str)
    print("anchor", mix, json.dumps({k: row[k] for k in ("wall_ms_median", "queued_ms_per_step")}),
          "verified", checked.get("verified"), flush=True)


if VARIANT == "anchor":
    anchor(os.environ.get("OUT", "/tmp"), int(os.environ.get("SEQ", "32768")), os.environ.get("MIXES", "short"))
    sys.exit(0)
if VARIANT == "coarse4":
    from jax_impl.kernels import runs

    runs.causal_length_ladder = lambda n: tuple(sorted({max(min(n, 256), n * e // 8) for e in (1, 2, 4, 8)}))
elif VARIANT == "noprune":
    from jax_impl.kernels import runs

    whole = runs.length_choice
    runs.length_choice = lambda ladder, t, s, longest, least=1: whole(ladder, t, s, longest)
elif VARIANT != "base":
    raise SystemExit(f"unknown VARIANT {VARIANT}")
print("variant", VARIANT, flush=True)
if os.environ.get("TARGET") == "docs":
    from benchmarks import one_gpu_documents  # after the patch above

    one_gpu_documents.main(sys.argv[1:])
else:
    from benchmarks import mesh_profile_jax  # after the patch above

    mesh_profile_jax.main()
