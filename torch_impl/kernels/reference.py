"""The portable block kernels (backend ``"reference"``): einsum with float32 accumulation, any
device, any dtype. The default on CPU and for float32, the fallback of the aten adapters'
backward when a caller passes an lse cotangent, and the kernel of a document-masked or windowed
block that no fused kernel takes.

Blockwise, as jax_impl's: the keys are walked in chunks of ``c`` (``seqplan.chunks.key_chunk``) with an
online softmax in the forward and the scores recomputed per chunk in the backward, so a block's
temporaries are O(t · c), never the [t, s] scores. A block with t · s ≤ ``SCORE_ELEMENTS`` is one
chunk: the plain softmax.

Shapes: q, do, o [b, t, h, d]; k, v [b, s, hk, d]; lse, dlse [b, h, t] float32; with a document
mask, ``segments = (q_ids [b, t], kv_ids [b, s])`` integer ids (query i sees key j only if their
ids are equal, on top of the static mask); with a window ``(left, right)``, ``positions =
(q_pos [t], kv_pos [s])`` integer original positions (query i sees key j only if
q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right, on top of the rest), or per batch row
``(q_pos [b, t], kv_pos [b, s])`` — explicit token indices, whose causal mask is the window
``(UNBOUNDED, 0)`` on them (``seqplan.schedule.token_index_window``).

Soft-capping (``softcap``, a float, Gemma 2): every scaled logit x = scale·q·k becomes
softcap · tanh(x / softcap) before the mask and the softmax, in the forward and in the backward's
recomputed scores; the backward multiplies dS by the cap's slope 1 − tanh²(x / softcap) before
the scale. The LSE and its merge are unchanged (capping is per logit).
"""

from __future__ import annotations

import torch

from seqplan.chunks import key_chunk
from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend

F32 = torch.float32


def _window_matrix(window: tuple[int, int], q_pos, kv_pos):
    """[t, c]: q_pos - left <= kv_pos <= q_pos + right (original positions); [b, t, c] for per-row
    token indices q_pos [b, t], kv_pos [b, c]."""
    left, right = window
    offset = kv_pos.long()[..., None, :] - q_pos.long()[..., :, None]  # key minus query, original positions
    return (offset >= -left) & (offset <= right)


def check_mask_arrays(mask: BlockMask, t: int, s: int, segments, positions, b: int | None = None) -> None:
    """ValueError unless a causal / strict block is square, a window comes with positions [t], [s]
    and documents with segments [b, t], [b, s]."""
    if mask.kind is not MaskKind.FULL and t != s:
        raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
    if mask.window is not None:
        if positions is None:
            raise ValueError("a windowed mask needs positions = (q_pos [t], kv_pos [s])")
        q_pos, kv_pos = positions
        shapes = (tuple(q_pos.shape), tuple(kv_pos.shape))
        if shapes != ((t,), (s,)) and not (len(shapes[0]) == len(shapes[1]) == 2 and shapes[0][0] == shapes[1][0]
                                            and b in (None, shapes[0][0]) and (shapes[0][1], shapes[1][1]) == (t, s)):
            raise ValueError(f"positions must be [{t}] and [{s}] like the block, or per row (token indices) "
                             f"[b, {t}] and [b, {s}], got {shapes[0]} and {shapes[1]}")
    if mask.documents:
        if segments is None:
            raise ValueError("a document mask needs segments = (q_ids [b, t], kv_ids [b, s])")
        q_ids, kv_ids = segments
        if q_ids.shape[1] != t or kv_ids.shape[1] != s:
            raise ValueError(f"segments must be [b, {t}] and [b, {s}] like the block, got {tuple(q_ids.shape)} "
                             f"and {tuple(kv_ids.shape)}")


def chunk_visible(mask: BlockMask, t: int, lo: int, hi: int, device, segments=None, positions=None):
    """The visible pairs of the queries against keys lo..hi-1 of the block, broadcastable against
    the scores [b, hk, g, t, hi - lo]: None when every pair is (FULL), the static pattern
    [t, c] (with ``mask.window``: & the window on ``positions``), or with ``mask.documents`` that
    & (q_ids[:, :, None] == kv_ids[:, None, lo:hi]) as [b, 1, 1, t, c] (the same for every head)."""
    visible = None
    if mask.kind is not MaskKind.FULL:
        q_index = torch.arange(t, device=device)[:, None]
        kv_index = torch.arange(lo, hi, device=device)[None, :]
        visible = kv_index <= q_index if mask.kind is MaskKind.CAUSAL else kv_index < q_index
    if mask.window is not None:
        q_pos, kv_pos = positions
        inside = _window_matrix(mask.window, q_pos, kv_pos[..., lo:hi]).to(device)  # [t, c] or [b, t, c]
        visible = inside if visible is None else visible & inside
    if mask.documents:
        q_ids, kv_ids = segments
        same = q_ids[:, :, None] == kv_ids[:, None, lo:hi]  # [b, t, c]
        visible = same if visible is None else same & visible
    return visible[:, None, None] if visible is not None and visible.dim() == 3 else visible


def mask_matrix(mask: BlockMask, t: int, s: int, device, segments=None, positions=None):
    """The visible (query, key) pairs of the whole block (:func:`chunk_visible` of all its keys;
    for tests and small blocks — the kernels below build it chunk by chunk)."""
    check_mask_arrays(mask, t, s, segments, positions)
    return chunk_visible(mask, t, 0, s, device, segments, positions)


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.float().reshape(b, t, hk, h // hk, d)
    return torch.einsum("btkgd,bskd->bkgts", qg, k.float()) * scale


def _capped(scores, softcap):
    """(softcap · tanh(scores / softcap), its slope 1 − tanh²) in place of ``scores`` — or
    (scores, None) without a cap."""
    if softcap is None:
        return scores, None
    th = scores.div_(softcap).tanh_()
    slope = 1.0 - th * th
    return th.mul_(softcap), slope


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None, softcap=None, *,
                        chunk: int | None = None):
    """Portable forward, an online softmax over key chunks (``chunk``: default ``seqplan.chunks.key_chunk``).
    A query row with no visible key gets o = 0 and lse = -inf (stripe's strict mask on row 0, no
    key of its document in the block, or none inside its window), which the LSE merge treats as
    an empty partial."""
    b, t, h, d = q.shape
    s = k.shape[1]
    check_mask_arrays(mask, t, s, segments, positions, b)
    c = chunk or key_chunk(t, s)
    m = total = acc = None  # running max, sum of exp and numerator: [b, hk, g, t], [..], [b, hk, g, t, d]
    for lo in range(0, s, c):
        hi = min(s, lo + c)
        sc, _ = _capped(_scores(q, k[:, lo:hi], scale), softcap)
        visible = chunk_visible(mask, t, lo, hi, q.device, segments, positions)
        if visible is not None:
            sc.masked_fill_(~visible, float("-inf"))
        m_c = sc.amax(dim=-1)  # -inf on a row that sees nothing in this chunk
        p = sc.sub_(torch.where(torch.isfinite(m_c), m_c, 0.0).unsqueeze(-1)).exp_()
        pv = torch.einsum("bkgts,bskd->bkgtd", p, v[:, lo:hi].float())
        if m is None:  # the first chunk starts the sums (one chunk — a small block — is the plain softmax)
            m, total, acc = m_c, p.sum(dim=-1), pv
            continue
        # the online softmax: rescale both sides to the new row max (exp(-inf - x) = 0)
        m_new = torch.maximum(m, m_c)
        safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        old, new = torch.exp(m - safe), torch.exp(torch.where(torch.isfinite(m_c), m_c, 0.0) - safe)
        total.mul_(old).add_(p.sum(dim=-1).mul_(new))
        acc.mul_(old.unsqueeze(-1)).add_(pv.mul_(new.unsqueeze(-1)))
        m = m_new
    has_key = total > 0
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    safe = torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(has_key, m_safe + torch.log(safe), torch.full_like(total, float("-inf")))
    o = (acc / safe.unsqueeze(-1)).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return o, lse.reshape(b, h, t)


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None,
                        positions=None, softcap=None, *, chunk: int | None = None):
    """Portable backward with the global ``o`` and ``lse``, per key chunk:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse) (∘ the cap's slope with ``softcap``), dQ = scale·dS K (summed over chunks),
    dK = scale·dSᵀ Q, dV = Pᵀ dO (each chunk's own rows).
    Masked pairs have P = 0, so a row with no visible key contributes nothing."""
    b, t, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    g = h // hk
    check_mask_arrays(mask, t, s, segments, positions, b)
    lse_g = lse.float().reshape(b, hk, g, t, 1)
    do_g = do.float().reshape(b, t, hk, g, d)
    q_g = q.float().reshape(b, t, hk, g, d)
    delta = torch.einsum("btkgd,btkgd->bkgt", do_g, o.float().reshape(b, t, hk, g, d))
    if dlse is not None:
        delta = delta - dlse.float().reshape(b, hk, g, t)
    dq = torch.zeros((b, t, hk, g, d), device=q.device)
    dk = torch.empty((b, s, hk, d), device=q.device)
    dv = torch.empty((b, s, hk, d), device=q.device)
    c = chunk or key_chunk(t, s)
    for lo in range(0, s, c):
        hi = min(s, lo + c)
        k_c, v_c = k[:, lo:hi].float(), v[:, lo:hi].float()
        sc, slope = _capped(_scores(q, k_c, scale), softcap)
        p = sc.sub_(lse_g).exp_()
        visible = chunk_visible(mask, t, lo, hi, q.device, segments, positions)
        if visible is not None:
            p.masked_fill_(~visible, 0.0)
        dv[:, lo:hi] = torch.einsum("bkgts,btkgd->bskd", p, do_g)
        ds = torch.einsum("btkgd,bskd->bkgts", do_g, v_c).sub_(delta.unsqueeze(-1)).mul_(p)
        ds = (ds if slope is None else ds.mul_(slope)).mul_(scale)
        dq.add_(torch.einsum("bkgts,bskd->btkgd", ds, k_c))
        dk[:, lo:hi] = torch.einsum("bkgts,btkgd->bskd", ds, q_g)
    return dq.reshape(b, t, h, d), dk, dv


register_backend(BlockBackend("reference", reference_block_fwd, reference_block_bwd,
                              supports=lambda mask, dtype, softcap=False: True))  # every mask, dtype, softcap
