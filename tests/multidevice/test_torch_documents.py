"""Packed documents (``segment_ids``, issue 25) in torch_impl on gloo worlds of 2 and 4 processes:
every strategy (ring contiguous / zigzag / stripe on 2 and 4 ranks, all-gather KV, Ulysses, USP,
double ring, a data axis), causal and not, GQA / MQA, float32, on a random packed mix — documents
spanning shards, length-1 documents, an id that recurs in runs apart — against float64
``dense_attention`` with the original-order ids (o, lse, dq, dk, dv); block skipping proven by
counting kernel calls against ``schedule.document_work``; bad ids refused before any collective;
the one-device replay equal to the world run.

Each rank receives the GLOBAL layout-order tensors and takes its own local shard (as a torch
caller passes them: local ids [b/D, t/(R·U)]); the test stitches the shards back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl
from seqplan.schedule import DocumentWork, Exchange, Part, device_visits, document_work, make_schedule
from torch_impl import replay
from torch_tasks import bad_segment_ids_task, documents_task

T, HEADS, HEAD_DIM = 32, 4, 8
RTOL = 1e-5  # relative L2 of float32 against the float64 truth (the float32 policy's bound)
NAMES = ("o", "lse", "dq", "dk", "dv")


def packed_ids(rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """A packed mix per batch row, in original order: row 0 long-tailed document lengths (many
    length-1 and length-2 documents, a few long ones spanning shards), ids 0, 1, 2, ...; row 1
    runs of 1-6 tokens whose ids come from {0, 1, 2}, so one id recurs in runs far apart
    (e.g. [0, 0, 1, 1, 0, 0, ...]: one document, not contiguous); further rows alternate."""
    rows = []
    for row in range(batch):
        ids, doc = [], 0
        while len(ids) < seq:
            if row % 2 == 0:
                length = int(rng.choice([1, 1, 2, 3, 5, 11, 19]))
                ids += [doc] * length
                doc += 1
            else:
                ids += [int(rng.integers(0, 3))] * int(rng.integers(1, 7))
        rows.append(ids[:seq])
    return np.asarray(rows, dtype=np.int64)


def make_inputs(seed: int, batch: int, kv_heads: int) -> dict:
    """Global float32 q, k, v, do [b, T, ., d], dlse [b, h, T] and int64 segment_ids [b, T], original order."""
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal((batch, T, h, HEAD_DIM)).astype(np.float32)
         for n, h in (("q", HEADS), ("k", kv_heads), ("v", kv_heads), ("do", HEADS))}
    x["dlse"] = rng.standard_normal((batch, HEADS, T)).astype(np.float32)
    x["segment_ids"] = packed_ids(rng, batch, T)
    return {n: torch.from_numpy(a) for n, a in x.items()}


def truth(x: dict, causal: bool) -> dict:
    """float64 dense attention with the original-order ids and its gradients for (do, dlse)."""
    q, k, v = (x[n].double().requires_grad_() for n in ("q", "k", "v"))
    o, lse = torch_impl.dense_attention(q, k, v, causal=causal, segment_ids=x["segment_ids"])
    torch.autograd.backward((o, lse), (x["do"].double(), x["dlse"].double()))
    return {"o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def seq_dim(name: str) -> int:
    return 2 if name == "lse" else 1


def to_layout(x: dict, perm) -> dict:
    return {n: a[:, :, perm] if n == "dlse" else a[:, perm] for n, a in x.items()}


def stitch(shards: list[dict], data: int) -> dict:
    """Per-rank shards back into global layout-order tensors (batch block, then sequence block)."""
    out = {}
    for name in NAMES:
        rows = []
        for d in range(data):
            mine = sorted((s for s in shards if s["data"] == d), key=lambda s: s["block"])
            rows.append(torch.cat([s[name] for s in mine], dim=seq_dim(name)))
        out[name] = torch.cat(rows, dim=0)
    return out


def from_layout(out: dict, perm) -> dict:
    inverse = np.argsort(perm)
    return {n: a[:, :, inverse] if n == "lse" else a[:, inverse] for n, a in out.items()}


def assert_close_to(got: dict, want: dict, label: str) -> None:
    for name in NAMES:
        g, w = got[name].double(), want[name].double()
        assert g.shape == w.shape and torch.isfinite(g).all(), f"{label} {name}: shape {g.shape} / not finite"
        rel = (torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w)).item()
        assert rel <= RTOL, f"{label} {name}: relative L2 error {rel:.2e} > {RTOL:.0e}"


# (id, mesh axes, kv_exchange, layout, causal, kv_heads, batch)
RING = [(f"ring{r}-{layout}-{'causal' if c else 'full'}", (("ring", r),), "ring", layout, c, 2, 2)
        for r in (2, 4) for layout in ("contiguous", "zigzag", "stripe") for c in (True, False)]
OTHERS = [
    ("allgather4-zigzag-causal", (("ring", 4),), "allgather", "zigzag", True, 2, 2),
    ("allgather4-stripe-causal", (("ring", 4),), "allgather", "stripe", True, 1, 2),
    ("allgather4-contiguous-causal", (("ring", 4),), "allgather", "contiguous", True, 2, 2),
    ("allgather4-zigzag-full", (("ring", 4),), "allgather", "zigzag", False, 2, 2),
    ("ulysses2-causal", (("ulysses", 2),), "ring", "contiguous", True, 2, 2),
    ("ulysses2-full-mqa", (("ulysses", 2),), "ring", "contiguous", False, 1, 2),
    ("usp2x2-zigzag-causal", (("ring", 2), ("ulysses", 2)), "ring", "zigzag", True, 2, 2),
    ("usp2x2-stripe-causal-mqa", (("ring", 2), ("ulysses", 2)), "ring", "stripe", True, 1, 2),
    ("usp2x2-zigzag-full-allgather", (("ring", 2), ("ulysses", 2)), "allgather", "zigzag", False, 2, 2),
    ("double2x2-zigzag-causal", (("ring_outer", 2), ("ring_inner", 2)), "ring", "zigzag", True, 2, 2),
    ("double2x2-stripe-causal", (("ring_outer", 2), ("ring_inner", 2)), "ring", "stripe", True, 2, 2),
    ("double2x2-contiguous-full", (("ring_outer", 2), ("ring_inner", 2)), "ring", "contiguous", False, 2, 2),
    ("data2-ring2-zigzag-causal", (("data", 2), ("ring", 2)), "ring", "zigzag", True, 2, 4),
]
CASES = RING + OTHERS


def ring_and_ulysses(axes) -> tuple[int, int]:
    sizes = dict(axes)
    return sizes.get("ring", sizes.get("ring_outer", 1) * sizes.get("ring_inner", 1)), sizes.get("ulysses", 1)


def run_world(worlds, axes, exchange, layout, causal, x_layout, count=False) -> list[dict]:
    devices = int(np.prod([n for _, n in axes]))
    kwargs = dict(causal=causal, layout=layout, kv_exchange=exchange)
    return worlds(devices).run(documents_task, axes, x_layout, kwargs, count)


@pytest.mark.parametrize("name,axes,exchange,layout,causal,kv_heads,batch", CASES, ids=[c[0] for c in CASES])
def test_packed_documents_match_dense_truth(name, axes, exchange, layout, causal, kv_heads, batch, seed, worlds):
    x = make_inputs(seed, batch, kv_heads)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    shards = run_world(worlds, axes, exchange, layout, causal, to_layout(x, perm))
    got = from_layout(stitch(shards, dict(axes).get("data", 1)), perm)
    assert_close_to(got, truth(x, causal), f"{name} (seed {seed})")


@pytest.mark.parametrize("dtype", ["uint8", "int16"])
def test_narrow_integer_ids(dtype, seed, worlds):
    """Ids in any accepted integer dtype are compared as int32 (USP: gathered over Ulysses, then the ring)."""
    x = make_inputs(seed, 2, 2)
    perm = torch_impl.layout_permutation(T, "zigzag", 2, 2)
    x_layout = to_layout(x, perm)
    x_layout["segment_ids"] = x_layout["segment_ids"].to(getattr(torch, dtype))
    axes = (("ring", 2), ("ulysses", 2))
    got = from_layout(stitch(run_world(worlds, axes, "ring", "zigzag", True, x_layout), 1), perm)
    assert_close_to(got, truth(x, True), dtype)


def test_without_ids_nothing_changes(seed, worlds):
    """segment_ids=None is today's attention (the packed path is not taken by accident): the
    result equals dense attention without ids, which differs from the packed truth."""
    x = make_inputs(seed, 2, 2)
    perm = torch_impl.layout_permutation(T, "zigzag", 4, 1)
    x_layout = to_layout({n: a for n, a in x.items() if n != "segment_ids"}, perm)
    got = from_layout(stitch(run_world(worlds, (("ring", 4),), "ring", "zigzag", True, x_layout), 1), perm)
    plain = truth({**x, "segment_ids": None}, True)
    assert_close_to(got, plain, "no ids")
    packed = truth(x, True)
    assert not torch.allclose(plain["o"], packed["o"], atol=1e-3), "the mix must change the answer"


# ---- block skipping, counted ------------------------------------------------------------------

SKIP_MIX = np.asarray([[0] * 9 + [1] * 2 + [2] * 5 + [3] * 16,  # long documents over several shards
                       [5] * 3 + [6] * 13 + [8] * 16])


def schedule_of(axes, exchange, layout, causal):
    ring, _ = ring_and_ulysses(axes)
    outer = dict(axes).get("ring_outer", 1)
    kind = Exchange.DOUBLE_RING if outer > 1 else Exchange(exchange)
    return make_schedule(kind, layout, causal, outer, ring // outer)


def expected_calls(axes, exchange, layout, causal, ids_layout: np.ndarray) -> dict[int, list]:
    """Per ring position: (document mask?, query rows, key columns) of every block the loops must
    compute, from the schedule and ``schedule.document_work`` on the layout-order ids."""
    ring, _ = ring_and_ulysses(axes)
    schedule = schedule_of(axes, exchange, layout, causal)
    shard = ids_layout.shape[1] // ring
    out = {}
    for r in range(ring):
        calls = []
        for visit in device_visits(schedule, r):
            if visit.block is None:
                continue
            q_lo, q_hi = visit.block.q_part.bounds(shard)
            k_lo, k_hi = visit.block.kv_part.bounds(shard)
            q_ids = ids_layout[:, r * shard + q_lo:r * shard + q_hi]
            kv_ids = ids_layout[:, visit.source * shard + k_lo:visit.source * shard + k_hi]
            work = document_work(q_ids.min(1), q_ids.max(1), kv_ids.min(1), kv_ids.max(1))
            if work is not DocumentWork.SKIP:
                calls.append((work is DocumentWork.DOCUMENTS, q_hi - q_lo, k_hi - k_lo))
        out[r] = calls
    return out


# (id, mesh axes, kv_exchange, layout, causal, blocks skipped?) Contiguous shards hold id ranges
# that miss each other; a zigzag shard holds chunks from both ends, so its range meets every
# other shard's and nothing may be skipped (the count proves none is).
SKIP_CASES = [
    ("ring4-contiguous-full", (("ring", 4),), "ring", "contiguous", False, True),
    ("ring4-contiguous-causal", (("ring", 4),), "ring", "contiguous", True, True),
    ("allgather4-contiguous-full", (("ring", 4),), "allgather", "contiguous", False, True),
    ("double2x2-contiguous-full", (("ring_outer", 2), ("ring_inner", 2)), "ring", "contiguous", False, True),
    ("usp2x2-contiguous-causal", (("ring", 2), ("ulysses", 2)), "ring", "contiguous", True, True),
    ("ring4-zigzag-causal", (("ring", 4),), "ring", "zigzag", True, False),
]


@pytest.mark.parametrize("name,axes,exchange,layout,causal,skips", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_blocks_without_a_shared_document_are_never_computed(name, axes, exchange, layout, causal, skips, seed,
                                                             worlds):
    """Every rank's counted kernel calls, forward and backward, are exactly the blocks
    ``document_work`` keeps (SKIP: no call; PLAIN: the static mask; DOCUMENTS: the document
    mask) — fewer than without ids where the layout lets blocks miss each other — and the
    answer is still the dense truth."""
    x = make_inputs(seed, 2, 2)
    x["segment_ids"] = torch.from_numpy(SKIP_MIX)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    x_layout = to_layout(x, perm)
    shards = run_world(worlds, axes, exchange, layout, causal, x_layout, count=True)
    expected = expected_calls(axes, exchange, layout, causal, x_layout["segment_ids"].numpy())
    flat = [c for calls in expected.values() for c in calls]
    assert any(c[0] for c in flat), "the mix must give DOCUMENTS blocks"
    schedule = schedule_of(axes, exchange, layout, causal)
    unpacked = sum(v.block is not None for r in range(ring) for v in device_visits(schedule, r))
    assert (len(flat) < unpacked) == skips, f"{len(flat)} of {unpacked} blocks computed"
    for s in shards:
        r = s["block"] // ulysses  # the ring position of this rank
        for kind in ("fwd", "bwd"):
            got = sorted(c[1:4] for c in s["calls"] if c[0] == kind)  # (document mask?, rows, columns)
            assert got == sorted(expected[r]), f"{name} rank {s['coords']} {kind}: {got} != {sorted(expected[r])}"
    got = from_layout(stitch(shards, 1), perm)
    assert_close_to(got, truth(x, causal), name)


def test_the_skip_mix_gives_every_kind_of_block():
    """SKIP_MIX on 4 contiguous shards: some blocks skipped, some PLAIN (both rows inside one
    document: the static mask, a fused kernel could run them), some DOCUMENTS."""
    calls = expected_calls((("ring", 4),), "ring", "contiguous", False, SKIP_MIX)
    flat = [c for per_rank in calls.values() for c in per_rank]
    assert len(flat) < 16 and any(c[0] for c in flat) and not all(c[0] for c in flat), flat


def test_block_parts_are_what_the_count_measures():
    """The expected-count helper's parts are the schedule's (a zigzag later-shard block is half
    the queries), so a count of whole-shard blocks could not pass by accident."""
    assert Part.SECOND_HALF.bounds(8) == (4, 8)
    calls = expected_calls((("ring", 2),), "ring", "zigzag", True, np.zeros((1, 16), dtype=np.int64))
    assert calls[0] == [(False, 8, 8), (False, 4, 8)] and calls[1] == [(False, 8, 8), (False, 8, 4)]


# ---- validation before any collective ----------------------------------------------------------

BAD = [
    ("wrong shape", (1, 8, 4, 8), (1, 9), "int32", "cpu", "ValueError", "local segment_ids must be [batch, seq] = (1, 8)"),
    ("rank-3 ids", (1, 8, 4, 8), (1, 8, 1), "int64", "cpu", "ValueError", "local segment_ids must be [batch, seq]"),
    ("float ids", (1, 8, 4, 8), (1, 8), "float32", "cpu", "TypeError", "segment_ids must have an integer dtype"),
    ("bool ids", (1, 8, 4, 8), (1, 8), "bool", "cpu", "TypeError", "segment_ids must have an integer dtype"),
    ("ids not on q's device", (1, 8, 4, 8), (1, 8), "int32", "meta", "ValueError", "segment_ids must be on q's device"),
]


@pytest.mark.parametrize("desc,q_shape,ids_shape,dtype,device,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_segment_ids_same_error_on_every_rank(desc, q_shape, ids_shape, dtype, device, exc, message, worlds):
    results = worlds(4).run(bad_segment_ids_task, (("ring", 2), ("ulysses", 2)), q_shape, ids_shape, dtype, device)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == exc and message in text, results[0]


def test_valid_segment_ids_reach_the_tripwire(worlds):
    """The tripwire works: valid ids get past validation to the first collective (the ids' gather)."""
    results = worlds(4).run(bad_segment_ids_task, (("ring", 4),), (1, 8, 4, 8), (1, 8), "int32", "cpu", True)
    assert all(kind == "AssertionError" and "collective was reached" in text for kind, text in results), results


def test_the_rank_check_compares_segment_ids(worlds):
    """check_ranks=True: a rank without ids among ranks with ids gets the same ValueError on
    every rank, naming the ids' shape, before any attention collective."""
    results = worlds(4).run(bad_segment_ids_task, (("ring", 4),), (1, 8, 4, 8), (1, 8), "int32", "cpu", True, (1,))
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == "ValueError" and "segment_ids shape: from () to (1, 8)" in text, results[0]


# ---- the one-device replay ---------------------------------------------------------------------

REPLAYED = [
    ("ring4-zigzag-causal", (("ring", 4),), "ring", "zigzag", True, dict(ring=4)),
    ("allgather4-stripe-causal", (("ring", 4),), "allgather", "stripe", True, dict(ring=4, kv_exchange="allgather")),
    ("double2x2-zigzag-causal", (("ring_outer", 2), ("ring_inner", 2)), "ring", "zigzag", True, dict(ring=4, outer=2)),
    ("usp2x2-stripe-full", (("ring", 2), ("ulysses", 2)), "ring", "stripe", False, dict(ring=2, ulysses=2)),
    ("ulysses2-causal", (("ulysses", 2),), "ring", "contiguous", True, dict(ulysses=2)),
]


@pytest.mark.parametrize("name,axes,exchange,layout,causal,fields", REPLAYED, ids=[c[0] for c in REPLAYED])
def test_replay_with_segment_ids_equals_the_world_run(name, axes, exchange, layout, causal, fields, seed, worlds):
    """replay_attention(_grads) on the GLOBAL layout-order ids walks the same blocks as the gloo
    world on local ids: o, lse, dq, dk, dv agree to float32 rounding of the summation order."""
    x = make_inputs(seed, 2, 2)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    x_layout = to_layout(x, perm)
    world = stitch(run_world(worlds, axes, exchange, layout, causal, x_layout), 1)
    strategy = replay.Strategy(**fields)
    kw = dict(strategy=strategy, causal=causal, layout=layout, segment_ids=x_layout["segment_ids"])
    q, k, v = (x_layout[n] for n in ("q", "k", "v"))
    o, lse = replay.replay_attention(q, k, v, **kw)
    dq, dk, dv = replay.replay_attention_grads(q, k, v, o, lse, x_layout["do"], x_layout["dlse"], **kw)
    for n, got in zip(NAMES, (o, lse, dq, dk, dv)):
        torch.testing.assert_close(got, world[n], rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{name} {n}: {m}")
