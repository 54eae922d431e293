"""Run one parity case with jax_impl (simulated CPU devices or real GPUs). jax and jax_impl are
imported when a case runs, so this module imports without them."""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs, from_layout, permutation, to_layout, without_token_index
from ..core.names import Device
from .base import option_keywords, shared_keywords

__all__ = ["JaxRunner", "RUNNER", "make_mesh", "measure_attention_traffic"]


def make_mesh(case: Case, devices=None):
    """A ``jax.sharding.Mesh`` with the case's axes, in canonical order, over the first
    ``case.devices`` devices."""
    import jax

    axes = case.mesh_axes
    devices = jax.devices()[: case.devices] if devices is None else devices
    if len(devices) < case.devices:
        raise ValueError(f"case {case.name} needs {case.devices} devices, JAX has {len(devices)}")
    return jax.sharding.Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes))


def _as(x, dtype):
    """Host-side cast (ml_dtypes), so that no small conversion program is compiled per shape."""
    import jax.numpy as jnp

    return jnp.asarray(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))


def _options(x: Inputs) -> tuple:
    """The inputs' segment ids (JAX int32), sinks (JAX float32) and token indices (JAX int32),
    each None when the case has none: ``forward_backward``'s last three arguments."""
    import jax.numpy as jnp

    ids = None if x.segment_ids is None else jnp.asarray(x.segment_ids, jnp.int32)
    index = None if x.token_index is None else jnp.asarray(x.token_index, jnp.int32)
    return ids, None if x.sinks is None else jnp.asarray(np.asarray(x.sinks, np.float32)), index


def _vjp_results(fn, case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """Forward and backward of ``fn(q, k, v, **options)`` compiled as one program, as a training
    step compiles them (and less compile time than two programs: 0.9 s instead of 1.5 s for a USP
    r4×u2 case on CPU). ``options`` are the case's segment ids, sinks and token indices when it has them
    (``option_keywords``): arguments of the program, not constants folded into it. The ids get no
    cotangent, nor do the token indices; the sinks are differentiated like q, k, v (dsinks: ``jax.vjp``
    w.r.t. them)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(case.dtype)

    @jax.jit
    def forward_backward(q, k, v, do, dlse, ids, sinks, index):
        def attention(q, k, v, *sink):
            return fn(q, k, v, **option_keywords(segment_ids=ids, sinks=sink[0] if sink else None, token_index=index))

        primals = (q, k, v, *(() if sinks is None else (sinks,)))
        if not case.lse_cotangent:  # o's cotangent alone, as a training step: the kernels get no dlse
            o, vjp = jax.vjp(lambda *a: attention(*a)[0], *primals)
            return (o, attention(*primals)[1]), vjp(do)
        out, vjp = jax.vjp(attention, *primals)
        return out, vjp((do, dlse))

    (o, lse), grads = forward_backward(_as(x.q, dtype), _as(x.k, dtype), _as(x.v, dtype), _as(x.do, dtype),
                                       _as(x.dlse, jnp.float32), *_options(x))
    out = {"o": o, "lse": lse} | dict(zip(("dq", "dk", "dv", "dsinks"), grads))
    return {n: np.asarray(t).astype(np.float64) for n, t in out.items()}


class JaxRunner:
    """``Runner`` for jax_impl: one jitted forward+backward program per case."""

    def __init__(self, block_backend: str = "auto"):
        self.block_backend = block_backend

    def device_count(self, devices: Device = "cpu") -> int:
        """Devices JAX can place a mesh on (its default platform, chosen before JAX starts)."""
        import jax

        return len(jax.devices())

    def run_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> dict[str, np.ndarray]:
        """o, lse, dq, dk, dv from ``sequence_parallel_attention``, in original order.
        ``devices`` is informational: JAX runs on its default platform."""
        import jax_impl

        mesh = make_mesh(case)
        perm = permutation(case, x)  # [t], or [b, t] for a token-index case (the per-document zigzag)
        y = to_layout(x, perm)
        shared = shared_keywords(case, y.segment_ids)

        def fn(q, k, v, **options):  # global ids and token indices in layout order (sharded like q), sinks [h]
            return jax_impl.sequence_parallel_attention(
                q, k, v, mesh, causal=case.causal, layout=case.layout, scale=case.scale,
                kv_exchange=case.kv_exchange, return_lse=True, block_backend=self.block_backend,
                **options, **option_keywords(window=case.window, softcap=case.softcap), **shared)

        return from_layout(_vjp_results(fn, case, y), perm)

    def replay(self, devices: Device = "cpu"):
        """The same backend replaying a case on one device (for cases that need more devices
        than are present): ``parity.runners.replay_runner.JaxReplayRunner``."""
        from .replay_runner import JaxReplayRunner

        return JaxReplayRunner(self.block_backend)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's own dtype on one device: the low-precision control (with
        the case's documents: dense ids in original order; its window and sinks, dsinks by
        jax.vjp through it)."""
        import jax_impl

        def fn(q, k, v, **options):
            return jax_impl.dense_attention(q, k, v, causal=case.causal, scale=case.scale, **options,
                                            **option_keywords(window=case.window, softcap=case.softcap))

        return _vjp_results(fn, case, without_token_index(x))


RUNNER = JaxRunner()


def measure_attention_traffic(case: Case, *, return_lse: bool = True):
    """Per-device collectives of the compiled forward and forward+backward programs (``Traffic``),
    for a loss that uses o and (when returned) lse; with the case's segment ids (int32 [b, t])
    when it has packed documents, its token indices (int32 [b, t]) when it passes them, its window,
    and its sinks (float32 [h], differentiated: the backward has their cotangent)."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    from ..accounting.hlo import split_passes

    mesh = make_mesh(case)
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.head_dim), dtype)
    ids = None if case.documents == "none" else jax.ShapeDtypeStruct((case.batch, case.seq), jnp.int32)
    index = jax.ShapeDtypeStruct((case.batch, case.seq), jnp.int32) if case.token_index else None
    sinks = jax.ShapeDtypeStruct((case.heads,), jnp.float32) if case.sinks else None

    def attention(q, k, v, ids, index, *sink):
        out = jax_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=case.causal, layout=case.layout, kv_exchange=case.kv_exchange, scale=case.scale,
            return_lse=return_lse, **option_keywords(segment_ids=ids, window=case.window, sinks=sink[0] if sink else None,
                                                     softcap=case.softcap, token_index=index))
        return out if return_lse else (out, None)

    def forward_backward(q, k, v, do, dlse, ids, index, sinks):
        # cotangents are inputs and outputs are kept, as in training (else XLA drops the output all-to-alls)
        out, vjp = jax.vjp(lambda q, k, v, *sink: attention(q, k, v, ids, index, *sink), q, k, v,
                           *(() if sinks is None else (sinks,)))
        return out, vjp((do, dlse))

    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq), jnp.float32) if return_lse else None
    sink = () if sinks is None else (sinks,)
    fwd = jax.jit(attention).lower(q, kv, kv, ids, index, *sink).compile().as_text()
    both = jax.jit(forward_backward).lower(q, kv, kv, q, lse, ids, index, sinks).compile().as_text()
    return split_passes(fwd, both)
