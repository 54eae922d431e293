"""The portable block kernels (backend ``"reference"``): einsum with float32 accumulation, any
device, any dtype. The default on CPU and for float32, the fallback of the aten adapters'
backward when a caller passes an lse cotangent, and the kernel of every document-masked or
windowed block (no fused document or window kernel is registered yet).

Shapes: q, do, o [b, t, h, d]; k, v [b, s, hk, d]; lse, dlse [b, h, t] float32; with a document
mask, ``segments = (q_ids [b, t], kv_ids [b, s])`` integer ids (query i sees key j only if their
ids are equal, on top of the static mask); with a window ``(left, right)``, ``positions =
(q_pos [t], kv_pos [s])`` integer original positions (query i sees key j only if
q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right, on top of the rest).
"""

from __future__ import annotations

import torch

from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend

F32 = torch.float32


def _window_matrix(window: tuple[int, int], t: int, s: int, positions):
    """[t, s]: q_pos - left <= kv_pos <= q_pos + right, from ``positions = (q_pos [t], kv_pos [s])``."""
    if positions is None:
        raise ValueError("a windowed mask needs positions = (q_pos [t], kv_pos [s])")
    q_pos, kv_pos = positions
    if tuple(q_pos.shape) != (t,) or tuple(kv_pos.shape) != (s,):
        raise ValueError(f"positions must be [{t}] and [{s}] like the block, got {tuple(q_pos.shape)} and "
                         f"{tuple(kv_pos.shape)}")
    left, right = window
    offset = kv_pos.long()[None, :] - q_pos.long()[:, None]  # key minus query, original positions
    return (offset >= -left) & (offset <= right)


def mask_matrix(mask: BlockMask, t: int, s: int, device, segments=None, positions=None):
    """The visible (query, key) pairs in local indices, broadcastable against the scores
    [b, hk, g, t, s]: None when every pair is (FULL), the static pattern [t, s] (with
    ``mask.window``: & the window on ``positions``), or with ``mask.documents`` that
    & (q_ids[:, :, None] == kv_ids[:, None, :]) as [b, 1, 1, t, s] (the same for every head)."""
    visible = None
    if mask.kind is not MaskKind.FULL:
        if t != s:
            raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
        offset = 0 if mask.kind is MaskKind.CAUSAL else -1
        visible = torch.ones((t, s), dtype=torch.bool, device=device).tril(offset)
    if mask.window is not None:
        inside = _window_matrix(mask.window, t, s, positions).to(device)
        visible = inside if visible is None else visible & inside
    if mask.documents:
        if segments is None:
            raise ValueError("a document mask needs segments = (q_ids [b, t], kv_ids [b, s])")
        q_ids, kv_ids = segments
        if q_ids.shape[1] != t or kv_ids.shape[1] != s:
            raise ValueError(f"segments must be [b, {t}] and [b, {s}] like the block, got {tuple(q_ids.shape)} "
                             f"and {tuple(kv_ids.shape)}")
        same = q_ids[:, :, None] == kv_ids[:, None, :]  # [b, t, s]
        visible = (same if visible is None else same & visible)[:, None, None]
    return visible


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.float().reshape(b, t, hk, h // hk, d)
    return torch.einsum("btkgd,bskd->bkgts", qg, k.float()) * scale


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    """Portable forward. A query row with no visible key gets o = 0 and lse = -inf (stripe's
    strict mask on row 0, no key of its document in the block, or none inside its window),
    which the LSE merge treats as an empty partial."""
    b, t, h, d = q.shape
    s = _scores(q, k, scale)
    visible = mask_matrix(mask, t, k.shape[1], q.device, segments, positions)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    lse = torch.where(has_key, row_max + torch.log(safe), torch.full_like(denom, float("-inf")))
    o = torch.einsum("bkgts,bskd->btkgd", p / safe, v.float())
    return o.reshape(b, t, h, d), lse[..., 0].reshape(b, h, t)


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None,
                        positions=None):
    """Portable backward with the global ``o`` and ``lse``:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), dQ = scale·dS K, dK = scale·dSᵀ Q, dV = Pᵀ dO.
    Masked pairs have P = 0, so a row with no visible key contributes nothing."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    s = _scores(q, k, scale)
    p = torch.exp(s - lse.float().reshape(b, hk, g, t, 1))
    visible = mask_matrix(mask, t, k.shape[1], q.device, segments, positions)
    if visible is not None:
        p = p.masked_fill(~visible, 0.0)
    do_g = do.float().reshape(b, t, hk, g, d)
    delta = torch.einsum("btkgd,btkgd->bkgt", do_g, o.float().reshape(b, t, hk, g, d))
    if dlse is not None:
        delta = delta - dlse.float().reshape(b, hk, g, t)
    dv = torch.einsum("bkgts,btkgd->bskd", p, do_g)
    dp = torch.einsum("btkgd,bskd->bkgts", do_g, v.float())
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bkgts,bskd->btkgd", ds, k.float()).reshape(b, t, h, d)
    dk = torch.einsum("bkgts,btkgd->bskd", ds, q.float().reshape(b, t, hk, g, d))
    return dq, dk, dv


register_backend(BlockBackend("reference", reference_block_fwd, reference_block_bwd))
