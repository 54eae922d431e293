"""Backend ``"aten_window"``: windowed blocks on FlashAttention-2's own sliding window
(``aten._flash_attention_forward`` / ``_backward`` with ``window_size_left`` / ``_right``, CUDA).

A windowed block whose queries and keys are each a contiguous range of original positions (every
block of the contiguous layout; zigzag's half-shard blocks) sees a band of its [t, s] grid: key j
is visible to query i when lo <= j - i <= hi, with δ = q_pos[0] - kv_pos[0], lo = δ - left,
hi = δ + right (and hi <= 0 on a causal block). FA2's window is such a band, aligned to the
bottom-right corner of the grid: j - i in [(s - t) - window_left, (s - t) + window_right]. The
adapter crops the block to the rows that see a key and the keys some row sees (:func:`band`),
which makes both window sizes non-negative (FA2's convention; -1 is unbounded), and writes o = 0,
lse = -inf for the rows left out and zero dK / dV for the keys left out — never a kernel's guess.

What it routes to the portable kernel, forward and backward alike: positions that are not two
contiguous ranges (stripe, a zigzag block spanning both chunks), documents with a window (no
varlen window here), a strict block, an lse cotangent, float32. The positions are read on the
host (one device-to-host copy per block). The op's argument lists can change between torch
releases: used here and in ``aten.py`` / ``varlen.py`` only, and checked on a GPU
(``benchmarks/masked.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import UNBOUNDED, BlockMask, MaskKind

from ..block import BlockBackend, register_backend
from .reference import reference_block_bwd, reference_block_fwd

F32 = torch.float32


@dataclass(frozen=True)
class Band:
    """The cropped block: rows [i0, i1), keys [j0, j1), and FA2's window sizes for it (-1: unbounded)."""

    i0: int
    i1: int
    j0: int
    j1: int
    left: int
    right: int


def band(t: int, s: int, lo: int, hi: int | None) -> Band | None:
    """The sub-block of a [t, s] grid that holds the pairs lo <= j - i <= hi (``hi`` None: no
    upper bound) and FA2's window for it, or None when no pair is visible."""
    i0 = 0 if hi is None else max(0, -hi)
    i1 = min(t, s - lo)
    j0 = max(0, lo)
    j1 = s if hi is None else min(s, t + hi)
    if i0 >= i1 or j0 >= j1:
        return None
    lo_c, offset = lo - j0 + i0, (j1 - j0) - (i1 - i0)
    right = -1 if hi is None else hi - j0 + i0 - offset
    return Band(i0, i1, j0, j1, offset - lo_c, right)


def _contiguous_start(x) -> int | None:
    """x[0] when the positions are x[0], x[0] + 1, ..., else None (host copy)."""
    values = x.detach().cpu()
    start = int(values[0])
    return start if torch.equal(values, torch.arange(start, start + len(values), dtype=values.dtype)) else None


def block_band(mask: BlockMask, t: int, s: int, positions) -> Band | None | str:
    """The block's band, None when it sees nothing, or "portable" when it is not expressible."""
    q0, k0 = (_contiguous_start(x) for x in positions)
    if q0 is None or k0 is None:
        return "portable"
    left, right = mask.window
    delta = q0 - k0
    hi = None if right >= UNBOUNDED else delta + right
    if mask.kind is MaskKind.CAUSAL:
        hi = 0 if hi is None else min(hi, 0)
    return band(t, s, delta - left, hi)


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
    b, t, h, d = q.shape
    cut = block_band(mask, t, k.shape[1], positions) if _fits(mask, q, positions) and segments is None else "portable"
    if cut == "portable":
        return reference_block_fwd(q, k, v, mask, scale, segments, positions)
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=F32, device=q.device)
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
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
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
