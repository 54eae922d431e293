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

from seqplan.layouts import (
    DOCUMENT_HYBRID,
    DOCUMENT_ZIGZAG,
    document_layout,
    hybrid_layout,
    layout_permutation,
    pad_documents,
)
from seqplan.strategy import Strategy
from varlen_ops import emulated_backward, emulated_forward

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


def _replay(backend, index, ids, q, k, v, do, strategy, layout="contiguous"):
    from torch_impl import replay

    kw = dict(strategy=strategy, causal=True, layout=layout, segment_ids=ids, token_index=index,
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


@pytest.mark.parametrize("ring, layout, with_index", [(4, DOCUMENT_HYBRID, True), (4, DOCUMENT_ZIGZAG, True),
                                                       (2, "zigzag", False)])
def test_allgather_runs_each_device_as_one_varlen_call(ring, layout, with_index, emulated_varlen, monkeypatch, seed):
    """All-gather-KV with packed documents — by token indices on the per-row layouts, or by the
    static zigzag's positions — runs each device's forward and backward as ONE (emulated) varlen
    call over gathered key prefixes (``allgather.prefix_plan``), no block walked, and equals the
    portable kernel's block walk: outputs and every shard's dK / dV."""
    from torch_impl.kernels import varlen

    calls = []
    for name in ("flash_forward", "flash_backward"):
        op = getattr(varlen, name)
        monkeypatch.setattr(varlen, name, lambda *a, _op=op, _n=name, **k: calls.append((_n, a[0].shape[0])) or _op(*a, **k))
    rng = np.random.default_rng(seed)
    ids = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])  # a length-1 document
    padded, _ = pad_documents(ids, ring)
    t = padded.shape[1]
    if layout == "zigzag":
        perm, index = np.broadcast_to(np.asarray(layout_permutation(t, "zigzag", ring)), padded.shape), None
    else:
        row = document_layout(padded, ring) if layout == DOCUMENT_ZIGZAG else hybrid_layout(padded, ring, split_at=30)
        perm, index = row.perm, torch.from_numpy(np.ascontiguousarray(row.token_index))
    laid = torch.from_numpy(np.take_along_axis(padded, perm, 1).astype(np.int32))
    q, do = (torch.from_numpy(rng.standard_normal((2, t, 4, 16))).bfloat16() for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((2, t, 2, 16))).bfloat16() for _ in range(2))
    strategy = Strategy(ring=ring, kv_exchange="allgather")
    static = "contiguous" if index is not None else "zigzag"
    got = _replay("aten_varlen", index, laid, q, k, v, do, strategy, layout=static)
    assert emulated_varlen == {"fwd": 0, "bwd": 0}, f"blocks left to the portable kernel: {emulated_varlen}"
    real = [c for c in calls if c[1] > 1]  # the one-token call that only fetches the rng state aside
    assert real == [("flash_forward", 2 * t // ring)] * ring + [("flash_backward", 2 * t // ring)] * ring, real
    want = _replay("reference", index, laid, q, k, v, do, strategy, layout=static)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        err = (x.double() - y.double()).norm() / y.double().norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


def test_allgather_with_one_document_per_row_walks_plain_blocks(emulated_varlen, monkeypatch, seed):
    """A batch of one document per row (the timed whole-model rows) given as ids masks exactly as
    no ids: all-gather-KV must not take the one varlen call (on FA2 it ran the 2x H100 whole-model
    step at 1.44x the cuDNN walk's time, 2026-11-26) — no varlen op runs, and the result equals the
    call without ids."""
    from torch_impl.kernels import varlen

    calls = []
    for name in ("flash_forward", "flash_backward"):
        op = getattr(varlen, name)
        monkeypatch.setattr(varlen, name, lambda *a, _op=op, _n=name, **k: calls.append(_n) or _op(*a, **k))
    rng = np.random.default_rng(seed)
    t, ring = 32, 2
    q, do = (torch.from_numpy(rng.standard_normal((2, t, 4, 16))).bfloat16() for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((2, t, 2, 16))).bfloat16() for _ in range(2))
    ids = torch.from_numpy(np.array([[3] * t, [5] * t], np.int32))
    strategy = Strategy(ring=ring, kv_exchange="allgather")
    got = _replay("aten_varlen", None, ids, q, k, v, do, strategy, layout="zigzag")
    assert calls == [], calls
    want = _replay("reference", None, None, q, k, v, do, strategy, layout="zigzag")
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(x, y) or (x.double() - y.double()).norm() <= 1e-2 * y.double().norm(), name
