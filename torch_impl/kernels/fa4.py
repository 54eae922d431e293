"""Backend ``"fa4"``: blocks on FlashAttention-4 (pip ``flash-attn-4``, the CuTe DSL's
``flash_attn.cute``; bf16 / fp16; available on Hopper (SM90) only, the generation its GPU tier
verified — Blackwell's head-dim limits differ), forward and backward, soft-capped when the
call soft-caps, and all-gather-KV's one varlen call per device (``allgather``).

Two entries of one kernel family. A document block or a token-index block goes through the varlen
entry: the run list ``aten_varlen`` plans (``varlen.block_runs``: one run per document, in place,
no gather). A block without documents goes through the dense entry, the kernel the one-GPU FA4
ceiling times: a plain FULL block, a square CAUSAL diagonal block, and a windowed block whose parts
are contiguous ranges, cropped to its band first (``seqplan.bands``, as ``aten_window`` and JAX's
fa3 adapter do) and run with FA4's own sliding window. Why the library's private
``_flash_attn_fwd`` / ``_flash_attn_bwd`` rather than ``flash_attn_func``: the ring's block backward
needs the *global* o and lse (the public autograd function's backward uses its own), as
``varlen.py`` uses aten's underscore ops. They are bound in one place (:func:`fa4_forward`,
:func:`fa4_backward`), which the CPU tests emulate (tests/fa4_ops.py).

FA4 compiles a kernel variant per distinct ``max_seqlen`` (seconds each, on first use): in packed
training every batch's longest document differs, so the bounds passed are rounded up to
:func:`seqlen_bucket` (powers of two from 128, capped at the packed length) — a larger bound is
still a bound, costing at most idle tiles. The causal mask and the window are aligned bottom-right
per run (the prefix runs of the one call and the bands rely on it); FA4 reads a negative window
size as a window, so "unbounded" is passed as None, and a window that bounds nothing in the
cropped block is dropped (a band that is a causal diagonal runs FA4's causal kernel, not its local one).

What it routes elsewhere (the portable kernel, never guessed): fp32, a strict block, a window with
documents (other than the token-index one), a windowed block whose parts are not contiguous ranges
(stripe, a zigzag block spanning both chunks), a non-square CAUSAL block, an lse cotangent, ids
that are not runs, a head_dim outside FA4's (8..256, a multiple of 8), and a backward with head_dim
> 192 (not supported on SM90: such a block runs both passes on ``aten_cudnn`` or ``aten_window``,
which "auto" chose for it before FA4). Queries whose document has no key in the block (or no key in its
window) get o = 0, lse = -inf and zero gradients, and keys no query reads zero dK / dV, written
here. Under ``deterministic=True`` (torch's deterministic switch, held by the call) the backward
runs in FA4's deterministic mode, and a plain block FA4's backward cannot take goes to
``aten_flash`` instead of ``aten_cudnn``: measured bitwise reproducible on one H200
(docs/decisions.md, "Deterministic mode holds torch's switch; FA4's deterministic backward").
"""

from __future__ import annotations

import functools

import torch

from seqplan.bands import Band
from seqplan.documents import DocumentRuns, PrefixRuns
from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind, by_token_index

from ..block import BlockBackend, get_backend, register_backend
from .reference import reference_block_bwd, reference_block_fwd
from .varlen import (
    block_runs,
    no_grads,
    nothing_seen,
    pack_lse,
    plan_key_grads,
    plan_keys,
    prefix_offsets,
    run_offsets,
    unpack_forward,
    unpack_grads,
)
from .window import block_band

# FA4's head dims: 8..256 and a multiple of 8 in bf16 / fp16 (its own check asserts, mid-call), the
# SM90 backward only up to 192 — outside them the block runs on the portable kernel
HEAD_DIMS, HEAD_DIM_ALIGNMENT, MAX_BWD_HEAD_DIM = (8, 256), 8, 192
SMALLEST_BUCKET = 128


def fa4_forward(*args, **kwargs):
    """``flash_attn.cute.interface._flash_attn_fwd``, bound in one place (the CPU tests emulate it)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    return _flash_attn_fwd(*args, **kwargs)


def fa4_backward(*args, **kwargs):
    """``flash_attn.cute.interface._flash_attn_bwd``, bound in one place (the CPU tests emulate it)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    return _flash_attn_bwd(*args, **kwargs)


def _backward(*args, **kwargs):
    """:func:`fa4_backward` in FA4's deterministic mode while torch's deterministic switch is on (a
    call with ``deterministic=True`` holds it: ``torch_impl.config.deterministic_kernels``): dq, and
    with GQA dK / dV, accumulated in a fixed order instead of by atomics."""
    return fa4_backward(*args, deterministic=torch.are_deterministic_algorithms_enabled(), **kwargs)


@functools.cache
def available() -> bool:
    """CUDA on compute capability 9.x (Hopper: where the GPU tier verified it), and
    ``flash_attn.cute`` importable."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        return False
    return True


def seqlen_bucket(n: int, cap: int) -> int:
    """``max_seqlen`` as passed to FA4: the smallest power of two >= n, at least 128, at most
    ``cap`` (the packed length, itself >= n) — a short static set, so the kernel variants compiled
    for a stream of batches stop growing after the first few."""
    return min(cap, max(SMALLEST_BUCKET, 1 << max(0, int(n) - 1).bit_length()))


def _head_dim_fits(d: int, backward: bool) -> bool:
    """Whether FA4 takes head_dim ``d`` (the backward: SM90's bound too)."""
    return HEAD_DIMS[0] <= d <= (MAX_BWD_HEAD_DIM if backward else HEAD_DIMS[1]) and d % HEAD_DIM_ALIGNMENT == 0


def _fits(q, backward: bool) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16) and _head_dim_fits(q.shape[-1], backward)


def _plan(mask: BlockMask, segments, positions, q, backward: bool = False) -> tuple[DocumentRuns, bool] | None:
    """(runs, causal) of a document or token-index block FA4's varlen entry runs exactly, or None."""
    if not _fits(q, backward) or mask.kind is MaskKind.STRICT:
        return None
    return block_runs(mask, segments, positions, q.dtype)


def _dense_band(mask: BlockMask, positions, q, k) -> Band | None | str:
    """The part of a block without documents that FA4's dense entry runs (``seqplan.bands``
    convention: rows [i0, i1), keys [j0, j1), window sizes -1 for unbounded), None when the block
    sees nothing, or "portable". Decided on the backward's bounds in both passes: one kernel for
    both passes of a block."""
    (t, s), kind = (q.shape[1], k.shape[1]), mask.kind
    if not _fits(q, backward=True) or kind is MaskKind.STRICT:
        return "portable"
    if mask.window is not None:
        return "portable" if positions is None else block_band(mask, t, s, positions)
    if kind is MaskKind.CAUSAL and t != s:  # the ring's causal blocks are square diagonals
        return "portable"
    return Band(0, t, 0, s, -1, 0 if kind is MaskKind.CAUSAL else -1)


def _dense_mask(cut: Band) -> dict:
    """FA4's causal / window keywords for a band: unbounded (-1) as None, a size that bounds
    nothing in the cropped [t, s] grid dropped (j - i stays in [-(t - 1), s - 1]), and a window
    (None, 0) as ``causal`` (FA4's causal tiles, not its local ones)."""
    t, s = cut.i1 - cut.i0, cut.j1 - cut.j0
    left = None if cut.left < 0 or cut.left >= s - 1 else cut.left
    right = None if cut.right < 0 or cut.right >= t - 1 else cut.right
    if left is None and right == 0:
        return {"causal": True}
    return {"causal": False, "window_size_left": left, "window_size_right": right}


def _whole(cut: Band, t: int, s: int) -> bool:
    return (cut.i0, cut.i1, cut.j0, cut.j1) == (0, t, 0, s)


def _dense_fwd(q, k, v, cut: Band, scale: float, softcap):
    rows, cols = slice(cut.i0, cut.i1), slice(cut.j0, cut.j1)
    crop = lambda x, part: x[:, part].contiguous()
    o, lse = fa4_forward(crop(q, rows), crop(k, cols), crop(v, cols), softmax_scale=scale, softcap=softcap,
                         return_lse=True, **_dense_mask(cut))[:2]
    if _whole(cut, q.shape[1], k.shape[1]):
        return o, lse.float()
    o_full, lse_full = nothing_seen(q)  # rows outside the band see no key
    o_full[:, rows], lse_full[:, :, rows] = o, lse.float()
    return o_full, lse_full


def _dense_bwd(do, q, k, v, o, lse, cut: Band, scale: float, softcap):
    rows, cols = slice(cut.i0, cut.i1), slice(cut.j0, cut.j1)
    crop = lambda x, part: x[:, part].to(q.dtype).contiguous()
    grads = _backward(crop(q, rows), crop(k, cols), crop(v, cols), crop(o, rows), crop(do, rows),
                         lse[:, :, rows].float().contiguous(), scale, softcap=softcap or 0.0, **_dense_mask(cut))[:3]
    if _whole(cut, q.shape[1], k.shape[1]):
        return grads
    dq, dk, dv = no_grads(q, k, v)
    dq[:, rows], dk[:, cols], dv[:, cols] = grads
    return dq, dk, dv


def _bounds(runs: DocumentRuns, q, k) -> dict:
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    return {"max_seqlen_q": seqlen_bucket(runs.max_q, b * t), "max_seqlen_k": seqlen_bucket(runs.max_k, b * s)}


def _fused_instead(q, mask: BlockMask, softcap) -> BlockBackend | None:
    """The fused backend "auto" chose before FA4 was installed, for an uncapped CUDA block without
    documents FA4 cannot run (its SM90 backward stops at head_dim 192): ``aten_cudnn`` for a plain
    block (under torch's deterministic switch ``aten_flash``, as deterministic mode routes),
    ``aten_window`` for a windowed one (FA2, head dims to 256) — or None (the portable kernel)."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and softcap is None and not mask.documents
            and mask.kind is not MaskKind.STRICT):
        return None
    plain = "aten_flash" if torch.are_deterministic_algorithms_enabled() else "aten_cudnn"
    backend = get_backend(plain if mask.window is None else "aten_window")
    return backend if backend.available() else None


def fa4_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None, softcap=None):
    if segments is None and not by_token_index(mask):
        cut = _dense_band(mask, positions, q, k)
        if cut is None:
            return nothing_seen(q)
        if cut != "portable":
            return _dense_fwd(q, k, v, cut, scale, softcap)
        fused = _fused_instead(q, mask, softcap)
        if fused is not None:
            return fused.fwd(q, k, v, mask, scale, positions=positions)
        return reference_block_fwd(q, k, v, mask, scale, segments, positions, softcap=softcap)
    plan = _plan(mask, segments, positions, q)
    if plan is None:
        return reference_block_fwd(q, k, v, mask, scale, segments, positions, softcap=softcap)
    runs, causal = plan
    if runs.max_k == 0 or runs.max_q == 0:  # no query's document has a key here
        return nothing_seen(q)
    cu_q, cu_k, empty, _ = run_offsets(runs, q.device)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    o, lse = fa4_forward(flat(q), flat(k), flat(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **_bounds(runs, q, k),
                         softmax_scale=scale, causal=causal, softcap=softcap, return_lse=True)[:2]
    return unpack_forward(o, lse, empty, q.shape)


def fa4_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None,
                  softcap=None):
    portable = lambda: reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions, softcap=softcap)
    if dlse is not None:
        return portable()
    if segments is None and not by_token_index(mask):
        cut = _dense_band(mask, positions, q, k)
        if cut is None:
            return no_grads(q, k, v)
        if cut != "portable":
            return _dense_bwd(do, q, k, v, o, lse, cut, scale, softcap)
        fused = _fused_instead(q, mask, softcap)
        return portable() if fused is None else fused.bwd(do, q, k, v, o, lse, mask, scale, positions=positions)
    plan = _plan(mask, segments, positions, q, backward=True)
    if plan is None:
        return portable()
    runs, causal = plan
    if runs.max_k == 0 or runs.max_q == 0:
        return no_grads(q, k, v)
    cu_q, cu_k, empty, unread = run_offsets(runs, q.device)
    flat = lambda x: x.to(q.dtype).reshape(-1, *x.shape[2:])
    dq, dk, dv = _backward(flat(q), flat(k), flat(v), flat(o), flat(do), pack_lse(lse, empty), scale, causal,
                              softcap or 0.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **_bounds(runs, q, k))[:3]
    return unpack_grads(dq, dk, dv, empty, unread, q.shape, k.shape)


def _supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
    if dtype not in LOW_PRECISION or mask.kind is MaskKind.STRICT:
        return False
    return mask.window is None or by_token_index(mask) or not mask.documents


register_backend(BlockBackend("fa4", fa4_block_fwd, fa4_block_bwd, supports=_supports, available=available))


# ---- one call for a device's queries against every key (all-gather-KV: seqplan.documents.prefix_runs) ----

def one_call_takes(q) -> bool:
    """Whether the one call's forward and backward run on FA4 for queries like ``q``."""
    return _fits(q, backward=True)


def _prefix_bounds(plan: PrefixRuns, total_q: int, total_k: int) -> dict:
    return {"max_seqlen_q": seqlen_bucket(plan.max_q, total_q), "max_seqlen_k": seqlen_bucket(plan.max_k, total_k)}


def prefix_forward(q, k_packed, v_packed, plan: PrefixRuns, scale: float):
    """``varlen.prefix_forward`` on FA4: ONE varlen forward of ``q`` [b, t, h, d] against the
    keys ``plan`` gathers, each run bottom-right causal over its document's key prefix."""
    b, t, h, d = q.shape
    cu_q, cu_k, index = prefix_offsets(plan, q.device)
    o, lse = fa4_forward(q.reshape(b * t, h, d), *plan_keys(plan, index, k_packed, v_packed),
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **_prefix_bounds(plan, b * t, len(index)),
                         softmax_scale=scale, causal=True, return_lse=True)[:2]
    return o.reshape(b, t, h, d), lse.float().reshape(h, b, t).transpose(0, 1).contiguous()


def prefix_backward(do, q, k_packed, v_packed, o, lse, plan: PrefixRuns, scale: float):
    """``varlen.prefix_backward`` on FA4: (dq, dk, dv float32 [n, hk, d], the gathered keys'
    gradients scattered back and summed)."""
    b, t, h, d = q.shape
    cu_q, cu_k, index = prefix_offsets(plan, q.device)
    flat = lambda x: x.to(q.dtype).reshape(b * t, h, d)
    dq, dk, dv = _backward(flat(q), *plan_keys(plan, index, k_packed, v_packed), flat(o),
                              flat(do), pack_lse(lse), scale, True, 0.0, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, **_prefix_bounds(plan, b * t, len(index)))[:3]
    return dq.reshape(q.shape), *plan_key_grads(plan, index, k_packed.shape, dk, dv)
