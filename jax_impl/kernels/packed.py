"""Backend ``"cudnn_varlen"``: document-masked blocks on cuDNN's packed layout (XLA's cuDNN fused
attention with per-segment ``q_seqlen`` / ``kv_seqlen`` and ``q_offsets`` / ``kv_offsets``).

A document-masked block whose ids form one run per document is a batch of independent attention
problems, one per document (the rule of ``seqplan.documents``, which torch's ``aten_varlen``
uses on the host). Under ``jit`` the ids are traced, so the run list is computed on the device
with static shapes (``runs.packed_segments``): at most ``runs.MAX_RUNS`` runs per batch row,
padded with -1 (cuDNN's convention, not zero-length runs). Each query run's keys are the same
document's key run, found by offset — no gather: cuDNN reads every segment at its own offset.
A query document with no key in the block is left out of the segment list: its rows get o = 0,
lse = -inf and zero dq, written here; keys of documents no query run reads get zero dk / dv.

When the block is not expressible — an id in two runs of a row, more runs than
``MAX_RUNS``, or a causal block whose keys are not its queries' own tokens (only a diagonal
block's runs are square) — the block runs on the portable kernel instead, decided on the device
by ``runs.dispatch`` (one ``lax.switch``, which also picks the fewest run slots that hold the
block's runs): never guessed, never unmasked. Measured on H100 (jax 0.11.2): XLA sizes cuDNN's
packed backward workspace by slots × block length × heads × head_dim (8.3 GB at 64 slots, 4k
tokens, 32 heads): ``fa3_varlen``, not this backend, is what ``"auto"`` routes to. A window, a strict block or an lse cotangent
go to the portable kernel too, statically.

Why JAX's private API (``jax._src.cudnn.fused_attention_stablehlo``), as ``cudnn.py``: the ring's
block backward needs the *global* o and lse. In the packed layout cuDNN's softmax statistics are
``[B·M, N, T]`` — one row of T slots per segment (compacted over the batch), token k of a
segment at slot k — so :func:`stats_from_lse` / :func:`lse_from_stats` convert between that and
the ring's ``[b, h, t]`` by gathers (checked on a GPU by ``benchmarks/masked.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend
from .reference import reference_block_bwd, reference_block_fwd
from .runs import PackedSegments, dispatch, packed_segments

F32 = jnp.float32


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo  # private: see the module docstring

    return fused_attention_stablehlo


def _token_slot(seg: PackedSegments, t: int):
    """(segment slot, position inside the segment) of every query token [b, t] (slot -1: left out)."""
    run = jnp.minimum(seg.q_run, seg.slot.shape[1] - 1)
    slot = jnp.where(seg.covered_q, jnp.take_along_axis(seg.slot, run, axis=1), -1)
    inside = jnp.arange(t)[None, :] - jnp.take_along_axis(seg.q_start, run, axis=1)
    return slot, inside


def lse_from_stats(stats, seg: PackedSegments, b: int, h: int, t: int):
    """cuDNN's packed statistics [B·M, N, T] -> the ring's lse [b, h, t] (-inf for left-out rows)."""
    slot, inside = _token_slot(seg, t)
    picked = stats[jnp.maximum(slot, 0), :, inside]  # [b, t, h]
    return jnp.where(slot[..., None] >= 0, picked, -jnp.inf).transpose(0, 2, 1)


def stats_from_lse(lse, seg: PackedSegments, b: int, h: int, t: int):
    """The ring's lse [b, h, t] -> cuDNN's packed statistics [B·M, N, T] (unused slots 0)."""
    m = seg.slot.shape[1]
    slot, inside = _token_slot(seg, t)
    rows = jnp.where(slot >= 0, slot, b * m)  # left-out rows land in a dropped extra slot
    stats = jnp.zeros((b * m + 1, h, t), F32)
    stats = stats.at[rows, :, inside].set(lse.transpose(0, 2, 1).astype(F32))
    return stats[: b * m]


def _mask_type(fa, mask: BlockMask):
    return fa.MaskType.PADDING_CAUSAL if mask.kind is MaskKind.CAUSAL else fa.MaskType.PADDING


def _segment_args(seg: PackedSegments):
    return seg.q_seqlen, seg.kv_seqlen, seg.q_offsets, seg.kv_offsets


def packed_fwd(q, k, v, mask: BlockMask, scale: float, seg: PackedSegments):
    """cuDNN packed forward on an expressible block: (o float32 [b, t, h, d], lse [b, h, t])."""
    fa = _fa()
    b, t, h, _ = q.shape
    q_seqlen, kv_seqlen, q_offsets, kv_offsets = _segment_args(seg)
    o, stats = fa.dot_product_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, q_offsets=q_offsets,
                                        kv_offsets=kv_offsets, scale=scale, mask_type=_mask_type(fa, mask),
                                        qkv_layout="BTNH", return_residual=True)
    covered = seg.covered_q[:, :, None, None]
    return jnp.where(covered, o.astype(F32), 0.0), lse_from_stats(stats, seg, b, h, t)


def packed_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, seg: PackedSegments):
    """cuDNN packed backward with the given (global) o and lse, on an expressible block."""
    fa = _fa()
    b, t, h, _ = q.shape
    unused = jnp.zeros(0, q.dtype)
    dtype = q.dtype
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, *_segment_args(seg), unused, unused, stats_from_lse(lse, seg, b, h, t), o.astype(dtype),
        do.astype(dtype), scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=_mask_type(fa, mask), layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)[:3]
    zero = lambda x, covered: jnp.where(covered[:, :, None, None], x.astype(F32), 0.0)
    return zero(dq, seg.covered_q), zero(dk, seg.covered_kv), zero(dv, seg.covered_kv)


def _static_fit(mask: BlockMask, q, segments, positions, dlse=None) -> bool:
    return (segments is not None and positions is None and dlse is None and mask.window is None
            and mask.kind is not MaskKind.STRICT and q.dtype in (jnp.bfloat16, jnp.float16))


def varlen_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    if not _static_fit(mask, q, segments, positions):
        return reference_block_fwd(q, k, v, mask, scale, segments, positions)
    return dispatch(segments, mask.kind is MaskKind.CAUSAL, lambda seg: packed_fwd(q, k, v, mask, scale, seg),
                    lambda: reference_block_fwd(q, k, v, mask, scale, segments, positions), form=packed_segments)


def varlen_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
    if not _static_fit(mask, q, segments, positions, dlse):
        return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
    return dispatch(segments, mask.kind is MaskKind.CAUSAL,
                    lambda seg: packed_bwd(do, q, k, v, o, lse, mask, scale, seg),
                    lambda: reference_block_bwd(do, q, k, v, o, lse, mask, scale, None, segments, positions),
                    form=packed_segments)


def _available() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


register_backend(BlockBackend(
    "cudnn_varlen", varlen_block_fwd, varlen_block_bwd,
    supports=lambda mask, dtype, softcap=False: (not softcap and mask.documents and mask.window is None
                                                 and mask.kind is not MaskKind.STRICT and dtype in LOW_PRECISION),
    available=_available))
