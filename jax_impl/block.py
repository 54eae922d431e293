"""The local block kernel: attention of a query block against one K/V block, with its LSE.

    block_fwd(q, k, v, mask, scale)                   -> (o, lse)      o: [b, t, h, d] f32
    block_bwd(do, q, k, v, o, lse, mask, scale, dlse) -> (dq, dk, dv)  all float32

``mask`` is a :class:`schedule.BlockMask` (full / causal / strict today). ``block_bwd`` takes the
*global* ``o`` and ``lse`` (after every block was merged), which is what makes per-block gradients
sum to the true gradient. Backends are pluggable by name: the portable ``"reference"`` backend
(einsum, float32 accumulation, any device) is the default and the fallback; fast GPU kernels
register themselves under other names. Each says which masks and dtypes it takes
(``BlockBackend.supports``), so a caller can refuse or reroute a block before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from .schedule import CAUSAL_MASK, BlockMask, MaskKind

F32 = jnp.float32
# f32 matmuls at full precision: on GPUs XLA's default may use TF32, which breaks the 1e-5 policy.
_PRECISION = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class BlockBackend:
    """A pair of block kernels with the signatures in the module docstring."""

    name: str
    fwd: Callable
    bwd: Callable
    # False when the kernels' outputs carry no shard_map "varying axes" type (flash_attn3_jax's
    # primitives): the API then runs shard_map with check_vma=False.
    typed_for_shard_map: bool = True
    # supports(mask, dtype name) -> whether the kernels compute that block mask in that dtype.
    supports: Callable[[BlockMask, str], bool] = lambda mask, dtype: True


_BACKENDS: dict[str, BlockBackend] = {}


def register_backend(backend: BlockBackend) -> None:
    """Make ``backend`` selectable by name (tests use this to count kernel calls)."""
    _BACKENDS[backend.name] = backend


# Run-to-run determinism, measured on H200 (``python -m parity determinism``, 2026-11-22): the
# fused backwards accumulate dq with atomics, so dq differs between identical runs for cudnn and
# fa3; with XLA_FLAGS=--xla_gpu_deterministic_ops=true XLA makes cudnn deterministic, fa3 stays
# not. "reference" and every forward were bitwise reproducible.
NONDETERMINISTIC_WHEN_REQUESTED = frozenset({"fa3"})


def get_backend(name: str = "auto", *, deterministic: bool = False) -> BlockBackend:
    """The backend called ``name``; ``"auto"`` picks the fastest one registered for the default
    device, which today is the portable reference everywhere. ``deterministic=True`` (the API's
    ``deterministic`` argument, which defaults to whether XLA_FLAGS has
    ``--xla_gpu_deterministic_ops=true``) refuses a backend measured non-deterministic in that mode.
    XLA reads its flags when the backend starts, so this can only refuse a kernel: it cannot make
    XLA's own ops deterministic."""
    if name == "auto":
        name = "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown block backend {name!r}; registered: {sorted(_BACKENDS)}")
    if name in NONDETERMINISTIC_WHEN_REQUESTED and deterministic:
        raise RuntimeError(f"block backend {name!r} is not deterministic (its backward's dq differs between identical "
                           "runs) and deterministic=True (by default: XLA_FLAGS has "
                           "--xla_gpu_deterministic_ops=true): use 'cudnn' (deterministic in that mode) or 'reference'")
    return _BACKENDS[name]


def _mask_matrix(mask: BlockMask, t: int, s: int):
    """[t, s] bool of visible (query, key) pairs in local indices, or None for FULL."""
    if mask.is_full:
        return None
    if t != s:
        raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
    offset = 0 if mask.kind is MaskKind.CAUSAL else -1
    return jnp.tril(jnp.ones((t, s), dtype=bool), k=offset)


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, h // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32, precision=_PRECISION)
    return s * jnp.asarray(scale, F32)


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float):
    """Portable forward. A query row with no visible key gets o = 0 and lse = -inf (stripe's
    strict mask on row 0), which the LSE merge treats as an empty partial."""
    b, t, h, d = q.shape
    s = _scores(q, k, scale)
    visible = _mask_matrix(mask, t, k.shape[1])
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    has_key = denom > 0
    lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
    p = p / jnp.where(has_key, denom, 1.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32), precision=_PRECISION)
    return o.reshape(b, t, h, d), lse[..., 0].reshape(b, h, t)


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None):
    """Portable backward with the global ``o`` and ``lse``:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), dQ = scale·dS K, dK = scale·dSᵀ Q, dV = Pᵀ dO."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    s = _scores(q, k, scale)
    lse_g = lse.reshape(b, hk, g, t)[..., None]
    p = jnp.exp(s - lse_g)
    visible = _mask_matrix(mask, t, k.shape[1])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    do_g = do.astype(F32).reshape(b, t, hk, g, d)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do_g, o.astype(F32).reshape(b, t, hk, g, d), precision=_PRECISION)
    if dlse is not None:
        delta = delta - dlse.astype(F32).reshape(b, hk, g, t)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do_g, precision=_PRECISION)
    dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v.astype(F32), precision=_PRECISION)
    ds = p * (dp - delta[..., None]) * jnp.asarray(scale, F32)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32), precision=_PRECISION).reshape(b, t, h, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(F32).reshape(b, t, hk, g, d), precision=_PRECISION)
    return dq, dk, dv


register_backend(BlockBackend("reference", reference_block_fwd, reference_block_bwd))


# ---- fused GPU kernels: cuDNN, FlashAttention-3 (bf16 / fp16) -----------------------------------
# The ring's block backward needs the *global* o and lse; JAX's public
# ``jax.nn.dot_product_attention(implementation="cudnn")`` differentiates only with its own, so
# the backward binds cuDNN's backward primitive directly (jax._src; checked against the portable
# kernel on GPU by tests/test_gpu.py). flash_attn3_jax (optional) exposes both directions.

def _cudnn_ops():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def mask_type(causal: bool):
        return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK

    def fwd(q, k, v, causal: bool, scale: float):
        return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask_type(causal), qkv_layout="BTNH",
                                        return_residual=True)  # (o, lse: [b, h, t] float32, natural log)

    def bwd(do, q, k, v, o, lse, causal: bool, scale: float):
        unused = jnp.zeros(0, q.dtype)
        grads = fa._dot_product_attention_bwd_p_wrapper.bind(
            q, k, v, unused, unused, unused, unused, unused, unused, unused, lse, o, do,
            scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask_type(causal),
            layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
        return grads[:3]

    return fwd, bwd


def _fa3_ops():
    try:
        from flash_attn3_jax.flash import _flash_mha_bwd, _flash_mha_fwd
    except ImportError as err:
        raise RuntimeError("block backend 'fa3' needs the flash_attn3_jax package (Hopper GPUs)") from err

    def fwd(q, k, v, causal: bool, scale: float):
        return _flash_mha_fwd(q, k, v, softmax_scale=scale, is_causal=causal, window_size=(-1, -1))[:2]

    def bwd(do, q, k, v, o, lse, causal: bool, scale: float):
        return _flash_mha_bwd(do, q, k, v, o, lse, softmax_scale=scale, is_causal=causal, window_size=(-1, -1))[:3]

    return fwd, bwd


def _fused_backend(name: str, ops, typed_for_shard_map: bool = True) -> BlockBackend:
    """Block kernels on a fused attention op pair ``ops() -> (fwd, bwd)`` (imported at first use).
    A STRICT block (stripe layout) is the causal block of rows 1.. against keys ..t-1; a backward
    with an lse cotangent (only when the caller uses lse) falls back to the portable kernel, as
    torch_impl's aten backends do."""

    def fwd(q, k, v, mask: BlockMask, scale: float):
        if mask.kind is MaskKind.STRICT:
            o_r, lse_r = fwd(q[:, 1:], k[:, :-1], v[:, :-1], CAUSAL_MASK, scale)
            b, _, h, d = q.shape
            return (jnp.concatenate([jnp.zeros((b, 1, h, d), F32), o_r], 1),
                    jnp.concatenate([jnp.full((b, h, 1), -jnp.inf, F32), lse_r], 2))
        o, lse = ops()[0](q, k, v, mask.kind is MaskKind.CAUSAL, scale)
        return o.astype(F32), lse.astype(F32)

    def bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None):
        if dlse is not None:
            return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse)
        if mask.kind is MaskKind.STRICT:
            dq_r, dk_r, dv_r = bwd(do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse[..., 1:], CAUSAL_MASK,
                                   scale)
            rows = lambda first, last: [(0, 0), (first, last), (0, 0), (0, 0)]  # noqa: E731
            return jnp.pad(dq_r, rows(1, 0)), jnp.pad(dk_r, rows(0, 1)), jnp.pad(dv_r, rows(0, 1))
        dtype = q.dtype
        causal = mask.kind is MaskKind.CAUSAL
        grads = ops()[1](do.astype(dtype), q, k, v, o.astype(dtype), lse.astype(F32), causal, scale)
        return tuple(g.astype(F32) for g in grads)

    return BlockBackend(name, fwd, bwd, typed_for_shard_map)


register_backend(_fused_backend("cudnn", _cudnn_ops))
register_backend(_fused_backend("fa3", _fa3_ops, typed_for_shard_map=False))
