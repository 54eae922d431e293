"""Tier 1 — torch_impl's pure pieces on one process: every block-kernel backend that runs on
CPU (portable einsum, aten CPU flash op) with every mask and head layout, and the LSE merge."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.core import reference
from seqplan.layouts import LAYOUTS
from seqplan.schedule import BLOCK_MASKS, FULL_MASK, STRICT_MASK
from torch_impl import layout_permutation, merge_partials
from torch_impl.block import get_backend


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_permutation_matches_oracle(layout):
    for ring, ulysses in [(1, 1), (2, 1), (4, 2), (8, 1)]:
        n = 2 * ring * ulysses * 3
        np.testing.assert_array_equal(layout_permutation(n, layout, ring, ulysses),
                                      reference.layout_permutation(n, layout, ring, ulysses))


@pytest.mark.parametrize("backend", ["reference", "aten_cpu"])
@pytest.mark.parametrize("mask", list(BLOCK_MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_block_kernel_matches_oracle(backend, mask, heads, kv_heads, seed):
    """o, lse and gradients of one block (its own o/lse as global, with an lse cotangent on the
    reference path) equal the oracle under the equivalent position mask; row 0 of a strict block
    is empty (o = 0, lse = -inf)."""
    rng = np.random.default_rng(seed)
    b, t, d, scale = 2, 8, 16, 0.3
    q, do = rng.standard_normal((2, b, t, heads, d))
    k, v = rng.standard_normal((2, b, t, kv_heads, d))
    dlse = rng.standard_normal((b, heads, t)) if backend == "reference" else None
    kernel = get_backend(backend)
    tq, tk, tv, tdo = (torch.tensor(x, dtype=torch.float32) for x in (q, k, v, do))
    o, lse = kernel.fwd(tq, tk, tv, mask, scale)
    rows = slice(1, None) if mask == STRICT_MASK else slice(None)
    q_pos = np.arange(t) - (0.5 if mask == STRICT_MASK else 0.0)  # strict: query i sees keys j < i
    if mask == STRICT_MASK:
        assert torch.all(lse[:, :, 0] == float("-inf")) and torch.all(o[:, 0] == 0)
    fwd = reference.attention_forward(q[:, rows], k, v, causal=mask != FULL_MASK, scale=scale,
                                      q_pos=q_pos[rows], k_pos=np.arange(t))
    np.testing.assert_allclose(o[:, rows].numpy(), fwd.o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse[:, :, rows].numpy(), fwd.lse, rtol=2e-5, atol=2e-6)
    dl = None if dlse is None else torch.tensor(dlse, dtype=torch.float32)
    dq, dk, dv = kernel.bwd(tdo, tq, tk, tv, o, lse, mask, scale, dl)
    q_rows = q[:, rows]
    want = reference.attention_backward(fwd, q_rows, k, v, do[:, rows], None if dlse is None else dlse[:, :, rows],
                                        scale=scale)
    for name, g, w in zip(("dq", "dk", "dv"), (dq[:, rows], dk, dv), want):
        np.testing.assert_allclose(g.numpy(), w, rtol=2e-5, atol=2e-5, err_msg=name)


def test_merge_of_two_key_halves_equals_whole(seed):
    """Attention over keys [A; B] is the LSE merge of attention over A and over B."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((1, 6, 2, 8)), rng.standard_normal((1, 10, 2, 8)), rng.standard_normal((1, 10, 2, 8))
    whole = reference.attention_forward(q, k, v)
    kernel = get_backend("reference")
    tq, tk, tv = (torch.tensor(x, dtype=torch.float32) for x in (q, k, v))
    o, lse = merge_partials(*kernel.fwd(tq, tk[:, :4], tv[:, :4], FULL_MASK, 8**-0.5),
                            *kernel.fwd(tq, tk[:, 4:], tv[:, 4:], FULL_MASK, 8**-0.5))
    np.testing.assert_allclose(o.numpy(), whole.o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole.lse, rtol=1e-6)


def test_deterministic_mode_refuses_the_backend_measured_nondeterministic():
    """torch.use_deterministic_algorithms(True): aten_cudnn (dq differs run to run on H200 even in
    that mode) raises like torch's own non-deterministic ops; aten_flash and reference pass."""
    from torch_impl.config import default_deterministic

    torch.use_deterministic_algorithms(True)
    try:
        assert default_deterministic(None) and not default_deterministic(False)
        with pytest.raises(RuntimeError, match="'aten_cudnn' is not deterministic"):
            get_backend("aten_cudnn", deterministic=default_deterministic(None))
        assert get_backend("aten_flash", deterministic=True).name == "aten_flash"
        assert get_backend("auto", deterministic=True).name == "reference"
    finally:
        torch.use_deterministic_algorithms(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.warns(UserWarning, match="not deterministic"):
            assert get_backend("aten_cudnn", deterministic=default_deterministic(None)).name == "aten_cudnn"
    finally:
        torch.use_deterministic_algorithms(False)
    assert not default_deterministic(None)
    assert get_backend("aten_cudnn", deterministic=default_deterministic(None)).name == "aten_cudnn"  # allowed


def test_a_deterministic_call_holds_torchs_switch_while_its_kernels_run(monkeypatch, seed):
    """``deterministic=True`` with torch's switch off: every block kernel, forward and backward,
    runs under the strict switch (torch then picks FA2's deterministic backward — under warn-only
    it does not, measured on an H200 — and a deterministic ``index_add_``; ``fa4`` reads it for
    FA4's deterministic backward), and the switch is off again after each pass — also when a kernel
    raises. A process that set the switch itself keeps its own setting (warn-only here).
    ``deterministic=False``: the kernels run with it off."""
    import torch_impl
    from torch_impl import block

    seen = []
    reference = get_backend("reference")

    def recording(fn):
        def run(*args, **kwargs):
            seen.append((torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setitem(block._BACKENDS, "recording", block.BlockBackend(
        "recording", recording(reference.fwd), recording(reference.bwd)))
    rng = np.random.default_rng(seed)
    q, k, v, do = (torch.tensor(rng.standard_normal((1, 16, 2, 8)), dtype=torch.float32) for _ in range(4))

    def step(deterministic: bool, switch_set: bool = False):
        seen.clear()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = torch_impl.ring_attention(*leaves, causal=True, layout="contiguous", block_backend="recording",
                                         deterministic=deterministic)
        assert torch.are_deterministic_algorithms_enabled() == switch_set  # between the passes: as it was
        o.backward(do)
        return list(seen)

    assert step(deterministic=True) == [(True, False)] * 2  # one block, forward and backward
    assert not torch.are_deterministic_algorithms_enabled()
    assert step(deterministic=False) == [(False, False)] * 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert step(deterministic=True, switch_set=True) == [(True, True)] * 2
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)

    def failing(*args, **kwargs):
        raise ZeroDivisionError("a kernel that fails")

    monkeypatch.setitem(block._BACKENDS, "failing", block.BlockBackend("failing", failing, failing))
    with pytest.raises(ZeroDivisionError):
        torch_impl.ring_attention(q, k, v, causal=True, layout="contiguous", block_backend="failing",
                                  deterministic=True)
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_on_cuda_needs_cublas_set_up_before_any_collective(monkeypatch):
    """``deterministic=True`` on CUDA: refused by name unless ``CUBLAS_WORKSPACE_CONFIG`` is one of
    cuBLAS's reproducible settings (under torch's strict switch — the call's, or the process's own —
    the portable kernel's products would raise mid-call); on the CPU, under the process's own
    warn-only switch (warnings only), or with ``deterministic=False``, nothing is asked."""
    from torch_impl.config import check_deterministic_ready

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        check_deterministic_ready(True, "cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="':0:0'"):
        check_deterministic_ready(True, torch.device("cuda", 0))
    check_deterministic_ready(False, "cuda")
    check_deterministic_ready(True, "cpu")
    for setting in (":4096:8", ":16:8"):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", setting)
        check_deterministic_ready(True, "cuda")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    for warn_only, refused in ((False, True), (True, False)):
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        try:
            if refused:
                with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
                    check_deterministic_ready(True, "cuda")
            else:
                check_deterministic_ready(True, "cuda")
        finally:
            torch.use_deterministic_algorithms(False)


def test_calls_holding_the_switch_at_once_leave_it_on_until_the_last_leaves():
    """Two calls holding the switch at once (two threads, or two devices' autograd threads in one
    process): the first to leave does not turn it off under the other; the last does, and only what
    the first turned on."""
    from torch_impl.config import deterministic_kernels

    with deterministic_kernels(True):
        with deterministic_kernels(True):
            assert torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with deterministic_kernels(True):
            pass
        assert torch.are_deterministic_algorithms_enabled()  # the process's own: kept
    finally:
        torch.use_deterministic_algorithms(False)


def test_in_place_merge_follows_the_merge_formula():
    """merge_partials_into (the ring forward's in-place merge of a bf16 partial into a float32
    accumulator; merge_partials is built on it) computes the contract's (docs/contract.md) stable merge, checked in
    float64 by hand, empty partials (lse_b = -inf) included."""
    from torch_impl.merge import merge_partials_into

    gen = torch.Generator().manual_seed(3)
    o, o_b = torch.randn(2, 6, 4, 8, generator=gen), torch.randn(2, 6, 4, 8, generator=gen).bfloat16()
    lse, lse_b = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 4, 6, generator=gen)
    lse_b[0, 1] = float("-inf")  # batch 0, head 1: an empty partial
    o_before, lse_before = o.clone(), lse.clone()
    w = torch.sigmoid(lse_b.double() - lse.double())
    want_o = o.double() - w.transpose(1, 2).unsqueeze(-1) * (o.double() - o_b.double())
    want_lse = lse.double() - torch.nn.functional.logsigmoid(lse.double() - lse_b.double())
    merge_partials_into(o, lse, o_b, lse_b)
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(o[0, :, 1], o_before[0, :, 1]) and torch.equal(lse[0, 1], lse_before[0, 1])


@pytest.mark.parametrize("spans", [[(2, 4), (3, 6)], [(0, 2), (5, 7)], [(5, 10), (0, 10)], [(0, 3), (7, 10), (2, 8)],
                                   [(0, 10)], []])
def test_float32_rows_equal_the_whole_shard_widened(spans, seed):
    """Float32Rows (the loops' accumulators, widened only on the rows later blocks touch) gives
    bit for bit what widening the whole shard gave: merges and adds on the rows asked for, in
    float32; every other row exactly the kernel's bf16 — and only the rows asked for are widened."""
    from seqplan.schedule import Span
    from torch_impl.merge import Float32Rows, merge_partials_into

    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 10, 3, 4, generator=gen).bfloat16()
    whole, lse_whole = base.float(), torch.randn(2, 3, 10, generator=gen)
    acc, lse = Float32Rows(base.clone()), lse_whole.clone()
    for i, (lo, hi) in enumerate(spans):
        o_b, lse_b = torch.randn(2, hi - lo, 3, 4, generator=gen).bfloat16(), torch.randn(2, 3, hi - lo, generator=gen)
        if i % 2:  # a gradient added
            whole[:, lo:hi] += o_b.float()
            acc.rows(Span(lo, hi)).add_(o_b.float())
        else:  # a partial merged
            merge_partials_into(whole[:, lo:hi], lse_whole[:, :, lo:hi], o_b, lse_b)
            merge_partials_into(acc.rows(Span(lo, hi)), lse[:, :, lo:hi], o_b, lse_b)
    touched = np.zeros(10, bool)
    for lo, hi in spans:
        touched[lo:hi] = True
    widened = np.zeros(10, bool)
    for lo, hi in acc._spans:
        widened[lo:hi] = True
    np.testing.assert_array_equal(widened, touched)
    assert torch.equal(acc.result(torch.bfloat16), whole.bfloat16())
    assert torch.equal(acc.result(torch.float32), whole)  # the untouched rows' float32 round trip: exact


def test_attention_function_names_its_arguments_in_forward_order():
    """``_Attention.ARGUMENTS`` (backward's gradients and ``needs_input_grad`` are read by these
    names) is exactly forward's parameter list after ctx."""
    import inspect

    from torch_impl.loop import _Attention

    assert tuple(inspect.signature(_Attention.forward).parameters)[1:] == _Attention.ARGUMENTS


def test_a_token_index_that_passed_is_not_read_again_until_it_changes(monkeypatch):
    """The per-call range check of ``token_index`` copies its min / max to the host (a sync on
    GPUs): the same tensor, unchanged, against the same length is not read again — a model's layers
    pass one — while an in-place write (through a view too), another length or another tensor with
    the same values are read, and out-of-range values are refused every time."""
    from torch_impl import api

    reads = []
    real = api.check_token_index_range
    monkeypatch.setattr(api, "check_token_index_range", lambda *a, **k: reads.append(a) or real(*a, **k))
    q = torch.zeros(1, 4, 2, 8)
    index = torch.arange(4, dtype=torch.int32)[None]
    for _ in range(3):
        api._check_token_index(index, q, 8)
    assert len(reads) == 1
    api._check_token_index(index, q, 16)  # another length: read
    assert len(reads) == 2
    index[:, 1:].add_(20)  # through a view: the version counter moves
    with pytest.raises(ValueError, match=r"token_index values must lie in \[0, 16\)"):
        api._check_token_index(index, q, 16)
    with pytest.raises(ValueError, match=r"token_index values must lie in \[0, 16\)"):
        api._check_token_index(index, q, 16)  # refused again, not remembered
    api._check_token_index(torch.arange(4, dtype=torch.int32)[None], q, 16)  # another tensor: read
    assert len(reads) == 5
    with torch.inference_mode():  # no version counter: read every call, never remembered
        frozen = torch.arange(4, dtype=torch.int32)[None]
    for _ in range(2):
        api._check_token_index(frozen, q, 16)
    assert len(reads) == 7
