"""FlashAttention-3's varlen forward and backward (flash_attn3_jax's FFI targets) emulated on the
CPU from their contract — cumulative offsets, bottom-right causal per run, ``max_seqlen``
bounding the tiles a run gets, the backward taking the given o and lse — for the tests that
drive ``jax_impl.kernels.fa3_varlen`` without a GPU (tests/unit/test_fa3_varlen_emulated.py,
tests/multidevice/test_jax_token_index.py); the backward also dense, unwindowed, as
``fa3.flash_mha_bwd`` binds it."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
CALLS: list[dict] = []  # every emulated call's attributes, newest last


def _in_runs(cu, used, total: int):
    """Per packed position: its run and offset in it, and whether it lies inside the run (its
    first ``used`` positions when ``used`` (seqused) is given, else the offsets' difference)."""
    run = jnp.clip(jnp.searchsorted(cu, jnp.arange(total), side="right") - 1, 0, cu.shape[0] - 2)
    at = jnp.arange(total) - cu[run]
    length = (cu[1:] - cu[:-1]) if used.shape[0] == 0 else used
    return run, at, length[run], (at >= 0) & (at < length[run])


def _visible(cu_q, cu_k, total_q: int, total_k: int, causal: bool, max_q: int, max_k: int, used_q=None,
             used_k=None):
    """[total_q, total_k] pairs FA3 varlen computes: same run, causal aligned bottom-right (on the
    runs' lengths: ``used_q`` / ``used_k`` when given), and only positions inside the first max_q
    queries / max_k keys of a run (tiles past max_seqlen are never launched)."""
    none = jnp.zeros((0,), jnp.int32)
    run_q, i, n_q, in_q = _in_runs(cu_q, none if used_q is None else used_q, total_q)
    run_k, j, n_k, in_k = _in_runs(cu_k, none if used_k is None else used_k, total_k)
    seen = (run_q[:, None] == run_k[None, :]) & in_q[:, None] & in_k[None, :]
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
             is_causal, **attrs):
        assert len(_optional) == 13, "flash_mha_fwd takes 21 buffers"
        CALLS.append(dict(attrs, is_causal=is_causal))
        o, lse = _fake_fwd(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale_val, is_causal)
        declared = result_types[1].shape
        flat = lse.reshape(-1)[: q.shape[0] * q.shape[1]]
        assert flat.size <= np.prod(declared), f"lse buffer {declared} smaller than [h, total_q]"
        buffer = jnp.zeros(int(np.prod(declared)), F32).at[: flat.size].set(flat).reshape(declared)
        return (o, buffer, *(jnp.zeros(r.shape, r.dtype) for r in result_types[2:]))

    return call


def _ffi_bwd(result_types):
    """The backward target: reads the lse ``[h, total_q]`` at the front of the given buffer."""

    def call(do, q, k, v, o, lse_buffer, cu_q, cu_k, used_q, used_k, *, max_seqlen_q_val, max_seqlen_k_val,
             softmax_scale_val, is_causal, **attrs):
        CALLS.append(dict(attrs, is_causal=is_causal))
        if q.ndim == 4:  # dense [b, t, h, d], lse [b, h, t]: b sequences, as packed runs
            assert cu_q.shape[0] == 0 and cu_k.shape[0] == 0, "a dense call passes no offsets"
            assert (attrs["window_size_left"], attrs["window_size_right"]) == (-1, -1), "window: not emulated"
            b, t, h, d = q.shape
            s = k.shape[1]
            flat = lambda x: x.reshape(-1, *x.shape[2:])
            grads = packed(flat(do), flat(q), flat(k), flat(v), flat(o), lse_buffer.transpose(1, 0, 2).reshape(-1),
                           (jnp.arange(b + 1) * t).astype(jnp.int32), (jnp.arange(b + 1) * s).astype(jnp.int32),
                           used_q, used_k, max_seqlen_q_val, max_seqlen_k_val, softmax_scale_val, is_causal)
            return (grads[0].reshape(q.shape), grads[1].reshape(k.shape), grads[2].reshape(v.shape),
                    *(jnp.zeros(r.shape, r.dtype) for r in result_types[3:]))
        return (*packed(do, q, k, v, o, lse_buffer, cu_q, cu_k, used_q, used_k, max_seqlen_q_val, max_seqlen_k_val,
                        softmax_scale_val, is_causal), *(jnp.zeros(r.shape, r.dtype) for r in result_types[3:]))

    def packed(do, q, k, v, o, lse_buffer, cu_q, cu_k, used_q, used_k, max_seqlen_q_val, max_seqlen_k_val,
               softmax_scale_val, is_causal):
        t, h, _ = q.shape
        hk = k.shape[1]
        seen = _visible(cu_q, cu_k, t, k.shape[0], is_causal, max_seqlen_q_val, max_seqlen_k_val, used_q, used_k)
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
        if used_q.shape[0]:  # with seqused, rows outside every run are never written: NaN here, so a
            # caller that reads them fails its test instead of trusting what the GPU leaves there
            rows_q, rows_k = _in_runs(cu_q, used_q, t)[3], _in_runs(cu_k, used_k, k.shape[0])[3]
            unwritten = lambda x, rows: jnp.where(rows[:, None, None], x, jnp.nan)
            outs = (unwritten(outs[0], rows_q), unwritten(outs[1], rows_k), unwritten(outs[2], rows_k))
        return outs

    return call


def emulate(monkeypatch):
    """Install the emulation (undone with ``monkeypatch``); returns ``jax_impl.kernels.fa3_varlen``."""
    package = types.ModuleType("flash_attn3_jax")
    hlo = types.ModuleType("flash_attn3_jax.flash_hlo")
    for name, module in (("flash_attn3_jax", package), ("flash_attn3_jax.flash_hlo", hlo)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(jax.ffi, "ffi_call", _fake_ffi_call)
    CALLS.clear()
    from jax_impl.kernels import fa3_varlen

    return fa3_varlen
