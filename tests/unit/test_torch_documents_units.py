"""Tier 1 — packed documents (``segment_ids``, issue 25) in torch_impl's pieces on one process:
the reference block kernel's document mask against a float64 masked computation (forward,
backward, rows with no visible key), the aten backends' refusal and fallback, "auto" routing of
document blocks, ``loop.block_work``'s decision, ``dense_attention`` (the multi-device tests'
truth) against attention run document by document, and the per-device entry points' checks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl
import torch_impl.block as tblock
from seqplan.schedule import (
    BLOCK_MASKS,
    CAUSAL_MASK,
    DOCUMENT_MASKS,
    FULL_MASK,
    STRICT_MASK,
    Block,
    BlockMask,
    DocumentWork,
    Part,
    document_work,
)
from torch_impl.block import get_backend
from torch_impl.loop import block_work

F64 = torch.float64


def masked_truth(q, k, v, visible, scale, do, dlse):
    """float64 attention under ``visible`` [b, t, s] and its gradients for (do, dlse), computed
    without the kernel: rows with no visible key are o = 0, lse = -inf and get no gradient."""
    q, k, v = (x.to(F64).requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    vis = visible[:, None]
    has_key = vis.any(-1)  # [b, 1, t]
    scores = scores.masked_fill(~vis, float("-inf")).masked_fill(~has_key[..., None], 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]) * has_key[..., None]
    o = torch.einsum("bhts,bshd->bthd", p, vv)
    lse_out = lse.masked_fill(~has_key, float("-inf"))
    torch.autograd.backward((o, lse.masked_fill(~has_key, 0.0)), (do.to(F64), dlse.to(F64) * has_key))
    return o.detach(), lse_out.detach(), q.grad, k.grad, v.grad


def static_visible(mask: BlockMask, t: int, s: int):
    if mask.kind.value == "full":
        return torch.ones((t, s), dtype=torch.bool)
    return torch.ones((t, s), dtype=torch.bool).tril(0 if mask.kind.value == "causal" else -1)


@pytest.mark.parametrize("backend", ["reference", "aten_cpu"])
@pytest.mark.parametrize("mask", list(DOCUMENT_MASKS), ids=lambda m: m.kind.value)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_document_block_matches_float64_masked_attention(backend, mask, heads, kv_heads, seed):
    """o, lse, dq, dk, dv of one document block (query ids != key ids: an off-diagonal block of
    a ring) equal the float64 computation under static mask & (q_ids == kv_ids); a query whose
    document has no key in the block gets o = 0, lse = -inf, dq = 0, and adds nothing to dk, dv.
    The aten backend runs it on the reference kernel (it has no document mask)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, d, scale = 2, 8, 16, 0.3
    s = t if mask.kind.value != "full" else 6  # a full block may be rectangular (zigzag halves)
    q, do = (torch.randn(b, t, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, kv_heads, d, generator=gen) for _ in range(2))
    dlse = torch.randn(b, heads, t, generator=gen)
    q_ids = torch.tensor([[0, 0, 1, 1, 2, 2, 7, 3], [4, 4, 4, 4, 5, 5, 5, 5]], dtype=torch.int32)  # 7: no key
    kv_ids = torch.tensor([[0, 1, 1, 2, 3, 3, 0, 0], [4, 5, 5, 5, 5, 4, 4, 4]], dtype=torch.int32)[:, :s]
    visible = static_visible(mask, t, s) & (q_ids[:, :, None] == kv_ids[:, None, :])
    empty = ~visible.any(-1)  # [b, t]
    assert empty.any() and not empty.all(), "the ids must leave some rows without a key"
    kernel = get_backend(backend)
    o, lse = kernel.fwd(q, k, v, mask, scale, segments=(q_ids, kv_ids))
    dq, dk, dv = kernel.bwd(do, q, k, v, o, lse, mask, scale, dlse, segments=(q_ids, kv_ids))
    want = masked_truth(q, k, v, visible, scale, do, dlse)
    e = empty[:, :, None, None].expand_as(o)
    assert torch.all(o[e] == 0) and torch.all(lse.transpose(1, 2)[empty] == float("-inf"))
    assert torch.all(dq[e] == 0)
    for name, got, w in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), want):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(got), finite), name
        torch.testing.assert_close(got.double()[finite], w[finite], rtol=2e-5, atol=2e-5, msg=name)
    if backend == "aten_cpu":  # the documented fallback: the reference kernel, bit for bit
        ref = get_backend("reference")
        for got, r in zip((o, lse, dq, dk, dv), (*ref.fwd(q, k, v, mask, scale, (q_ids, kv_ids)),
                                                  *ref.bwd(do, q, k, v, o, lse, mask, scale, dlse, (q_ids, kv_ids)))):
            assert torch.equal(got, r)


def test_document_mask_without_segments_is_refused():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="a document mask needs segments"):
        get_backend("reference").fwd(q, q, q, CAUSAL_MASK.with_documents(), 1.0)


def test_aten_backends_do_not_support_documents_and_auto_routes_around_them():
    """supports() is False for every document mask; "auto" then routes a document block to the
    portable kernel even where aten_cudnn takes the same static mask (a stand-in, available)."""
    for name in ("aten_cpu", "aten_flash", "aten_cudnn"):
        backend = get_backend(name)
        for mask in BLOCK_MASKS:
            assert not backend.supports(mask.with_documents(), "bfloat16")
        assert backend.supports(FULL_MASK, "bfloat16")
    real = get_backend("aten_cudnn")
    tblock.register_backend(tblock.BlockBackend("aten_cudnn", real.fwd, real.bwd, supports=real.supports,
                                                available=lambda: True))
    try:
        for mask in BLOCK_MASKS:
            assert tblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16", mask=mask) == "aten_cudnn"
            assert tblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16",
                                          mask=mask.with_documents()) == "reference"
    finally:
        tblock.register_backend(real)


def test_block_work_decides_from_each_parts_id_ranges():
    """block_work reads the block's parts only, per batch row, and agrees with document_work."""
    q_ids = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2]])
    kv_ids = torch.tensor([[1, 1, 3, 3], [2, 2, 2, 2]])
    full = Block(Part.ALL, Part.ALL, FULL_MASK)
    assert block_work(full, q_ids, kv_ids) is DocumentWork.DOCUMENTS  # row 0 meets on id 1
    assert block_work(Block(Part.FIRST_HALF, Part.ALL, FULL_MASK), q_ids, kv_ids) is DocumentWork.DOCUMENTS
    assert block_work(Block(Part.FIRST_HALF, Part.SECOND_HALF, FULL_MASK), q_ids, kv_ids) is DocumentWork.DOCUMENTS
    one = torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2]])
    assert block_work(Block(Part.SECOND_HALF, Part.FIRST_HALF, FULL_MASK), q_ids, kv_ids) is DocumentWork.PLAIN
    assert block_work(full, one, one) is DocumentWork.PLAIN
    apart = torch.tensor([[5, 5, 6, 6], [7, 7, 7, 7]])
    assert block_work(full, q_ids, apart) is DocumentWork.SKIP
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, c = rng.integers(0, 4, (2, 2, 6))
        got = block_work(full, torch.from_numpy(a), torch.from_numpy(c))
        assert got is document_work(a.min(1), a.max(1), c.min(1), c.max(1))


@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention_with_ids_is_attention_document_by_document(causal, seed):
    """The truth the multi-device tests use: dense_attention with segment_ids equals plain dense
    attention run on each document's tokens alone (ids contiguous here), in float64."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 7, 5]
    t = sum(lengths)
    q = torch.randn(1, t, 4, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(1, t, 2, 8, generator=gen, dtype=F64) for _ in range(2))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    o, lse = torch_impl.dense_attention(q, k, v, causal=causal, segment_ids=ids)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        o_d, lse_d = torch_impl.dense_attention(q[:, part], k[:, part], v[:, part], causal=causal)
        torch.testing.assert_close(o[:, part], o_d, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[..., part], lse_d, rtol=1e-12, atol=1e-12)
        start += n
    assert lse.dtype == F64


@pytest.mark.parametrize("attention", ["ring_attention", "allgather_attention", "double_ring_attention",
                                       "ulysses_attention", "usp_attention"])
def test_per_device_entry_points_check_local_segment_ids(attention):
    fn = getattr(torch_impl, attention)
    q = torch.zeros(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"local segment_ids must be \[batch, seq\] = \(1, 8\)"):
        fn(q, q, q, segment_ids=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="integer dtype"):
        fn(q, q, q, segment_ids=torch.zeros(1, 8))
    if attention.startswith(("ulysses", "usp")):  # their all-to-all needs a process group even for one rank
        return
    o, lse = fn(q, q, q, segment_ids=torch.zeros(1, 8, dtype=torch.int64), causal=True)  # one rank: valid
    o_plain, lse_plain = fn(q, q, q, causal=True)
    assert torch.equal(o, o_plain) and torch.equal(lse, lse_plain)  # one document: plain attention


def test_strict_document_block_row_zero_is_empty():
    """The strict mask's row 0 stays empty with documents (both restrictions apply)."""
    q = torch.randn(1, 4, 2, 8)
    ids = torch.zeros(1, 4, dtype=torch.int32)
    o, lse = get_backend("reference").fwd(q, q, q, STRICT_MASK.with_documents(), 1.0, segments=(ids, ids))
    assert torch.all(lse[:, :, 0] == float("-inf")) and torch.all(o[:, 0] == 0) and torch.isfinite(lse[:, :, 1:]).all()
