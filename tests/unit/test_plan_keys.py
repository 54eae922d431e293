"""Why: a one-call plan that reads a device's own keys in order (the shared prefix's local part)
takes a view of the packed keys and writes their gradients back by slice — the kernels' fast
path must give bitwise what the gather / scatter-add path gives, and must only be taken where
the plan's keys really are one range in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.probes.balance import MIXES
from seqplan.chooser import choose_layout
from seqplan.documents import PrefixRuns
from seqplan.shared import split_runs
from torch_impl.kernels.varlen import plan_key_grads, plan_keys


def plan_of(key_index) -> PrefixRuns:
    key_index = np.asarray(key_index, dtype=np.int64)
    n = len(key_index)
    return PrefixRuns(np.array([0, n], np.int32), np.array([0, n], np.int32), key_index, n, n)


@pytest.mark.parametrize("key_index, expected", [
    (np.arange(3, 9), (3, 9)),
    (np.arange(0, 1), (0, 1)),
    (np.array([3, 4, 6]), None),  # a gap
    (np.array([3, 4, 4, 5]), None),  # a key read twice
    (np.array([5, 4, 3]), None),  # out of order
    (np.array([], dtype=np.int64), None),
])
def test_key_range_only_where_the_keys_are_one_range_in_order(key_index, expected):
    assert plan_of(key_index).key_range == expected


@pytest.mark.parametrize("key_index", [np.arange(2, 10), np.array([0, 1, 1, 7, 3, 3, 3])])
def test_the_view_and_the_slice_equal_the_gather_and_the_scatter_add_bitwise(key_index):
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(12, 2, 4, generator=gen).to(torch.bfloat16) for _ in range(2))
    plan = plan_of(key_index)
    index = torch.from_numpy(plan.key_index)
    for got, x in zip(plan_keys(plan, index, k, v), (k, v)):
        assert torch.equal(got, x.index_select(0, index))
    grads = [torch.randn(len(key_index), 2, 4, generator=gen).to(torch.bfloat16) for _ in range(2)]
    for got, g in zip(plan_key_grads(plan, index, k.shape, *grads), grads):
        want = torch.zeros(k.shape, dtype=torch.float32).index_add_(0, index, g.float())
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_the_local_part_of_the_short_mix_reads_one_range_on_every_device():
    """The premise of the fast path: under the chooser's hybrid with the shared prefix, each
    device's local part reads its own keys in order (the shared part gathers)."""
    ids = MIXES[0].segment_ids(32768)[None]
    choice = choose_layout(ids, ring=4)
    seg, index = np.asarray(choice.segment_ids), np.asarray(choice.token_index)
    b, total = seg.shape
    shards = lambda x: x.reshape(b, 4, total // 4).transpose(1, 0, 2)
    for device in range(4):
        split = split_runs(shards(seg), shards(index), device=device, shared_tokens=choice.shared_tokens,
                           layout="contiguous")
        assert split.local is not None and split.local.key_range is not None
        lo, hi = split.local.key_range
        assert hi == b * total // 4 and lo <= choice.shared_tokens
