"""FlashAttention-4's two varlen entry points (``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd``) emulated on the CPU from their contract — cumulative offsets, causal aligned
bottom-right per run, GQA, soft-capping, lse [h, total_q] (-inf for a row with no key), the
backward from the given o and lse — for the tests that drive ``torch_impl.kernels.fa4`` without a
GPU. Every call is recorded (``CALLS``: its ``max_seqlen`` bounds), and a bound below a run's real
length raises, as a too-small grid would compute a wrong answer on the GPU."""

from __future__ import annotations

import torch

F64 = torch.float64
CALLS: list[dict] = []


def _runs(cu_q, cu_k):
    return [(int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])) for n in range(len(cu_q) - 1)]


def _check_bounds(cu_q, cu_k, max_q, max_k, kind):
    longest_q = max((b - a for a, b, _, _ in _runs(cu_q, cu_k)), default=0)
    longest_k = max((d - c for _, _, c, d in _runs(cu_q, cu_k)), default=0)
    if max_q < longest_q or max_k < longest_k:
        raise ValueError(f"max_seqlen ({max_q}, {max_k}) below the longest run ({longest_q}, {longest_k})")
    CALLS.append({"kind": kind, "max_seqlen_q": max_q, "max_seqlen_k": max_k})


def _raw_scores(q, k, scale):
    group = q.shape[1] // k.shape[1]
    return torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1)) * scale


def _visible(n_q, n_k, causal):
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    return (j <= i + (n_k - n_q)) if causal else torch.ones(n_q, n_k, dtype=torch.bool)


def _capped(raw, softcap):
    return raw if not softcap else softcap * torch.tanh(raw / softcap)


def emulated_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False, softcap=None,
                 return_lse=False, **unused):
    assert not unused and qv is None and seqused_q is None and seqused_k is None, unused
    _check_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "fwd")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    o = torch.zeros(q.shape, dtype=F64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=F64)
    for q0, q1, k0, k1 in _runs(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        s = _capped(_raw_scores(q[q0:q1].to(F64), k[k0:k1].to(F64), scale), softcap)
        s = s.masked_fill(~_visible(q1 - q0, k1 - k0, causal), float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[:, q0:q1, None]).nan_to_num(0.0)
        o[q0:q1] = torch.einsum("hts,shd->thd", p, v[k0:k1].to(F64).repeat_interleave(group, 1))
    return o.to(q.dtype), lse.float() if return_lse else None, None, None, None


def emulated_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **unused):
    assert not unused, unused
    _check_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "bwd")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=F64) for x in (q, k, v))
    fold = lambda x: x.reshape(x.shape[0], k.shape[1], group, -1).sum(2)
    for q0, q1, k0, k1 in _runs(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        qr, kr = q[q0:q1].to(F64), k[k0:k1].to(F64).repeat_interleave(group, 1)
        raw = _raw_scores(q[q0:q1].to(F64), k[k0:k1].to(F64), scale)
        s = _capped(raw, softcap).masked_fill(~_visible(q1 - q0, k1 - k0, causal), float("-inf"))
        p = torch.exp(s - lse[:, q0:q1, None].to(F64)).nan_to_num(0.0)
        vr, d_o = v[k0:k1].to(F64).repeat_interleave(group, 1), dout[q0:q1].to(F64)
        delta = (d_o * out[q0:q1].to(F64)).sum(-1).T[:, :, None]
        ds = p * (torch.einsum("thd,shd->hts", d_o, vr) - delta)
        if softcap:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq[q0:q1] = torch.einsum("hts,shd->thd", ds, kr) * scale
        dk[k0:k1] = fold(torch.einsum("hts,thd->shd", ds, qr) * scale)
        dv[k0:k1] = fold(torch.einsum("hts,thd->shd", p, d_o))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def emulate(fa4, monkeypatch=None) -> None:
    """Bind the emulated entry points into ``torch_impl.kernels.fa4`` and make it available."""
    CALLS.clear()
    set_ = monkeypatch.setattr if monkeypatch is not None else setattr
    set_(fa4, "fa4_forward", emulated_fwd)
    set_(fa4, "fa4_backward", emulated_bwd)
    set_(fa4, "available", lambda: True)
