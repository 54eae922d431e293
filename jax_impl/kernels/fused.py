"""What every fused attention kernel needs around it to serve as a block backend — no
third-party code here (``cudnn.py`` and ``fa3.py`` supply the op pairs).

A fused op pair takes a causal flag, not a block mask (and, for a kernel with its own sliding
window, ``window=(left, right)``: FlashAttention's bottom-right-aligned sizes, -1 unbounded):

    fwd_op(q, k, v, causal, scale[, window=])                  -> (o, lse)       o in the input dtype
    bwd_op(do, q, k, v, o, lse, causal, scale[, window=])      -> (dq, dk, dv)   in the input dtype

q, do, o: [b, t, h, d]; k, v: [b, s, hk, d] (bf16 / fp16); lse: [b, h, t] float32, natural log.
The adapter expresses a STRICT block (j < i, stripe's later shards) as the causal block of rows
1.. against keys ..t-1 (row 0 sees nothing: o = 0, lse = -inf; key t-1 is seen by no row), returns
o and the gradients in the kernel's own dtype (never widened here: the loops cast where they
merge or accumulate, so a device's only block is not copied to float32 and back) and lse in
float32, and sends a backward with an lse cotangent (only when the caller uses lse) to the
portable kernel, as torch_impl's aten adapters do.

**Windows** (``windowed=True``): a FULL or CAUSAL block whose mask carries the window and the
parts' static offset (``BlockMask.offset``: the loops set it when the parts are contiguous runs of
original positions) is a band of its grid (``seqplan.bands``): cropped to it with static slices,
run on the kernel's own window, and padded back — o = 0, lse = -inf for the rows left out, zero
dK / dV for the keys left out. A window without a static offset, a window with documents, and
any document mask are not ``supports``-ed (so ``"auto"`` never routes one here), and one given
anyway — the caller named this backend — runs on the portable kernel, never unmasked. (A window
that covers a whole block is dropped from its mask by the loops, so such blocks still reach the
fused kernel unwindowed.)
No fused op soft-caps logits: ``supports`` refuses ``softcap``, and the block layer runs a capped
block on the portable kernel (``block.capped_backend``), never here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from seqplan.bands import block_band
from seqplan.routing import LOW_PRECISION
from seqplan.schedule import CAUSAL_MASK, BlockMask, MaskKind

from ..block import BlockBackend
from .reference import reference_block_bwd, reference_block_fwd

F32 = jnp.float32


def is_band(mask: BlockMask) -> bool:
    """A windowed block a fused kernel's own window runs: FULL or CAUSAL, no documents, a static offset."""
    return (mask.window is not None and mask.offset is not None and not mask.documents
            and mask.kind is not MaskKind.STRICT)


def _pad_rows(x, lo: int, hi: int, axis: int, value=0.0):
    """x padded with ``lo`` leading and ``hi`` trailing entries of ``value`` along ``axis``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (lo, hi)
    return jnp.pad(x, pad, constant_values=value)


def fused_backend(name: str, fwd_op: Callable, bwd_op: Callable, *, typed_for_shard_map: bool = True,
                  available: Callable[[], bool] = lambda: True, windowed: bool = False) -> BlockBackend:
    """A block backend on the fused op pair ``fwd_op`` / ``bwd_op`` (module docstring);
    ``windowed``: the ops take ``window=`` (the kernel's own sliding window)."""

    def fused_here(mask: BlockMask) -> bool:
        return (windowed and is_band(mask)) or (not mask.documents and mask.window is None)

    def band_fwd(q, k, v, mask: BlockMask, scale: float):
        b, t, h, d = q.shape
        cut = block_band(mask, t, k.shape[1], mask.offset)
        if cut is None:  # the band misses the block
            return jnp.zeros(q.shape, q.dtype), jnp.full((b, h, t), -jnp.inf, F32)
        rows, cols = slice(cut.i0, cut.i1), slice(cut.j0, cut.j1)
        o, lse = fwd_op(q[:, rows], k[:, cols], v[:, cols], False, scale, window=(cut.left, cut.right))
        return (_pad_rows(o, cut.i0, t - cut.i1, 1), _pad_rows(lse.astype(F32), cut.i0, t - cut.i1, 2, -jnp.inf))

    def band_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float):
        t, s = q.shape[1], k.shape[1]
        cut = block_band(mask, t, s, mask.offset)
        if cut is None:
            return tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
        rows, cols = slice(cut.i0, cut.i1), slice(cut.j0, cut.j1)
        dtype = q.dtype
        dq, dk, dv = bwd_op(do[:, rows].astype(dtype), q[:, rows], k[:, cols], v[:, cols], o[:, rows].astype(dtype),
                            lse[:, :, rows].astype(F32), False, scale, window=(cut.left, cut.right))
        return (_pad_rows(dq, cut.i0, t - cut.i1, 1), _pad_rows(dk, cut.j0, s - cut.j1, 1),
                _pad_rows(dv, cut.j0, s - cut.j1, 1))

    def fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
        if not fused_here(mask):
            return reference_block_fwd(q, k, v, mask, scale, segments, positions)
        if mask.window is not None:
            return band_fwd(q, k, v, mask, scale)
        if mask.kind is MaskKind.STRICT:
            o_r, lse_r = fwd(q[:, 1:], k[:, :-1], v[:, :-1], CAUSAL_MASK, scale)
            b, _, h, d = q.shape
            return (jnp.concatenate([jnp.zeros((b, 1, h, d), o_r.dtype), o_r], 1),
                    jnp.concatenate([jnp.full((b, h, 1), -jnp.inf, F32), lse_r], 2))
        o, lse = fwd_op(q, k, v, mask.kind is MaskKind.CAUSAL, scale)
        return o, lse.astype(F32)

    def bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
        if dlse is not None or not fused_here(mask):
            return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
        if mask.window is not None:
            return band_bwd(do, q, k, v, o, lse, mask, scale)
        if mask.kind is MaskKind.STRICT:
            dq_r, dk_r, dv_r = bwd(do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse[..., 1:], CAUSAL_MASK,
                                   scale)
            rows = lambda first, last: [(0, 0), (first, last), (0, 0), (0, 0)]
            return jnp.pad(dq_r, rows(1, 0)), jnp.pad(dk_r, rows(0, 1)), jnp.pad(dv_r, rows(0, 1))
        dtype = q.dtype
        return tuple(bwd_op(do.astype(dtype), q, k, v, o.astype(dtype), lse.astype(F32), mask.kind is MaskKind.CAUSAL,
                            scale))

    return BlockBackend(name, fwd, bwd, typed_for_shard_map=typed_for_shard_map,
                        supports=lambda mask, dtype, softcap=False: (not softcap and dtype in LOW_PRECISION
                                                                     and fused_here(mask)),
                        available=available, window_offsets=windowed)
