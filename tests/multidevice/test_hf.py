"""Hugging Face transformers models trained sequence-parallel through torch_impl.hf (an
``AttentionInterface`` registration bound to a DeviceMesh), over gloo on CPU.

Why: most torch users train Hugging Face models. Registering an attention function is easy; what
goes wrong is everything around it — the model's own label shift inside a shard, RoPE positions
that follow the layout, a loss averaged per rank, a sliding window off by one. A tiny random
Llama (and a Mistral with a sliding window), the same weights, must give the same losses over two
Adam steps and the same gradients with and without sequence parallelism."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_tasks

TOL = 1e-5

MESHES = [
    ("llama", (("ring", 2),), "zigzag", False),
    ("llama", (("ring", 2), ("ulysses", 2)), "stripe", False),
    ("mistral", (("ring", 4),), "contiguous", False),  # a sliding window of 5 over shards of 8 tokens
    ("llama", (("ring", 2),), "zigzag", True),  # packed documents: segment_ids vs HF's packed-sequence mask
]


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind, axes, layout, packed", MESHES, ids=lambda x: str(x))
def test_hf_model_trains_sequence_parallel_like_the_plain_model(kind, axes, layout, packed, worlds):
    from parity.runners.torch_world import get_world

    ref_losses, ref_grads = hf_tasks.plain_task(kind, 2, packed)
    size = int(np.prod([n for _, n in axes]))
    results = get_world(size).run(hf_tasks.sequence_parallel_task, kind, axes, layout, 2, packed)
    losses, grads = results[0]
    assert _rel(np.array(losses), np.array(ref_losses)) <= TOL, (losses, ref_losses)
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert _rel(grads[worst], ref_grads[worst]) <= TOL, (worst, _rel(grads[worst], ref_grads[worst]))
    assert ref_losses[1] < ref_losses[0]


def test_sliding_window_maps_to_left_w_minus_one():
    """Hugging Face's sliding window of w lets query q see keys q - w < k <= q: torch_impl.hf maps it
    to ringbridge's window (w - 1, 0). Pinned against transformers' own overlay function, position
    by position, for the mapping the attention function uses."""
    from transformers.masking_utils import sliding_window_overlay

    from seqplan.validation import check_window
    from torch_impl.hf import hf_window

    assert hf_window(None) is None
    for w in (1, 2, 5):
        overlay = sliding_window_overlay(w)
        left, right = check_window(hf_window(w))
        for q in range(12):
            for k in range(q + 1):  # causal
                assert bool(overlay(0, 0, q, k)) == (q - left <= k <= q + right), (w, q, k)


def test_padding_mask_is_refused(worlds):
    from parity.runners.torch_world import get_world

    messages = get_world(2).run(hf_tasks.padding_refused_task, (("ring", 2),))
    assert all("padding mask" in m for m in messages), messages
