"""The balance probe (parity.probes.balance): counts known by hand on a small case, the vectorised
tile and pair counts against a pair-by-pair walk of every block, and that a block the schedule's
``document_work`` skips really holds no visible pair."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from parity.core.documents import draw_segment_ids
from parity.probes import balance
from seqplan.layouts import layout_permutation
from seqplan.schedule import DocumentWork, device_visits, document_work, ring_schedule

TWO_SHARD_DOCUMENTS = np.repeat(np.array([0, 1], dtype=np.int32), 8)  # 16 tokens: 8 of document 0, 8 of 1


def test_counts_known_by_hand_contiguous():
    """R = 2, contiguous, document k = shard k: each device's own shard is one document (PLAIN,
    causal: 8·8/2 = 32 entries; 3 of its four 4x4 tiles); device 1's block against shard 0
    shares no document (SKIP). 8·9/2 = 36 visible pairs each."""
    c = balance.device_counts(TWO_SHARD_DOCUMENTS, "contiguous", ring=2, tile=4)
    assert c["area"].tolist() == [32, 32] and c["tiles"].tolist() == [3, 3] and c["pairs"].tolist() == [36, 36]
    assert c["blocks"] == {"SKIP": 1, "PLAIN": 2, "DOCUMENTS": 0} and c["visible_tiles"] == 6


def test_counts_known_by_hand_zigzag():
    """The same ids in zigzag order: shard 0 = tokens 0-3 (doc 0) ++ 12-15 (doc 1), shard 1 = 4-7
    ++ 8-11. Every block spans both documents (DOCUMENTS): the causal local block (32) and a half
    block (4·8 = 32) each. Visible tiles: the four diagonal ones, tokens 4-7 on 0-3 (device 1)
    and 12-15 on 8-11 (device 0)."""
    c = balance.device_counts(TWO_SHARD_DOCUMENTS, "zigzag", ring=2, tile=4)
    assert c["area"].tolist() == [64, 64] and c["tiles"].tolist() == [3, 3] and c["pairs"].tolist() == [36, 36]
    assert c["blocks"] == {"SKIP": 0, "PLAIN": 0, "DOCUMENTS": 4}


def test_unpacked_zigzag_yardstick_is_r_over_two_shard_blocks():
    """One document: zigzag gives every device a causal shard block and R-1 half blocks, R/2
    shard blocks of area; nothing is skipped and every block is PLAIN."""
    for ring in (2, 4, 8):
        c = balance.device_counts(np.zeros(64 * ring, np.int32), "zigzag", ring, tile=8)
        assert c["area"].tolist() == [64 * 64 * ring / 2] * ring
        assert c["blocks"] == {"SKIP": 0, "PLAIN": ring * ring, "DOCUMENTS": 0}


def _walk(ids: np.ndarray, layout: str, ring: int, tile: int):
    """Pair by pair: per device the visible tiles of its computed blocks and its visible pairs;
    and, for every block the schedule visits, its DocumentWork and its visible-pair count."""
    tokens = len(ids)
    shard = tokens // ring
    perm = layout_permutation(tokens, layout, ring)
    layout_ids = ids[perm]
    tiles, pairs, blocks = np.zeros(ring, int), np.zeros(ring, int), []
    for device in range(ring):
        for visit in device_visits(ring_schedule(layout, True, ring), device):
            if visit.block is None:
                continue
            q_lo, q_hi = visit.block.q_part.bounds(shard)
            k_lo, k_hi = visit.block.kv_part.bounds(shard)
            q = np.arange(device * shard + q_lo, device * shard + q_hi)
            k = np.arange(visit.source * shard + k_lo, visit.source * shard + k_hi)
            static = np.array([[visit.block.mask.visible(i, j) for j in range(len(k))] for i in range(len(q))])
            assert np.array_equal(static, perm[k][None, :] <= perm[q][:, None]), "mask kind != original positions"
            seen = static & (layout_ids[q][:, None] == layout_ids[k][None, :])
            work = document_work(*(np.array([f(x)]) for x, f in ((layout_ids[q], np.min), (layout_ids[q], np.max),
                                                                  (layout_ids[k], np.min), (layout_ids[k], np.max))))
            blocks.append((work, int(seen.sum()), visit.step.local))
            pairs[device] += seen.sum()
            if work is not DocumentWork.SKIP:
                tiles[device] += seen.reshape(len(q) // tile, tile, len(k) // tile, tile).any(axis=(1, 3)).sum()
    return tiles, pairs, blocks


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("pattern", ["mix", "interleaved", "singletons", "one"])
@pytest.mark.parametrize("ring", [2, 4])
def test_vectorised_counts_equal_the_pair_by_pair_walk(layout, pattern, ring, seed):
    """Tiles of computed blocks and visible pairs per device, for non-contiguous ids too; every
    visible tile lies in a computed block; SKIP blocks hold no visible pair and the own shard is
    never skipped."""
    tile, tokens = 2, 32 * ring
    ids = draw_segment_ids(pattern, 1, tokens, np.random.default_rng(seed))[0]
    c = balance.device_counts(ids, layout, ring, tile)
    tiles, pairs, blocks = _walk(ids, layout, ring, tile)
    assert c["tiles"].tolist() == tiles.tolist() and c["pairs"].tolist() == pairs.tolist()
    assert c["tiles"].sum() == c["visible_tiles"]
    assert all(n == 0 for work, n, _ in blocks if work is DocumentWork.SKIP)
    assert not any(local for work, _, local in blocks if work is DocumentWork.SKIP)
    assert c["blocks"]["SKIP"] == sum(work is DocumentWork.SKIP for work, _, _ in blocks)
    if pattern == "singletons" and layout != "stripe":
        assert c["blocks"]["SKIP"] > 0  # the test exercises skipping


def test_visible_pairs_rank_tokens_within_their_document():
    assert balance.visible_pairs(np.array([5, 5, 2, 5, 2, 9])).tolist() == [1, 2, 1, 3, 2, 1]


def test_table_rows_and_yardstick():
    """A reduced table: one row per (tokens, mix, ring, layout); the yardstick is the unpacked
    zigzag (one document under zigzag compares as 1.00 with itself)."""
    one = balance.Mix("one", median=10**9, sigma=0.01)  # a single document
    rows = balance.balance_table(mixes=(one, balance.MIXES[0]), tokens=(4096,), rings=(2, 4), tile=128)
    assert len(rows) == 2 * 2 * len(balance.LAYOUTS)
    for r in rows:
        if r.mix == "one" and r.layout == "zigzag":
            assert (r.area_vs_zigzag, r.tiles_vs_zigzag, r.area_imbalance) == (1.0, 1.0, 1.0)
        assert r.to_dict()["tiles_max_over_mean"] == r.tile_imbalance >= 1.0
    assert balance.ids_gather_bytes(1, 1024, 4) == 4 * 1024 * 3 / 4
    assert balance.ids_gather_bytes(2, 1024, 2, 2) == 4 * 2 * (512 / 2 + 512)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of tile"):
        balance.device_counts(np.zeros(1000, np.int32), "zigzag", 4, tile=128)


def test_cli_balance_prints_the_table_and_writes_json(tmp_path, capsys):
    import json

    from parity import cli

    out = tmp_path / "balance.json"
    assert cli.main(["balance", "--tokens", "4096", "--rings", "2,4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(balance.MIXES) * 2 * len(balance.LAYOUTS) and {r["layout"] for r in rows} == set(balance.LAYOUTS)
    assert "all-gather of int32 [b, t] per call" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["balance", "--rings", "two"])


@pytest.mark.parametrize("pattern", ["mix", "singletons", "one"])
@pytest.mark.parametrize("ring", [2, 4])
def test_document_zigzag_counts_equal_the_pair_by_pair_walk(pattern, ring, seed):
    """The per-document zigzag's counts from the padded, laid-out ids, pair by pair: (b) tiles
    and (c) pairs by token index and id; (c) is the same on every device (exact balance) and the
    padding is what pad_documents adds."""
    from seqplan.layouts import document_layout, pad_documents

    tile, tokens = 2, 32 * ring
    ids = draw_segment_ids(pattern, 1, tokens, np.random.default_rng(seed))[0]
    c = balance.device_counts(ids, "document-zigzag", ring, tile)
    padded = pad_documents(ids[None], ring, multiple=ring * tile)[0][0]
    perm = document_layout(padded[None], ring).perm[0]
    assert c["padding"] == len(padded) - tokens
    laid = padded[perm]
    seen = (perm[None, :] <= perm[:, None]) & (laid[:, None] == laid[None, :])  # [query, key], layout order
    shard = len(padded) // ring
    pairs = seen.reshape(ring, shard, -1).sum(axis=(1, 2))
    tiles = seen.reshape(len(padded) // tile, tile, -1, tile).any(axis=(1, 3)).reshape(ring, -1).sum(axis=1)
    assert c["pairs"].tolist() == pairs.tolist() and c["tiles"].tolist() == tiles.tolist()
    assert len(set(pairs.tolist())) == 1
    assert np.all(c["runs"] >= c["pairs"] / 2)  # a run area never undercounts the causal pairs by more than half
