"""The ``"flex"`` block backend (torch FlexAttention, ``torch_impl/kernels/flex.py``) inside the
ring on gloo worlds of 2 processes (CPU: torch's unfused flex path): zigzag (causal diagonal and
the rectangular full halves) with packed documents, and stripe (strict blocks) without, against
the float64 dense truth — forward and the backward with an lse cotangent, where every block's
backward is given the GLOBAL o / lse. The inputs, truth and stitching are the packed-documents
tier's (test_torch_documents.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch_impl
from test_torch_documents import assert_close_to, from_layout, make_inputs, stitch, to_layout, truth
from torch_tasks import documents_task

CASES = [("zigzag", True, True), ("stripe", True, False)]


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
