"""Where the JAX document block's time goes (issue 35): FA3 varlen with the exact run list against
the static-shape run list the traced adapter must use (zero-length padding sequences, max_seqlen
= the block length), the run list's own cost, and the adapter end to end — forward and backward,
one causal diagonal block of packed documents.

    python -m benchmarks.varlen_probe [--seq 32768]     (a Hopper GPU, flash_attn3_jax 0.2.3)

Every variant's o is checked against the exact call's (the same kernel: must agree to bf16
rounding) before it is timed; a row says ``verified``.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.masked import jax_ms


def _ms(fn, *args) -> float:
    return jax_ms(fn, *args, iters=20, warmup=3)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.varlen_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from flash_attn3_jax.varlen_fwd import flash_mha_varlen_fwd

    from benchmarks.common import Problem
    from jax_impl.kernels import fa3_varlen
    from jax_impl.kernels.runs import varlen_offsets
    from seqplan.schedule import BlockMask, MaskKind

    t, h, hk, d = a.seq, 32, 8, 128
    ids = Problem(seq=t, heads=h, kv_heads=hk, head_dim=d, documents="mix").segment_ids()
    starts = np.flatnonzero(np.r_[True, ids[0, 1:] != ids[0, :-1]])
    n = len(starts)
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(kk, (1, t, h, d)).astype(jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, t, hk, d)).astype(jnp.bfloat16) for kk in keys[2:])
    scale = d**-0.5

    def cu_of(slots):
        cu = np.r_[starts, np.full(slots - n, t), t].astype(np.int32)
        return jnp.asarray(cu)

    longest = int(np.diff(np.r_[starts, t]).max())
    variants = {f"exact ({n} seqs, max {longest})": (cu_of(n), longest),
                f"{n} seqs, max_seqlen = t": (cu_of(n), t),
                "16 slots, max_seqlen = t": (cu_of(16), t),
                "64 slots, max_seqlen = t": (cu_of(64), t),
                "64 slots, max exact": (cu_of(64), longest)}
    base = None
    print(f"{t} tokens, {n} documents, h {h}/{hk}, d {d}", flush=True)
    for name, (cu, mx) in variants.items():
        fwd = jax.jit(lambda q, k, v, cu=cu, mx=mx: flash_mha_varlen_fwd(q[0], k[0], v[0], cu, cu, max_seqlen_q=mx,
                                                                          max_seqlen_k=mx, softmax_scale=scale,
                                                                          is_causal=True))
        o = np.asarray(fwd(q, k, v)[0], np.float32)
        base = o if base is None else base
        ok = float(np.abs(o - base).max()) <= 1e-2
        print(f"library varlen fwd, {name}: {_ms(fwd, q, k, v):.3f} ms verified={ok}", flush=True)

    seg = (jnp.asarray(ids), jnp.asarray(ids))
    runs_only = jax.jit(lambda a, b: varlen_offsets(a, b, True).cu_q)
    print(f"run list (varlen_offsets, traced): {_ms(runs_only, *seg):.3f} ms", flush=True)
    mask = BlockMask(MaskKind.CAUSAL, documents=True)
    fwd = jax.jit(lambda q, k, v: fa3_varlen.fa3_varlen_block_fwd(q, k, v, mask, scale, segments=seg))
    o, lse = fwd(q, k, v)
    ok = float(np.abs(np.asarray(o, np.float32)[0] - base).max()) <= 1e-2
    print(f"adapter fwd (block interface, lax.cond): {_ms(fwd, q, k, v):.3f} ms verified={ok}", flush=True)
    runs = varlen_offsets(*seg, True)
    direct = jax.jit(lambda q, k, v: fa3_varlen.varlen_fwd(q, k, v, True, scale, runs))
    print(f"adapter fwd without the cond: {_ms(direct, q, k, v):.3f} ms", flush=True)
    ob = o.astype(jnp.bfloat16)
    bwd = jax.jit(lambda do, q, k, v, o, lse: fa3_varlen.fa3_varlen_block_bwd(do, q, k, v, o, lse, mask, scale,
                                                                              segments=seg))
    print(f"adapter bwd (block interface, lax.cond): {_ms(bwd, do, q, k, v, ob, lse):.3f} ms", flush=True)
    bwd_direct = jax.jit(lambda do, q, k, v, o, lse: fa3_varlen.varlen_bwd(do, q, k, v, o, lse, True, scale, runs))
    print(f"adapter bwd without the cond: {_ms(bwd_direct, do, q, k, v, ob, lse):.3f} ms", flush=True)
    exact = {**runs, "cu_q": cu_of(n), "cu_k": cu_of(n)}
    bwd_exact = jax.jit(lambda do, q, k, v, o, lse: fa3_varlen.varlen_bwd(do, q, k, v, o, lse, True, scale, exact))
    g1, g2 = bwd_direct(do, q, k, v, ob, lse), bwd_exact(do, q, k, v, ob, lse)
    ok = all(float(jnp.abs(x - y).max() / jnp.abs(y).max()) <= 1e-2 for x, y in zip(g1, g2))
    print(f"adapter bwd, exact run list: {_ms(bwd_exact, do, q, k, v, ob, lse):.3f} ms (agrees with padded: {ok})",
          flush=True)


if __name__ == "__main__":
    main()
