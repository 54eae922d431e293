"""The portable block kernels (backend ``"reference"``): einsum with float32 accumulation, any
device, any dtype. The default on CPU and for float32, and the fallback of the aten adapters'
backward when a caller passes an lse cotangent.

Shapes: q, do, o [b, t, h, d]; k, v [b, s, hk, d]; lse, dlse [b, h, t] float32.
"""

from __future__ import annotations

import torch

from ..block import BlockBackend, register_backend
from ..schedule import BlockMask, MaskKind

F32 = torch.float32


def mask_matrix(mask: BlockMask, t: int, s: int, device):
    """[t, s] bool of visible (query, key) pairs in local indices, or None for FULL."""
    if mask.is_full:
        return None
    if t != s:
        raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
    offset = 0 if mask.kind is MaskKind.CAUSAL else -1
    return torch.ones((t, s), dtype=torch.bool, device=device).tril(offset)


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.float().reshape(b, t, hk, h // hk, d)
    return torch.einsum("btkgd,bskd->bkgts", qg, k.float()) * scale


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float):
    """Portable forward. A query row with no visible key gets o = 0 and lse = -inf (stripe's
    strict mask on row 0), which the LSE merge treats as an empty partial."""
    b, t, h, d = q.shape
    s = _scores(q, k, scale)
    visible = mask_matrix(mask, t, k.shape[1], q.device)
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


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None):
    """Portable backward with the global ``o`` and ``lse``:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), dQ = scale·dS K, dK = scale·dSᵀ Q, dV = Pᵀ dO."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    s = _scores(q, k, scale)
    p = torch.exp(s - lse.float().reshape(b, hk, g, t, 1))
    visible = mask_matrix(mask, t, k.shape[1], q.device)
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
