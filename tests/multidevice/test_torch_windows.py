"""Sliding windows (``window``) and attention sinks (``sinks``, issue 26) in torch_impl on gloo
worlds of 2, 4 and 8 processes: every strategy (ring contiguous / zigzag / stripe, all-gather KV,
Ulysses, USP, double ring, double-ring USP, a data axis), causal and not, GQA / MQA, windows
smaller than a shard, spanning shards and longer than the sequence, sinks with and without a
window, with and without packed segment ids, against float64 ``dense_attention`` (o, lse, dq,
dk, dv, and dsinks = the sum of every rank's ``sinks.grad``); block skipping counted at run time
against a brute-force count over the blocks' (query, key) pairs; bad windows and sinks refused
identically on every rank before any collective; the one-device replay equal to the world run.

Each rank receives the GLOBAL layout-order tensors and takes its own local shard (as a torch
caller passes them); the test stitches the shards back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl
from seqplan.bands import crop_to_band
from seqplan.schedule import (
    Block,
    DocumentWork,
    Exchange,
    MaskKind,
    device_visits,
    document_work,
    kernel_window,
    make_schedule,
    window_flags,
)
from seqplan.validation import check_window
from torch_impl import replay
from torch_impl.block import BlockBackend, get_backend, register_backend
from torch_tasks import bad_window_or_sinks_task, documents_task, float32_rows_task

T, HEADS, HEAD_DIM = 32, 4, 8
RTOL = 1e-5  # relative L2 of float32 against the float64 truth (the float32 policy's bound)
NAMES = ("o", "lse", "dq", "dk", "dv")


def packed_ids(rng: np.random.Generator, batch: int) -> np.ndarray:
    """Original-order ids: documents of 1-13 tokens (some shorter than a window, some spanning shards)."""
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < T:
            ids += [doc] * int(rng.choice([1, 2, 5, 9, 13]))
            doc += 1
        rows.append(ids[:T])
    return np.asarray(rows, dtype=np.int64)


def make_inputs(seed: int, batch: int, kv_heads: int, *, sinks: bool, ids: bool) -> dict:
    """Global float32 q, k, v, do [b, T, ., d], dlse [b, h, T], optional sinks [h] (large enough
    to matter: exp(sink) comparable to a row's denominator) and int64 segment_ids [b, T]."""
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal((batch, T, h, HEAD_DIM)).astype(np.float32)
         for n, h in (("q", HEADS), ("k", kv_heads), ("v", kv_heads), ("do", HEADS))}
    x["dlse"] = rng.standard_normal((batch, HEADS, T)).astype(np.float32)
    if sinks:
        x["sinks"] = (1.0 + rng.standard_normal(HEADS)).astype(np.float32)
    if ids:
        x["segment_ids"] = packed_ids(rng, batch)
    return {n: torch.from_numpy(a) for n, a in x.items()}


def truth(x: dict, causal: bool, window) -> dict:
    """float64 dense attention (original order) and its gradients for (do, dlse), dsinks included."""
    q, k, v = (x[n].double().requires_grad_() for n in ("q", "k", "v"))
    sinks = None if "sinks" not in x else x["sinks"].double().requires_grad_()
    o, lse = torch_impl.dense_attention(q, k, v, causal=causal, segment_ids=x.get("segment_ids"), window=window,
                                        sinks=sinks)
    torch.autograd.backward((o, lse), (x["do"].double(), x["dlse"].double()))
    out = {"o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return out if sinks is None else out | {"dsinks": sinks.grad}


def to_layout(x: dict, perm) -> dict:
    return {n: a if n == "sinks" else a[:, :, perm] if n == "dlse" else a[:, perm] for n, a in x.items()}


def from_layout(out: dict, perm) -> dict:
    inverse = np.argsort(perm)
    return {n: a if n == "dsinks" else a[:, :, inverse] if n == "lse" else a[:, inverse] for n, a in out.items()}


def stitch(shards: list[dict], data: int) -> dict:
    """Per-rank shards back into global layout-order tensors; dsinks summed over every rank (each
    rank's sinks.grad is its own contribution)."""
    out = {}
    for name in NAMES:
        rows = []
        for d in range(data):
            mine = sorted((s for s in shards if s["data"] == d), key=lambda s: s["block"])
            rows.append(torch.cat([s[name] for s in mine], dim=2 if name == "lse" else 1))
        out[name] = torch.cat(rows, dim=0)
    if "dsinks" in shards[0]:
        out["dsinks"] = sum(s["dsinks"].double() for s in shards)
    return out


def assert_close_to(got: dict, want: dict, label: str) -> None:
    assert set(got) == set(want), f"{label}: {sorted(got)} != {sorted(want)}"
    for name in want:
        g, w = got[name].double(), want[name].double()
        assert g.shape == w.shape and torch.isfinite(g).all(), f"{label} {name}: shape {g.shape} / not finite"
        rel = (torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w)).item()
        assert rel <= RTOL, f"{label} {name}: relative L2 error {rel:.2e} > {RTOL:.0e}"


def ring_and_ulysses(axes) -> tuple[int, int]:
    sizes = dict(axes)
    return sizes.get("ring", sizes.get("ring_outer", 1) * sizes.get("ring_inner", 1)), sizes.get("ulysses", 1)


def run_world(worlds, axes, exchange, layout, causal, window, x_layout, count=False) -> list[dict]:
    devices = int(np.prod([n for _, n in axes]))
    kwargs = dict(causal=causal, layout=layout, kv_exchange=exchange, window=window)
    return worlds(devices).run(documents_task, axes, x_layout, kwargs, count)


# (id, mesh axes, kv_exchange, layout, causal, kv_heads, batch, window, sinks?, ids?). T = 32: a
# ring of 4 has shards of 8 tokens, of 2 shards of 16; windows below a shard, across several, and
# (100) beyond the sequence; sinks alone (window None); every strategy and layout at least once.
CASES = [
    ("ring4-contiguous-causal-w5-sinks-ids", (("ring", 4),), "ring", "contiguous", True, 2, 2, (5, 0), True, True),
    ("ring4-contiguous-full-w3x2", (("ring", 4),), "ring", "contiguous", False, 2, 2, (3, 2), False, False),
    ("ring4-zigzag-causal-w12-sinks", (("ring", 4),), "ring", "zigzag", True, 2, 2, 12, True, False),
    ("ring4-zigzag-full-w100-sinks-ids", (("ring", 4),), "ring", "zigzag", False, 2, 2, 100, True, True),
    ("ring4-zigzag-causal-sinks-only", (("ring", 4),), "ring", "zigzag", True, 2, 2, None, True, False),
    ("ring4-stripe-causal-w3-sinks-ids", (("ring", 4),), "ring", "stripe", True, 1, 2, (3, 0), True, True),
    ("ring2-stripe-full-w10x4", (("ring", 2),), "ring", "stripe", False, 2, 2, (10, 4), False, False),
    ("allgather4-zigzag-causal-w6-sinks-ids", (("ring", 4),), "allgather", "zigzag", True, 2, 2, (6, 0), True, True),
    ("allgather4-contiguous-full-w9", (("ring", 4),), "allgather", "contiguous", False, 2, 2, 9, False, False),
    ("ulysses2-causal-w5-sinks-ids-mqa", (("ulysses", 2),), "ring", "contiguous", True, 1, 2, (5, 0), True, True),
    ("usp2x2-zigzag-causal-w7-sinks", (("ring", 2), ("ulysses", 2)), "ring", "zigzag", True, 2, 2, 7, True, False),
    ("usp2x2-stripe-full-w4x3-sinks-ids-mqa", (("ring", 2), ("ulysses", 2)), "ring", "stripe", False, 1, 2, (4, 3),
     True, True),
    ("usp2x2-contiguous-causal-w3-allgather-sinks", (("ring", 2), ("ulysses", 2)), "allgather", "contiguous", True, 2,
     2, 3, True, False),
    ("double2x2-zigzag-causal-w9-sinks-ids", (("ring_outer", 2), ("ring_inner", 2)), "ring", "zigzag", True, 2, 2,
     (9, 0), True, True),
    ("double2x2-contiguous-full-w2x6", (("ring_outer", 2), ("ring_inner", 2)), "ring", "contiguous", False, 2, 2,
     (2, 6), False, False),
    ("double2x2x2-usp-zigzag-causal-w6-sinks-ids", (("ring_outer", 2), ("ring_inner", 2), ("ulysses", 2)), "ring",
     "zigzag", True, 2, 2, (6, 0), True, True),
    ("data2-ring2-zigzag-causal-w5-sinks", (("data", 2), ("ring", 2)), "ring", "zigzag", True, 2, 4, 5, True, False),
]


@pytest.mark.parametrize("name,axes,exchange,layout,causal,kv_heads,batch,window,sinks,ids", CASES,
                         ids=[c[0] for c in CASES])
def test_windows_and_sinks_match_dense_truth(name, axes, exchange, layout, causal, kv_heads, batch, window, sinks,
                                             ids, seed, worlds):
    x = make_inputs(seed, batch, kv_heads, sinks=sinks, ids=ids)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    shards = run_world(worlds, axes, exchange, layout, causal, window, to_layout(x, perm))
    got = from_layout(stitch(shards, dict(axes).get("data", 1)), perm)
    assert_close_to(got, truth(x, causal, window), f"{name} (seed {seed})")


def test_the_window_and_the_sinks_change_the_answer(seed):
    """The cases above could not pass by ignoring the window or the sinks: each changes the truth."""
    x = make_inputs(seed, 2, 2, sinks=True, ids=False)
    plain = truth({n: a for n, a in x.items() if n != "sinks"}, True, None)
    for window, with_sinks in (((5, 0), False), (None, True), (12, False)):
        other = truth(x if with_sinks else {n: a for n, a in x.items() if n != "sinks"}, True, window)
        assert not torch.allclose(plain["o"], other["o"], atol=1e-3), (window, with_sinks)
    assert torch.allclose(plain["o"], truth({n: a for n, a in x.items() if n != "sinks"}, True, 100)["o"])


# ---- block skipping, counted ------------------------------------------------------------------

def schedule_of(axes, exchange, layout, causal):
    ring, _ = ring_and_ulysses(axes)
    outer = dict(axes).get("ring_outer", 1)
    kind = Exchange.DOUBLE_RING if outer > 1 else Exchange(exchange)
    return make_schedule(kind, layout, causal, outer, ring // outer)


def block_pairs(visit, r: int, shard: int, perm, block=None):
    """(query positions [t'], key positions [s'], static visibility [t', s']) of a visit's block
    (or of ``block``, that block cropped)."""
    block = block or visit.block
    q_lo, q_hi = block.q_part.bounds(shard)
    k_lo, k_hi = block.kv_part.bounds(shard)
    q_pos = perm[r * shard + q_lo:r * shard + q_hi]
    kv_pos = perm[visit.source * shard + k_lo:visit.source * shard + k_hi]
    static = np.array([[block.mask.visible(i, j) for j in range(len(kv_pos))] for i in range(len(q_pos))])
    return q_pos, kv_pos, static


def _runs(*positions) -> bool:
    return all(np.array_equal(np.diff(p), np.ones(len(p) - 1)) for p in positions)


def documented_crop(visit, r: int, shard: int, perm, window):
    """The block the loops hand the kernel: a visited block whose parts are position runs, cropped
    to its window's band (``seqplan.bands.crop_to_band``; None: it sees nothing) — else the block."""
    q_pos, kv_pos, _ = block_pairs(visit, r, shard, perm)
    if visit.step.local or not _runs(q_pos, kv_pos):
        return visit.block
    mask = visit.block.mask.with_window(window, int(q_pos[0] - kv_pos[0]))
    cut = crop_to_band(visit.block, mask, shard)
    return None if cut is None else Block(cut.q_part, cut.kv_part, visit.block.mask)


def expected_calls(schedule, layout, window, ids_layout=None, seq: int = T) -> dict[int, list]:
    """Per ring position, the calls the loops must make, each (document mask?, query rows, key
    columns, window mask?): the documented decision — ``window_flags`` on the parts' position
    ranges and ``document_work`` on their id ranges."""
    ring = schedule.size
    causal = schedule.plan.local.mask.kind is not MaskKind.FULL
    shard, (left, right) = seq // ring, kernel_window(check_window(window), causal)
    perm = torch_impl.layout_permutation(seq, layout, ring)
    out = {}
    for r in range(ring):
        calls = []
        for visit in device_visits(schedule, r):
            if visit.block is None:
                continue
            q_pos, kv_pos, _ = block_pairs(visit, r, shard, perm)
            ranges = (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max())
            reachable, covered = window_flags(*ranges, left, right)
            if not (reachable or visit.step.local):
                continue
            block = visit.block if covered else documented_crop(visit, r, shard, perm, (left, right))
            if block is None:
                continue
            q_pos, kv_pos, _ = block_pairs(visit, r, shard, perm, block)
            reachable, covered = window_flags(q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max(), left, right)
            documents = False
            if ids_layout is not None:
                q_lo, q_hi = block.q_part.bounds(shard)
                k_lo, k_hi = block.kv_part.bounds(shard)
                q_ids = ids_layout[:, r * shard + q_lo:r * shard + q_hi]
                kv_ids = ids_layout[:, visit.source * shard + k_lo:visit.source * shard + k_hi]
                work = document_work(q_ids.min(1), q_ids.max(1), kv_ids.min(1), kv_ids.max(1))
                if work is DocumentWork.SKIP:
                    continue
                documents = work is DocumentWork.DOCUMENTS
            calls.append((documents, len(q_pos), len(kv_pos), not bool(covered)))
        out[r] = calls
    return out


def brute_force_calls(schedule, layout, window, seq: int = T) -> dict[int, list]:
    """Per ring position, the blocks holding at least one pair visible under the static mask AND
    the window (the local block always), each (False, rows, columns, some pair of the block
    outside the window?) — enumerated pair by pair; a visited block whose parts are position runs
    counted over the rows and keys from its first to its last that see a pair."""
    ring = schedule.size
    shard, (left, right) = seq // ring, check_window(window)
    perm = torch_impl.layout_permutation(seq, layout, ring)
    out = {}
    for r in range(ring):
        calls = []
        for visit in device_visits(schedule, r):
            if visit.block is None:
                continue
            q_pos, kv_pos, static = block_pairs(visit, r, shard, perm)
            offset = kv_pos[None, :] - q_pos[:, None]
            inside = (offset >= -left) & (offset <= right)
            seen = static & inside
            if not (seen.any() or visit.step.local):
                continue
            if not visit.step.local and _runs(q_pos, kv_pos):  # to the rows and keys that see a pair
                rows, keys = np.flatnonzero(seen.any(1)), np.flatnonzero(seen.any(0))
                cut = np.ix_(range(rows[0], rows[-1] + 1), range(keys[0], keys[-1] + 1))
                inside, static = inside[cut], static[cut]
            calls.append((False, *inside.shape, not (inside | ~static).all()))  # windowed iff it drops a visible pair
        out[r] = calls
    return out


# (id, mesh axes, kv_exchange, layout, causal, window, exact?, skips?). Exact: the range test
# computes exactly the blocks that hold a visible pair (contiguous parts; zigzag's causal blocks,
# whose nearest pair is always present); otherwise (stripe, non-causal zigzag) it is conservative.
# Zigzag with a window of 10 (> a chunk of 4) still reaches every block its plan keeps.
SKIP_CASES = [
    ("ring4-contiguous-causal-w3", (("ring", 4),), "ring", "contiguous", True, (3, 0), True, True),
    ("ring4-contiguous-full-w3x3", (("ring", 4),), "ring", "contiguous", False, 3, True, True),
    ("ring4-zigzag-causal-w6", (("ring", 4),), "ring", "zigzag", True, (6, 0), True, True),
    ("ring4-zigzag-causal-w10", (("ring", 4),), "ring", "zigzag", True, (10, 0), True, False),
    ("ring4-stripe-causal-w2", (("ring", 4),), "ring", "stripe", True, (2, 0), False, False),
    ("allgather4-contiguous-causal-w10", (("ring", 4),), "allgather", "contiguous", True, (10, 0), True, True),
    ("double2x2-contiguous-full-w2", (("ring_outer", 2), ("ring_inner", 2)), "ring", "contiguous", False, 2, True,
     True),
    ("usp2x2-contiguous-causal-w20", (("ring", 2), ("ulysses", 2)), "ring", "contiguous", True, (20, 0), True, False),
]


def test_the_brute_force_count_can_tell_blocks_apart():
    """The counts below compare more than totals: on 4 contiguous causal shards a window of 3
    keeps the own block (windowed: its far pairs are out) and the previous shard's (windowed),
    its 3 first rows against its 3 last keys, nothing else; a window of 100 keeps every causal
    block, the diagonal plain."""
    sched = make_schedule(Exchange.RING, "contiguous", True, 1, 4)
    calls = brute_force_calls(sched, "contiguous", (3, 0))
    assert calls[0] == [(False, 8, 8, True)] and calls[3] == [(False, 8, 8, True), (False, 3, 3, True)]
    assert brute_force_calls(sched, "contiguous", 100)[3] == [(False, 8, 8, False)] * 4


@pytest.mark.parametrize("name,axes,exchange,layout,causal,window,exact,skips", SKIP_CASES,
                         ids=[c[0] for c in SKIP_CASES])
def test_blocks_out_of_the_window_are_never_computed(name, axes, exchange, layout, causal, window, exact, skips, seed,
                                                     worlds):
    """Every rank's counted kernel calls, forward and backward, are the documented decision's
    (skip / static mask / windowed mask); where the decision is exact they are the brute-force
    count's, otherwise a superset of it (never a visible pair skipped); fewer blocks than
    without a window where the layout lets the window miss whole blocks — and the answer is
    still the dense truth."""
    x = make_inputs(seed, 2, 2, sinks=True, ids=False)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    shards = run_world(worlds, axes, exchange, layout, causal, window, to_layout(x, perm), count=True)
    schedule = schedule_of(axes, exchange, layout, causal)
    expected, brute = expected_calls(schedule, layout, window), brute_force_calls(schedule, layout, window)
    for r in range(ring):
        if exact:
            assert sorted(expected[r]) == sorted(brute[r]), f"{name} position {r}: {expected[r]} != {brute[r]}"
        else:
            assert len(expected[r]) >= len(brute[r])
    unwindowed = sum(v.block is not None for r in range(ring) for v in device_visits(schedule, r))
    computed = sum(len(c) for c in expected.values())
    assert (computed < unwindowed) == skips, f"{name}: {computed} of {unwindowed} blocks computed"
    for s in shards:
        r = s["block"] // ulysses
        for kind in ("fwd", "bwd"):
            got = sorted(c[1:] for c in s["calls"] if c[0] == kind)
            assert got == sorted(expected[r]), f"{name} rank {s['coords']} {kind}: {got} != {sorted(expected[r])}"
    assert_close_to(from_layout(stitch(shards, 1), perm), truth(x, causal, window), name)


def test_window_and_documents_decide_together(seed, worlds):
    """With ids and a window, a block is computed only if both let it (window first: static), the
    kernel gets the document mask and the window only where each is needed."""
    axes, layout = (("ring", 2), ("ulysses", 2)), "zigzag"
    x = make_inputs(seed, 2, 2, sinks=True, ids=True)
    x["segment_ids"] = torch.from_numpy(np.asarray([[0] * 9 + [1] * 2 + [2] * 5 + [3] * 16,
                                                    [5] * 3 + [6] * 13 + [8] * 16]))
    perm = torch_impl.layout_permutation(T, layout, 2, 2)
    x_layout = to_layout(x, perm)
    shards = run_world(worlds, axes, "ring", layout, True, (6, 0), x_layout, count=True)
    expected = expected_calls(schedule_of(axes, "ring", layout, True), layout, (6, 0), x_layout["segment_ids"].numpy())
    flat = [c for calls in expected.values() for c in calls]
    assert any(c[0] for c in flat) and any(c[3] for c in flat), flat
    for s in shards:
        r = s["block"] // 2
        for kind in ("fwd", "bwd"):
            assert sorted(c[1:] for c in s["calls"] if c[0] == kind) == sorted(expected[r]), (s["coords"], kind)
    assert_close_to(from_layout(stitch(shards, 1), perm), truth(x, True, (6, 0)), "window + documents")


def counting_backend(calls: list) -> str:
    """Register "counting_replay": the reference kernels, recording (document mask?, rows, columns, window mask?)."""
    reference = get_backend("reference")

    def fwd(q, k, v, mask, scale, segments=None, positions=None):
        calls.append((mask.documents, q.shape[1], k.shape[1], mask.window is not None))
        return reference.fwd(q, k, v, mask, scale, segments, positions)

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None):
        return reference.bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)

    register_backend(BlockBackend("counting_replay", fwd, bwd))
    return "counting_replay"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("fields", [dict(ring=8), dict(ring=8, kv_exchange="allgather"), dict(ring=8, outer=2),
                                    dict(ring=4, ulysses=2, outer=2)], ids=["ring8", "allgather8", "double2x4",
                                                                            "double-usp2x2x2"])
def test_replayed_devices_skip_what_the_count_says(fields, layout):
    """The one-device replay walks the same loop code: each virtual device's forward calls, over
    R = 8 (shards of 8 of 64 tokens), are the documented decision's for a window of 5 — and the
    brute force's where the decision is exact (contiguous; zigzag causal)."""
    seq = 64
    strategy = replay.Strategy(**fields)
    schedule = strategy.schedule(layout, True)
    expected = expected_calls(schedule, layout, (5, 0), seq=seq)
    brute = brute_force_calls(schedule, layout, (5, 0), seq=seq)
    q = torch.randn(1, seq, 4, 8)
    for device in range(strategy.devices):
        calls: list = []
        replay.device_forward(device, q, q, q, strategy=strategy, causal=True, layout=layout, window=(5, 0),
                              block_backend=counting_backend(calls))
        r = device // strategy.ulysses
        assert sorted(calls) == sorted(expected[r]), (device, calls, expected[r])
        if layout != "stripe":
            assert sorted(calls) == sorted(brute[r]), (device, calls, brute[r])


# ---- validation before any collective ----------------------------------------------------------

BAD = [
    ("negative window", -1, None, "float32", "cpu", "ValueError", "window extents must be >= 0, got (-1, -1)"),
    ("negative right", (4, -2), None, "float32", "cpu", "ValueError", "window extents must be >= 0"),
    ("3-tuple window", (1, 2, 3), None, "float32", "cpu", "TypeError", "window must be None, an int or a (left, right)"),
    ("bool window", True, None, "float32", "cpu", "TypeError", "window must be None, an int or a (left, right)"),
    ("float window", 2.5, None, "float32", "cpu", "TypeError", "window must be None, an int or a (left, right)"),
    ("sinks per kv head", None, (2,), "float32", "cpu", "ValueError", "sinks must be [heads] = (4,)"),
    ("sinks rank 2", 3, (1, 4), "float32", "cpu", "ValueError", "sinks must be [heads] = (4,)"),
    ("integer sinks", None, (4,), "int32", "cpu", "TypeError", "sinks must have a floating dtype"),
    ("sinks off q's device", 3, (4,), "float32", "meta", "ValueError", "sinks must be on q's device"),
]


@pytest.mark.parametrize("desc,window,sinks_shape,dtype,device,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_window_or_sinks_same_error_on_every_rank(desc, window, sinks_shape, dtype, device, exc, message, worlds):
    results = worlds(4).run(bad_window_or_sinks_task, (("ring", 2), ("ulysses", 2)), window, sinks_shape, dtype,
                            device)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == exc and message in text, results[0]


def test_valid_window_and_sinks_reach_the_tripwire(worlds):
    """The tripwire works: a valid window and sinks get past validation to the first collective."""
    results = worlds(4).run(bad_window_or_sinks_task, (("ring", 4),), (3, 0), (4,), "float32", "cpu")
    assert all(kind == "AssertionError" and "collective was reached" in text for kind, text in results), results


@pytest.mark.parametrize("per_rank,field", [
    ({1: {"window": 5}}, "window (left, right; -1: none): from (3, 0) to (5, 5)"),
    ({2: {"window": -3}}, "window (left, right; -1: none): from (-2, -2) to (3, 0)"),
    ({3: {"sinks_shape": None}}, "sinks shape: from () to (4,)"),
])
def test_the_rank_check_compares_window_and_sinks(per_rank, field, worlds):
    """check_ranks=True: ranks that disagree on the window (an invalid one too) or on having sinks
    get the same ValueError on every rank, naming the field, before any attention collective."""
    results = worlds(4).run(bad_window_or_sinks_task, (("ring", 4),), (3, 0), (4,), "float32", "cpu", True, per_rank)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == "ValueError" and field in text, results[0]


# ---- the one-device replay ---------------------------------------------------------------------

REPLAYED = [
    ("ring4-zigzag-causal-w6-sinks-ids", (("ring", 4),), "ring", "zigzag", True, (6, 0), True, dict(ring=4)),
    ("allgather4-contiguous-full-w3-sinks", (("ring", 4),), "allgather", "contiguous", False, 3, False,
     dict(ring=4, kv_exchange="allgather")),
    ("double2x2-stripe-causal-w5-sinks-ids", (("ring_outer", 2), ("ring_inner", 2)), "ring", "stripe", True, (5, 0),
     True, dict(ring=4, outer=2)),
    ("usp2x2-zigzag-causal-w9-sinks", (("ring", 2), ("ulysses", 2)), "ring", "zigzag", True, (9, 0), False,
     dict(ring=2, ulysses=2)),
]


@pytest.mark.parametrize("name,axes,exchange,layout,causal,window,ids,fields", REPLAYED, ids=[c[0] for c in REPLAYED])
def test_replay_with_window_and_sinks_equals_the_world_run(name, axes, exchange, layout, causal, window, ids, fields,
                                                           seed, worlds):
    """replay_attention(_grads) with the window, the full sinks (and global ids) walks the same
    blocks as the gloo world: o, lse, dq, dk, dv agree to float32 rounding, and the replay's
    dsinks equals the sum of the ranks' sinks.grad."""
    x = make_inputs(seed, 2, 2, sinks=True, ids=ids)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    x_layout = to_layout(x, perm)
    world = stitch(run_world(worlds, axes, exchange, layout, causal, window, x_layout), 1)
    kw = dict(strategy=replay.Strategy(**fields), causal=causal, layout=layout, window=window,
              sinks=x_layout["sinks"], segment_ids=x_layout.get("segment_ids"))
    q, k, v = (x_layout[n] for n in ("q", "k", "v"))
    o, lse = replay.replay_attention(q, k, v, **kw)
    grads = replay.replay_attention_grads(q, k, v, o, lse, x_layout["do"], x_layout["dlse"], **kw)
    assert len(grads) == 4, "with sinks the replay's backward returns dsinks too"
    for n, got in zip((*NAMES, "dsinks"), (o, lse, *grads)):
        torch.testing.assert_close(got.double(), world[n].double(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, n=n: f"{name} {n}: {m}")


# (layout, causal, window, sinks, ids, K/V in float32): the halo schedule (contiguous, a causal or
# right-0 window below a shard: rows [0, 5) of the queries, the last 5 keys), with sinks, documents
# and float32 K/V; zigzag causal without a window (rank 0 widens only one half of its shard).
FLOAT32_ROWS_CASES = [("contiguous", True, (5, 0), False, True, False), ("contiguous", False, (5, 0), True, False, True),
                      ("zigzag", True, None, False, False, False)]


@pytest.mark.parametrize("devices", [4, 2])
def test_partial_float32_accumulators_equal_the_whole_shard_bit_for_bit(devices, worlds):
    """torch's accumulators widen to float32 only the rows later blocks touch (``merge.Float32Rows``):
    with a kernel that returns the inputs' dtype (as the GPU kernels do — the CPU's portable kernel
    returns float32, where the partial path never runs), bf16 o, lse and every gradient equal bit
    for bit those of the whole shard widened at once — the halo's dK / dV trail on a ring of 4
    (its return hop) and of 2, sinks, documents, float32 K/V — and partial spans were taken; on the
    contiguous layout each rank's rows also meet a float64 truth within bf16's error (both variants
    share the trail, so a wrong trail would pass the first check alone)."""
    results = worlds(devices).run(float32_rows_task, FLOAT32_ROWS_CASES)
    for rank, per_case in enumerate(results):
        for case, got in zip(FLOAT32_ROWS_CASES, per_case):
            assert got["differ"] == [], (devices, rank, case, got)
            assert all(err < 2e-2 for err in got["error"].values()), (devices, rank, case, got["error"])
    assert any(got["error"] for per_case in results for got in per_case)  # the contiguous cases met the truth
    t = 64 // devices  # float32_rows_task's shard
    halo_spans = {s for per_case in results for s in per_case[0]["partial_spans"]}
    assert ((0, 5),) in halo_spans and ((t - 5, t),) in halo_spans, halo_spans  # dq / o rows; dK / dV keys
