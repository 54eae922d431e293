"""Run one parity case with jax_impl (simulated CPU devices or real GPUs). jax and jax_impl are
imported when a case runs, so this module imports without them."""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs, from_layout, permutation, to_layout
from ..core.names import Device
from .base import document_keywords

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


def _segment_ids(x: Inputs) -> tuple:
    """The inputs' segment ids as a JAX int32 array, in a tuple: ``fn``'s extra argument (none
    without packed documents)."""
    import jax.numpy as jnp

    return () if x.segment_ids is None else (jnp.asarray(x.segment_ids, jnp.int32),)


def _vjp_results(fn, case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """Forward and backward of ``fn(q, k, v[, segment_ids])`` compiled as one program, as a training
    step compiles them (and less compile time than two programs: 0.9 s instead of 1.5 s for a USP
    r4×u2 case on CPU). The ids (when the case has packed documents) are an argument of the
    program, not a constant folded into it, and get no cotangent."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(case.dtype)

    @jax.jit
    def forward_backward(q, k, v, do, dlse, *ids):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *ids), q, k, v)
        return out, vjp((do, dlse))

    (o, lse), (dq, dk, dv) = forward_backward(_as(x.q, dtype), _as(x.k, dtype), _as(x.v, dtype),
                                              _as(x.do, dtype), _as(x.dlse, jnp.float32), *_segment_ids(x))
    out = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
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
        perm = permutation(case)

        def fn(q, k, v, segment_ids=None):  # global ids in layout order, sharded like q by the API
            return jax_impl.sequence_parallel_attention(
                q, k, v, mesh, causal=case.causal, layout=case.layout, scale=case.scale,
                kv_exchange=case.kv_exchange, return_lse=True, block_backend=self.block_backend,
                **document_keywords(segment_ids))

        return from_layout(_vjp_results(fn, case, to_layout(x, perm)), perm)

    def replay(self, devices: Device = "cpu"):
        """The same backend replaying a case on one device (for cases that need more devices
        than are present): ``parity.runners.replay_runner.JaxReplayRunner``."""
        from .replay_runner import JaxReplayRunner

        return JaxReplayRunner(self.block_backend)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's own dtype on one device: the low-precision control (with
        the case's documents: dense ids in original order)."""
        import jax_impl

        def fn(q, k, v, segment_ids=None):
            return jax_impl.dense_attention(q, k, v, causal=case.causal, scale=case.scale,
                                            **document_keywords(segment_ids))

        return _vjp_results(fn, case, x)


RUNNER = JaxRunner()


def measure_attention_traffic(case: Case, *, return_lse: bool = True):
    """Per-device collectives of the compiled forward and forward+backward programs (``Traffic``),
    for a loss that uses o and (when returned) lse; with the case's segment ids (int32 [b, t])
    when it has packed documents."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    from ..accounting.hlo import split_passes

    mesh = make_mesh(case)
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.head_dim), dtype)
    ids = () if case.documents == "none" else (jax.ShapeDtypeStruct((case.batch, case.seq), jnp.int32),)

    def attention(q, k, v, segment_ids=None):
        out = jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=case.causal, layout=case.layout,
                                                   kv_exchange=case.kv_exchange, scale=case.scale,
                                                   return_lse=return_lse, **document_keywords(segment_ids))
        return out if return_lse else (out, None)

    def forward_backward(q, k, v, do, dlse, *ids):
        # cotangents are inputs and outputs are kept, as in training (else XLA drops the output all-to-alls)
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *ids), q, k, v)
        return out, vjp((do, dlse))

    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq), jnp.float32) if return_lse else None
    fwd = jax.jit(attention).lower(q, kv, kv, *ids).compile().as_text()
    both = jax.jit(forward_backward).lower(q, kv, kv, q, lse, *ids).compile().as_text()
    return split_passes(fwd, both)
