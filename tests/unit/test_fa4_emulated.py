"""Tier 1 — torch's ``fa4`` adapter (FlashAttention-4's varlen and dense kernels) on the CPU, its
two entry points emulated from their contract (tests/fa4_ops.py). Why: the adapter is written before
a GPU session can check it, and the GPU tier then checks the real kernels; these prove the plumbing —
which blocks it takes and which it leaves to the portable kernel, which entry each block takes, the
run lists and the causal flag per block, windowed blocks cropped to their band with FA4's window
sizes (None for unbounded), empty rows and unread keys, soft-capping in both passes, ``max_seqlen``
bucketed to a short static set over a stream of batches, all-gather-KV's one call on it — against
the portable kernel (float32), outputs and gradients."""

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


def _both(module, q, k, v, do, mask, segments=None, softcap=None, positions=None):
    """(fa4's o, lse, dq, dk, dv) and the portable kernel's, on the same inputs."""
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    kw = {name: x for name, x in (("segments", segments), ("positions", positions)) if x is not None}
    cap = {} if softcap is None else {"softcap": softcap}
    o, lse = module.fa4_block_fwd(q, k, v, mask, 0.25, **kw, **cap)
    grads = module.fa4_block_bwd(do, q, k, v, o, lse, mask, 0.25, **kw, **cap)
    o_r, lse_r = reference_block_fwd(q, k, v, mask, 0.25, segments, positions, softcap=softcap)
    grads_r = reference_block_bwd(do, q, k, v, o_r.to(q.dtype), lse_r, mask, 0.25, None, segments, positions,
                                  softcap=softcap)
    return (o, lse, *grads), (o_r, lse_r, *grads_r)


def _close(got, want):
    for label, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert _rel(x, y) < 1e-2, f"{label}: relative error {_rel(x, y):.2e}"


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
    entry = "" if documents else "dense "  # a block without documents: the dense kernel the FA4 ceiling times
    assert [c["kind"] for c in fa4_ops.CALLS] == [entry + "fwd", entry + "bwd"]
    _close(got, want)
    if documents and kind is MaskKind.FULL:  # document 4 has no key here, keys of document 2 no query
        assert torch.all(got[1][0, :, 8:18] == float("-inf")) and torch.all(got[0][0, 8:18] == 0)
        assert torch.all(got[3][0, :4] == 0) and torch.all(got[4][0, :4] == 0)


WINDOW_CASES = {  # name: (kind, window, t, s, q_pos[0] - kv_pos[0], FA4's (left, right) on the crop, or None: no call)
    "causal diagonal, window 8 (FA4's local window)": (MaskKind.CAUSAL, (8, "unbounded"), 32, 32, 0, (8, 0)),
    "causal diagonal, a window wider than the block (FA4's causal kernel)": (
        MaskKind.CAUSAL, (40, "unbounded"), 32, 32, 0, "causal"),
    # rows 0-11 see keys 20 + i .. 31: cropped to 12 x 12, key c - i >= 0, no right bound
    "halo: queries one block after the keys, window 12": (MaskKind.FULL, (12, "unbounded"), 24, 32, 32, (0, None)),
    # j - i in [-11, -1]: rows 1-31, keys 0-30, a causal band of 10 on the crop
    "two-sided window (7, 3), keys after the queries": (MaskKind.FULL, (7, 3), 32, 32, -4, (10, 0)),
    "two-sided window (3, 5) around the diagonal": (MaskKind.FULL, (3, 5), 32, 32, 0, (3, 5)),
    "a window that reaches no key of the block": (MaskKind.FULL, (4, "unbounded"), 16, 16, 40, None),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_windowed_blocks_run_on_fa4s_window_cropped_to_their_band(name, softcap, fa4, seed):
    """A windowed block whose parts are contiguous ranges (the loops pass their offset) runs FA4's
    dense entry on its band with FA4's own window sizes — never a negative size, which FA4 would
    read as a window (the emulation raises) — and equals the portable kernel; rows outside the band
    get o = 0, lse = -inf."""
    from seqplan.schedule import UNBOUNDED

    kind, (left, right), t, s, offset, sizes = WINDOW_CASES[name]
    window = (left, UNBOUNDED if right == "unbounded" else right)
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 2, t, s)
    q0 = 64 + offset
    positions = (torch.arange(q0, q0 + t, dtype=torch.int32), torch.arange(64, 64 + s, dtype=torch.int32))
    mask = BlockMask(kind, window=window, offset=offset)
    got, want = _both(fa4, q, k, v, do, mask, softcap=softcap, positions=positions)
    assert fa4.portable == {"fwd": 0, "bwd": 0}, "a block left to the portable kernel"
    _close(got, want)
    if sizes is None:
        assert fa4_ops.CALLS == [] and torch.all(got[1] == float("-inf")) and torch.all(got[2] == 0)
        return
    assert [c["kind"] for c in fa4_ops.CALLS] == ["dense fwd", "dense bwd"]
    expect = (None, None) if sizes == "causal" else sizes
    assert all(c["window"] == expect for c in fa4_ops.CALLS), fa4_ops.CALLS


def test_windowed_blocks_fa4_cannot_band_go_to_the_portable_kernel(fa4, seed):
    """Positions that are not two contiguous runs (a zigzag block spanning both chunks), and a
    window on a document block: the portable kernel, no FA4 call."""
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 16, 16)
    zigzag = (torch.cat([torch.arange(0, 8), torch.arange(40, 48)]).int(), torch.arange(0, 16, dtype=torch.int32))
    got, want = _both(fa4, q, k, v, do, BlockMask(MaskKind.FULL, window=(20, 0)), positions=zigzag)
    _close(got, want)
    ids = torch.zeros((1, 16), dtype=torch.int32)
    spans = (torch.arange(16, dtype=torch.int32), torch.arange(16, dtype=torch.int32))
    _both(fa4, q, k, v, do, BlockMask(MaskKind.CAUSAL, documents=True, window=(4, 0), offset=0), (ids, ids),
          positions=spans)
    assert fa4_ops.CALLS == [] and fa4.portable == {"fwd": 2, "bwd": 2}


def test_what_fa4_cannot_run_goes_to_the_portable_kernel(fa4, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 16, 16)
    fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.STRICT), 0.25)  # stripe's strict block
    fa4.fa4_block_fwd(*(x.float() for x in (q, k, v)), BlockMask(MaskKind.CAUSAL), 0.25)  # float32
    assert fa4.portable["fwd"] == 2 and fa4_ops.CALLS == []
    # the SM90 backward stops at head_dim 192: a document block runs its forward on FA4, its backward
    # portable; a plain block both passes off FA4 (aten_cudnn on CUDA, the portable kernel here)
    q, k, v, do = _inputs(rng, 1, 16, 16, d=256)
    ids = torch.zeros((1, 16), dtype=torch.int32)
    documents = BlockMask(MaskKind.CAUSAL, documents=True)
    o, lse = fa4.fa4_block_fwd(q, k, v, documents, 0.25, segments=(ids, ids))
    fa4.fa4_block_bwd(do, q, k, v, o, lse, documents, 0.25, segments=(ids, ids))
    assert [c["kind"] for c in fa4_ops.CALLS] == ["fwd"] and fa4.portable == {"fwd": 2, "bwd": 1}
    o, lse = fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.CAUSAL), 0.25)
    fa4.fa4_block_bwd(do, q, k, v, o, lse, BlockMask(MaskKind.CAUSAL), 0.25)
    assert [c["kind"] for c in fa4_ops.CALLS] == ["fwd"] and fa4.portable == {"fwd": 3, "bwd": 2}
    fa4.fa4_block_bwd(do[..., :16], q[..., :16], k[..., :16], v[..., :16], o[..., :16], lse, BlockMask(MaskKind.CAUSAL),
                      0.25, dlse=torch.ones_like(lse))  # an lse cotangent
    assert fa4.portable["bwd"] == 3
    q, k, v, do = _inputs(rng, 1, 16, 16, d=12)  # FA4 takes head dims 8..256 in multiples of 8: both passes portable
    o, lse = fa4.fa4_block_fwd(q, k, v, BlockMask(MaskKind.CAUSAL), 0.25)
    fa4.fa4_block_bwd(do, q, k, v, o, lse, BlockMask(MaskKind.CAUSAL), 0.25)
    assert fa4.portable == {"fwd": 4, "bwd": 4} and [c["kind"] for c in fa4_ops.CALLS] == ["fwd"]
    assert not fa4.one_call_takes(q) and fa4.one_call_takes(q[..., :8]) and not fa4.one_call_takes(q[..., :8].float())


def test_blocks_fa4_cannot_run_go_to_the_fused_kernel_auto_chose_before_it(fa4, monkeypatch, seed):
    """On CUDA (stood in here: CI has no GPU), a block with head_dim 256 (FA4's SM90 backward
    stops at 192) runs both passes on what "auto" chose for it before FA4 was installed — a plain
    block on ``aten_cudnn``, a windowed one on ``aten_window`` — not on FA4's forward and the
    portable backward; a soft-capped one stays portable (neither caps), and so does any block
    when that kernel is not available."""
    from torch_impl.block import BlockBackend
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    calls, up = [], {"aten_cudnn": True, "aten_window": True}

    def stand_in(name):
        return BlockBackend(name, lambda *a, **k: calls.append((name, "fwd")) or reference_block_fwd(*a, **k),
                            lambda *a, **k: calls.append((name, "bwd")) or reference_block_bwd(*a, **k),
                            available=lambda: up[name])

    monkeypatch.setattr(fa4, "get_backend", stand_in)
    monkeypatch.setattr(fa4.torch.Tensor, "is_cuda", property(lambda self: True))
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 16, 16, d=256)
    spans = (torch.arange(16, 32, dtype=torch.int32), torch.arange(0, 16, dtype=torch.int32))
    blocks = [(BlockMask(MaskKind.CAUSAL), {}, "aten_cudnn"),
              (BlockMask(MaskKind.FULL, window=(20, 0), offset=16), {"positions": spans}, "aten_window")]
    for mask, kw, name in blocks:
        calls.clear()
        got, want = _both(fa4, q, k, v, do, mask, **kw)
        assert calls == [(name, "fwd"), (name, "bwd")], calls
        _close(got, want)
    assert fa4_ops.CALLS == [] and fa4.portable == {"fwd": 0, "bwd": 0}
    calls.clear()
    _both(fa4, q, k, v, do, BlockMask(MaskKind.CAUSAL), softcap=2.0)  # capped: no fused kernel caps it
    up["aten_cudnn"] = False
    _both(fa4, q, k, v, do, BlockMask(MaskKind.CAUSAL))  # cuDNN unavailable: portable
    assert calls == [] and fa4.portable == {"fwd": 2, "bwd": 2}


def test_max_seqlen_takes_few_values_over_a_stream_of_packed_batches(fa4, monkeypatch):
    """50 batches of 4096 tokens, each with its own documents (a fixed stream: the claim is about
    the ladder, not the draw): the kernel is asked for at most the bucket ladder's six
    ``max_seqlen`` values (powers of two from 128 to the packed length), not one per batch — so
    FA4's compiled variants are bounded by six, whatever the stream. The forward is the
    emulation's bounds check alone (still raising on a bound below a run): what the kernel
    computes is the other tests' claim, and computing it here cost 13 s of the default run."""

    def bounds_only(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **_):
        fa4_ops._check_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "fwd", (None, None))
        return torch.zeros(q.shape, dtype=q.dtype), torch.zeros((q.shape[1], q.shape[0])), None, None, None

    monkeypatch.setattr(fa4, "fa4_forward", bounds_only)
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


def test_fa4s_backward_is_deterministic_under_torchs_switch(fa4, monkeypatch, seed):
    """Under torch's deterministic switch (what a ``deterministic=True`` call holds while its
    kernels run: ``torch_impl.config.deterministic_kernels``) every FA4 backward — dense, varlen,
    and all-gather-KV's one call — is asked for FA4's deterministic mode, and off it for none; a
    block FA4's backward cannot take (head_dim 256, on CUDA: stood in) goes to ``aten_flash`` (FA2,
    deterministic under the switch) instead of ``aten_cudnn``; a windowed one to ``aten_window`` as
    outside it (FA2's window kernel, deterministic under the switch too)."""
    from torch_impl.block import BlockBackend
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 32, 32)
    ids = (torch.tensor([[0] * 9 + [1] + [2] * 22], dtype=torch.int32),) * 2
    blocks = [(BlockMask(MaskKind.CAUSAL), {}), (BlockMask(MaskKind.CAUSAL, documents=True), {"segments": ids})]
    for switch in (False, True):
        fa4_ops.CALLS.clear()
        torch.use_deterministic_algorithms(switch)
        try:
            for mask, kw in blocks:
                _both(fa4, q, k, v, do, mask, **kw)
            recorded = list(fa4_ops.CALLS)
            fa4_ops.CALLS.clear()
            test_allgather_runs_each_device_as_one_fa4_call(fa4, seed)  # the one call, forward and backward
        finally:
            torch.use_deterministic_algorithms(False)
        backward = [c for c in recorded + fa4_ops.CALLS if c["kind"].endswith("bwd")]
        assert {c["kind"] for c in backward} == {"dense bwd", "bwd"} and len(backward) == 2 + 4
        assert all(c["deterministic"] is switch for c in backward), backward

    calls = []
    stand_in = lambda name: BlockBackend(name, lambda *a, **k: calls.append(name) or reference_block_fwd(*a, **k),
                                         lambda *a, **k: calls.append(name) or reference_block_bwd(*a, **k))
    monkeypatch.setattr(fa4, "get_backend", stand_in)
    monkeypatch.setattr(fa4.torch.Tensor, "is_cuda", property(lambda self: True))
    q, k, v, do = _inputs(rng, 1, 16, 16, d=256)
    spans = (torch.arange(16, 32, dtype=torch.int32), torch.arange(0, 16, dtype=torch.int32))
    fa4.portable.update(fwd=0, bwd=0)
    torch.use_deterministic_algorithms(True)
    try:
        _both(fa4, q, k, v, do, BlockMask(MaskKind.CAUSAL))
        _both(fa4, q, k, v, do, BlockMask(MaskKind.FULL, window=(20, 0), offset=16), positions=spans)
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == ["aten_flash"] * 2 + ["aten_window"] * 2 and fa4.portable == {"fwd": 0, "bwd": 0}


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


@pytest.mark.parametrize("layout,ulysses", [("contiguous", 1), ("contiguous", 2), ("zigzag", 1)])
def test_rings_with_a_window_run_every_block_on_fa4(layout, ulysses, fa4, seed):
    """The ring (and USP 2 x 2) with a sliding window named onto ``fa4``: the loops give each block
    its parts' offset, so every windowed block runs FA4's dense entry on its band (no block on the
    portable kernel, no host read of positions) — equal to the portable kernel's ring, outputs and
    gradients. Unmasked blocks of the same rings run the dense entry too."""
    from torch_impl import replay

    ring = 2
    rng = np.random.default_rng(seed)
    t = 64
    q, k, v, do = _inputs(rng, 1, t, t)
    for window in ((12, 0), None):
        kw = dict(strategy=Strategy(ring=ring, ulysses=ulysses), causal=True, layout=layout, window=window)

        def run(backend, kw=kw):
            o, lse = replay.replay_attention(q, k, v, block_backend=backend, **kw)
            return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, block_backend=backend, **kw))

        fa4_ops.CALLS.clear()
        fa4.portable.update(fwd=0, bwd=0)
        got = run("fa4")
        assert fa4_ops.CALLS and all(c["kind"].startswith("dense") for c in fa4_ops.CALLS)
        # a zigzag shard is two runs of positions: its windowed blocks that span both are not a band
        if layout != "zigzag" or window is None:
            assert fa4.portable == {"fwd": 0, "bwd": 0}, (window, fa4.portable)
        _close(got, run("reference"))


def test_auto_routes_every_block_fa4_takes_to_it_where_installed(monkeypatch):
    """Where FA4 is installed (its availability forced here: CI has no FA4), "auto" on CUDA sends
    plain, windowed, document, token-index causal and soft-capped blocks to ``fa4`` (measured: its
    dense and window kernels 1.13x cuDNN's and 1.85x FA2's window on one H200, its varlen 1.08-1.81x
    ``aten_varlen`` on the 4-GPU table), strict blocks to ``aten_cudnn``, float32 to the portable
    kernel, in deterministic mode too (FA4's deterministic backward, measured bitwise reproducible);
    without FA4 plain blocks stay on ``aten_cudnn`` (deterministic mode: ``aten_flash``), windowed
    ones on ``aten_window`` and document blocks on ``aten_varlen``, in deterministic mode too."""
    from seqplan.schedule import UNBOUNDED
    from torch_impl import block

    documents = BlockMask(MaskKind.CAUSAL, documents=True)
    by_index = BlockMask(MaskKind.FULL, window=(UNBOUNDED, 0), documents=True)
    plain, windowed = BlockMask(MaskKind.CAUSAL), BlockMask(MaskKind.FULL, window=(4096, 0), offset=4096)
    kw = dict(device_kind="cuda", dtype="bfloat16")
    installed = block.get_backend("fa4")
    assert (block.resolve_backend("auto", mask=documents, **kw) == "fa4") == installed.available()
    for name in ("fa4", "aten_flash", "aten_cudnn", "aten_varlen", "aten_window"):  # a CUDA machine with FA4
        real = block.get_backend(name)
        monkeypatch.setitem(block._BACKENDS, name, block.BlockBackend(
            name, real.fwd, real.bwd, supports=real.supports, available=lambda: True))
    for mask in (documents, by_index, plain, windowed):
        assert block.resolve_backend("auto", mask=mask, **kw) == "fa4", mask
    assert block.resolve_backend("auto", mask=plain, softcap=True, **kw) == "fa4"
    assert block.resolve_backend("auto", mask=BlockMask(MaskKind.STRICT), **kw) == "aten_cudnn"
    for mask in (documents, by_index, plain, windowed):
        assert block.resolve_backend("auto", mask=mask, deterministic=True, **kw) == "fa4", mask
    assert block.get_backend("fa4", deterministic=True).name == "fa4"
    assert block.resolve_backend("auto", mask=BlockMask(MaskKind.STRICT), deterministic=True, **kw) == "aten_flash"
    fa4 = block.get_backend("fa4")
    monkeypatch.setitem(block._BACKENDS, "fa4", block.BlockBackend("fa4", fa4.fwd, fa4.bwd, supports=fa4.supports,
                                                                   available=lambda: False))
    assert block.resolve_backend("auto", mask=plain, **kw) == "aten_cudnn"
    assert block.resolve_backend("auto", mask=windowed, **kw) == "aten_window"
    assert block.resolve_backend("auto", mask=plain, deterministic=True, **kw) == "aten_flash"
    for mask, name in ((documents, "aten_varlen"), (by_index, "aten_varlen"), (windowed, "aten_window")):
        assert block.resolve_backend("auto", mask=mask, deterministic=True, **kw) == name, mask
    assert block.resolve_backend("auto", mask=documents, device_kind="cuda", dtype="float32") == "reference"


def test_a_blocks_backward_takes_its_forwards_run_list_and_offsets(fa4, monkeypatch, seed):
    """One rank, packed documents on ``fa4``, forward and backward through autograd: the block's
    run list is planned once per call and its offsets uploaded once — the backward is handed the
    forward's (the loop's per-block memo, ``HostPair.memo``) — and a second call with other ids
    plans its own. Both equal the portable kernel."""
    import torch_impl
    from torch_impl.kernels import varlen

    planned, offsets = [], []
    real_runs = varlen.document_runs
    monkeypatch.setattr(varlen, "document_runs", lambda *a, **k: planned.append(1) or real_runs(*a, **k))
    for name in ("fa4_forward", "fa4_backward"):
        real = getattr(fa4, name)
        monkeypatch.setattr(fa4, name, lambda *a, _real=real, **k: offsets.append(k["cu_seqlens_q"]) or _real(*a, **k))
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, 1, 48, 48)
    for ids in ([0] * 9 + [1] + [2] * 30 + [3] * 8, [5] * 20 + [6] * 28):
        planned.clear(), offsets.clear()
        segment_ids = torch.tensor([ids], dtype=torch.int32)

        def step(backend, segment_ids=segment_ids):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, lse = torch_impl.ring_attention(*leaves, causal=True, layout="contiguous", segment_ids=segment_ids,
                                               block_backend=backend)
            return tuple(x.detach() for x in (o, lse, *torch.autograd.grad(o, leaves, do)))

        got = step("fa4")
        assert len(planned) == 1, "the backward planned its block again"
        assert len(offsets) == 2 and offsets[0] is offsets[1], "the backward uploaded its offsets again"
        assert offsets[0].tolist() == np.r_[0, np.cumsum(np.unique(ids, return_counts=True)[1])].tolist()
        _close(got, step("reference"))
    assert fa4.portable == {"fwd": 0, "bwd": 0}
