"""FlashAttention-2's two varlen ops (``aten._flash_attention_forward`` / ``_backward``) emulated
on the CPU from their contract — cumulative offsets, causal aligned bottom-right per run, GQA,
FA2's +inf lse for empty rows, the backward from the given o and lse — for the tests that drive
``torch_impl.kernels.varlen`` without a GPU (tests/unit/test_varlen_emulated.py, and the gloo
worlds' ``documents_task(..., emulate_varlen=True)``)."""

from __future__ import annotations

import torch

F32 = torch.float32


def _visible(n_q: int, n_k: int, causal: bool) -> torch.Tensor:
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    return (j <= i + (n_k - n_q)) if causal else torch.ones(n_q, n_k, dtype=torch.bool)


def _runs(cu_q, cu_k):
    return [(int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])) for n in range(len(cu_q) - 1)]


def _scores(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    return s.masked_fill(~_visible(q.shape[0], k.shape[0], causal), float("-inf")), k


def emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(q.shape, dtype=F32)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=F32)  # FA2's empty rows: +inf
    for q0, q1, k0, k1 in _runs(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        s, _ = _scores(q[q0:q1].float(), k[k0:k1].float(), causal, scale)
        group = q.shape[1] // k.shape[1]
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[:, q0:q1, None]).nan_to_num(0.0)
        o[q0:q1] = torch.einsum("hts,shd->thd", p, v[k0:k1].float().repeat_interleave(group, 1))
    return o.to(q.dtype), lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), None


def emulated_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, scale):
    dq, dk, dv = (torch.zeros(x.shape, dtype=F32) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in _runs(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        s, kr = _scores(q[q0:q1].float(), k[k0:k1].float(), causal, scale)
        p = torch.exp(s - lse[:, q0:q1, None]).nan_to_num(0.0)
        vr = v[k0:k1].float().repeat_interleave(group, 1)
        d_o = do[q0:q1].float()
        dp = torch.einsum("thd,shd->hts", d_o, vr)
        delta = (d_o * o[q0:q1].float()).sum(-1).T[:, :, None]
        ds = p * (dp - delta) * scale
        dq[q0:q1] = torch.einsum("hts,shd->thd", ds, kr)
        fold = lambda x: x.reshape(x.shape[0], k.shape[1], group, -1).sum(2)
        dk[k0:k1] = fold(torch.einsum("hts,thd->shd", ds, q[q0:q1].float()))
        dv[k0:k1] = fold(torch.einsum("hts,thd->shd", p, d_o))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def emulate(varlen) -> None:
    """Bind the emulated ops into ``torch_impl.kernels.varlen`` (a worker process: for good)."""
    varlen.flash_forward, varlen.flash_backward, varlen._RNG = emulated_forward, emulated_backward, {}
