"""Unit — the schedule (``schedule.py``) proved on its own, with no kernel and no framework: every
(query, key) pair the mask allows is visited exactly once by original positions, K/V and dK/dV
hops land where the next step needs them, and the hop counts are the documented ones. Both
implementations import this one module (seqplan.schedule): there is no second copy to compare."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import seqplan.schedule as S

SHARD = 4  # tokens per ring shard (even: zigzag halves it)
RINGS = [(1, r) for r in range(1, 9)]  # single ring / all-gather: outer = 1
DOUBLE = [(o, i) for o in range(1, 5) for i in range(1, 5)]


def _truncated(layout: str, causal: bool):
    """Every truncated single ring (reach 0 .. R-2) of the sizes tested."""
    for _outer, inner in RINGS:
        for reach in range(inner - 1):
            yield S.ring_schedule(layout, causal, inner, reach)


def _schedules(layout: str, causal: bool):
    for _outer, inner in RINGS:
        yield S.ring_schedule(layout, causal, inner)
        yield S.allgather_schedule(layout, causal, inner)
    for outer, inner in DOUBLE:
        yield S.double_ring_schedule(layout, causal, outer, inner)


def _original_positions(layout: str, ring: int, shard: int) -> np.ndarray:
    """[ring, shard]: the original token at each local index of each ring shard, from the layouts'
    definitions (docs/contract.md), written here independently of ``layouts.py``."""
    n = ring * shard
    if layout == "contiguous":
        return np.arange(n).reshape(ring, shard)
    if layout == "stripe":  # shard r = tokens t with t % R == r
        return np.arange(n).reshape(shard, ring).T
    chunks = np.arange(n).reshape(2 * ring, shard // 2)  # zigzag: chunk r ++ chunk 2R-1-r
    return np.stack([np.concatenate([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])


def _pair_counts(schedule, layout: str) -> np.ndarray:
    """[seq, seq] how often each (query, key) pair of *original* positions is computed, walking
    ``device_visits`` on every device and applying each block's mask predicate."""
    ring = schedule.size
    pos = _original_positions(layout, ring, SHARD)
    counts = np.zeros((ring * SHARD,) * 2, int)
    for device in range(ring):
        for visit in S.device_visits(schedule, device):
            block = visit.block
            if block is None:
                continue
            q_lo, q_hi = block.q_part.bounds(SHARD)
            k_lo, k_hi = block.kv_part.bounds(SHARD)
            for i, j in itertools.product(range(q_hi - q_lo), range(k_hi - k_lo)):
                if block.mask.visible(i, j):
                    counts[pos[device, q_lo + i], pos[visit.source, k_lo + j]] += 1
    return counts


@pytest.mark.parametrize("layout", S.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_visible_pair_is_visited_exactly_once(layout, causal):
    """Union over devices of the visited (query, key) pairs == the mask's visible pairs by
    original positions, each once: single ring and all-gather for R = 1..8, double ring O x I."""
    for schedule in _schedules(layout, causal):
        n = schedule.size * SHARD
        want = np.tril(np.ones((n, n), int)) if causal else np.ones((n, n), int)
        got = _pair_counts(schedule, layout)
        assert np.array_equal(got, want), (schedule.exchange, schedule.outer, schedule.inner)


@pytest.mark.parametrize("right_zero", [False, True])
def test_a_truncated_ring_visits_every_pair_of_its_window_once(right_zero):
    """Contiguous layout, a window reaching a shards back (causal, or non-causal with right = 0):
    the ring of reach a (``window_reach``) visits every (query, key) pair inside the window
    exactly once, and nothing reaches a pair outside it that the full ring would not."""
    causal = not right_zero
    for _outer, ring in RINGS:
        n = ring * SHARD
        i, j = np.indices((n, n))
        for left in range(0, n):
            window = (left, 0)
            reach = S.window_reach("contiguous", causal, window, SHARD, ring)
            if reach is None:
                assert ring == 1 or -(-left // SHARD) >= ring - 1
                continue
            schedule = S.ring_schedule("contiguous", causal, ring, reach)
            assert len(schedule.steps) == reach + 1
            got = _pair_counts(schedule, "contiguous")
            inside = (j <= i) & (j >= i - left)
            assert (got[inside] == 1).all(), (ring, left)
            assert (got <= 1).all()


def test_window_reach_only_where_it_is_built():
    assert S.window_reach("zigzag", True, (4, 0), 8, 4) is None
    assert S.window_reach("stripe", True, (4, 0), 8, 4) is None
    assert S.window_reach("contiguous", False, (4, 4), 8, 4) is None  # would need both directions
    assert S.window_reach("contiguous", True, None, 8, 4) is None
    assert S.window_reach("contiguous", True, (8, 0), 8, 4) == 1
    assert S.window_reach("contiguous", True, (9, 0), 8, 4) == 2
    assert S.window_reach("contiguous", True, (17, 0), 8, 4) is None  # reach 3 = R-1: the whole ring
    with pytest.raises(ValueError, match="truncated"):
        S.ring_schedule("contiguous", True, 4, 3)


def test_window_halo_is_the_left_reach_where_the_ring_reaches_one_shard_back():
    """The rows of the previous shard its window reads, and only where the ring has one K/V hop
    (truncated to reach 1, or a ring of 2) and the window is shorter than a shard; a schedule
    takes a halo only then."""
    assert S.window_halo("contiguous", True, (5, 0), 8, 4) == 5
    assert S.window_halo("contiguous", False, (6, 0), 8, 4) == 6  # right 0: nothing visible ahead
    assert S.window_halo("contiguous", True, (8, 0), 8, 4) is None  # the whole shard: nothing to trim
    assert S.window_halo("contiguous", True, (9, 0), 8, 4) is None  # reach 2
    assert S.window_halo("contiguous", True, (0, 0), 8, 4) is None  # reach 0: no hop
    assert S.window_halo("zigzag", True, (5, 0), 8, 4) is None and S.window_halo("contiguous", True, None, 8, 4) is None
    schedule = S.window_ring_schedule("contiguous", True, (5, 0), 8, 4)
    assert (schedule.reach, schedule.halo) == (1, 5)
    assert S.window_ring_schedule("contiguous", True, (9, 0), 8, 4).halo is None
    pair = S.window_ring_schedule("contiguous", True, (5, 0), 8, 2)  # a ring of 2: whole, one K/V hop
    assert (pair.reach, pair.halo, len(pair.steps)) == (None, 5, 2)
    with pytest.raises(ValueError, match="halo"):
        S.ring_schedule("contiguous", True, 4, 2, halo=5)
    with pytest.raises(ValueError, match="halo"):
        S.ring_schedule("contiguous", True, 4, None, halo=5)
    with pytest.raises(ValueError, match="halo"):
        S.make_schedule(S.Exchange.ALLGATHER, "contiguous", True, 1, 2, halo=5)


def test_the_halo_holds_every_key_a_windowed_query_of_the_next_shard_sees():
    """Brute force over positions: under window (left, 0) on the contiguous layout, every key of
    shard r-1 that a query of shard r sees is among the last ``window_halo`` rows of shard r-1."""
    for t, left in [(8, 1), (8, 5), (8, 7), (16, 3)]:
        halo = S.window_halo("contiguous", True, (left, 0), t, 4)
        for r in range(1, 4):
            seen = {j for i in range(r * t, (r + 1) * t) for j in range(max(i - left, 0), i + 1) if j < r * t}
            assert seen and min(seen) - (r - 1) * t == t - halo, (t, left, r)


@pytest.mark.parametrize("layout", S.LAYOUTS)
def test_every_device_meets_every_shard_once_own_first(layout):
    for schedule in _schedules(layout, causal=True):
        for device in range(schedule.size):
            visits = S.device_visits(schedule, device)
            assert [v.source for v in visits][0] == device and visits[0].step.local
            assert sorted(v.source for v in visits) == list(range(schedule.size))
            assert visits[0].block == schedule.plan.local


def test_kv_hops_deliver_what_the_next_step_visits():
    """A step's ``kv_hop`` takes the K/V in hand to the device whose next step visits them; a
    round's ``kv_hop`` takes the round's first K/V to where they start the next round."""
    for schedule in [*_schedules("zigzag", True), *_truncated("contiguous", True)]:
        n_out, n_in = schedule.outer, schedule.inner
        for device in range(schedule.size):
            for rnd in schedule.rounds:
                for step in rnd.steps:
                    here = schedule.source(device, step.round, step.inner)
                    if step.kv_hop is not None:
                        there = schedule.destination(step.kv_hop, device)
                        assert schedule.source(there, step.round, step.inner + 1) == here
                if rnd.kv_hop is not None:
                    there = rnd.kv_hop.destination(device, n_out, n_in)
                    assert schedule.source(there, rnd.index + 1, 0) == schedule.source(device, rnd.index, 0)


def test_dkv_hops_follow_their_shard_and_end_at_home():
    """After every step the visited shard's dK/dV go by ``dkv_hop`` to the device that visits that
    shard next; the last hop brings them to the shard's own device (ring and double ring; a
    truncated ring's last hop is the RETURN shift)."""
    for schedule in [*_schedules("stripe", True), *_truncated("contiguous", True)]:
        if schedule.exchange is S.Exchange.ALLGATHER or schedule.size == 1:
            assert all(step.dkv_hop is None for step in schedule.steps)
            continue
        steps = schedule.steps
        for device in range(schedule.size):
            for x, step in enumerate(steps):
                shard = schedule.source(device, step.round, step.inner)
                if step.dkv_hop is None:  # reach 0: one step, nothing travels
                    assert len(steps) == 1
                    continue
                there = schedule.destination(step.dkv_hop, device)
                if x + 1 < len(steps):
                    nxt = steps[x + 1]
                    assert schedule.source(there, nxt.round, nxt.inner) == shard
                else:
                    assert there == shard  # home


def _kv_hops(schedule) -> dict:
    hops = [s.kv_hop for s in schedule.steps] + [r.kv_hop for r in schedule.rounds]
    return {h: hops.count(h) for h in S.Hop if hops.count(h)}


@pytest.mark.parametrize("outer,inner", [(1, 1), (1, 2), (1, 5), (2, 2), (2, 3), (4, 2), (3, 1)])
def test_hop_counts_are_the_documented_ones(outer, inner):
    """Single ring: R-1 K/V hops forward, R-2 in the backward (it restarts from step 1's K/V),
    R dK/dV hops. Double ring: O·(I-1) inner + O-1 outer K/V hops, R dK/dV hops (inner, and one
    diagonal per round). All-gather: none."""
    r = outer * inner
    if outer == 1:
        ring = S.ring_schedule("zigzag", True, r)
        assert sum(_kv_hops(ring).values()) == r - 1 == _kv_hops(ring).get(S.Hop.RING, 0)
        assert ring.backward_reuses_first_kv == (r > 1)
        dkv = [s.dkv_hop for s in ring.steps if s.dkv_hop is not None]
        assert len(dkv) == (r if r > 1 else 0) and set(dkv) <= {S.Hop.RING}
        gather = S.allgather_schedule("zigzag", True, r)
        assert not _kv_hops(gather) and all(s.dkv_hop is None for s in gather.steps)
    double = S.double_ring_schedule("zigzag", True, outer, inner)
    hops = _kv_hops(double)
    assert hops.get(S.Hop.INNER, 0) == outer * (inner - 1) and hops.get(S.Hop.OUTER, 0) == outer - 1
    assert not double.backward_reuses_first_kv
    dkv = [s.dkv_hop for s in double.steps if s.dkv_hop is not None]
    assert len(dkv) == (r if r > 1 else 0)
    assert dkv.count(S.Hop.DIAGONAL) == (outer if r > 1 else 0)


def test_loops_scan_a_bounded_number_of_step_kinds():
    """The JAX loops trace one body per run of same-kind steps (rounds): at most 3 runs per level
    whatever R, so the compiled program does not grow with the ring."""
    for schedule in _schedules("zigzag", True):
        assert len(S.runs(schedule.rounds)) <= 3
        assert all(len(S.runs(rnd.steps)) <= 3 for rnd in schedule.rounds)
        flattened = [p for _, span in S.runs(schedule.rounds) for p in span]
        assert flattened == list(range(schedule.outer))


def test_block_mask_descriptor():
    assert S.BlockMask("causal") == S.CAUSAL_MASK and S.BlockMask() == S.FULL_MASK
    assert len({S.FULL_MASK, S.CAUSAL_MASK, S.STRICT_MASK, S.BlockMask("strict")}) == 3  # hashable, by value
    assert [S.STRICT_MASK.visible(i, 1) for i in range(3)] == [False, False, True]
    assert [S.CAUSAL_MASK.visible(i, 1) for i in range(3)] == [False, True, True]
    with pytest.raises(ValueError, match="mask kind must be one of"):
        S.BlockMask("window")
    with pytest.raises(ValueError, match="layout must be one of"):
        S.ring_schedule("spiral", True, 2)
    with pytest.raises(ValueError, match="device must be in"):
        S.device_visits(S.ring_schedule("zigzag", True, 2), 2)
