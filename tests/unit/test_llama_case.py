"""Tier 1 — the whole-model case (parity.training.llama, NumPy only) that both frameworks' models
and the float64 oracle start from: if its labels, positions or FLOP count were wrong, every
framework would agree with every other and still train the wrong thing."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.mesh import MeshShape
from parity.core.reference import visible
from parity.training.llama import (
    IGNORE,
    LlamaConfig,
    ModelCase,
    packed_corpus,
    step_flops,
    visible_pairs,
    weight_shapes,
)


def test_labels_are_the_next_token_of_the_same_document():
    batch = packed_corpus(LlamaConfig(), batch=3, seq=64, seed=5)
    for tokens, labels, ids, pos in zip(batch.tokens, batch.labels, batch.segment_ids, batch.positions):
        for i in range(63):
            expected = tokens[i + 1] if ids[i + 1] == ids[i] else IGNORE
            assert labels[i] == expected
        assert labels[-1] == IGNORE
        starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 1))
        assert (pos[starts] == 0).all() and (tokens[starts] == 0).all()  # BOS, positions restart
    assert batch.labelled == int((batch.labels != IGNORE).sum()) > 0


def test_permuted_batch_keeps_each_token_with_its_label_and_position():
    case = ModelCase(mesh=MeshShape(ring=4), layout="zigzag", seq=32)
    _, batch = case.inputs()
    perm = case.permutation()
    permuted = batch.permuted(perm)
    assert (permuted.order == perm).all()
    assert (permuted.labels == batch.labels[:, perm]).all() and permuted.labelled == batch.labelled
    # a shard edge in layout order is not a document edge: the label of the token there is its
    # ORIGINAL successor's token, wherever that token now lives
    shard = 32 // 4
    last = shard - 1
    original = perm[last]
    if original + 1 < 32 and batch.segment_ids[0, original + 1] == batch.segment_ids[0, original]:
        assert permuted.labels[0, last] == batch.tokens[0, original + 1]


@pytest.mark.parametrize("window", [None, (3, 0), (0, 0), (100, 0)])
def test_visible_pairs_counts_the_reference_mask(window):
    ids = packed_corpus(LlamaConfig(), batch=1, seq=96, seed=2).segment_ids
    pos = np.arange(96)
    mask = visible(pos, pos, True, ids, ids, window)
    assert visible_pairs(ids[0], window) == int(mask.sum())


def test_step_flops_of_one_layer_by_hand():
    config = LlamaConfig(vocab=10, d_model=4, layers=1, heads=2, kv_heads=1, head_dim=2, d_ff=6)
    batch = packed_corpus(config, batch=1, seq=8, seed=0)
    flops = step_flops(config, batch)
    # q 4x4, k and v 4x2 each, o 4x4, gate/up/down 4x6 each, lm_head 4x10: multiply-adds per token
    macs = 16 + 8 + 8 + 16 + 3 * 24 + 40
    assert flops["matmul_fwd"] == 2 * macs * 8 and flops["matmul_bwd"] == 2 * flops["matmul_fwd"]
    assert flops["attention_fwd"] == 4 * 2 * 2 * visible_pairs(batch.segment_ids[0])


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="heads % kv_heads"):
        LlamaConfig(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LlamaConfig(head_dim=7)
    with pytest.raises(ValueError, match="batch % data"):
        ModelCase(mesh=MeshShape(data=2, ring=2), batch=3)
    with pytest.raises(ValueError, match="fsdp shards dim 0"):
        ModelCase(model=LlamaConfig(vocab=50), mesh=MeshShape(ring=4))
    assert "lm_head" not in weight_shapes(LlamaConfig(tie_embeddings=True))
