"""The ``"flex"`` block backend (torch FlexAttention, ``torch_impl/kernels/flex.py``) inside the
ring on a gloo world of 2 processes (CPU: torch's unfused flex path): zigzag (causal diagonal
and the rectangular full halves) with packed documents, stripe (strict blocks) without, and
windows (with documents and sinks), against the float64 dense truth — forward and the backward
with an lse cotangent, where every block's backward is given the GLOBAL o / lse. The inputs,
truth and stitching are the packed-documents and windows tiers' (test_torch_documents.py,
test_torch_windows.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import test_torch_windows as windows
import torch_impl
from helpers import FULL
from test_torch_documents import assert_close_to, from_layout, make_inputs, stitch, to_layout, truth
from torch_tasks import documents_task

CASES = [("zigzag", True, True), ("stripe", True, False)]

# flex inside a gloo ring (eager flex on the CPU: slow); the flex block kernel itself is checked by
# tests/unit/test_torch_flex.py in the default run, this whole-ring check with --full.
pytestmark = pytest.mark.skipif(not FULL, reason="the flex ring runs with --full (RINGBRIDGE_FULL=1)")


@pytest.mark.parametrize("layout,causal,documents", CASES,
                         ids=[f"ring2-{lay}-{'causal' if c else 'full'}{'-documents' if d else ''}" for lay, c, d in CASES])
def test_ring_with_the_flex_backend_matches_dense_truth(layout, causal, documents, seed, worlds):
    x = make_inputs(seed, 2, 2)
    if not documents:
        x = {n: a for n, a in x.items() if n != "segment_ids"}
    perm = torch_impl.layout_permutation(x["q"].shape[1], layout, 2, 1)
    kwargs = dict(causal=causal, layout=layout, kv_exchange="ring", block_backend="flex")
    shards = worlds(2).run(documents_task, (("ring", 2),), to_layout(x, perm), kwargs, False)
    got = from_layout(stitch(shards, 1), perm)
    assert_close_to(got, truth({"segment_ids": None} | x, causal), f"flex ring2 {layout} (seed {seed})")


WINDOWED = [("zigzag", True, (6, 0), True), ("stripe", False, (5, 3), False)]


@pytest.mark.parametrize("layout,causal,window,documents", WINDOWED,
                         ids=[f"ring2-{lay}-{'causal' if c else 'full'}-w{w[0]}x{w[1]}-sinks{'-documents' if d else ''}"
                              for lay, c, w, d in WINDOWED])
def test_windowed_ring_with_the_flex_backend_matches_dense_truth(layout, causal, window, documents, seed, worlds):
    """Windows on original positions (the kernel's ``positions``), with sinks. One world size for
    the whole file: each new process pays flex's first (dynamo) call once."""
    x = windows.make_inputs(seed, 2, 2, sinks=True, ids=documents)
    perm = torch_impl.layout_permutation(windows.T, layout, 2, 1)
    kwargs = dict(causal=causal, layout=layout, kv_exchange="ring", window=window, block_backend="flex")
    shards = worlds(2).run(documents_task, (("ring", 2),), windows.to_layout(x, perm), kwargs, False)
    got = windows.from_layout(windows.stitch(shards, 1), perm)
    windows.assert_close_to(got, windows.truth(x, causal, window), f"flex ring2 {layout} w{window} (seed {seed})")


def test_softcapped_ring_with_the_flex_backend_matches_the_oracle(seed, worlds):
    """Soft-capping as a score_mod in every block of a causal zigzag ring with a window, sinks
    (uncapped) and packed documents, bf16, through the parity pipeline against the float64 oracle."""
    from helpers import assert_passed
    from parity.core.cases import Case
    from parity.runners.pipeline import check_case
    from parity.runners.torch_runner import TorchRunner

    case = Case(ring=2, layout="zigzag", causal=True, kv_heads=2, dtype="bfloat16", batch=2, documents="mix",
                window=(6, 0), sinks=True, softcap=1.5)
    assert_passed(check_case(case, TorchRunner(block_backend="flex"), seed=seed), case, "torch flex", seed)
