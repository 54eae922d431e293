"""The local block kernel: attention of a query block against one K/V block, with its LSE.

    block_fwd(q, k, v, mask, scale)                   -> (o, lse)      o: [b, t, h, d] f32 or input dtype
    block_bwd(do, q, k, v, o, lse, mask, scale, dlse) -> (dq, dk, dv)  float32 or the input dtype

``mask`` is a :class:`schedule.BlockMask` (full / causal / strict today); each backend says which
masks and dtypes it takes (``BlockBackend.supports``), so a caller can refuse or reroute a block
before any collective. ``block_bwd`` takes the *global* ``o`` and ``lse``; the aten adapters return MHA gradients in the
input dtype (a float32 copy of each would be a transient the size of two K/V shards), and every
caller accumulates into float32 buffers (``Tensor.add_`` promotes in place). Backends are
pluggable by name:

- ``"reference"``: portable einsum, float32 accumulation, any device (the default fallback);
- ``"aten_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward;
- ``"aten_flash"`` / ``"aten_cudnn"``: the CUDA flash / cuDNN SDPA ops and their backwards.

The aten ops take [b, h, t, d], equal head counts and no lse cotangent; the adapters below expand
GQA heads (and sum their gradients back), fold ``dlse`` into the reference path, and express the
strict mask as a causal block shifted by one row (row 0 sees nothing). Each op's LSE shape and
strides (cuDNN ``[b, h, t, 1]``, CPU non-contiguous) are normalised in ``_lse_bht`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .schedule import CAUSAL_MASK, BlockMask, MaskKind

F32 = torch.float32


@dataclass(frozen=True)
class BlockBackend:
    """A pair of block kernels with the signatures in the module docstring."""

    name: str
    fwd: Callable
    bwd: Callable
    # supports(mask, dtype name) -> whether the kernels compute that block mask in that dtype.
    supports: Callable[[BlockMask, str], bool] = lambda mask, dtype: True


_BACKENDS: dict[str, BlockBackend] = {}


def register_backend(backend: BlockBackend) -> None:
    """Make ``backend`` selectable by name (tests use this to count kernel calls)."""
    _BACKENDS[backend.name] = backend


# Run-to-run determinism, measured on H200 (``python -m parity determinism``, 2026-11-22): the
# fused backwards accumulate dq with atomics, so dq differs between identical runs for
# aten_flash and aten_cudnn; torch.use_deterministic_algorithms(True) makes aten_flash
# deterministic (torch picks FlashAttention's deterministic backward) but not aten_cudnn.
# "reference" and every forward were bitwise reproducible.
NONDETERMINISTIC_WHEN_REQUESTED = frozenset({"aten_cudnn"})


def get_backend(name: str = "auto", *, deterministic: bool = False) -> BlockBackend:
    """The backend called ``name``; ``"auto"`` is the portable reference (fast kernels are
    chosen explicitly until the GPU benchmarks pick a default). ``deterministic=True`` (the API's
    ``deterministic`` argument, which defaults to ``torch.are_deterministic_algorithms_enabled()``)
    refuses a backend measured non-deterministic in that mode — or warns, under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, as torch's own ops do."""
    if name == "auto":
        name = "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown block backend {name!r}; registered: {sorted(_BACKENDS)}")
    if name in NONDETERMINISTIC_WHEN_REQUESTED and deterministic:
        message = (f"block backend {name!r} is not deterministic (its backward's dq differs between identical "
                   "runs) and deterministic=True (by default: torch.use_deterministic_algorithms(True) is set): "
                   "use 'aten_flash' (deterministic in that mode) or 'reference'")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(message)
        import warnings

        warnings.warn(message, stacklevel=2)
    return _BACKENDS[name]


def _mask_matrix(mask: BlockMask, t: int, s: int, device):
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
    visible = _mask_matrix(mask, t, k.shape[1], q.device)
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
    visible = _mask_matrix(mask, t, k.shape[1], q.device)
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


# ---- aten SDPA adapters -------------------------------------------------------------------------

def _lse_bht(lse, b: int, h: int, t: int):
    """Every op's LSE as a contiguous float32 [b, h, t] (cuDNN: [b, h, t, 1]; CPU: strided)."""
    return lse.reshape(b, h, t).float().contiguous()


def _expand(x, heads: int):
    """[b, s, hk, d] -> [b, h, s, d] (the aten ops want equal head counts, head-major)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2).transpose(1, 2)


def _fold_heads(dx, kv_heads: int):
    """[b, h, s, d] gradient of an expanded K/V -> [b, s, hk, d], summed over each group."""
    b, h, s, d = dx.shape
    return dx.reshape(b, kv_heads, h // kv_heads, s, d).sum(2).transpose(1, 2)


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


def _aten_ops(name: str):
    ops = torch.ops.aten
    if name == "aten_cpu":
        fwd = lambda q, k, v, causal, scale: ops._scaled_dot_product_flash_attention_for_cpu(  # noqa: E731
            q, k, v, 0.0, causal, scale=scale)[:2]
        bwd = lambda do, q, k, v, o, lse, causal, scale: ops._scaled_dot_product_flash_attention_for_cpu_backward(  # noqa: E731
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
    op_fwd, op_bwd = _aten_ops(name)

    def fwd(q, k, v, mask: BlockMask, scale: float):
        if mask.kind is MaskKind.STRICT:  # strict lower triangle = causal block of rows 1.. vs keys ..t-1
            o_r, lse_r = fwd(q[:, 1:], k[:, :-1], v[:, :-1], CAUSAL_MASK, scale)
            b, _, h, d = q.shape
            o0 = torch.zeros((b, 1, h, d), dtype=o_r.dtype, device=q.device)
            lse0 = torch.full((b, h, 1), float("-inf"), dtype=F32, device=q.device)
            return torch.cat([o0, o_r], 1), torch.cat([lse0, lse_r], 2)
        b, t, h, d = q.shape
        o, lse = op_fwd(q.transpose(1, 2), _expand(k, h), _expand(v, h), mask.kind is MaskKind.CAUSAL, scale)
        return o.transpose(1, 2), _lse_bht(lse, b, h, t)  # o in the input dtype: merged into float32

    def bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None):
        if dlse is not None:  # the ops take no lse cotangent (None when lse is not used)
            return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse)
        if mask.kind is MaskKind.STRICT:
            dq, dk, dv = (torch.zeros(x.shape, dtype=F32, device=x.device) for x in (q, k, v))
            dq_r, dk_r, dv_r = bwd(do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse[..., 1:], CAUSAL_MASK,
                                   scale)
            dq[:, 1:], dk[:, :-1], dv[:, :-1] = dq_r, dk_r, dv_r
            return dq, dk, dv
        b, t, h, d = q.shape
        hk = k.shape[2]
        dtype = q.dtype
        grads = op_bwd(do.to(dtype).transpose(1, 2), q.transpose(1, 2), _expand(k, h), _expand(v, h),
                       o.to(dtype).transpose(1, 2), lse.float().contiguous(), mask.kind is MaskKind.CAUSAL, scale)
        dq, dk, dv = grads[:3]
        if hk != h:  # GQA: sum the expanded heads' gradients in float32
            return dq.transpose(1, 2), _fold_heads(dk.float(), hk), _fold_heads(dv.float(), hk)
        # In the input dtype: callers add them into float32 accumulators in place.
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    return BlockBackend(name, fwd, bwd)


for _name in ("aten_cpu", "aten_flash", "aten_cudnn"):
    register_backend(_make_aten_backend(_name))
