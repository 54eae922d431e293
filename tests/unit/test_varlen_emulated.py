"""Tier 1 — torch's ``aten_varlen`` adapter on the CPU, its two FlashAttention-2 varlen ops
emulated from their contract (cumulative offsets, causal aligned bottom-right per run, GQA, the
backward from the given o and lse): the torch replay of the per-document zigzag with explicit
token indices — every block through the adapter's run lists (``seqplan.documents.index_runs``),
none left to the portable kernel — equals the replay on the portable kernel, outputs and
gradients. The GPU rows check the real ops (benchmarks' verified rows); this proves the plumbing
(host copies of the token indices, the run lists, the causal flag per block) without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqplan.layouts import DOCUMENT_HYBRID, DOCUMENT_ZIGZAG, document_layout, hybrid_layout, pad_documents
from seqplan.strategy import Strategy


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


F32 = torch.float32


@pytest.fixture
def emulated_varlen(monkeypatch):
    """The adapter with its two ops emulated; counts the blocks left to the portable kernel."""
    from torch_impl.kernels import varlen

    monkeypatch.setattr(varlen, "flash_forward", emulated_forward)
    monkeypatch.setattr(varlen, "flash_backward", emulated_backward)
    monkeypatch.setattr(varlen, "_RNG", {})
    portable = {"fwd": 0, "bwd": 0}
    fwd, bwd = varlen.reference_block_fwd, varlen.reference_block_bwd

    def counted(name, fn):
        def call(*args, **kwargs):
            portable[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(varlen, "reference_block_fwd", counted("fwd", fwd))
    monkeypatch.setattr(varlen, "reference_block_bwd", counted("bwd", bwd))
    return portable


def _replay(backend, index, ids, q, k, v, do, strategy):
    from torch_impl import replay

    kw = dict(strategy=strategy, causal=True, layout="contiguous", segment_ids=ids, token_index=index,
              block_backend=backend)
    o, lse = replay.replay_attention(q, k, v, **kw)
    return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, **kw))


@pytest.mark.parametrize("ring, with_ids, name", [(4, True, DOCUMENT_ZIGZAG), (2, False, DOCUMENT_ZIGZAG),
                                                  (4, True, DOCUMENT_HYBRID)])
def test_token_index_blocks_run_on_the_varlen_ops(ring, with_ids, name, emulated_varlen, monkeypatch, seed):
    """Every block of the per-document zigzag and hybrid on the (emulated) varlen ops, equal to the
    portable kernel; ``with_ids=False``: one document per row, the token indices alone. The
    hybrid's off-diagonal blocks are cropped to its shared documents (``loop.crop_block``)."""
    from torch_impl import loop

    cropped = []
    crop = loop.crop_block
    monkeypatch.setattr(loop, "crop_block", lambda block, masks: cropped.append(crop(block, masks)) or cropped[-1])
    rng = np.random.default_rng(seed)
    ids = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])  # a length-1 document
    if not with_ids:
        ids = np.zeros((2, 16 * ring), np.int64)
    padded, _ = pad_documents(ids, ring)
    layout = document_layout(padded, ring) if name == DOCUMENT_ZIGZAG else hybrid_layout(padded, ring, split_at=30)
    laid = torch.from_numpy(np.take_along_axis(padded, layout.perm, 1).astype(np.int32))
    index = torch.from_numpy(np.ascontiguousarray(layout.token_index))
    t = padded.shape[1]
    q, do = (torch.from_numpy(rng.standard_normal((2, t, 4, 16))).bfloat16() for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((2, t, 2, 16))).bfloat16() for _ in range(2))
    strategy = Strategy(ring=ring)
    got = _replay("aten_varlen", index, laid if with_ids else None, q, k, v, do, strategy)
    assert emulated_varlen == {"fwd": 0, "bwd": 0}, f"blocks left to the portable kernel: {emulated_varlen}"
    if name == DOCUMENT_HYBRID:  # documents 2 and 8 split, the others whole: some blocks cropped or skipped
        from seqplan.schedule import Span

        spans = [b for b in cropped if b is None or isinstance(b.q_part, Span)]
        assert spans, "no block of the hybrid was cropped"
    want = _replay("reference", index, laid if with_ids else None, q, k, v, do, strategy)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        err = (x.double() - y.double()).norm() / y.double().norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
