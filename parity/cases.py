"""The case matrix: one ``Case`` per (mesh, shapes, layout, causal, dtype, ...) combination.

``full_matrix()`` is the cross product the issue asks for; ``pairwise_matrix()`` keeps every
(layout, causal, mesh) triple and then just enough cases that every *pair* of factor values
appears together at least once (greedy all-pairs), which is how the default test run stays fast
while still meeting every mesh shape with every layout, head layout, head_dim and dtype.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

LAYOUTS = ("contiguous", "zigzag", "stripe")
# (ring, ulysses) shapes: pure ring, pure Ulysses, and USP, 1-8 devices; (ring, ulysses,
# ring_outer): the double ring, ring_outer x (ring / ring_outer) inner, alone and under Ulysses.
MESHES = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (4, 1, 2), (4, 2, 2))
AXIS_ABBREVIATIONS = {"data": "d", "ring": "r", "ring_outer": "ro", "ring_inner": "ri", "ulysses": "u"}
HEAD_LAYOUTS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}  # name -> (heads, kv_heads)
HEAD_DIMS = (16, 40, 64)
DTYPES = ("float32", "bfloat16")
KV_EXCHANGES = ("ring", "allgather")  # ring hops, or one all-gather of K/V (jax_impl/allgather.py)


def ring_position(coords: dict, sizes: dict) -> tuple[int, int]:
    """(index, size) of a device in the combined ring of a mesh with axis ``sizes``: its "ring"
    coordinate, or the double ring's o·I + i."""
    inner = sizes.get("ring_inner", 1)
    index = coords.get("ring", 0) + coords.get("ring_outer", 0) * inner + coords.get("ring_inner", 0)
    return index, sizes.get("ring", 1) * sizes.get("ring_outer", 1) * inner


@dataclass(frozen=True)
class Case:
    """One parity case. Sizes are global; ``ring``/``ulysses``/``data`` are mesh-axis sizes;
    ``ring_outer > 1`` lays the ring of ``ring`` devices out as the double ring
    ``ring_outer x ring // ring_outer``."""

    ring: int = 1
    ulysses: int = 1
    data: int = 1
    batch: int = 1
    seq: int = 64
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 16
    layout: str = "zigzag"
    causal: bool = True
    dtype: str = "float32"
    scale: float | None = None
    kv_exchange: str = "ring"
    ring_outer: int = 1

    @property
    def devices(self) -> int:
        return self.ring * self.ulysses * self.data

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Mesh axis name -> size in canonical order; an axis of size 1 is left out, except that a
        mesh always has at least the ring axis (the double ring: always both of its axes)."""
        rings = ((("ring_outer", self.ring_outer), ("ring_inner", self.ring // self.ring_outer)) if self.ring_outer > 1
                 else (("ring", self.ring),))
        axes = {name: size for name, size in (("data", self.data), *rings, ("ulysses", self.ulysses))
                if size > 1 or name.startswith("ring_")}
        return axes or {"ring": 1}

    @property
    def strategy(self) -> str:
        axes = self.mesh_axes
        if "ring_outer" in axes:
            return "double_ring_usp" if "ulysses" in axes else "double_ring"
        if "ring" in axes and "ulysses" in axes:
            return "usp"
        return "ulysses" if "ulysses" in axes else "ring"

    def ring_coordinate(self, coords: dict) -> int:
        """The combined ring index of a device at mesh ``coords`` (o·I + i in the double ring)."""
        return ring_position(coords, self.mesh_axes)[0]

    @property
    def name(self) -> str:
        heads = f"h{self.heads}kv{self.kv_heads}"
        mesh = "x".join(f"{AXIS_ABBREVIATIONS[a]}{n}" for a, n in self.mesh_axes.items())
        scale = "" if self.scale is None else f"-s{self.scale:g}"
        exchange = "-agkv" if self.kv_exchange == "allgather" else ""  # all-gather KV instead of ring hops
        return (f"{self.strategy}{exchange}-{mesh}-{self.layout}-{'causal' if self.causal else 'full'}-{heads}"
                f"-d{self.head_dim}-b{self.batch}-t{self.seq}-{self.dtype}{scale}")

    def to_dict(self) -> dict:
        return asdict(self) | {"name": self.name, "strategy": self.strategy}


def _factors():
    return {
        "layout": LAYOUTS, "causal": (False, True), "mesh": MESHES,
        "heads": tuple(HEAD_LAYOUTS), "head_dim": HEAD_DIMS, "dtype": DTYPES, "kv_exchange": KV_EXCHANGES,
    }


def _meaningful(values: dict) -> bool:
    """All-gather KV replaces ring hops: on a mesh without a ring it is the same computation;
    on a double ring it has no form of its own (one all-gather over the combined ring)."""
    return values["kv_exchange"] == "ring" or (values["mesh"][0] > 1 and len(values["mesh"]) == 2)


def _make(values: dict) -> Case:
    ring, ulysses, *outer = values["mesh"]
    heads, kv_heads = HEAD_LAYOUTS[values["heads"]]
    return Case(ring=ring, ulysses=ulysses, heads=heads, kv_heads=kv_heads, head_dim=values["head_dim"],
                layout=values["layout"], causal=values["causal"], dtype=values["dtype"],
                kv_exchange=values["kv_exchange"], ring_outer=outer[0] if outer else 1)


def full_matrix() -> list[Case]:
    """Every meaningful combination of the factors (1944 cases)."""
    f = _factors()
    combos = (dict(zip(f, combo)) for combo in itertools.product(*f.values()))
    return [_make(c) for c in combos if _meaningful(c)]


def pairwise_matrix() -> list[Case]:
    """Every (layout, causal, mesh) triple once, every pair of factor values at least once."""
    f = _factors()
    names = list(f)
    combos = [c for c in (dict(zip(names, v)) for v in itertools.product(*f.values())) if _meaningful(c)]

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
    while uncovered:  # then greedy all-pairs for whatever is left
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return [_make(c) for c in chosen]
