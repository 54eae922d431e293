"""Tier 1 — torch's ``fa4`` adapter (FlashAttention-4's varlen kernels) on the CPU, its two entry
points emulated from their contract (tests/fa4_ops.py). Why: the adapter is written before a GPU
session can check it, and the GPU tier then checks the real kernels; these prove the plumbing —
which blocks it takes and which it leaves to the portable kernel, the run lists and the causal
flag per block, empty rows and unread keys, soft-capping in both passes, ``max_seqlen`` bucketed
to a short static set over a stream of batches, all-gather-KV's one call on it — against the
portable kernel (float32), outputs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa4_ops
from seqplan.layouts import layout_permutation, pad_documents
from seqplan.schedule import BlockMask, MaskKind
from seqplan.strategy import Strategy

F32 = torch.float32


@pytest.fixture
def fa4(monkeypatch):
    """The adapter with its entry points emulated; counts the blocks left to the portable kernel."""
    from torch_impl.kernels import fa4 as module

    fa4_ops.emulate(module, monkeypatch)
    portable = {"fwd": 0, "bwd": 0}
    for name, fn in (("fwd", module.reference_block_fwd), ("bwd", module.reference_block_bwd)):
        monkeypatch.setattr(module, f"reference_block_{name}",
                            lambda *a, _fn=fn, _n=name, **k: portable.__setitem__(_n, portable[_n] + 1) or _fn(*a, **k))
    module.portable = portable
    return module


def _inputs(rng, b, t, s, h=4, hk=2, d=16, dtype=torch.bfloat16):
    q, do = (torch.from_numpy(rng.standard_normal((b, t, h, d))).to(dtype) for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((b, s, hk, d))).to(dtype) for _ in range(2))
    return q, k, v, do


def _rel(x, y):
    x, y = x.double(), y.double()
    finite = torch.isfinite(y)
    assert torch.equal(finite, torch.isfinite(x)), "empty rows differ"
    return float((x[finite] - y[finite]).norm() / y[finite].norm().clamp_min(1e-30))


def _both(module, q, k, v, do, mask, segments=None, softcap=None):
    """(fa4's o, lse, dq, dk, dv) and the portable kernel's, on the same inputs."""
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    kw = {} if segments is None else {"segments": segments}
    cap = {} if softcap is None else {"softcap": softcap}
    o, lse = module.fa4_block_fwd(q, k, v, mask, 0.25, **kw, **cap)
    grads = module.fa4_block_bwd(do, q, k, v, o, lse, mask, 0.25, **kw, **cap)
    o_r, lse_r = reference_block_fwd(q, k, v, mask, 0.25, segments, None, softcap=softcap)
    grads_r = reference_block_bwd(do, q, k, v, o_r.to(q.dtype), lse_r, mask, 0.25, None, segments, None, softcap=softcap)
    return (o, lse, *grads), (o_r, lse_r, *grads_r)


CASES = {  # name: (mask kind, documents?, t, s, q ids row 0, kv ids row 0)
    "full": (MaskKind.FULL, False, 24, 40, None, None),
    "causal diagonal": (MaskKind.CAUSAL, False, 32, 32, None, None),
    "documents, causal diagonal, a length-1 document": (
        MaskKind.CAUSAL, True, 32, 32, [0] * 9 + [1] + [2] * 22, [0] * 9 + [1] + [2] * 22),
    "documents, full, a query document with no key and an unread key run": (
        MaskKind.FULL, True, 24, 16, [3] * 8 + [4] * 10 + [5] * 6, [2] * 4 + [3] * 6 + [5] * 6),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_blocks_run_on_fa4_and_equal_the_portable_kernel(name, softcap, fa4, seed):
    kind, documents, t, s, q_row, kv_row = CASES[name]
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 2, t, s)
    segments = None
    if documents:
        q_ids = torch.tensor([q_row, q_row[::-1]], dtype=torch.int32)
        kv_ids = torch.tensor([kv_row, kv_row[::-1]], dtype=torch.int32) if kind is MaskKind.FULL else q_ids
        segments = (q_ids, kv_ids)
    mask = BlockMask(kind, documents=documents)
    got, want = _both(fa4, q, k, v, do, mask, segments, softcap)
    assert fa4.portable == {"fwd": 0, "bwd": 0}, "a block left to the portable kernel"
    assert [c["kind"] for c in fa4_ops.CALLS] == ["fwd", "bwd"]
    for label, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert _rel(x, y) < 1e-2, f"{label}: relative error {_rel(x, y):.2e}"
    if documents and kind is MaskKind.FULL:  # document 4 has no key here, keys of document 2 no query
        assert torch.all(got[1][0, :, 8:18] == float("-inf")) and torch.all(got[0][0, 8:18] == 0)
        assert torch.all(got[3][0, :4] == 0) and torch.all(got[4][0, :4] == 0)


def test_what_fa4_cannot_run_goes_to_the_portable_kernel(fa4, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 16, 16)
    fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.STRICT), 0.25)  # stripe's strict block
    fa4.fa4_block_fwd(*(x.float() for x in (q, k, v)), BlockMask(MaskKind.CAUSAL), 0.25)  # float32
    assert fa4.portable["fwd"] == 2 and fa4_ops.CALLS == []
    q, k, v, do = _inputs(rng, 1, 16, 16, d=256)  # the SM90 backward stops at head_dim 192: forward only
    o, lse = fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.CAUSAL), 0.25)
    fa4.fa4_block_bwd(do, q, k, v, o, lse, BlockMask(MaskKind.CAUSAL), 0.25)
    assert [c["kind"] for c in fa4_ops.CALLS] == ["fwd"] and fa4.portable["bwd"] == 1
    fa4.fa4_block_bwd(do[..., :16], q[..., :16], k[..., :16], v[..., :16], o[..., :16], lse, BlockMask(MaskKind.CAUSAL),
                      0.25,
                      dlse=torch.ones_like(lse))  # an lse cotangent
    assert fa4.portable["bwd"] == 2
    q, k, v, do = _inputs(rng, 1, 16, 16, d=12)  # FA4 takes head dims 8..256 in multiples of 8: both passes portable
    o, lse = fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.CAUSAL), 0.25)
    fa4.fa4_block_bwd(do, q, k, v, o, lse, BlockMask(MaskKind.CAUSAL), 0.25)
    assert fa4.portable == {"fwd": 3, "bwd": 3} and [c["kind"] for c in fa4_ops.CALLS] == ["fwd"]
    assert not fa4.one_call_takes(q) and fa4.one_call_takes(q[..., :8]) and not fa4.one_call_takes(q[..., :8].float())


def test_max_seqlen_takes_few_values_over_a_stream_of_packed_batches(fa4):
    """50 batches of 4096 tokens, each with its own documents (a fixed stream: the claim is about
    the ladder, not the draw): the kernel is asked for at most the bucket ladder's six
    ``max_seqlen`` values (powers of two from 128 to the packed length), not one per batch — so
    FA4's compiled variants are bounded by six, whatever the stream."""
    rng = np.random.default_rng(0)
    t = 4096
    q, k, v, _ = _inputs(rng, 1, t, t, h=2, hk=1, d=8)
    longest = set()
    for _ in range(50):
        cuts = np.sort(rng.choice(np.arange(1, t), rng.integers(1, 40), replace=False))
        ids = np.repeat(np.arange(len(cuts) + 1), np.diff(np.r_[0, cuts, t]))[None].astype(np.int32)
        longest.add(int(np.diff(np.r_[0, cuts, t]).max()))
        segments = (torch.from_numpy(ids),) * 2
        fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.CAUSAL, documents=True), 0.25, segments=segments)
    bounds = {c["max_seqlen_q"] for c in fa4_ops.CALLS}
    assert len(longest) > 40  # the raw bound would have asked for a new variant nearly every batch
    assert bounds <= {128, 256, 512, 1024, 2048, 4096}, bounds
    assert len(fa4_ops.CALLS) == 50  # every batch on FA4, none left to the portable kernel
    assert fa4.portable == {"fwd": 0, "bwd": 0}


def test_deterministic_mode_refuses_fa4_before_any_call():
    from torch_impl.block import get_backend

    with pytest.raises(RuntimeError, match="'fa4' is not deterministic"):
        get_backend("fa4", deterministic=True)


def test_allgather_runs_each_device_as_one_fa4_call(fa4, seed):
    """All-gather-KV with packed documents named onto ``fa4``: every device's forward and backward
    is ONE FA4 varlen call over gathered key prefixes (bottom-right causal per run), no block
    walked, equal to the portable kernel's block walk — outputs and every shard's dK / dV."""
    from torch_impl import replay

    ring = 4
    rng = np.random.default_rng(seed)
    ids = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])
    padded, _ = pad_documents(ids, ring)
    t = padded.shape[1]
    laid = torch.from_numpy(padded[:, layout_permutation(t, "zigzag", ring)].astype(np.int32))
    q, k, v, do = _inputs(rng, 2, t, t)
    kw = dict(strategy=Strategy(ring=ring, kv_exchange="allgather"), causal=True, layout="zigzag", segment_ids=laid)

    def run(backend):
        o, lse = replay.replay_attention(q, k, v, block_backend=backend, **kw)
        return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, block_backend=backend, **kw))

    got = run("fa4")
    assert fa4.portable == {"fwd": 0, "bwd": 0}
    assert [c["kind"] for c in fa4_ops.CALLS] == ["fwd"] * ring + ["bwd"] * ring
    want = run("reference")
    for label, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert _rel(x, y) < 1e-2, f"{label}: relative error {_rel(x, y):.2e}"


def test_auto_routes_document_and_capped_blocks_to_fa4_where_installed(monkeypatch):
    """Where FA4 is installed (its availability forced here: CI has no FA4), "auto" on CUDA sends
    document blocks, token-index causal blocks and soft-capped blocks to ``fa4`` — measured
    1.08-1.81x ``aten_varlen`` on the 4-GPU table — while plain blocks stay on ``aten_cudnn``,
    float32 on the portable kernel, and deterministic mode avoids it (its determinism is not
    measured); without FA4 never to it."""
    from seqplan.schedule import UNBOUNDED
    from torch_impl import block

    documents = BlockMask(MaskKind.CAUSAL, documents=True)
    by_index = BlockMask(MaskKind.FULL, window=(UNBOUNDED, 0), documents=True)
    plain = BlockMask(MaskKind.CAUSAL)
    kw = dict(device_kind="cuda", dtype="bfloat16")
    installed = block.get_backend("fa4")
    assert (block.resolve_backend("auto", mask=documents, **kw) == "fa4") == installed.available()
    for name in ("fa4", "aten_cudnn", "aten_varlen"):  # a CUDA machine with FA4 installed
        real = block.get_backend(name)
        monkeypatch.setitem(block._BACKENDS, name, block.BlockBackend(
            name, real.fwd, real.bwd, supports=real.supports, available=lambda: True))
    for mask in (documents, by_index):
        assert block.resolve_backend("auto", mask=mask, **kw) == "fa4", mask
        assert block.resolve_backend("auto", mask=mask, deterministic=True, **kw) == "reference", mask
    assert block.resolve_backend("auto", mask=plain, softcap=True, **kw) == "fa4"
    assert block.resolve_backend("auto", mask=plain, **kw) == "aten_cudnn"
    assert block.resolve_backend("auto", mask=documents, device_kind="cuda", dtype="float32") == "reference"
