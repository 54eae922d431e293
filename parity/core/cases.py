"""The case matrix: one ``Case`` per (mesh, shapes, layout, causal, dtype, ...) combination.

``full_matrix()`` is the cross product the issue asks for; ``pairwise_matrix()`` keeps every
(layout, causal, mesh) triple and then just enough cases that every *pair* of factor values
appears together at least once (greedy all-pairs), which is how the default test run stays fast
while still meeting every mesh shape with every layout, head layout, head_dim and dtype.

Packed documents (``Case.documents``, default "none": no segment ids) are one more factor: the
cross product runs every pattern with everything; the default matrix adds a few cases
(``document_cases``) so that the patterns meet every layout, causal mode and strategy. Sliding
windows (``Case.window``, one of ``WINDOWS``) and attention sinks (``Case.sinks``) are two more:
the cross product runs them with everything (documents included), the default matrix adds
``window_cases``. Logit soft-capping (``Case.softcap``, ``SOFTCAP`` or None) is the last: the
cross product runs every case capped too, the all-pairs matrix ends with ``softcap_cases`` (every
strategy meets it; the default report and test tier sample two of them).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass
from functools import cached_property

from .mesh import MeshShape, ring_position, sequence_block
from .names import (
    DOCUMENTS,
    DTYPES,
    KV_EXCHANGES,
    LAYOUTS,
    MATRIX_DOCUMENTS,
    Documents,
    Dtype,
    KvExchange,
    Layout,
    check_choice,
)

# (ring, ulysses) shapes: pure ring, pure Ulysses, and USP, 1-8 devices; (ring, ulysses,
# ring_outer): the double ring, ring_outer x (ring / ring_outer) inner, alone and under Ulysses.
MESHES = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (4, 1, 2), (4, 2, 2))
HEAD_LAYOUTS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}  # name -> (heads, kv_heads)
HEAD_DIMS = (16, 40, 64)
MATRIX_DTYPES = ("float32", "bfloat16")  # float16 is drawn by the property tier (tests/property)
__all__ = ["Case", "MESHES", "HEAD_LAYOUTS", "HEAD_DIMS", "MATRIX_DTYPES", "LAYOUTS", "KV_EXCHANGES",
           "DOCUMENTS", "DOCUMENT_PATTERNS", "WINDOWS", "ring_position", "full_matrix", "pairwise_matrix",
           "document_cases", "window_cases", "SOFTCAP", "softcap_cases", "strategy_name", "token_index_cases"]
# Sliding windows (left, right) at the matrix's 64 tokens (shards of 64/R tokens, zigzag halves of
# 32/R): SMALL fits inside one shard up to R = 4 (inside a zigzag half up to R = 2) and reaches the
# next at R = 8; WIDE spans two or three shards at R = 4 and R = 8 (one at R = 2); BEYOND is wider
# than the sequence on both sides (every block in reach and covered: the window's no-op path).
# Asymmetric, so that a left/right swap is visible in a non-causal case.
SMALL_WINDOW, WIDE_WINDOW, BEYOND_WINDOW = (5, 2), (20, 9), (100, 70)
WINDOWS = (None, SMALL_WINDOW, WIDE_WINDOW, BEYOND_WINDOW)
# Logit soft-capping at the matrix's logits (standard normal inputs at the default scale: logits of
# about unit size): a cap of 1.5 bends most of them (|x| = 1.5 -> 1.14), so an uncapped or
# miscapped run is far outside the policy; not 1, where softcap·tanh(x/softcap) and
# tanh(x·softcap)/softcap would agree.
SOFTCAP = 1.5


@dataclass(frozen=True)
class Case:
    """One parity case. Sizes are global; ``ring``/``ulysses``/``data`` are mesh-axis sizes;
    ``ring_outer > 1`` lays the ring of ``ring`` devices out as the double ring
    ``ring_outer x ring // ring_outer``. Invalid combinations raise ValueError at construction."""

    ring: int = 1
    ulysses: int = 1
    data: int = 1
    batch: int = 1
    seq: int = 64
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 16
    layout: Layout = "zigzag"
    causal: bool = True
    dtype: Dtype = "float32"
    scale: float | None = None
    kv_exchange: KvExchange = "ring"
    ring_outer: int = 1
    documents: Documents = "none"  # packed documents' segment ids (parity.core.documents); "none": no ids
    window: tuple[int, int] | None = None  # sliding window (left, right) on original positions; None: none
    sinks: bool = False  # attention sinks: [heads] logits drawn from the seed (parity.core.inputs)
    softcap: float | None = None  # logit soft-capping: softcap·tanh(x/softcap) of every scaled logit; None: none
    # Explicit token indices: each row's tokens laid out by the per-document zigzag of its documents
    # (seqplan.layouts.document_layout, a [b, t] permutation; documents "none": the row is one document)
    # and the call given token_index (and segment_ids, if any) in that order; ``layout`` then only names
    # the divisibility rule. Needs seq % 2·ring == 0 (document lengths are drawn in units of 2·ring tokens).
    token_index: bool = False
    # The per-row layout of a token-index case (seqplan.layouts.row_layout): "document-zigzag" or
    # "document-hybrid" (long documents split as document-zigzag, short ones whole, balanced).
    row_layout: str = "document-zigzag"
    # All-gather KV's shared prefix (seqplan.shared): the call gets the shared_tokens its laid-out ids
    # allow (seqplan.shared.shared_tokens_for), so only each ring shard's leading shared tokens travel.
    # Token-index cases on the per-document hybrid with packed documents, all-gather KV, causal.
    shared_prefix: bool = False
    # Whether the backward gets a cotangent for lse too (dlse drawn) or for o alone (dlse zero and not
    # passed: what a training step does, and the path the fused varlen backwards take).
    lse_cotangent: bool = True

    def __post_init__(self):
        for field in ("batch", "seq", "heads", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("documents", self.documents, DOCUMENTS)
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.sinks, bool):
            raise TypeError(f"sinks must be a bool, got {self.sinks!r}")
        if not isinstance(self.token_index, bool):
            raise TypeError(f"token_index must be a bool, got {self.token_index!r}")
        from seqplan.layouts import DOCUMENT_LAYOUTS

        check_choice("row_layout", self.row_layout, DOCUMENT_LAYOUTS)
        if self.row_layout != DOCUMENT_LAYOUTS[0] and not self.token_index:
            raise ValueError(f"row_layout={self.row_layout!r} lays rows out for token_index cases only: set token_index=True")
        for flag in ("shared_prefix", "lse_cotangent"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.shared_prefix and not (self.token_index and self.row_layout == "document-hybrid" and self.causal
                                       and self.documents != "none" and self.kv_exchange == "allgather"
                                       and self.window is None and self.softcap is None):
            raise ValueError("shared_prefix needs a causal token-index case on the document-hybrid row layout with "
                             "documents, all-gather KV, no window and no softcap")
        if self.token_index and self.seq % (2 * self.ring):
            raise ValueError(f"token_index cases need seq % (2·ring) == 0 (document lengths in units of 2·ring "
                             f"tokens), got seq={self.seq}, ring={self.ring}")
        if self.window is not None and not (
                isinstance(self.window, tuple) and len(self.window) == 2
                and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.window)):
            raise ValueError(f"window must be None or a (left, right) tuple of non-negative ints, got {self.window!r}")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and not isinstance(self.softcap, bool)
                                             and math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a finite positive number, got {self.softcap!r}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)
                                           and self.scale > 0):
            raise ValueError(f"scale must be a finite positive number or None, got {self.scale!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads % kv_heads must be 0, got heads={self.heads}, kv_heads={self.kv_heads}")
        if self.batch % self.data:
            raise ValueError(f"batch % data must be 0, got batch={self.batch}, data={self.data}")
        self.mesh  # noqa: B018 — MeshShape validates the mesh sizes and kv_exchange

    @cached_property
    def mesh(self) -> MeshShape:
        return MeshShape(data=self.data, ring=self.ring, ulysses=self.ulysses, ring_outer=self.ring_outer,
                         kv_exchange=self.kv_exchange)

    @property
    def devices(self) -> int:
        return self.mesh.devices

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Mesh axis name -> size in canonical order (``MeshShape.axes``)."""
        return self.mesh.axes

    @property
    def strategy(self) -> str:
        """The algorithm the mesh selects (``parity.core.mesh.algorithm``)."""
        return self.mesh.algorithm

    def ring_coordinate(self, coords: dict) -> int:
        """The combined ring index of a device at mesh ``coords`` (o·I + i in the double ring)."""
        return ring_position(coords, self.mesh_axes)[0]

    def sequence_block(self, coords: dict) -> int:
        """Which of the ring·ulysses sequence blocks (layout order) the device at ``coords`` holds."""
        return sequence_block(coords, self.mesh_axes)

    @property
    def name(self) -> str:
        heads = f"h{self.heads}kv{self.kv_heads}"
        scale = "" if self.scale is None else f"-s{self.scale:g}"
        documents = "" if self.documents == "none" else f"-docs-{self.documents}"
        window = "" if self.window is None else f"-win{self.window[0]}x{self.window[1]}"
        sinks = "-sinks" if self.sinks else ""
        softcap = "" if self.softcap is None else f"-softcap{self.softcap:g}"
        token_index = "-token-index" if self.token_index else ""
        if self.token_index and self.row_layout != "document-zigzag":
            token_index += "-" + self.row_layout
        token_index += ("-shared" if self.shared_prefix else "") + ("" if self.lse_cotangent else "-nodlse")
        return (f"{self.mesh.name}-{self.layout}-{'causal' if self.causal else 'full'}-{heads}"
                f"-d{self.head_dim}-b{self.batch}-t{self.seq}-{self.dtype}{scale}{documents}{token_index}{window}{sinks}"
                f"{softcap}")

    def to_dict(self) -> dict:
        return asdict(self) | {"name": self.name, "strategy": self.strategy}


def _factors():
    return {
        "layout": LAYOUTS, "causal": (False, True), "mesh": MESHES,
        "heads": tuple(HEAD_LAYOUTS), "head_dim": HEAD_DIMS, "dtype": MATRIX_DTYPES, "kv_exchange": KV_EXCHANGES,
    }


def _meaningful(values: dict) -> bool:
    """All-gather KV replaces ring hops: on a mesh without a ring it is the same computation;
    on a double ring it has no form of its own (one all-gather over the combined ring)."""
    return values["kv_exchange"] == "ring" or (values["mesh"][0] > 1 and len(values["mesh"]) == 2)


def _make(values: dict) -> Case:
    ring, ulysses, *outer = values["mesh"]
    heads, kv_heads = HEAD_LAYOUTS[values["heads"]]
    documents = values.get("documents", "none")
    return Case(ring=ring, ulysses=ulysses, heads=heads, kv_heads=kv_heads, head_dim=values["head_dim"],
                layout=values["layout"], causal=values["causal"], dtype=values["dtype"],
                kv_exchange=values["kv_exchange"], ring_outer=outer[0] if outer else 1, documents=documents,
                batch=1 if documents == "none" else DOCUMENT_BATCH, window=values.get("window"),
                sinks=values.get("sinks", False), softcap=values.get("softcap"))


def _combos(factors: dict) -> list[dict]:
    names = list(factors)
    return [c for c in (dict(zip(names, v)) for v in itertools.product(*factors.values())) if _meaningful(c)]


def _cover(combos: list[dict], features, required: set, chosen: list[dict]) -> list[dict]:
    """Greedy set cover: add the combination covering most still-required features until none is
    left (ties: the first in ``combos``' order, so the matrix is the same every run)."""
    uncovered = set(required) - set().union(set(), *(features(c) for c in chosen))
    while uncovered:
        best = max(combos, key=lambda c: len(features(c) & uncovered))
        if not features(best) & uncovered:
            raise ValueError(f"no combination covers {sorted(uncovered)}")
        chosen.append(best)
        uncovered -= features(best)
    return chosen


def full_matrix() -> list[Case]:
    """Every meaningful combination of the factors, for every window (none first), sinks off and
    on, and every document pattern: 1944 cases without documents, window or sinks (first), then
    1944 for each of the other 39 (window, sinks, documents) triples, 77760 in all — and the same
    77760 soft-capped (``SOFTCAP``) after them: 155520; then the token-index cases
    (``token_index_cases``: the per-document zigzag is not crossed with everything)."""
    return [_make(c | {"window": window, "sinks": sinks, "documents": documents, "softcap": softcap})
            for softcap in (None, SOFTCAP) for window in WINDOWS for sinks in (False, True)
            for documents in MATRIX_DOCUMENTS
            for c in _combos(_factors())] + token_index_cases()


def pairwise_matrix() -> list[Case]:
    """Every (layout, causal, mesh) triple once, every pair of factor values at least once, then
    the packed-document cases (``document_cases``), the window and sink cases (``window_cases``),
    the soft-capping cases (``softcap_cases``) and the token-index cases (``token_index_cases``)."""
    f = _factors()
    names = list(f)
    combos = _combos(f)

    def pairs(c):
        return {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in combos))
    chosen = []
    # First every (layout, causal, mesh) triple, each with the completion covering most new pairs.
    for layout, causal, mesh in itertools.product(f["layout"], f["causal"], f["mesh"]):
        options = [c for c in combos if (c["layout"], c["causal"], c["mesh"]) == (layout, causal, mesh)]
        best = max(options, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return ([_make(c) for c in _cover(combos, pairs, uncovered, chosen)] + document_cases() + window_cases()
            + softcap_cases() + token_index_cases())


# ---- packed documents in the default matrix ------------------------------------------------------

DOCUMENT_PATTERNS = MATRIX_DOCUMENTS[1:]  # every pattern the matrices cross but "none"
DOCUMENT_BATCH = 2  # document cases run two batch rows, each with its own documents
RING_SCHEDULES = ("ring", "ring-agkv", "double_ring")  # strategies whose K/V loop skips blocks per layout


def strategy_name(case_or_values) -> str:
    """The algorithm, with "-agkv" for all-gather KV: ring, ring-agkv, ulysses, usp, usp-agkv, ..."""
    values = case_or_values if isinstance(case_or_values, dict) else {
        "mesh": (case_or_values.ring, case_or_values.ulysses, case_or_values.ring_outer),
        "kv_exchange": case_or_values.kv_exchange}
    ring, ulysses, *outer = values["mesh"]
    mesh = MeshShape(ring=ring, ulysses=ulysses, ring_outer=outer[0] if outer else 1, kv_exchange=values["kv_exchange"])
    return mesh.algorithm + ("-agkv" if values["kv_exchange"] == "allgather" else "")


def _document_features(c: dict) -> set:
    strategy = strategy_name(c)
    out = {("documents", c["documents"], factor, c[factor]) for factor in ("layout", "causal", "dtype", "heads")}
    if c["causal"]:  # the schedule's causal blocks (and skips) meet the documents' in every strategy
        out.add(("strategy", strategy))
    if strategy in RING_SCHEDULES:
        out |= {("strategy", strategy, "layout", c["layout"]), ("strategy", strategy, "causal", c["causal"]),
                ("block loop", "layout", c["layout"], "causal", c["causal"]),
                ("block loop", "documents", c["documents"], "causal", c["causal"])}
    if strategy == "ring" and c["causal"]:
        out.add(("ring", c["mesh"][0]))
    if strategy in RING_SCHEDULES and c["causal"] and c["mesh"][0] >= 4:  # documents across several shards
        out.add(("long ring", "documents", c["documents"]))
    return out


def document_cases() -> list[Case]:
    """The packed-document cases of the default matrix (15, greedy cover of these features): every
    pattern meets every layout, causal and non-causal, float32 and bfloat16, every head layout,
    and a causal K/V ring of R >= 4 (documents across several shards); the strategies whose K/V
    loop decides per block (ring, all-gather KV, double ring) meet every layout, causal and not,
    and every (layout, causal) pair; every strategy (Ulysses, USP, USP with all-gather KV and
    double-ring USP included) runs causally at least once; the causal ring at R = 1, 2, 4 and 8.
    Each case has two batch rows with documents of their own."""
    combos = _combos(_factors() | {"documents": DOCUMENT_PATTERNS})
    required = set().union(*(_document_features(c) for c in combos))
    return [_make(c) for c in _cover(combos, _document_features, required, [])]


# ---- sliding windows and attention sinks in the default matrix -----------------------------------

def _window_features(c: dict) -> set:
    strategy, window = strategy_name(c), c["window"]
    out = set()
    if c["sinks"]:
        out |= {("sinks", "window", window is not None), ("sinks", "strategy", strategy),
                ("sinks", "causal", c["causal"]), ("sinks", "dtype", c["dtype"]), ("sinks", "heads", c["heads"]),
                ("sinks", "documents", c["documents"] != "none")}
    if window is None:
        return out
    out |= {("window", window, "causal", c["causal"]), ("window", window, "layout", c["layout"]),
            ("window", "strategy", strategy), ("window", "layout", c["layout"], "causal", c["causal"]),
            ("window", "dtype", c["dtype"]), ("window", "sinks", c["sinks"]),
            ("window", "documents", c["documents"] != "none")}
    if strategy in RING_SCHEDULES:  # the K/V loops that skip, window or cover each block
        out |= {("window", "strategy", strategy, "layout", c["layout"]),
                ("window", "strategy", strategy, "causal", c["causal"])}
        if c["layout"] == "contiguous" and c["causal"]:  # where a window truncates the ring's hops (issue 26)
            out.add(("window", "strategy", strategy, "contiguous causal"))
        if c["mesh"][0] >= 4:  # shards of 16 tokens or fewer: SMALL inside or next door, WIDE across two
            out.add(("window", window, "long ring"))
        if c["mesh"][0] == 8 and window == WIDE_WINDOW:  # shards of 8 tokens: WIDE reaches three shards back
            out.add(("window", window, "ring of 8"))
    return out


def window_cases() -> list[Case]:
    """The window and sink cases of the default matrix (14: a cover of these features): each
    window (small, wide, beyond the sequence) runs causal and not, in every layout, and on a K/V
    ring of R >= 4 (small inside a shard or next door, wide across two shards; wide across three
    at R = 8); every strategy (ring, all-gather KV, Ulysses, USP, USP with all-gather KV, double
    ring, double-ring USP) meets a window, and the strategies whose K/V loop decides per block
    (ring, all-gather KV, double ring) meet it in every layout, causal and not, and causally in
    the contiguous layout (where a window truncates the ring); every (layout, causal) pair has a
    window; windows run with and without sinks, with packed documents, float32 and bf16. Sinks run
    in every strategy, with and without a window, with and without documents, causal and not,
    float32 and bf16 (dsinks against the dense control's), MHA, GQA and MQA. Documents are drawn
    only as "mix" here (every pattern meets windows and sinks in the cross product). No case runs
    on one device (no block loop)."""
    return [_make(c) for c in _window_cover()]


@functools.cache
def _window_cover() -> tuple[dict, ...]:
    """A greedy cover of ``_window_features`` (ties: fewer devices, then more features), then
    pairs of chosen cases merged into one combination wherever one covers what only those two
    did (greedy alone needs 15). Cached: about a second."""
    combos = [c | {"window": w, "sinks": s, "documents": d}
              for c in _combos(_factors()) for w in WINDOWS for s in (False, True) for d in ("none", "mix")
              if (w is not None or s) and c["mesh"] != (1, 1)]
    features = [frozenset(_window_features(c)) for c in combos]
    devices = [math.prod(c["mesh"]) for c in combos]
    uncovered, chosen = set().union(*features), []
    while uncovered:
        best = max(range(len(combos)), key=lambda i: (len(features[i] & uncovered), -devices[i], len(features[i])))
        chosen.append(best)
        uncovered -= features[best]
    merged = True
    while merged:
        merged = False
        for a, b in itertools.combinations(chosen, 2):
            need = (features[a] | features[b]) - set().union(*(features[j] for j in chosen if j not in (a, b)))
            options = [i for i in range(len(combos)) if need <= features[i]]
            if options:
                chosen = [j for j in chosen if j not in (a, b)] + [min(options, key=lambda i: devices[i])]
                merged = True
                break
    return tuple(combos[i] for i in chosen)


# ---- logit soft-capping in the default matrix ---------------------------------------------------

# The two the default report and test tier sample (parity.cli's _sample_key: the first capped case
# without and with Ulysses), then a cover of the rest. A: a ring of 4, zigzag halves, causal, GQA,
# bf16, with a window, sinks (not capped) and packed documents — every run-time mask meets the cap;
# B: USP 2 x 2, stripe, not causal, MQA replicated over Ulysses, float32 (held to 1e-5).
_SOFTCAP_SAMPLED = (
    {"layout": "zigzag", "causal": True, "mesh": (4, 1), "heads": "gqa", "head_dim": 16, "dtype": "bfloat16",
     "kv_exchange": "ring", "window": SMALL_WINDOW, "sinks": True, "documents": "mix", "softcap": SOFTCAP},
    {"layout": "stripe", "causal": False, "mesh": (2, 2), "heads": "mqa", "head_dim": 40, "dtype": "float32",
     "kv_exchange": "ring", "window": None, "sinks": False, "documents": "none", "softcap": SOFTCAP},
)


def _softcap_features(c: dict) -> set:
    return {("strategy", strategy_name(c)), ("causal", c["causal"]), ("dtype", c["dtype"]), ("layout", c["layout"]),
            ("heads", c["heads"]), ("window", c["window"] is not None), ("sinks", c["sinks"]),
            ("documents", c["documents"] != "none")}


@functools.cache
def _softcap_cover() -> tuple[dict, ...]:
    combos = [c | {"window": w, "sinks": s, "documents": d, "softcap": SOFTCAP}
              for c in _combos(_factors()) for w in (None, SMALL_WINDOW) for s in (False, True) for d in ("none", "mix")
              if c["mesh"] != (1, 1)]
    # ties go to the first: causal, windowed, with sinks, on few devices (the cap meets the most masks)
    combos.sort(key=lambda c: (not c["causal"], c["window"] is None, not c["sinks"], math.prod(c["mesh"])))
    required = set().union(*(_softcap_features(c) for c in combos))
    return tuple(_cover(combos, _softcap_features, required, list(_SOFTCAP_SAMPLED)))


def softcap_cases() -> list[Case]:
    """The soft-capping cases of the all-pairs matrix (last in it): every strategy (ring,
    all-gather KV, Ulysses, USP, USP with all-gather KV, double ring, double-ring USP) runs capped,
    causal and not, in every layout, float32 and bf16, MHA, GQA and MQA, with and without a
    window, sinks and packed documents. The first two (``_SOFTCAP_SAMPLED``) are the ones the
    default report and test tier run; ``--masks all`` / ``--full`` run them all. No case runs on
    one device (no block loop)."""
    return [_make(c) for c in _softcap_cover()]


# ---- explicit token indices (the per-document zigzag) in the default matrix ---------------------

def token_index_cases() -> list[Case]:
    """Packed documents laid out by the per-document zigzag and passed as explicit token indices
    (``Case.token_index``; last in the all-pairs matrix and the cross product). The first two are
    the ones the default report and test tier run (``parity.cli``'s ``_sample_key``): a causal ring
    of 4 in float32 with GQA (long-tailed documents, the static name "contiguous": the layout's own
    positions would truncate nothing but mean nothing) and a causal USP 2 × 2 in bf16 with MQA
    replicated over Ulysses (interleaved documents: an id that comes back is another document of
    the layout), "zigzag", laid out by the per-document hybrid (``Case.row_layout``). ``--masks
    all`` / ``--full`` add: all-gather KV on the stripe name with a
    window and singleton documents (each of 2R tokens); the double-ring USP with one document per
    row and sinks; a non-causal ring of 8 with the wide window (the window alone reads the indices).
    Each runs two batch rows with documents of their own (drawn in units of 2R tokens)."""
    return [
        Case(ring=4, heads=8, kv_heads=2, layout="contiguous", causal=True, documents="mix", batch=DOCUMENT_BATCH,
             token_index=True),
        Case(ring=2, ulysses=2, heads=8, kv_heads=1, head_dim=40, layout="zigzag", causal=True, dtype="bfloat16",
             documents="interleaved", batch=DOCUMENT_BATCH, token_index=True, row_layout="document-hybrid"),
        Case(ring=4, layout="stripe", causal=True, kv_exchange="allgather", documents="singletons",
             batch=DOCUMENT_BATCH, window=SMALL_WINDOW, token_index=True),
        Case(ring=4, ring_outer=2, ulysses=2, heads=8, kv_heads=2, layout="zigzag", causal=True, dtype="bfloat16",
             documents="one", batch=DOCUMENT_BATCH, sinks=True, token_index=True),
        Case(ring=8, heads=8, kv_heads=8, head_dim=64, layout="contiguous", causal=False, documents="mix",
             batch=DOCUMENT_BATCH, window=WIDE_WINDOW, token_index=True),
    ]
