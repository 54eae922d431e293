"""The case matrix: one ``Case`` per (mesh, shapes, layout, causal, dtype, ...) combination.

``full_matrix()`` is the cross product the issue asks for; ``pairwise_matrix()`` keeps every
(layout, causal, mesh) triple and then just enough cases that every *pair* of factor values
appears together at least once (greedy all-pairs), which is how the default test run stays fast
while still meeting every mesh shape with every layout, head layout, head_dim and dtype.

Packed documents (``Case.documents``, default "none": no segment ids) are one more factor: the
cross product runs every pattern with everything; the default matrix adds a few cases
(``document_cases``) so that the patterns meet every layout, causal mode and strategy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from functools import cached_property

from .mesh import MeshShape, ring_position
from .names import DOCUMENTS, DTYPES, KV_EXCHANGES, LAYOUTS, Documents, Dtype, KvExchange, Layout, check_choice

# (ring, ulysses) shapes: pure ring, pure Ulysses, and USP, 1-8 devices; (ring, ulysses,
# ring_outer): the double ring, ring_outer x (ring / ring_outer) inner, alone and under Ulysses.
MESHES = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (4, 1, 2), (4, 2, 2))
HEAD_LAYOUTS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}  # name -> (heads, kv_heads)
HEAD_DIMS = (16, 40, 64)
MATRIX_DTYPES = ("float32", "bfloat16")  # float16 is drawn by the property tier (tests/property)
__all__ = ["Case", "MESHES", "HEAD_LAYOUTS", "HEAD_DIMS", "MATRIX_DTYPES", "LAYOUTS", "KV_EXCHANGES",
           "DOCUMENTS", "DOCUMENT_PATTERNS", "ring_position", "full_matrix", "pairwise_matrix", "document_cases",
           "strategy_name"]


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
        if self.window is not None and not (
                isinstance(self.window, tuple) and len(self.window) == 2
                and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.window)):
            raise ValueError(f"window must be None or a (left, right) tuple of non-negative ints, got {self.window!r}")
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
        return self.ring_coordinate(coords) * self.ulysses + coords.get("ulysses", 0)

    @property
    def name(self) -> str:
        heads = f"h{self.heads}kv{self.kv_heads}"
        scale = "" if self.scale is None else f"-s{self.scale:g}"
        documents = "" if self.documents == "none" else f"-docs-{self.documents}"
        window = "" if self.window is None else f"-win{self.window[0]}x{self.window[1]}"
        sinks = "-sinks" if self.sinks else ""
        return (f"{self.mesh.name}-{self.layout}-{'causal' if self.causal else 'full'}-{heads}"
                f"-d{self.head_dim}-b{self.batch}-t{self.seq}-{self.dtype}{scale}{documents}{window}{sinks}")

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
                batch=1 if documents == "none" else DOCUMENT_BATCH)


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
    """Every meaningful combination of the factors, for every document pattern: 1944 cases
    without packed documents (first) and 1944 for each of the four patterns, 9720 in all."""
    return [_make(c | {"documents": documents}) for documents in DOCUMENTS for c in _combos(_factors())]


def pairwise_matrix() -> list[Case]:
    """Every (layout, causal, mesh) triple once, every pair of factor values at least once, then
    the packed-document cases (``document_cases``)."""
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
    return [_make(c) for c in _cover(combos, pairs, uncovered, chosen)] + document_cases()


# ---- packed documents in the default matrix ------------------------------------------------------

DOCUMENT_PATTERNS = DOCUMENTS[1:]  # every pattern but "none"
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
