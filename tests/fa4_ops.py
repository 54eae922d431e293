"""FlashAttention-4's two entry points (``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd``) emulated on the CPU from their contract — varlen (cumulative offsets, lse
[h, total_q]) or dense (q [b, t, h, d], lse [b, h, t]), causal and the sliding window aligned
bottom-right per run (key j seen by query i when j - i is in [(s - t) - left, (s - t) + right],
None: unbounded; causal sets right = 0), GQA, soft-capping, -inf lse for a row with no key, the
backward from the given o and lse — for the tests that drive ``torch_impl.kernels.fa4`` without a
GPU. Every call is recorded (``CALLS``: dense or varlen, its ``max_seqlen`` bounds, its window), a
varlen bound below a run's real length raises, as a too-small grid would compute a wrong answer on
the GPU, and so does a negative window size (FA4 reads it as a window, not as "unbounded")."""

from __future__ import annotations

import torch

F64 = torch.float64
CALLS: list[dict] = []


def _runs(cu_q, cu_k):
    return [(int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])) for n in range(len(cu_q) - 1)]


def _check_bounds(cu_q, cu_k, max_q, max_k, kind, window):
    longest_q = max((b - a for a, b, _, _ in _runs(cu_q, cu_k)), default=0)
    longest_k = max((d - c for _, _, c, d in _runs(cu_q, cu_k)), default=0)
    if max_q < longest_q or max_k < longest_k:
        raise ValueError(f"max_seqlen ({max_q}, {max_k}) below the longest run ({longest_q}, {longest_k})")
    if any(w is not None and w < 0 for w in window):
        raise ValueError(f"a negative window size {window}: FA4 would run it as a window (unbounded is None)")
    CALLS.append({"kind": kind, "max_seqlen_q": max_q, "max_seqlen_k": max_k, "window": window})


def _as_runs(q, k, cu_q, cu_k, max_q, max_k):
    """A dense call [b, t, ...] as the varlen call of its b rows: (flat q, flat k, cu_q, cu_k,
    max_q, max_k, dense shape or None)."""
    if cu_q is not None:
        return q, k, cu_q, cu_k, max_q, max_k, None
    (b, t), s = q.shape[:2], k.shape[1]
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    return flat(q), flat(k), torch.arange(b + 1) * t, torch.arange(b + 1) * s, t, s, (b, t)


def _raw_scores(q, k, scale):
    group = q.shape[1] // k.shape[1]
    return torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1)) * scale


def _visible(n_q, n_k, causal, left=None, right=None):
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    right = 0 if causal else right
    seen = torch.ones(n_q, n_k, dtype=torch.bool)
    if right is not None:
        seen &= j - i <= (n_k - n_q) + right
    if left is not None:
        seen &= j - i >= (n_k - n_q) - left
    return seen


def _capped(raw, softcap):
    return raw if not softcap else softcap * torch.tanh(raw / softcap)


def emulated_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False, softcap=None,
                 window_size_left=None, window_size_right=None, return_lse=False, **unused):
    assert not unused and qv is None and seqused_q is None and seqused_k is None, unused
    window = (window_size_left, window_size_right)
    q, k, cu_q, cu_k, max_q, max_k, dense = _as_runs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    v = v if dense is None else v.reshape(-1, *v.shape[2:])
    _check_bounds(cu_q, cu_k, max_q, max_k, "fwd" if dense is None else "dense fwd", window)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    o = torch.zeros(q.shape, dtype=F64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=F64)
    for q0, q1, k0, k1 in _runs(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        s = _capped(_raw_scores(q[q0:q1].to(F64), k[k0:k1].to(F64), scale), softcap)
        s = s.masked_fill(~_visible(q1 - q0, k1 - k0, causal, *window), float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[:, q0:q1, None]).nan_to_num(0.0)
        o[q0:q1] = torch.einsum("hts,shd->thd", p, v[k0:k1].to(F64).repeat_interleave(group, 1))
    if dense is not None:  # o [b, t, h, d], lse [b, h, t]
        o, lse = o.reshape(*dense, *o.shape[1:]), lse.reshape(lse.shape[0], *dense).transpose(0, 1)
    return o.to(q.dtype), lse.float() if return_lse else None, None, None, None


def emulated_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                 window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 deterministic=False, **unused):
    assert not unused, unused
    # what FA4's backward asserts: o and do in q's dtype, lse float32 [b, h, t] (dense) / [h, total_q]
    assert out.dtype == dout.dtype == q.dtype and lse.dtype == torch.float32, (out.dtype, dout.dtype, lse.dtype)
    dense_lse = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    assert tuple(lse.shape) == dense_lse, (tuple(lse.shape), dense_lse)
    window = (window_size_left, window_size_right)
    shapes = q.shape, k.shape
    q, k, cu_q, cu_k, max_q, max_k, dense = _as_runs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dense is not None:
        flat = lambda x: x.reshape(-1, *x.shape[2:])
        v, out, dout, lse = flat(v), flat(out), flat(dout), lse.transpose(0, 1).reshape(lse.shape[1], -1)
    _check_bounds(cu_q, cu_k, max_q, max_k, "bwd" if dense is None else "dense bwd", window)
    CALLS[-1]["deterministic"] = deterministic
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=F64) for x in (q, k, v))
    fold = lambda x: x.reshape(x.shape[0], k.shape[1], group, -1).sum(2)
    for q0, q1, k0, k1 in _runs(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        qr, kr = q[q0:q1].to(F64), k[k0:k1].to(F64).repeat_interleave(group, 1)
        raw = _raw_scores(q[q0:q1].to(F64), k[k0:k1].to(F64), scale)
        s = _capped(raw, softcap).masked_fill(~_visible(q1 - q0, k1 - k0, causal, *window), float("-inf"))
        p = torch.exp(s - lse[:, q0:q1, None].to(F64)).nan_to_num(0.0)
        vr, d_o = v[k0:k1].to(F64).repeat_interleave(group, 1), dout[q0:q1].to(F64)
        delta = (d_o * out[q0:q1].to(F64)).sum(-1).T[:, :, None]
        ds = p * (torch.einsum("thd,shd->hts", d_o, vr) - delta)
        if softcap:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq[q0:q1] = torch.einsum("hts,shd->thd", ds, kr) * scale
        dk[k0:k1] = fold(torch.einsum("hts,thd->shd", ds, qr) * scale)
        dv[k0:k1] = fold(torch.einsum("hts,thd->shd", p, d_o))
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return (dq, dk, dv) if dense is None else (dq.reshape(shapes[0]), dk.reshape(shapes[1]), dv.reshape(shapes[1]))


def emulate(fa4, monkeypatch=None) -> None:
    """Bind the emulated entry points into ``torch_impl.kernels.fa4`` and make it available."""
    CALLS.clear()
    set_ = monkeypatch.setattr if monkeypatch is not None else setattr
    set_(fa4, "fa4_forward", emulated_fwd)
    set_(fa4, "fa4_backward", emulated_bwd)
    set_(fa4, "available", lambda: True)
