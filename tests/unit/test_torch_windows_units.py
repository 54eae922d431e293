"""Tier 1 — sliding windows and attention sinks (issue 26) in torch_impl's pieces on one process:
the reference kernel's windowed mask against a float64 masked computation (forward, backward,
with documents, rows with no visible key), the aten backends' refusal and fallback, "auto"
routing of windowed blocks, the per-block decision (skip / static mask / windowed mask) of
``loop.attend_block``, the sink merge and its gradient against float64 autograd,
``dense_attention`` (the multi-device tests' truth) against an attention written row by row,
``AttentionConfig.window``, the per-device entry points' checks and one-rank results, and the
one-device replay of every strategy against the float64 truth."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_documents_units import masked_truth, static_visible  # one float64 masked truth

import torch_impl
import torch_impl.block as tblock
from seqplan.layouts import ring_positions
from seqplan.schedule import BLOCK_MASKS, CAUSAL_MASK, FULL_MASK, STRICT_MASK, UNBOUNDED, Block, Part
from torch_impl import replay
from torch_impl.block import get_backend
from torch_impl.config import AttentionConfig
from torch_impl.loop import (
    ShardMasks,
    VisitMasks,
    add_grads,
    add_sinks,
    attend_block,
    grad_block,
    merge_block,
    sinks_grad,
)
from torch_impl.merge import Float32Rows, merge_partials

F64 = torch.float64


@pytest.mark.parametrize("backend", ["reference", "aten_cpu"])
@pytest.mark.parametrize("mask", list(BLOCK_MASKS), ids=lambda m: m.kind.value)
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_windowed_block_matches_float64_masked_attention(backend, mask, documents, heads, kv_heads, seed):
    """o, lse, dq, dk, dv of one windowed block (stripe-like interleaved positions, so the window
    cuts through the block) equal the float64 computation under static mask & window (& ids);
    a query with no key inside its window gets o = 0, lse = -inf, dq = 0. The aten backend runs
    it on the reference kernel (it has no window), bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    b, t, d, scale = 2, 8, 16, 0.3
    s = t if mask.kind.value != "full" else 6
    q, do = (torch.randn(b, t, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, kv_heads, d, generator=gen) for _ in range(2))
    dlse = torch.randn(b, heads, t, generator=gen)
    q_pos = torch.tensor([3, 7, 11, 15, 19, 23, 27, 40], dtype=torch.int32)  # 40: no key within reach
    kv_pos = torch.tensor([1, 5, 9, 13, 17, 21, 25, 29], dtype=torch.int32)[:s]
    window = (7, 2)  # strict: only the previous key (-6); causal: also its own (-2); full: also the next (+2)
    offset = kv_pos[None, :].long() - q_pos[:, None].long()
    visible = static_visible(mask, t, s) & (offset >= -window[0]) & (offset <= window[1])  # [t, s]
    visible = visible[None].expand(b, t, s)
    extras = {"positions": (q_pos, kv_pos)}
    windowed = mask.with_window(window)
    if documents:
        q_ids = torch.tensor([[0, 0, 1, 1, 2, 2, 2, 2], [4, 4, 4, 4, 5, 5, 5, 5]], dtype=torch.int32)
        kv_ids = torch.tensor([[0, 1, 1, 2, 2, 2, 0, 0], [4, 4, 5, 5, 5, 5, 4, 4]], dtype=torch.int32)[:, :s]
        visible = visible & (q_ids[:, :, None] == kv_ids[:, None, :])
        extras["segments"], windowed = (q_ids, kv_ids), windowed.with_documents()
    empty = ~visible.any(-1)
    assert empty.any() and not empty.all(), "the window must leave some rows without a key"
    kernel = get_backend(backend)
    o, lse = kernel.fwd(q, k, v, windowed, scale, **extras)
    dq, dk, dv = kernel.bwd(do, q, k, v, o, lse, windowed, scale, dlse, **extras)
    want = masked_truth(q, k, v, visible, scale, do, dlse)
    e = empty[:, :, None, None].expand_as(o)
    assert torch.all(o[e] == 0) and torch.all(lse.transpose(1, 2)[empty] == float("-inf")) and torch.all(dq[e] == 0)
    for name, got, w in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), want):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(got), finite), name
        torch.testing.assert_close(got.double()[finite], w[finite], rtol=2e-5, atol=2e-5, msg=name)
    if backend == "aten_cpu":
        ref = get_backend("reference")
        o_r, lse_r = ref.fwd(q, k, v, windowed, scale, **extras)
        for got, r in zip((o, lse, dq, dk, dv), (o_r, lse_r, *ref.bwd(do, q, k, v, o, lse, windowed, scale, dlse,
                                                                      **extras))):
            assert torch.equal(got, r)


def test_windowed_mask_needs_positions_of_the_blocks_size():
    q = torch.zeros(1, 4, 2, 8)
    ref = get_backend("reference")
    with pytest.raises(ValueError, match="a windowed mask needs positions"):
        ref.fwd(q, q, q, FULL_MASK.with_window((1, 1)), 1.0)
    with pytest.raises(ValueError, match=r"positions must be \[4\] and \[4\]"):
        ref.fwd(q, q, q, FULL_MASK.with_window((1, 1)), 1.0, positions=(torch.arange(4), torch.arange(3)))


def test_aten_backends_do_not_support_windows_and_auto_routes_around_them():
    """supports() is False for every windowed mask; "auto" routes a windowed block to the
    portable kernel even where aten_cudnn takes the same static mask (a stand-in, available)."""
    for name in ("aten_cpu", "aten_flash", "aten_cudnn"):
        for mask in BLOCK_MASKS:
            assert not get_backend(name).supports(mask.with_window((3, 0)), "bfloat16")
    real = get_backend("aten_cudnn")
    tblock.register_backend(tblock.BlockBackend("aten_cudnn", real.fwd, real.bwd, supports=real.supports,
                                                available=lambda: True))
    try:
        for mask in BLOCK_MASKS:
            assert tblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16", mask=mask) == "aten_cudnn"
            assert tblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16",
                                          mask=mask.with_window((3, 0))) == "reference"
    finally:
        tblock.register_backend(real)


# ---- the per-block decision -------------------------------------------------------------------

class Recorder:
    """A block backend that records each forward call's mask and keyword arguments."""

    def __init__(self):
        self.calls: list = []
        self.reference = get_backend("reference")

    def fwd(self, q, k, v, mask, scale, **extras):
        self.calls.append((mask, extras))
        return self.reference.fwd(q, k, v, mask, scale, **extras)


def visit(q_pos, kv_pos, window, segments=None) -> VisitMasks:
    q_pos, kv_pos = np.asarray(q_pos, dtype=np.int32), np.asarray(kv_pos, dtype=np.int32)
    return VisitMasks(segments, window, (q_pos, kv_pos), (torch.from_numpy(q_pos), torch.from_numpy(kv_pos)))


def test_attend_block_skips_out_of_reach_and_drops_a_covering_window():
    """Contiguous shards of 4: keys 0-3 against queries 8-11. A window of 4 reaches nothing:
    skipped (no kernel call); of 5, key 3 from query 8: windowed, positions given; of 11, every
    pair: the static mask alone, no positions. The windowed mask carries the parts' offset (8:
    both parts are position runs), read from the static positions. A zigzag-style block reads
    its PARTS only."""
    q = torch.randn(1, 4, 2, 8)
    full = Block(Part.ALL, Part.ALL, FULL_MASK)
    rec = Recorder()
    assert attend_block(rec, 1.0, q, full, (q, q), visit([8, 9, 10, 11], [0, 1, 2, 3], (4, 0))) is None
    assert rec.calls == []
    attend_block(rec, 1.0, q, full, (q, q), visit([8, 9, 10, 11], [0, 1, 2, 3], (5, 0)))
    mask, extras = rec.calls[-1]
    assert mask == FULL_MASK.with_window((5, 0), offset=8) and set(extras) == {"positions"}
    assert extras["positions"][0].tolist() == [8, 9, 10, 11] and extras["positions"][1].tolist() == [0, 1, 2, 3]
    attend_block(rec, 1.0, q, full, (q, q), visit([8, 9, 10, 11], [0, 1, 2, 3], (11, 0)))
    assert rec.calls[-1] == (FULL_MASK, {})
    # the second half of the queries (positions 30, 31) against the first half of the keys (0, 1)
    half = Block(Part.SECOND_HALF, Part.FIRST_HALF, FULL_MASK)
    assert attend_block(rec, 1.0, q, half, (q, q), visit([2, 3, 30, 31], [0, 1, 28, 29], (28, 0))) is None
    attend_block(rec, 1.0, q, half, (q, q), visit([2, 3, 30, 31], [0, 1, 28, 29], (30, 0)))
    mask, extras = rec.calls[-1]
    assert mask.window == (30, 0) and mask.offset == 30 and extras["positions"][0].tolist() == [30, 31]
    assert extras["positions"][1].tolist() == [0, 1]


def test_a_halo_block_runs_merges_and_adds_gradients_on_its_band_alone(seed):
    """The window ring's visited block: this shard's queries (positions 8-15) against the previous
    shard's keys (0-7), window (3, 0): only queries 8-10 see a key (5-7). ``merge_block`` and
    ``grad_block`` crop the block to that band (``crop_block``), so the kernel gets 3 rows and 3 keys
    and the merge and the gradient adds touch those rows and keys alone — and (o, lse, dq, dk, dv)
    equal the whole block's, merged and added as before the crop."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: torch.from_numpy(rng.standard_normal(shape)).float()
    q, do, k, v = normal(1, 8, 2, 8), normal(1, 8, 2, 8), normal(1, 8, 1, 8), normal(1, 8, 1, 8)
    masks = visit(np.arange(8, 16), np.arange(8), (3, 0))
    state = (normal(1, 8, 2, 8), normal(1, 2, 8))
    full, ref = Block(Part.ALL, Part.ALL, FULL_MASK), get_backend("reference")
    rec = Recorder()
    got = tuple(x.clone() for x in state)
    merge_block(rec, 0.5, q, full, (k, v), got, masks)
    (mask, extras), = rec.calls
    assert mask == FULL_MASK.with_window((3, 0), offset=8 - 5)
    assert extras["positions"][0].tolist() == [8, 9, 10] and extras["positions"][1].tolist() == [5, 6, 7]
    whole_mask = FULL_MASK.with_window((3, 0), offset=8)
    whole_positions = tuple(torch.from_numpy(x) for x in masks.positions)
    o_b, lse_b = ref.fwd(q, k, v, whole_mask, 0.5, positions=whole_positions)
    want = merge_partials(*state, o_b, lse_b)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0][:, 3:], state[0][:, 3:], rtol=0, atol=0)  # rows 11-15: untouched
    lazy = Float32Rows(state[0].bfloat16())  # the loops' accumulator: only the band's rows widened
    merge_block(rec, 0.5, q, full, (k, v), (lazy, state[1].clone()), masks)
    assert lazy._spans == [(0, 3)]
    o, lse = want
    saved = (q, o, lse, do, None)
    grads = grad_block(ref, 0.5, saved, full, (k, v), masks)
    assert (grads.block.q_part.bounds(8), grads.block.kv_part.bounds(8)) == ((0, 3), (5, 8))
    acc = [torch.zeros_like(x) for x in (q, k, v)]
    add_grads(full, grads, acc[0], acc[1:])
    want_grads = ref.bwd(do, q, k, v, o, lse, whole_mask, 0.5, None, positions=whole_positions)
    for x, y in zip(acc, want_grads):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_the_local_block_is_never_skipped_and_documents_join_the_window():
    """The own block (equal positions) always runs — a window of 0 keeps each query's own key,
    the causal mask stays; with ids, the document mask joins the window where ids differ, and a
    block out of the window is skipped before the ids are looked at."""
    q = torch.randn(1, 4, 2, 8)
    local = Block(Part.ALL, Part.ALL, CAUSAL_MASK)
    rec = Recorder()
    o, lse = attend_block(rec, 1.0, q, local, (q, q), visit([4, 5, 6, 7], [4, 5, 6, 7], (0, 0)))
    assert rec.calls[-1][0] == CAUSAL_MASK.with_window((0, 0), offset=0) and torch.isfinite(lse).all()
    torch.testing.assert_close(o, q.float())  # each query sees only itself
    ids = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    attend_block(rec, 1.0, q, local, (q, q), visit([4, 5, 6, 7], [4, 5, 6, 7], (2, 0), (ids, ids)))
    mask, extras = rec.calls[-1]
    assert mask == CAUSAL_MASK.with_window((2, 0), offset=0).with_documents() and set(extras) == {"positions", "segments"}
    apart = torch.tensor([[7, 7, 7, 7]], dtype=torch.int32)
    n = len(rec.calls)
    full = Block(Part.ALL, Part.ALL, FULL_MASK)
    assert attend_block(rec, 1.0, q, full, (q, q), visit([8, 9, 10, 11], [0, 1, 2, 3], (1, 0), (ids, ids))) is None
    assert attend_block(rec, 1.0, q, full, (q, q), visit([8, 9, 10, 11], [0, 1, 2, 3], (9, 0), (ids, apart))) is None
    assert len(rec.calls) == n


def test_ring_positions_are_the_layouts_shards():
    for layout in ("contiguous", "zigzag", "stripe"):
        got = ring_positions(layout, 4, 6)
        assert got.shape == (4, 6) and got.dtype == np.int32
        assert got.reshape(-1).tolist() == torch_impl.layout_permutation(24, layout, 4).tolist()


# ---- sinks -------------------------------------------------------------------------------------

def test_a_windowed_call_copies_the_static_positions_to_the_device_once():
    """A window without token indices: every call's masks share one pair of position arrays
    (host and device), built on the first call — a copy from pageable host memory made the host
    wait for the GPU in every call (a sync a step). The pair is the layout's positions and read
    only on the host side."""
    config = AttentionConfig(True, "zigzag", 1.0, window=(5, 0))
    first = ShardMasks.build(config, 4, 8, None, torch.device("cpu"))
    again = ShardMasks.build(config, 4, 8, None, torch.device("cpu"))
    assert again.device_positions is first.device_positions and again.positions is first.positions
    np.testing.assert_array_equal(first.positions, ring_positions("zigzag", 4, 8))
    np.testing.assert_array_equal(first.device_positions.numpy(), ring_positions("zigzag", 4, 8))
    with pytest.raises(ValueError, match="read-only"):
        first.positions[0, 0] = 1
    other = ShardMasks.build(AttentionConfig(True, "contiguous", 1.0, window=(5, 0)), 4, 8, None,
                             torch.device("cpu"))
    np.testing.assert_array_equal(other.positions, ring_positions("contiguous", 4, 8))


def test_add_sinks_and_sinks_grad_match_float64_autograd(seed):
    """Merging the sink into the keys' (o, lse) gives dense attention with sinks; sinks_grad
    from the final (o, lse) is autograd's d/dsinks of <o, do> + <lse, dlse> (float64)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = 2, 6, 4, 8
    q, k, v, do = (torch.randn(b, t, h, d, generator=gen, dtype=F64) for _ in range(4))
    dlse = torch.randn(b, h, t, generator=gen, dtype=F64)
    sinks = torch.randn(h, generator=gen, dtype=F64).requires_grad_()
    o_keys, lse_keys = torch_impl.dense_attention(q, k, v, causal=True)
    o_f, lse_f = add_sinks(o_keys, lse_keys, sinks.detach())
    o, lse = torch_impl.dense_attention(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(o_f.double(), o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_f.double(), lse, rtol=1e-6, atol=1e-6)
    torch.autograd.backward((o, lse), (do, dlse))
    torch.testing.assert_close(sinks_grad(o, lse, do, dlse, sinks.detach()).double(), sinks.grad, rtol=1e-5,
                               atol=1e-5)
    sinks.grad = None
    torch.autograd.backward(torch_impl.dense_attention(q, k, v, causal=True, sinks=sinks)[0], do)
    torch.testing.assert_close(sinks_grad(o, lse, do, None, sinks.detach()).double(), sinks.grad, rtol=1e-5,
                               atol=1e-5)
    assert add_sinks(o_keys, lse_keys, None) == (o_keys, lse_keys)


def test_a_row_without_keys_takes_the_sink_alone():
    o = torch.zeros(1, 2, 2, 4)
    lse = torch.tensor([[[float("-inf"), 0.5], [float("-inf"), 1.0]]])
    o_f, lse_f = add_sinks(o, lse, torch.tensor([0.25, -3.0]))
    assert torch.equal(lse_f[:, :, 0], torch.tensor([[0.25, -3.0]])) and torch.all(o_f == 0)
    assert torch.all(sinks_grad(o_f, lse_f, torch.ones_like(o_f), None, torch.tensor([0.25, -3.0])) == 0)


# ---- the dense truth ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 3, (4, 1), (2, 6), 50])
def test_dense_attention_is_attention_written_row_by_row(causal, window, seed):
    """dense_attention with window and sinks equals a softmax over each query's own key range
    [i - left, i + right] (∩ [0, i] when causal) plus exp(sink), one row at a time (float64)."""
    gen = torch.Generator().manual_seed(seed)
    t, h = 12, 4
    q = torch.randn(1, t, h, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(1, t, 2, 8, generator=gen, dtype=F64) for _ in range(2))
    sinks = torch.randn(h, generator=gen, dtype=F64)
    o, lse = torch_impl.dense_attention(q, k, v, causal=causal, window=window, sinks=sinks)
    left, right = (window, window) if isinstance(window, int) else window
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    for i, head in itertools.product(range(t), range(h)):
        keys = [j for j in range(t) if i - left <= j <= i + right and (j <= i or not causal)]
        logits = torch.stack([q[0, i, head] @ kk[0, j, head] * 8**-0.5 for j in keys])
        row_lse = torch.logsumexp(torch.cat([logits, sinks[head:head + 1]]), 0)
        weights = torch.exp(logits - row_lse)
        torch.testing.assert_close(lse[0, head, i], row_lse, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o[0, i, head], weights @ vv[0, keys, head], rtol=1e-12, atol=1e-12)


# ---- configuration and the per-device entry points ---------------------------------------------

def test_attention_config_normalises_and_checks_the_window():
    assert AttentionConfig(False, "zigzag", 1.0, window=3).window == (3, 3)
    assert AttentionConfig(False, "zigzag", 1.0, window=[2, 0]).window == (2, 0)
    # causal: no visible key is after its query, so the right extent is stored unbounded
    assert AttentionConfig(True, "zigzag", 1.0, window=[2, 0]).window == (2, UNBOUNDED)
    assert AttentionConfig(True, "zigzag", 1.0).window is None
    hash(AttentionConfig(True, "zigzag", 1.0, window=[2, 0]))  # static: a hashable config
    with pytest.raises(ValueError, match="window extents must be >= 0"):
        AttentionConfig(True, "zigzag", 1.0, window=(-1, 0))
    with pytest.raises(TypeError, match="window must be None, an int or a"):
        AttentionConfig(True, "zigzag", 1.0, window=(1, 2, 3))


ENTRY_POINTS = ["ring_attention", "allgather_attention", "double_ring_attention", "ulysses_attention",
                "usp_attention"]


@pytest.mark.parametrize("attention", ENTRY_POINTS)
def test_per_device_entry_points_check_window_and_sinks(attention):
    fn = getattr(torch_impl, attention)
    q = torch.zeros(1, 8, 4, 8)
    with pytest.raises(ValueError, match="window extents must be >= 0"):
        fn(q, q, q, window=(2, -1))
    with pytest.raises(TypeError, match="window must be None, an int"):
        fn(q, q, q, window="3")
    with pytest.raises(ValueError, match=r"sinks must be \[heads\] = \(4,\)"):
        fn(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks must have a floating dtype"):
        fn(q, q, q, sinks=torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("attention", ["ring_attention", "allgather_attention", "double_ring_attention"])
def test_one_rank_with_window_and_sinks_is_the_dense_truth(attention, seed):
    """One rank (no group): o, lse and the gradients of q, k, v and sinks against float64."""
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(2, 16, 4, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 16, 2, 8, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    o, lse = getattr(torch_impl, attention)(*inputs[:3], causal=True, window=(5, 0), sinks=inputs[3])
    (o * do).sum().backward()
    truth = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    o_t, lse_t = torch_impl.dense_attention(*truth[:3], causal=True, window=(5, 0), sinks=truth[3])
    (o_t * do.double()).sum().backward()
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), (o, lse, *(x.grad for x in inputs)),
                               (o_t, lse_t, *(x.grad for x in truth))):
        torch.testing.assert_close(got.double(), want.detach(), rtol=2e-5, atol=2e-5, msg=name)


# ---- the one-device replay, every strategy -----------------------------------------------------

STRATEGIES = [dict(ring=4), dict(ring=4, kv_exchange="allgather"), dict(ring=4, outer=2), dict(ulysses=2),
              dict(ring=2, ulysses=2), dict(ring=2, ulysses=2, kv_exchange="allgather"),
              dict(ring=4, ulysses=2, outer=2)]


@pytest.mark.parametrize("fields", STRATEGIES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_replay_of_every_strategy_is_the_dense_truth(fields, seed):
    """replay_attention(_grads) with a window, sinks and segment ids on every strategy (double-ring
    USP included) and layout: o, lse, dq, dk, dv and dsinks against float64, GQA."""
    rng = np.random.default_rng(seed)
    t = 32
    x = {n: torch.from_numpy(rng.standard_normal((2, t, h, 8)).astype(np.float32))
         for n, h in (("q", 4), ("k", 2), ("v", 2), ("do", 4))}
    dlse, sinks = torch.randn(2, 4, t), torch.randn(4)
    ids = torch.from_numpy(np.sort(rng.integers(0, 5, (2, t)), axis=1))
    strategy = replay.Strategy(**fields)
    for layout, causal, window in (("contiguous", True, (5, 0)), ("zigzag", True, 11), ("stripe", False, (3, 6))):
        if strategy.ring == 1 and layout != "contiguous":
            continue
        perm = torch_impl.layout_permutation(t, layout, strategy.ring, strategy.ulysses)
        inv = np.argsort(perm)
        truth = [x[n].double().requires_grad_() for n in ("q", "k", "v")] + [sinks.double().requires_grad_()]
        o_t, lse_t = torch_impl.dense_attention(*truth[:3], causal=causal, window=window, sinks=truth[3],
                                                segment_ids=ids)
        torch.autograd.backward((o_t, lse_t), (x["do"].double(), dlse.double()))
        kw = dict(strategy=strategy, causal=causal, layout=layout, window=window, sinks=sinks, segment_ids=ids[:, perm])
        q, k, v = (x[n][:, perm] for n in ("q", "k", "v"))
        o, lse = replay.replay_attention(q, k, v, **kw)
        dq, dk, dv, dsinks = replay.replay_attention_grads(q, k, v, o, lse, x["do"][:, perm], dlse[:, :, perm], **kw)
        got = (o[:, inv], lse[:, :, inv], dq[:, inv], dk[:, inv], dv[:, inv], dsinks)
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, (o_t, lse_t, *(y.grad for y in truth))):
            rel = (torch.linalg.vector_norm(g.double() - w.detach()) / torch.linalg.vector_norm(w.detach())).item()
            assert rel <= 1e-5, f"{fields} {layout} {name}: {rel:.2e}"


def test_strict_windowed_row_zero_is_empty():
    """The strict mask's row 0 stays empty under a window (both restrictions apply)."""
    q = torch.randn(1, 4, 2, 8)
    pos = torch.arange(4, dtype=torch.int32)
    o, lse = get_backend("reference").fwd(q, q, q, STRICT_MASK.with_window((9, 9)), 1.0, positions=(pos, pos))
    assert torch.all(lse[:, :, 0] == float("-inf")) and torch.all(o[:, 0] == 0) and torch.isfinite(lse[:, :, 1:]).all()
