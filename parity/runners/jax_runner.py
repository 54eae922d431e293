"""Run one parity case with jax_impl (simulated CPU devices or real GPUs). jax and jax_impl are
imported when a case runs, so this module imports without them."""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs, from_layout, permutation, to_layout
from ..core.names import Device
from .base import option_keywords, shared_keywords
from .jax_control import dense_control, vjp_results

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

        return from_layout(vjp_results(fn, case, y), perm)

    def replay(self, devices: Device = "cpu"):
        """The same backend replaying a case on one device (for cases that need more devices
        than are present): ``parity.runners.replay_runner.JaxReplayRunner``."""
        from .replay_runner import JaxReplayRunner

        return JaxReplayRunner(self.block_backend)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's own dtype on one device: the low-precision control
        (``jax_control.dense_control``)."""
        return dense_control(case, x)


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
