"""Backends ``"aten_cpu"``, ``"aten_flash"``, ``"aten_cudnn"``: torch's fused SDPA kernels.

    aten_cpu:   aten._scaled_dot_product_flash_attention_for_cpu and its backward
    aten_flash: aten._scaled_dot_product_flash_attention (CUDA, FlashAttention-2) and its backward
    aten_cudnn: aten._scaled_dot_product_cudnn_attention (CUDA, cuDNN) and its backward

Why the underscore aten ops (torch internals): the ring's block backward needs the *global* o and
lse, and the public ``F.scaled_dot_product_attention`` returns no lse and differentiates only with
its own. The ops' argument lists can change between torch releases: they are used here and
nowhere else, and checked on a GPU by ``tests/gpu/test_one_gpu_kernels.py``.

The ops take [b, h, t, d] and no lse cotangent. They take grouped K/V heads (GQA) as they are and
return dK/dV at the K/V head count — checked against a float32 truth on the CPU (torch 2.13) and
on an H200 (torch 2.11, ``benchmarks/gqa_probe.py``, 2026-11-27), and by the GPU tier's GQA
cases — so the adapters pass K/V through unexpanded (expanding them cost a copy of each K/V block
per call and a float32 sum of the gradients). The adapters send a backward with ``dlse`` to the portable kernel,
and express the strict mask as a causal block shifted by one row (row 0 sees nothing). The ops
have no document mask (packed ``segment_ids``) and, as adapted here, no window: ``supports``
says False for either, so "auto" never routes such a block here, and one given to these backends
anyway (a caller named one) runs, forward and backward, on the portable kernel
(``kernels/reference.py``) — the same documented routing as the ``dlse`` fallback. (A block the
window covers entirely reaches the kernels without it: the loops drop a window no pair needs.) Each op's
LSE shape and strides (cuDNN ``[b, h, t, 1]``, CPU non-contiguous) are normalised in
``_lse_bht`` only (inside ``aten_ops``). Forward o and the gradients come back in the input dtype (a float32 copy of
each would be a transient the size of two K/V shards); every caller accumulates into float32
buffers (``Tensor.add_`` promotes in place). The ops do not soft-cap logits: ``supports`` refuses
``softcap``, and the block layer runs a capped block on the portable kernel
(``block.capped_backend``), never here.
"""

from __future__ import annotations

import torch

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import CAUSAL_MASK, BlockMask, MaskKind

from ..block import BlockBackend, register_backend
from .reference import reference_block_bwd, reference_block_fwd

F32 = torch.float32


def _lse_bht(lse, b: int, h: int, t: int):
    """Every op's LSE as a contiguous float32 [b, h, t] (cuDNN: [b, h, t, 1]; CPU: strided)."""
    return lse.reshape(b, h, t).float().contiguous()


_AUX: dict = {}


def _aux_outputs(op, device, dtype, d: int):
    """The non-varlen, dropout-free auxiliaries (cum_seq_q/k: undefined; philox seed/offset) that
    the CUDA backward ops expect back from their forward. They do not depend on the block's
    values, so one tiny forward per (op, device, dtype, head_dim) supplies them for every block;
    passing *defined* empty tensors instead would switch the ops into varlen (nested) mode."""
    key = (op, device, dtype, d)
    if key not in _AUX:
        x = torch.zeros((1, 1, 1, d), device=device, dtype=dtype)
        _AUX[key] = op(x)
    return _AUX[key]


def _heads_first(x):
    """[b, t, h, d] <-> the ops' [b, h, t, d] (a view)."""
    return x.transpose(1, 2)


def aten_ops(name: str):
    """The (forward, backward) op pair of backend ``name`` on [b, h, t, d] (K/V may have fewer heads:
    GQA, as the adapters pass them; ``benchmarks.gqa_probe`` checks that on the machine at hand):
    ``fwd(q, k, v, causal, scale) -> (o, lse)`` with lse a contiguous float32 [b, h, t] whatever
    the op's own form, ``bwd(do, q, k, v, o, lse, causal, scale)`` -> the op's outputs (dq, dk, dv first)."""
    op_fwd, op_bwd = _raw_ops(name)

    def fwd(q, k, v, causal, scale):
        o, lse = op_fwd(q, k, v, causal, scale)
        return o, _lse_bht(lse, *q.shape[:3])

    return fwd, op_bwd


def _raw_ops(name: str):
    """The op pair as torch declares it (each op's lse in its own shape and strides)."""
    ops = torch.ops.aten
    if name == "aten_cpu":
        fwd = lambda q, k, v, causal, scale: ops._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)[:2]
        bwd = lambda do, q, k, v, o, lse, causal, scale: ops._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, scale=scale)
        return fwd, bwd
    if name == "aten_flash":
        def flash(q, k, v, causal=False, scale=None):
            return ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)

        def fwd(q, k, v, causal, scale):
            return flash(q, k, v, causal, scale)[:2]

        def bwd(do, q, k, v, o, lse, causal, scale):
            aux = _aux_outputs(lambda x: flash(x, x, x), q.device, q.dtype, q.shape[-1])
            cum_q, cum_k, seed, offset = aux[2], aux[3], aux[6], aux[7]
            return ops._scaled_dot_product_flash_attention_backward(
                do, q, k, v, o, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
        return fwd, bwd
    if name == "aten_cudnn":
        def cudnn(q, k, v, causal=False, scale=None):
            return ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)

        def fwd(q, k, v, causal, scale):
            return cudnn(q, k, v, causal, scale)[:2]

        def bwd(do, q, k, v, o, lse, causal, scale):
            aux = _aux_outputs(lambda x: cudnn(x, x, x), q.device, q.dtype, q.shape[-1])
            cum_q, cum_k, seed, offset = aux[2], aux[3], aux[6], aux[7]
            b, h, t = lse.shape
            return ops._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, lse.reshape(b, h, t, 1), seed, offset, None, cum_q, cum_k, t, k.shape[2], 0.0,
                causal, scale=scale)
        return fwd, bwd
    raise ValueError(name)


def _make_aten_backend(name: str) -> BlockBackend:
    """Adapt an aten (fwd, bwd) op pair to the block-kernel signatures."""
    op_fwd, op_bwd = aten_ops(name)

    def fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
        if mask.documents or mask.window is not None:  # not in the ops: the portable kernel (module docstring)
            return reference_block_fwd(q, k, v, mask, scale, segments, positions)
        if mask.kind is MaskKind.STRICT:  # strict lower triangle = causal block of rows 1.. vs keys ..t-1
            o_r, lse_r = fwd(q[:, 1:], k[:, :-1], v[:, :-1], CAUSAL_MASK, scale)
            b, _, h, d = q.shape
            o0 = torch.zeros((b, 1, h, d), dtype=o_r.dtype, device=q.device)
            lse0 = torch.full((b, h, 1), float("-inf"), dtype=F32, device=q.device)
            return torch.cat([o0, o_r], 1), torch.cat([lse0, lse_r], 2)
        o, lse = op_fwd(_heads_first(q), _heads_first(k), _heads_first(v), mask.kind is MaskKind.CAUSAL, scale)
        return _heads_first(o), lse  # o in the input dtype: merged into float32

    def bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None):
        # the ops take no lse cotangent (None when lse is unused), no documents, no window
        if dlse is not None or mask.documents or mask.window is not None:
            return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
        if mask.kind is MaskKind.STRICT:
            dq, dk, dv = (torch.zeros(x.shape, dtype=F32, device=x.device) for x in (q, k, v))
            dq_r, dk_r, dv_r = bwd(do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse[..., 1:], CAUSAL_MASK,
                                   scale)
            dq[:, 1:], dk[:, :-1], dv[:, :-1] = dq_r, dk_r, dv_r
            return dq, dk, dv
        dtype = q.dtype
        grads = op_bwd(_heads_first(do.to(dtype)), _heads_first(q), _heads_first(k), _heads_first(v),
                       _heads_first(o.to(dtype)), lse.float().contiguous(), mask.kind is MaskKind.CAUSAL, scale)
        # In the input dtype, dK/dV at the K/V head count (the ops sum each group's gradients):
        # callers add them into float32 accumulators in place.
        return tuple(_heads_first(g) for g in grads[:3])

    def supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
        return (not softcap and not mask.documents and mask.window is None
                and (name == "aten_cpu" or dtype in LOW_PRECISION))

    return BlockBackend(name, fwd, bwd, supports=supports, available=lambda: _available(name))


def _available(name: str) -> bool:
    if name == "aten_cpu":
        return True
    return torch.cuda.is_available() and (name != "aten_cudnn" or torch.backends.cudnn.is_available())


for _name in ("aten_cpu", "aten_flash", "aten_cudnn"):
    register_backend(_make_aten_backend(_name))
