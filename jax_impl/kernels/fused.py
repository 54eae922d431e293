"""What every fused attention kernel needs around it to serve as a block backend — no
third-party code here (``cudnn.py`` and ``fa3.py`` supply the op pairs).

A fused op pair takes a causal flag, not a block mask:

    fwd_op(q, k, v, causal, scale)                  -> (o, lse)       o in the input dtype
    bwd_op(do, q, k, v, o, lse, causal, scale)      -> (dq, dk, dv)   in the input dtype

q, do, o: [b, t, h, d]; k, v: [b, s, hk, d] (bf16 / fp16); lse: [b, h, t] float32, natural log.
The adapter expresses a STRICT block (j < i, stripe's later shards) as the causal block of rows
1.. against keys ..t-1 (row 0 sees nothing: o = 0, lse = -inf; key t-1 is seen by no row), returns
float32, and sends a backward with an lse cotangent (only when the caller uses lse) to the
portable kernel, as torch_impl's aten adapters do. The op pairs take no segment ids and no
window: a document- or window-masked block is not ``supports``-ed (so ``"auto"`` never routes
one here), and one given anyway — the caller named this backend — runs on the portable kernel,
never unmasked. (A window that covers a whole block is dropped from its mask by the loops, so
such blocks still reach the fused kernel.) No fused op soft-caps logits: ``supports`` refuses
``softcap``, and the block layer runs a capped block on the portable kernel
(``block.capped_backend``), never here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import CAUSAL_MASK, BlockMask, MaskKind

from ..block import BlockBackend
from .reference import reference_block_bwd, reference_block_fwd

F32 = jnp.float32


def fused_backend(name: str, fwd_op: Callable, bwd_op: Callable, *, typed_for_shard_map: bool = True,
                  available: Callable[[], bool] = lambda: True) -> BlockBackend:
    """A block backend on the fused op pair ``fwd_op`` / ``bwd_op`` (module docstring)."""

    def fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
        if mask.documents or mask.window is not None:
            return reference_block_fwd(q, k, v, mask, scale, segments, positions)
        if mask.kind is MaskKind.STRICT:
            o_r, lse_r = fwd(q[:, 1:], k[:, :-1], v[:, :-1], CAUSAL_MASK, scale)
            b, _, h, d = q.shape
            return (jnp.concatenate([jnp.zeros((b, 1, h, d), F32), o_r], 1),
                    jnp.concatenate([jnp.full((b, h, 1), -jnp.inf, F32), lse_r], 2))
        o, lse = fwd_op(q, k, v, mask.kind is MaskKind.CAUSAL, scale)
        return o.astype(F32), lse.astype(F32)

    def bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
        if dlse is not None or mask.documents or mask.window is not None:
            return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
        if mask.kind is MaskKind.STRICT:
            dq_r, dk_r, dv_r = bwd(do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse[..., 1:], CAUSAL_MASK,
                                   scale)
            rows = lambda first, last: [(0, 0), (first, last), (0, 0), (0, 0)]
            return jnp.pad(dq_r, rows(1, 0)), jnp.pad(dk_r, rows(0, 1)), jnp.pad(dv_r, rows(0, 1))
        dtype = q.dtype
        grads = bwd_op(do.astype(dtype), q, k, v, o.astype(dtype), lse.astype(F32), mask.kind is MaskKind.CAUSAL,
                       scale)
        return tuple(g.astype(F32) for g in grads)

    return BlockBackend(name, fwd, bwd, typed_for_shard_map=typed_for_shard_map,
                        supports=lambda mask, dtype, softcap=False: (not softcap and dtype in LOW_PRECISION
                                                                     and not mask.documents and mask.window is None),
                        available=available)
