"""Property-based parity: hypothesis draws random *valid* configurations (mesh
factorization of 1–8 devices over data × ring × Ulysses, the double ring ring_outer × ring_inner
included; batch, seq, heads, kv_heads, head_dim, layout, causal, dtype — float32, bfloat16,
float16 — scale, kv_exchange, and packed documents: about half the examples carry segment ids of a
pattern drawn by ``document_patterns``, the ids themselves drawn from the seed by
parity.core.documents; a sliding window, about half the time, whose sides are drawn by
``window_sides`` around the shard size — a query alone, inside a shard, one shard, across several,
beyond the sequence; attention sinks half the time, their logits drawn from the seed; logit
soft-capping about half the time, at a cap drawn by ``softcaps`` — strong, moderate or barely
bending the logits; explicit token indices about half the time the sequence allows them,
``token_indices``: the tokens laid out per row by the per-document zigzag) and both frameworks
must agree with the float64 oracle under the numerics policy (dsinks included).

Why: the all-pairs matrix covers every pair of hand-picked values; users pass shapes nobody
picked. ``RINGBRIDGE_FUZZ_EXAMPLES`` sets the number of examples: 12 in the default run (20 until
2026-11-29, when CI measured the suite at 13 min 2 s: the 20 took 50 s of it; 50 until
2026-11-25, when the suite passed its 12-minute budget: 50 took 75 s in a loaded run, 30 took 52 s; 100 took
110 s on 2 cores on 2026-11-24, when the whole suite reached 11 min 18 s in CI against its 12-minute
budget; 200 took 3.8 min on 2026-11-23: XLA:CPU compiles at backend optimization level 0, see
parity.core.devices), 1000 with ``--full`` / ``RINGBRIDGE_FULL=1``. The draws are derandomized (the same
12 every run) so a CI failure reproduces; ``--seed`` still varies the input values. A shrunk
failure joins ``FOUND`` below and stays there as a regression case.
"""

from __future__ import annotations

import os
import zlib

import pytest

pytest.importorskip("jax")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FULL, assert_passed, jax_runner, torch_runner
from parity.core.cases import DOCUMENT_PATTERNS, KV_EXCHANGES, LAYOUTS, Case
from parity.core.inputs import flash_ideal, make_inputs, oracle
from parity.core.mesh import MeshShape
from parity.runners.pipeline import check_case
from seqplan.layouts import seq_multiple

EXAMPLES = int(os.environ.get("RINGBRIDGE_FUZZ_EXAMPLES", 1000 if FULL else 12))
# (data, ring, ulysses, ring_outer): every factorization of 1–8 devices; ring_outer > 1 lays the
# ring out as the double ring ring_outer × ring/ring_outer (both axes of size >= 2).
MESHES = [(d, r, u, 1) for d in (1, 2) for r in (1, 2, 4, 8) for u in (1, 2, 4, 8) if d * r * u <= 8]
MESHES += [(d, r, u, o) for d in (1, 2) for r in (4, 8) for u in (1, 2) for o in (2, 4)
           if d * r * u <= 8 and r // o >= 2]
DTYPES = ("float32", "bfloat16", "float16")


def document_patterns():
    """No packed documents, or one of the patterns (a long-tailed mix, one document, singletons,
    interleaved runs), half and half."""
    return st.one_of(st.just("none"), st.sampled_from(DOCUMENT_PATTERNS))


def window_sides(seq: int, ring: int):
    """One side of a window, in tokens, around a ring shard of ``seq // ring`` (zigzag: two halves):
    0 (the query alone), 1, half a shard, one shard ± 1, two shards + 1, the whole sequence and beyond."""
    shard = seq // ring
    return st.sampled_from(sorted({0, 1, shard // 2, max(shard - 1, 0), shard, shard + 1, 2 * shard + 1, seq - 1,
                                   seq + 5}))


@st.composite
def windows(draw, seq: int, ring: int):
    """None half the time, else (left, right) with sides from ``window_sides``."""
    if draw(st.booleans()):
        return None
    return draw(window_sides(seq, ring)), draw(window_sides(seq, ring))


def softcaps():
    """No soft-capping half the time, else a cap that bends most logits (0.5), some (2) or almost
    none (30, Gemma 2's final-logit cap) at the fuzz's logit sizes."""
    return st.one_of(st.none(), st.sampled_from((0.5, 2.0, 30.0)))


def token_indices(seq: int, ring: int):
    """Explicit token indices (the per-document zigzag or hybrid of the drawn documents —
    ``Case.row_layout``, drawn beside —, or of one document a row) about half the time, where
    the sequence splits into 2R-token units (``Case.token_index``)."""
    return st.booleans().map(lambda given: given and seq % (2 * ring) == 0)


ROW_LAYOUTS = ("document-zigzag", "document-hybrid")  # a token-index case's per-row layout (Case.row_layout)


@st.composite
def cases(draw) -> Case:
    data, ring, uly, outer = draw(st.sampled_from(MESHES))
    heads = draw(st.sampled_from([h for h in (4, 8) if h % uly == 0] or [8]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0 and (k % uly == 0 or uly % k == 0)]))
    layout = draw(st.sampled_from(LAYOUTS))
    multiple = seq_multiple(layout, ring, uly)
    seq = multiple * draw(st.sampled_from((1, 2, 3)))
    seq += multiple * -(-max(8 - seq, 0) // multiple)  # at least 8 tokens
    single_ring = ring > 1 and outer == 1  # all-gather KV has no double-ring form
    token_index = draw(token_indices(seq, ring))
    return Case(ring=ring, ulysses=uly, data=data, ring_outer=outer, batch=data * draw(st.sampled_from((1, 2))),
                seq=seq, heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from((8, 16, 24))), layout=layout,
                causal=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES)),
                scale=draw(st.sampled_from((None, 0.5, 0.05))),
                kv_exchange=draw(st.sampled_from(KV_EXCHANGES)) if single_ring else "ring",
                documents=draw(document_patterns()), window=draw(windows(seq, ring)), sinks=draw(st.booleans()),
                softcap=draw(softcaps()), token_index=token_index,
                row_layout=draw(st.sampled_from(ROW_LAYOUTS)) if token_index else ROW_LAYOUTS[0])


# Cases the fuzz must always pass: edge shapes picked by hand, and every shrunk failure it found (each its
# own test item, so pytest-xdist spreads them over its workers; before 2026-11-28 they were @example-s of
# the drawn test, one 98-second item).
FOUND = [
    Case(ring=8, layout="stripe", causal=True, kv_heads=1, seq=8),  # smallest stripe ring-8 shard: one token
    Case(ring=8, ring_outer=4, layout="zigzag", causal=True, kv_heads=1, seq=16, dtype="float16"),
    # Packed documents at one token per device: every block's id range is one token's.
    Case(ring=8, layout="stripe", causal=True, kv_heads=1, seq=8, batch=2, documents="mix"),
    Case(ring=2, ulysses=4, layout="zigzag", causal=True, kv_heads=2, seq=16, dtype="bfloat16", documents="interleaved"),
    # Windows and sinks at one token per device: a causal window of one key back (every off-diagonal block
    # but the neighbour's skipped, stripe: every block reachable); each query alone, non-causal, under Ulysses.
    Case(ring=8, layout="stripe", causal=True, kv_heads=1, seq=8, window=(1, 0), sinks=True),
    Case(ring=4, ulysses=2, layout="zigzag", causal=False, kv_heads=2, seq=16, dtype="bfloat16",
         window=(0, 0), sinks=True, batch=2, documents="mix"),
    # Found by the 1000-example run (--seed 1591065429): MQA replicated over U = 2, one token per device;
    # torch's dv missed the policy (5.1e-2 > 4.9e-2, 4.4x the unsharded error) while Ulysses summed the
    # replicas' gradients after rounding them to bf16; now float32 end to end, it errs 1.15e-2.
    Case(ring=4, ulysses=2, layout="stripe", causal=True, heads=8, kv_heads=1, head_dim=16, seq=8,
         dtype="bfloat16", scale=0.05, kv_exchange="allgather"),
    # Found by the first run drawing windows and sinks (--seed 11): both frameworks' dk at exactly the
    # flash ideal's error (2.06e-2), over twice the luckily close JAX control's (5.9e-3): rows of one or
    # two keys plus a sink. Passes since the policy's bound includes the ideal (parity.core.numerics).
    Case(ring=2, ulysses=2, data=2, batch=2, seq=8, heads=4, kv_heads=4, head_dim=8, layout="zigzag",
         causal=True, dtype="bfloat16", scale=0.5, kv_exchange="allgather", documents="interleaved",
         window=(1, 0), sinks=True),
    # Token indices at one token per chunk: two documents of 2R = 8 tokens, each device two tokens (USP), a window
    # of one key back on the indices, non-causal; and the same per-document zigzag under the double ring in fp16
    # with sinks.
    Case(ring=4, ulysses=2, layout="contiguous", causal=False, kv_heads=2, seq=16, batch=2, documents="mix",
         window=(1, 0), token_index=True),
    Case(ring=4, ring_outer=2, layout="zigzag", causal=True, kv_heads=1, seq=16, dtype="float16",
         documents="interleaved", sinks=True, token_index=True),
    # Found by CI (--seed 1790552572, and --seed 2048833874 through dsinks): one device with sinks in bf16 —
    # JAX's lone block returned o in bf16 before the sinks rescaled it, rounding o twice; dq missed the policy
    # (2.3e-2 > 1.9e-2). Its o now stays float32 until the one cast (tests/multidevice/test_jax_windows.py).
    Case(ring=1, seq=8, heads=8, kv_heads=1, head_dim=8, layout="zigzag", causal=False, dtype="bfloat16",
         documents="interleaved", window=(7, 17), sinks=True, token_index=True, row_layout="document-hybrid"),
]


def _check_both_frameworks(case: Case, seed: int) -> None:
    x = make_inputs(case, seed=seed ^ zlib.crc32(case.name.encode()))  # the same inputs in every process
    ref, ideal = oracle(case, x), flash_ideal(case, x) if case.dtype != "float32" else None
    for framework, runner in (("jax", jax_runner()), ("torch", torch_runner())):
        assert_passed(check_case(case, runner, x=x, ref=ref, ideal=ideal), case, framework, seed)


@pytest.mark.parametrize("case", FOUND, ids=lambda c: c.name)
def test_found_cases_match_the_oracle(case, seed, jax_devices, worlds):
    _check_both_frameworks(case, seed)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_valid_configurations_match_the_oracle(case, seed, jax_devices, worlds):
    _check_both_frameworks(case, seed)


def test_the_strategy_reaches_every_mesh_family():
    """The fuzz draws meshes of every algorithm, every document pattern, windows of both kinds of
    reach and sinks (guards the strategy against silently narrowing)."""
    strategies = {MeshShape(data=d, ring=r, ulysses=u, ring_outer=o).algorithm for d, r, u, o in MESHES}
    assert strategies == {"local", "ring", "ulysses", "usp", "double_ring", "double_ring_usp"}  # local: data only
    assert {d * r * u for d, r, u, _ in MESHES} == {1, 2, 4, 8}
    for pattern in ("none", *DOCUMENT_PATTERNS):
        found = hypothesis.find(cases(), lambda c, p=pattern: c.documents == p and c.causal,
                                settings=settings(database=None, derandomize=True))
        assert found.documents == pattern
    checks = {"sinks with a window": lambda c: c.sinks and c.window is not None,
              "sinks alone": lambda c: c.sinks and c.window is None,
              "a window inside one shard": lambda c: c.window is not None and c.ring >= 2
              and max(c.window) < c.seq // c.ring,
              "a window across shards": lambda c: c.window is not None and c.ring >= 4
              and c.window[0] > c.seq // c.ring,
              "a window beyond the sequence": lambda c: c.window is not None and min(c.window) >= c.seq,
              "a soft-cap with sinks and a window": lambda c: c.softcap is not None and c.sinks and c.window is not None,
              "a soft-cap in low precision": lambda c: c.softcap is not None and c.dtype != "float32",
              "token indices over documents on a ring": lambda c: c.token_index and c.documents != "none" and c.ring >= 2,
              "token indices under Ulysses": lambda c: c.token_index and c.ring >= 2 and c.ulysses >= 2,
              "the hybrid over documents": lambda c: c.token_index and c.row_layout == "document-hybrid"
              and c.documents != "none" and c.ring >= 2}
    for what, wanted in checks.items():
        found = hypothesis.find(cases(), wanted, settings=settings(database=None, derandomize=True))
        assert wanted(found), what
