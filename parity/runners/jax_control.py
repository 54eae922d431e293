"""JAX's side of a parity case that both the mesh runner (``jax_runner``) and the one-device
replay runner (``replay_runner``) use: the forward and backward compiled as one program
(:func:`vjp_results`) and the dense low-precision control (:func:`dense_control`) — here, so
neither runner imports the other. jax is imported inside the functions."""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs, without_token_index
from .base import option_keywords


def _as(x, dtype):
    """Host-side cast (ml_dtypes) to a NumPy array, so that no small program is compiled per
    shape: neither a conversion nor the slicing that spreads an array already on one device over
    the program's sharding (``_multi_slice``: 2–3 compiles of 0.06–0.13 s a case on 2 cores) —
    a host array is sliced on the host."""
    import jax.numpy as jnp

    return np.asarray(x, np.float32).astype(jnp.dtype(dtype))


def _options(x: Inputs) -> tuple:
    """The inputs' segment ids (int32), sinks (float32) and token indices (int32), NumPy arrays
    (:func:`_as`), each None when the case has none: ``forward_backward``'s last three arguments."""
    ids = None if x.segment_ids is None else np.asarray(x.segment_ids, np.int32)
    index = None if x.token_index is None else np.asarray(x.token_index, np.int32)
    return ids, None if x.sinks is None else np.asarray(x.sinks, np.float32), index


def vjp_results(fn, case: Case, x: Inputs) -> dict[str, np.ndarray]:
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


def dense_control(case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """Dense attention in the case's own dtype on one device: the low-precision control (with the
    case's documents: dense ids in original order; its window and sinks, dsinks by jax.vjp
    through it)."""
    import jax_impl

    def fn(q, k, v, **options):
        return jax_impl.dense_attention(q, k, v, causal=case.causal, scale=case.scale, **options,
                                        **option_keywords(window=case.window, softcap=case.softcap))

    return vjp_results(fn, case, without_token_index(x))
