"""Tier 1 — ``seqplan.chooser.choose_layout``: the measured choice of layout and K/V exchange for a
batch of packed documents. Why: a user's data goes through it before any attention call, so the
padding it adds and the permutation it applies must be exact (real tokens once each, original
order recoverable, causal order kept), and the rule must be the one docs/decisions.md states."""

from __future__ import annotations

import numpy as np
import pytest

from seqplan.chooser import choose_layout
from seqplan.config import AttentionLayerConfig
from seqplan.layouts import DOCUMENT_HYBRID

IDS = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 8 + [4] * 16, [7] * 3 + [8] * 45 + [9] * 16])  # odd lengths


def test_packed_causal_documents_on_a_ring_take_the_hybrid_on_allgather():
    choice = choose_layout(IDS, ring=4, ulysses=2)
    assert (choice.layout, choice.row_layout, choice.kv_exchange) == ("contiguous", DOCUMENT_HYBRID, "allgather")
    assert choice.source.shape[1] % (2 * 4 * 2) == 0 and choice.padding == choice.source.shape[1] - IDS.shape[1]
    assert choice.padding > 0  # odd document lengths: padded to multiples of 2R
    for row in range(2):
        real = choice.source[row][choice.real[row]]
        assert sorted(real.tolist()) == list(range(IDS.shape[1]))  # every real token exactly once
        np.testing.assert_array_equal(choice.segment_ids[row][choice.real[row]], IDS[row][real])
        order = np.argsort(choice.token_index[row][choice.real[row]])  # the masks' order is the original order
        assert np.all(np.diff(real[order]) > 0)


@pytest.mark.parametrize("kw, layout", [(dict(ring=4), "zigzag"), (dict(ring=1, ulysses=4), "contiguous")])
def test_everything_else_keeps_the_static_layout_on_the_ring(kw, layout):
    one_each = np.repeat(np.arange(2)[:, None], 64, 1)  # one document per row
    for ids, causal in ((one_each, True), (IDS, False)) if kw["ring"] > 1 else ((IDS, True),):
        choice = choose_layout(ids, causal=causal, **kw)
        assert (choice.layout, choice.row_layout, choice.kv_exchange, choice.padding) == (layout, None, "ring", 0)
        assert choice.token_index is None
        np.testing.assert_array_equal(choice.read_back(choice.lay_out(ids)), ids)


def test_lay_out_and_read_back_are_inverse_and_padding_is_filled():
    choice = choose_layout(IDS, ring=4)
    x = np.random.default_rng(0).standard_normal((*IDS.shape, 3)).astype(np.float32)
    laid = choice.lay_out(x, fill=np.nan)
    assert np.isnan(laid[~choice.real]).all() and not np.isnan(laid[choice.real]).any()
    np.testing.assert_array_equal(choice.read_back(laid), x)
    config = AttentionLayerConfig(d_model=8, heads=2, kv_heads=1, head_dim=4)
    assert (choice.layer_config(config).layout, choice.layer_config(config).kv_exchange) == ("contiguous", "allgather")


def test_bad_input_is_refused_with_the_constraint():
    with pytest.raises(ValueError, match="ring must be an int >= 1"):
        choose_layout(IDS, ring=0)
    with pytest.raises(TypeError, match=r"integer \[b, seq\]"):
        choose_layout(IDS[0], ring=2)
    with pytest.raises(ValueError, match="first two dimensions"):
        choose_layout(IDS, ring=2).lay_out(np.zeros((2, 5)))


def test_the_hybrid_choice_gathers_only_each_shards_shared_prefix():
    """The choice's ``shared_tokens`` holds every token whose document spans shards (the promise
    the all-gather checks), on the bucket ladder, below the shard when some documents stay whole;
    the layer config carries it."""
    from seqplan.shared import BUCKETS_PER_SHARD, check_shared_tokens, ring_shards, shared_extent

    ids = np.concatenate([np.repeat(np.arange(40), 8), np.full(64, 99)])[None]  # short ones and one long one
    choice = choose_layout(ids, ring=4)
    shards = ring_shards(choice.segment_ids, 4)
    t = shards.shape[2]
    check_shared_tokens(shards, choice.shared_tokens)
    assert shared_extent(shards) <= choice.shared_tokens < t
    assert choice.shared_tokens % -(-t // BUCKETS_PER_SHARD) == 0
    config = AttentionLayerConfig(d_model=8, heads=2, kv_heads=1, head_dim=4)
    assert choice.layer_config(config).shared_tokens == choice.shared_tokens
    assert choose_layout(np.repeat(np.arange(2)[:, None], 64, 1), ring=4).shared_tokens is None  # static: no prefix


def test_shared_prefix_off_gathers_every_shard():
    choice = choose_layout(IDS, ring=4, shared_prefix=False)
    assert choice.shared_tokens is None and choice.kv_exchange == "allgather"
    assert "every shard" in choice.reason


@pytest.mark.parametrize("window", [(64, 0), 16])
def test_a_window_takes_contiguous_shards_on_the_ring(window):
    """Why: the hybrid and all-gather KV refuse a window beyond causal, so a chooser that ignored
    the window would hand a windowed call a layout the call refuses. Documents or not: contiguous,
    the ring exchange, nothing padded, ids as given."""
    one_each = np.repeat(np.arange(2)[:, None], 64, 1)
    for ids in (IDS, one_each):
        choice = choose_layout(ids, ring=4, window=window)
        assert (choice.layout, choice.row_layout, choice.kv_exchange, choice.padding) == ("contiguous", None, "ring", 0)
        assert choice.token_index is None and choice.shared_tokens is None and "window" in choice.reason
        np.testing.assert_array_equal(choice.segment_ids, ids)
        np.testing.assert_array_equal(choice.read_back(choice.lay_out(ids)), ids)


def test_a_bad_window_is_refused():
    with pytest.raises(ValueError, match="window extents must be >= 0"):
        choose_layout(IDS, ring=4, window=(-1, 0))
    with pytest.raises(TypeError, match="window must be None"):
        choose_layout(IDS, ring=4, window="4096")
