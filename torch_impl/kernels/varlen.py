"""Backend ``"aten_varlen"``: document-masked blocks on FlashAttention-2's varlen kernels
(``aten._flash_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k``, CUDA).

A document-masked block whose ids form one run per document (``seqplan.documents``) is a batch of
independent attention problems; the varlen kernel runs them from cumulative offsets, so a packed
32k sequence costs its documents' pairs, not the [t, s] scores. Why the underscore aten ops: the
public ``torch.nn.attention.varlen.varlen_attn`` returns lse only through ``return_aux`` and its
registered backward uses its own o and lse, while the ring's block backward needs the *global*
o and lse; the ops' argument lists can change between torch releases, so they are used here and
nowhere else, and checked on a GPU (``benchmarks``' verified rows, ``tests/gpu``).

What it takes: bf16 / fp16, FULL blocks and CAUSAL diagonal blocks with documents (the kernel's
causal mask is per run, exact when every run is square — ``document_runs`` checks), and the
blocks of a causal call given ``token_index`` (FULL, the window "key index <= query index" on
per-row token indices, with or without documents: ``index_runs`` plans them — on the per-document
zigzag a diagonal block is one causal run per document, every other block full runs), GQA
natively (FA2 groups query heads over K/V heads). What it routes elsewhere, forward and backward
alike: no documents and no token indices (``aten_flash``'s job), any other window, a strict
block, an lse cotangent, or ids / indices that are not expressible as runs of one mask (the
portable kernel: never guessed). Queries whose document has no key
in the block get o = 0, lse = -inf and zero gradients, and keys no query reads zero dK / dV —
written here, not left to the kernel.
The run list is computed on the host from the block's ids and token indices: the loops' host
copies when they pass them (``seqplan.documents.HostPair``: no device sync), else one
device-to-host copy. A token-index plan (~2 ms a 16k block) is remembered by content
(``seqplan.documents.cached_plan``): a step's layers and a block's backward reuse its forward's. The runs walk
the block's queries and keys in place (a document only one side holds is a run with none of the
other), so no key is gathered and no dK / dV scattered.
"""

from __future__ import annotations

import weakref

import torch

from seqplan.documents import DocumentRuns, HostPair, PrefixRuns, cached_plan, document_runs, index_runs
from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind, by_token_index

from ..block import BlockBackend, register_backend
from ..comm import host_to_device
from .reference import reference_block_bwd, reference_block_fwd

F32 = torch.float32
_RNG: dict = {}


def flash_forward(*args, **kwargs):
    """``aten._flash_attention_forward``, bound in one place (the CPU tests emulate it here)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def flash_backward(*args, **kwargs):
    """``aten._flash_attention_backward``, bound in one place (the CPU tests emulate it here)."""
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


def _host(pair):
    host = getattr(pair, "host", None)  # the loops' host copy (seqplan.documents.HostPair): no sync
    return host if host is not None else tuple(x.cpu().numpy() for x in pair)


def block_runs(mask: BlockMask, segments, positions, dtype) -> tuple[DocumentRuns, bool] | None:
    """(runs, causal) of a document or token-index block a varlen kernel runs exactly, or None
    (the portable kernel's). Shared with ``kernels/fa4``: the plan is the kernel family's, not FA2's."""
    if dtype not in (torch.bfloat16, torch.float16) or mask.kind is MaskKind.STRICT:
        return None
    if mask.window is None:
        if segments is None:
            return None
        causal = mask.kind is MaskKind.CAUSAL
        # once per block and call: the loop's memo (HostPair.memo) hands the backward its forward's
        # run list — the same object, so its device offsets are uploaded once too (run_offsets)
        plan = lambda: document_runs(*_host(segments), causal)
        runs = segments.remembered(("document_runs", causal), plan) if isinstance(segments, HostPair) else plan()
        return None if runs is None else (runs, causal)
    if not by_token_index(mask) or positions is None:
        return None
    return cached_plan(index_runs, *(_host(segments) if segments is not None else (None, None)), *_host(positions))


_ON_DEVICE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan object -> {device: its arrays there}


def _on_device(plan, device, arrays) -> tuple:
    """A plan's host ``arrays`` (None stays None) on ``device``, copied once per plan object and
    device — a block's backward, a later layer, takes the same tensors — through pinned memory, so
    a fresh batch's plan does not wait for the GPU's queue (``comm.host_to_device``)."""
    held = _ON_DEVICE.setdefault(plan, {})
    key = torch.device(device)
    if key not in held:
        held[key] = tuple(None if x is None else host_to_device(x, device) for x in arrays)
    return held[key]


def run_offsets(runs: DocumentRuns, device):
    """(cu_q, cu_k, empty_rows, unread_keys) of ``runs`` on ``device`` (:func:`_on_device`: a
    block's backward, handed its forward's runs, takes its offsets without a second upload)."""
    return _on_device(runs, device, (runs.cu_q, runs.cu_k, runs.empty_rows, runs.unread_keys))


def _rng_state(device, dtype, d: int):
    """The (rng_state, unused) pair the backward op expects from its forward: with no dropout it
    does not depend on the block, so one tiny varlen forward per (device, dtype, head_dim) gives it."""
    key = (device, dtype, d)
    if key not in _RNG:
        x = torch.zeros((1, 1, d), device=device, dtype=dtype)
        cu = torch.tensor([0, 1], device=device, dtype=torch.int32)
        out = flash_forward(x, x, x, cu, cu, 1, 1, 0.0, False, False)
        _RNG[key] = (out[2], out[3])
    return _RNG[key]


def varlen_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    plan = block_runs(mask, segments, positions, q.dtype)
    if plan is None:
        return reference_block_fwd(q, k, v, mask, scale, segments, positions)
    runs, causal = plan
    if runs.max_k == 0 or runs.max_q == 0:  # no query's document has a key here
        return nothing_seen(q)
    cu_q, cu_k, empty, _ = run_offsets(runs, q.device)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    o, lse = flash_forward(
        flat(q), flat(k), flat(v), cu_q, cu_k, runs.max_q, runs.max_k, 0.0, causal, False, scale=scale)[:2]
    return unpack_forward(o, lse, empty, q.shape)


def nothing_seen(q):
    """The forward of a block where no query sees a key: o = 0, lse = -inf [b, h, t]."""
    b, t, h, _ = q.shape
    return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
            torch.full((b, h, t), float("-inf"), dtype=F32, device=q.device))


def no_grads(q, k, v):
    """The backward of a block where no query sees a key (or of the rows and keys a crop leaves
    out): dq, dk, dv all zero."""
    return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def unpack_forward(o, lse, empty, shape):
    """A varlen forward's packed o [b·t, h, d] and lse [h, b·t] as the block interface's [b, t, h, d]
    and float32 [b, h, t]; rows with no key here (``empty``) o = 0, lse = -inf, written here."""
    b, t, h, d = shape
    lse = lse.float()
    if empty is not None:
        o = o.masked_fill(empty[:, None, None], 0.0)
        lse = lse.masked_fill(empty[None, :], float("-inf"))
    return o.reshape(b, t, h, d), lse.reshape(h, b, t).transpose(0, 1).contiguous()


def varlen_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
    plan = None if dlse is not None else block_runs(mask, segments, positions, q.dtype)
    if plan is None:
        return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
    runs, causal = plan
    b, t, h, d = q.shape
    if runs.max_k == 0 or runs.max_q == 0:
        return no_grads(q, k, v)
    cu_q, cu_k, empty, unread = run_offsets(runs, q.device)
    dtype = q.dtype
    lse_packed = pack_lse(lse, empty)
    rng, unused = _rng_state(q.device, dtype, d)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    dq, dk, dv = flash_backward(
        flat(do.to(dtype)), flat(q), flat(k), flat(v), flat(o.to(dtype)), lse_packed, cu_q, cu_k, runs.max_q,
        runs.max_k, 0.0, causal, rng, unused, scale=scale)
    return unpack_grads(dq, dk, dv, empty, unread, q.shape, k.shape)


def pack_lse(lse, empty=None):
    """The block's lse [b, h, t] as a varlen backward's float32 [h, b·t]; rows with no key here
    (``empty``) get a finite lse (their gradients are zeroed after the call: :func:`unpack_grads`)."""
    b, h, t = lse.shape
    packed = lse.float().transpose(0, 1).reshape(h, b * t).contiguous()
    return packed if empty is None else packed.masked_fill(empty[None, :], 0.0)


def unpack_grads(dq, dk, dv, empty, unread, q_shape, kv_shape):
    """A varlen backward's packed gradients in the block's shapes; queries with no key here
    (``empty``) and keys no query reads (``unread``) zero, written here rather than trusted to the kernel."""
    if empty is not None:
        dq = dq.masked_fill(empty[:, None, None], 0.0)
    if unread is not None:
        dk, dv = (x.masked_fill(unread[:, None, None], 0.0) for x in (dk, dv))
    return dq.reshape(q_shape), dk.reshape(kv_shape), dv.reshape(kv_shape)


def _supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
    if softcap:  # the FA2 varlen op soft-caps nothing: a capped block runs on the portable kernel (block.capped_backend)
        return False
    if dtype not in LOW_PRECISION or mask.kind is MaskKind.STRICT:
        return False
    return (mask.documents and mask.window is None) or by_token_index(mask)


register_backend(BlockBackend("aten_varlen", varlen_block_fwd, varlen_block_bwd, supports=_supports,
                              available=torch.cuda.is_available))


# ---- one call for a device's queries against every key (all-gather-KV: seqplan.documents.prefix_runs) ----

def one_call_takes(q) -> bool:
    """Whether the one call runs on FA2's varlen ops for queries like ``q`` (its dtypes)."""
    return q.dtype in (torch.bfloat16, torch.float16)


def prefix_offsets(plan: PrefixRuns, device):
    """The plan's offsets and key index on ``device`` (:func:`_on_device`: a cached plan serves a
    step's layers and both passes — one host-to-device copy, not one per call)."""
    return _on_device(plan, device, (plan.cu_q, plan.cu_k, plan.key_index))


def plan_keys(plan: PrefixRuns, index, *packed):
    """The keys (and values) ``plan`` reads from the packed [n, hk, d] tensors, in its order: a
    view where they are one range in order (``PrefixRuns.key_range``), else a gather."""
    if plan.key_range is not None:
        lo, hi = plan.key_range
        return tuple(x.narrow(0, lo, hi - lo) for x in packed)
    return tuple(x.index_select(0, index) for x in packed)


def plan_key_grads(plan: PrefixRuns, index, shape, *grads):
    """Each of ``grads`` (one row per key ``plan`` read) back at its packed key [n, hk, d] in
    float32, summed where a key was read for several runs — a slice copy where the plan reads one
    range in order (bitwise the same as the scatter-add into zeros)."""
    out = []
    for g in grads:
        if plan.key_range is not None:  # only the keys outside the range need zeros
            lo, hi = plan.key_range
            full = torch.empty(shape, dtype=F32, device=g.device)
            full[:lo], full[hi:] = 0, 0
            full[lo:hi] = g
        else:
            full = torch.zeros(shape, dtype=F32, device=g.device).index_add_(0, index, g.float())
        out.append(full)
    return tuple(out)


def prefix_forward(q, k_packed, v_packed, plan: PrefixRuns, scale: float):
    """ONE FA2 varlen forward of ``q`` [b, t, h, d] against the keys ``plan`` gathers from
    ``k_packed`` / ``v_packed`` [n, hk, d] (every key of the sequence, packed; ``plan.key_index``
    indexes them): each run bottom-right causal over its document's key prefix. Returns
    (o [b, t, h, d] in q's dtype, lse [b, h, t] float32) — every query sees at least its own key."""
    b, t, h, d = q.shape
    cu_q, cu_k, index = prefix_offsets(plan, q.device)
    o, lse = flash_forward(q.reshape(b * t, h, d), *plan_keys(plan, index, k_packed, v_packed),
                           cu_q, cu_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale)[:2]
    return o.reshape(b, t, h, d), lse.float().reshape(h, b, t).transpose(0, 1).contiguous()


def prefix_backward(do, q, k_packed, v_packed, o, lse, plan: PrefixRuns, scale: float):
    """The backward of :func:`prefix_forward` given the GLOBAL o and lse: (dq in q's dtype, dk,
    dv float32 [n, hk, d] — every packed key's gradient, the gathered keys' scattered back and
    summed where a key was gathered for several runs)."""
    b, t, h, d = q.shape
    cu_q, cu_k, index = prefix_offsets(plan, q.device)
    dtype = q.dtype
    rng, unused = _rng_state(q.device, dtype, d)
    flat = lambda x: x.to(dtype).reshape(b * t, h, d)
    lse_packed = pack_lse(lse)
    dq, dk, dv = flash_backward(flat(do), flat(q), *plan_keys(plan, index, k_packed, v_packed),
                                flat(o), lse_packed, cu_q, cu_k, plan.max_q, plan.max_k, 0.0, True, rng, unused,
                                scale=scale)
    return dq.reshape(q.shape), *plan_key_grads(plan, index, k_packed.shape, dk, dv)
