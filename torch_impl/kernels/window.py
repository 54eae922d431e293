"""Backend ``"aten_window"``: windowed blocks on FlashAttention-2's own sliding window
(``aten._flash_attention_forward`` / ``_backward`` with ``window_size_left`` / ``_right``, CUDA).

A windowed block whose queries and keys are each a contiguous range of original positions (every
block of the contiguous layout; zigzag's half-shard blocks) sees a band of its [t, s] grid, which
FA2's own window runs once the block is cropped to it (``seqplan.bands``: the same band JAX's fa3
adapter uses); the adapter writes o = 0, lse = -inf for the rows left out and zero dK / dV for the
keys left out — never a kernel's guess.

What it routes to the portable kernel, forward and backward alike: positions that are not two
contiguous ranges (stripe, a zigzag block spanning both chunks), documents with a window (no
varlen window here), a strict block, an lse cotangent, float32. The loops give the parts'
offset in the mask (``BlockMask.offset``, from their static position tables); a block called
without it has its positions read on the host (one device-to-host copy). The op's argument lists can change between torch
releases: used here and in ``aten.py`` / ``varlen.py`` only, and checked on a GPU
(``benchmarks/masked.py``).
"""

from __future__ import annotations

import torch

from seqplan import bands
from seqplan.bands import Band, part_offset
from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend
from .reference import reference_block_bwd, reference_block_fwd
from .varlen import no_grads, nothing_seen


def block_band(mask: BlockMask, t: int, s: int, positions) -> Band | None | str:
    """The block's band (``seqplan.bands``), None when it sees nothing, or "portable" when it is
    not expressible. The offset comes from the mask when the loop knew it statically (no device
    sync), else from the positions, read on the host."""
    offset = mask.offset
    if positions[0].dim() == 2:  # per-row token indices: no band of the grid is assumed
        return "portable"
    if offset is None:
        offset = part_offset(*(x.detach().cpu().numpy() for x in positions))
    return "portable" if offset is None else bands.block_band(mask, t, s, offset)


def _fits(mask: BlockMask, q, positions, dlse=None) -> bool:
    return (mask.window is not None and not mask.documents and mask.kind is not MaskKind.STRICT and dlse is None
            and positions is not None and q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda)


_AUX: dict = {}


def _aux(device, dtype, d: int):
    """(cum_seq_q, cum_seq_k, rng_state, unused) of a dense, dropout-free forward: what the
    backward op expects back; they do not depend on the block (see aten.py's _aux_outputs)."""
    key = (device, dtype, d)
    if key not in _AUX:
        x = torch.zeros((1, 1, 1, d), device=device, dtype=dtype)
        out = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        rng = torch.ops.aten._flash_attention_forward(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2), None,
                                                      None, 1, 1, 0.0, False, False)
        _AUX[key] = (out[2], out[3], rng[2], rng[3])
    return _AUX[key]


def window_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    t = q.shape[1]
    cut = block_band(mask, t, k.shape[1], positions) if _fits(mask, q, positions) and segments is None else "portable"
    if cut == "portable":
        return reference_block_fwd(q, k, v, mask, scale, segments, positions)
    o, lse = nothing_seen(q)  # rows outside the band see no key
    if cut is None:
        return o, lse
    qs, ks, vs = q[:, cut.i0:cut.i1], k[:, cut.j0:cut.j1], v[:, cut.j0:cut.j1]
    out, lse_c = torch.ops.aten._flash_attention_forward(
        qs, ks, vs, None, None, qs.shape[1], ks.shape[1], 0.0, False, False, scale=scale,
        window_size_left=cut.left, window_size_right=cut.right)[:2]
    o[:, cut.i0:cut.i1] = out
    lse[:, :, cut.i0:cut.i1] = lse_c.float()
    return o, lse


def window_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
    b, t, h, d = q.shape
    ok = _fits(mask, q, positions, dlse) and segments is None
    cut = block_band(mask, t, k.shape[1], positions) if ok else "portable"
    if cut == "portable":
        return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
    dq, dk, dv = no_grads(q, k, v)
    if cut is None:
        return dq, dk, dv
    dtype = q.dtype
    cum_q, cum_k, rng, unused = _aux(q.device, dtype, d)
    rows, cols = slice(cut.i0, cut.i1), slice(cut.j0, cut.j1)
    ks = k[:, cols]
    grads = torch.ops.aten._flash_attention_backward(
        do[:, rows].to(dtype), q[:, rows], ks, v[:, cols], o[:, rows].to(dtype),
        lse[:, :, rows].float().contiguous(), cum_q, cum_k, cut.i1 - cut.i0, ks.shape[1], 0.0, False, rng, unused,
        scale=scale, window_size_left=cut.left, window_size_right=cut.right)
    dq[:, rows], dk[:, cols], dv[:, cols] = grads[0], grads[1], grads[2]
    return dq, dk, dv


def _supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
    if softcap:  # the FA2 window op soft-caps nothing: a capped block runs on the portable kernel (block.capped_backend)
        return False
    return mask.window is not None and not mask.documents and mask.kind is not MaskKind.STRICT and dtype in LOW_PRECISION


register_backend(BlockBackend("aten_window", window_block_fwd, window_block_bwd, supports=_supports,
                              available=torch.cuda.is_available))
