"""FlashAttention-3's varlen forward and backward (flash_attn3_jax's FFI targets) emulated on the
CPU from their contract — cumulative offsets, bottom-right causal per run, ``max_seqlen``
bounding the tiles a run gets, the backward taking the given o and lse — for the tests that
drive ``jax_impl.kernels.fa3_varlen`` without a GPU (tests/unit/test_fa3_varlen_emulated.py,
tests/multidevice/test_jax_token_index.py)."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _visible(cu_q, cu_k, total_q: int, total_k: int, causal: bool, max_q: int, max_k: int):
    """[total_q, total_k] pairs FA3 varlen computes: same run, causal aligned bottom-right, and
    only positions inside the first max_q queries / max_k keys of a run (tiles past max_seqlen
    are never launched)."""
    run_q = jnp.searchsorted(cu_q, jnp.arange(total_q), side="right") - 1
    run_k = jnp.searchsorted(cu_k, jnp.arange(total_k), side="right") - 1
    i = jnp.arange(total_q) - cu_q[run_q]
    j = jnp.arange(total_k) - cu_k[run_k]
    n_q, n_k = (cu_q[1:] - cu_q[:-1])[run_q], (cu_k[1:] - cu_k[:-1])[run_k]
    seen = run_q[:, None] == run_k[None, :]
    if causal:
        seen &= j[None, :] <= i[:, None] + n_k[None, :] - n_q[:, None]
    return seen & (i < max_q)[:, None] & (j < max_k)[None, :]


def _expand(x, h: int):
    return jnp.repeat(x, h // x.shape[1], axis=1)


def _fake_fwd(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal):
    t, h, _ = q.shape
    seen = _visible(cu_q, cu_k, t, k.shape[0], is_causal, max_seqlen_q, max_seqlen_k)
    s = jnp.einsum("thd,shd->hts", q.astype(F32), _expand(k, h).astype(F32)) * softmax_scale
    s = jnp.where(seen[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [h, t]
    p = jnp.where(seen[None], jnp.exp(s - lse[..., None]), 0.0)
    o = jnp.einsum("hts,shd->thd", p, _expand(v, h).astype(F32)).astype(q.dtype)
    nseq = cu_q.shape[0] - 1
    buffer = jnp.zeros((nseq * h * max_seqlen_q,), F32).at[: h * t].set(lse.reshape(-1))
    return o, buffer.reshape(nseq, h, max_seqlen_q)


def _fake_ffi_call(name, result_types, **_):
    assert name in ("flash_mha_fwd", "flash_mha_bwd")
    return _ffi_fwd(result_types) if name == "flash_mha_fwd" else _ffi_bwd(result_types)


def _ffi_fwd(result_types):
    """The forward target: writes o and the lse ``[h, total_q]`` at the front of the buffer of
    whatever shape the caller declared (too small a declaration fails here)."""

    def call(q, k, v, _k_new, _v_new, _q_v, cu_q, cu_k, *_optional, max_seqlen_q, max_seqlen_k, softmax_scale_val,
             is_causal, **_attrs):
        assert len(_optional) == 13, "flash_mha_fwd takes 21 buffers"
        o, lse = _fake_fwd(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale_val, is_causal)
        declared = result_types[1].shape
        flat = lse.reshape(-1)[: q.shape[0] * q.shape[1]]
        assert flat.size <= np.prod(declared), f"lse buffer {declared} smaller than [h, total_q]"
        buffer = jnp.zeros(int(np.prod(declared)), F32).at[: flat.size].set(flat).reshape(declared)
        return (o, buffer, *(jnp.zeros(r.shape, r.dtype) for r in result_types[2:]))

    return call


def _ffi_bwd(result_types):
    """The backward target: reads the lse ``[h, total_q]`` at the front of the given buffer."""

    def call(do, q, k, v, o, lse_buffer, cu_q, cu_k, _a, _b, *, max_seqlen_q_val, max_seqlen_k_val,
             softmax_scale_val, is_causal, **_attrs):
        t, h, _ = q.shape
        hk = k.shape[1]
        seen = _visible(cu_q, cu_k, t, k.shape[0], is_causal, max_seqlen_q_val, max_seqlen_k_val)
        lse = lse_buffer.reshape(-1)[: h * t].reshape(h, t)
        kf, vf = _expand(k, h).astype(F32), _expand(v, h).astype(F32)
        s = jnp.einsum("thd,shd->hts", q.astype(F32), kf) * softmax_scale_val
        p = jnp.where(seen[None], jnp.exp(s - lse[..., None]), 0.0)
        do32 = do.astype(F32)
        delta = jnp.einsum("thd,thd->ht", do32, o.astype(F32))
        dv = jnp.einsum("hts,thd->shd", p, do32)
        ds = p * (jnp.einsum("thd,shd->hts", do32, vf) - delta[..., None]) * softmax_scale_val
        dq = jnp.einsum("hts,shd->thd", ds, kf)
        dk = jnp.einsum("hts,thd->shd", ds, q.astype(F32))
        fold = lambda x: x.reshape(x.shape[0], hk, h // hk, x.shape[-1]).sum(2)
        outs = (dq.astype(q.dtype), fold(dk).astype(k.dtype), fold(dv).astype(v.dtype))
        return (*outs, *(jnp.zeros(r.shape, r.dtype) for r in result_types[3:]))

    return call


def emulate(monkeypatch):
    """Install the emulation (undone with ``monkeypatch``); returns ``jax_impl.kernels.fa3_varlen``."""
    package = types.ModuleType("flash_attn3_jax")
    hlo = types.ModuleType("flash_attn3_jax.flash_hlo")
    for name, module in (("flash_attn3_jax", package), ("flash_attn3_jax.flash_hlo", hlo)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(jax.ffi, "ffi_call", _fake_ffi_call)
    from jax_impl.kernels import fa3_varlen

    return fa3_varlen
