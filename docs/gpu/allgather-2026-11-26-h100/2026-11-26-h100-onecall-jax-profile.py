"""Where a device's time goes in JAX's all-gather-KV one varlen call (issue 36): per balance mix
at 128k over a replayed ring of 8, device 0's replay programs (fwd, bwd) against their parts
timed alone — the traced plan (``runs.prefix_runs``), the key gather, FA3's varlen forward and
backward on the plan, the dK scatter (the sentinel row, and dropped out-of-range indices). The
bare forward's o is compared with the replay's (same kernel, same plan); the replay's own rows
were verified by the benchmark.
    python docs/gpu/allgather-2026-11-26-h100/2026-11-26-h100-onecall-jax-profile.py [--smoke]"""
# ruff: noqa: B023  (every lambda here is timed where it is made)

import dataclasses
import json
import os
import sys
import time

import numpy as np

from parity.core.devices import configure_jax_devices

configure_jax_devices("gpu" if "--smoke" not in sys.argv else "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.documents import fit_documents, layout_keywords  # noqa: E402
from jax_impl import replay  # noqa: E402
from jax_impl.kernels import runs  # noqa: E402
from parity.probes.balance import MIXES  # noqa: E402
from seqplan.strategy import Strategy  # noqa: E402

smoke = "--smoke" in sys.argv
T, R, H, HK, D = (2048, 8, 4, 2, 16) if smoke else (131072, 8, 32, 8, 128)
t = T // R
gpu = not smoke
if os.environ.get("EMULATE") == "1":  # the CPU smoke of the GPU branch: FA3's varlen ops emulated (tests/fa3_ops.py)
    from pytest import MonkeyPatch

    sys.path.insert(0, "tests")
    import fa3_ops

    fa3_ops.emulate(MonkeyPatch())
    gpu = True
backend = "fa3_varlen" if gpu else "reference"
out = {}


def ms(fn, *args, iters=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        s = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - s))
    return float(np.median(times))


for mix in [m for m in MIXES if m.name in ("short", "heavy-tail")]:
    ids = fit_documents(mix.segment_ids(T)[None].astype(np.int32), R)
    lk = layout_keywords(ids, R, "document-hybrid")
    seg, index = jnp.asarray(lk["segment_ids"]), jnp.asarray(lk["token_index"], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.bfloat16 if not smoke else jnp.float16
    q, do = (jax.random.normal(k_, (1, T, H, D), dt) for k_ in keys[:2])
    k, v = (jax.random.normal(k_, (1, T, HK, D), dt) for k_ in keys[2:])
    kw = dict(strategy=Strategy(ring=R, kv_exchange="allgather"), causal=True, layout="contiguous",
              block_backend=backend)
    row = {}
    fwd = jax.jit(lambda seg, idx, q, k, v: replay.device_forward(0, q, k, v, segment_ids=seg, token_index=idx, **kw))
    o_d, lse_d = fwd(seg, index, q, k, v)
    o = jnp.zeros_like(q).at[:, :t].set(o_d)
    lse = jnp.zeros((1, H, T), jnp.float32).at[:, :, :t].set(lse_d)
    bwd = jax.jit(lambda seg, idx, q, k, v, o, lse, do: replay.device_backward(
        0, q, k, v, o, lse, do, segment_ids=seg, token_index=idx, **kw)[0])
    row["replay_fwd_ms"] = ms(fwd, seg, index, q, k, v)
    row["replay_bwd_ms"] = ms(bwd, seg, index, q, k, v, o, lse, do)
    cap = runs.PREFIX_KEY_FACTOR * T
    plan_fn = jax.jit(lambda seg, idx: runs.prefix_runs(seg[:, :t], seg, idx[:, :t], idx, 64, cap))
    row["plan_ms"] = ms(plan_fn, seg, index)
    plan = plan_fn(seg, index)
    row["plan_ok"], row["runs_keys"] = bool(plan.ok), int(plan.cu_k[-1])
    if gpu:
        from jax_impl.kernels.fa3_varlen import varlen_bwd, varlen_fwd

        # the run list as a pytree (runs.VarlenRuns: identity and the bounds static, the rest arrays)
        arrays = dataclasses.replace(plan, identity=False)
        scale = D ** -0.5
        # the kernels' gather of the keys (fa3_varlen's packing: index b·s, out of range, reads zero)
        gather = jax.jit(lambda k, a: k.reshape(-1, HK, D).at[a.kv_index].get(mode="fill", fill_value=0))
        row["gather_ms"] = ms(gather, k, arrays)
        fa_fwd = jax.jit(lambda q, k, v, a: varlen_fwd(q[:, :t], k, v, True, scale, a))
        o_bare, _ = fa_fwd(q, k, v, arrays)
        row["bare_o_vs_replay"] = float(jnp.linalg.norm(o_bare.astype(jnp.float32) - o_d.astype(jnp.float32))
                                        / jnp.linalg.norm(o_d.astype(jnp.float32)))
        row["bare_fwd_ms"] = ms(fa_fwd, q, k, v, arrays)
        longest = int(plan.longest)
        bound = min(b_ for b_ in runs.index_length_ladder(T) if b_ >= longest)
        fa_bwd = jax.jit(lambda do, q, k, v, o, lse, a: varlen_bwd(
            do[:, :t], q[:, :t], k, v, o[:, :t], lse[:, :, :t], True, scale,
            a.bounded(min(bound, t), bound)))
        row["bare_bwd_ms"], row["bwd_bound"] = ms(fa_bwd, do, q, k, v, o, lse, arrays), bound
        g = jnp.ones((cap, HK, D), dt)
        sentinel = jax.jit(lambda i, g: jnp.zeros((T + 1, HK, D), jnp.float32).at[i].add(g.astype(jnp.float32)))
        dropped = jax.jit(lambda i, g: jnp.zeros((T, HK, D), jnp.float32).at[jnp.where(i < T, i, T + 7)].add(
            g.astype(jnp.float32), mode="drop"))
        row["scatter_sentinel_ms"] = ms(sentinel, plan.kv_index, g)
        row["scatter_dropped_ms"] = ms(dropped, plan.kv_index, g)
    out[mix.name] = row
    print(mix.name, row, flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "onecall-jax-profile.json"), "w") as f:
    json.dump(out, f, indent=1)
