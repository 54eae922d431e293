"""One way to describe and name a sequence-parallel mesh, and the one function that says which
algorithm a mesh selects (parity cases and benchmarks both use it; the decision itself is seqplan's).

A mesh is named ``<algorithm>[-agkv]-<axes>``, axes abbreviated and joined by ``x`` in canonical
order: ``ring-r4``, ``ulysses-u4``, ``usp-r2xu2``, ``double_ring-ro2xri2``,
``double_ring_usp-ro2xri2xu2``, ``ring-agkv-r4`` (all-gather KV), ``usp-d2xr2xu2`` (with a data
axis), ``ring-r1`` (one device). A case's name starts with its mesh's name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from seqplan.validation import algorithm_of

from .names import AXES, AXIS_ABBREVIATIONS, KV_EXCHANGES, Algorithm, KvExchange, check_choice


def algorithm(axes: Iterable[str]) -> Algorithm:
    """The algorithm a mesh with these axis names runs — the one decision both implementations'
    validation makes (``seqplan.validation.algorithm_of``)."""
    return algorithm_of(set(axes))


@dataclass(frozen=True)
class MeshShape:
    """Mesh axis sizes. ``ring`` is the combined ring; ``ring_outer > 1`` lays it out as the
    double ring ``ring_outer x ring // ring_outer`` (both of size >= 2, KV exchange "ring")."""

    data: int = 1
    ring: int = 1
    ulysses: int = 1
    ring_outer: int = 1
    kv_exchange: KvExchange = "ring"

    def __post_init__(self):
        for field in ("data", "ring", "ulysses", "ring_outer"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        check_choice("kv_exchange", self.kv_exchange, KV_EXCHANGES)
        if self.ring_outer > 1:
            if self.ring % self.ring_outer or self.ring // self.ring_outer < 2:
                raise ValueError(f"the double ring needs ring = ring_outer x ring_inner with ring_inner >= 2, "
                                 f"got ring={self.ring}, ring_outer={self.ring_outer}")
            if self.kv_exchange != "ring":
                raise ValueError("kv_exchange='allgather' has no double-ring form (ring_outer must be 1)")

    @property
    def axes(self) -> dict[str, int]:
        """Axis name -> size in canonical order; an axis of size 1 is left out, except that a mesh
        always has at least the ring axis (the double ring: always both of its axes)."""
        sizes = {"data": self.data, "ulysses": self.ulysses}
        if self.ring_outer > 1:
            sizes |= {"ring_outer": self.ring_outer, "ring_inner": self.ring // self.ring_outer}
        else:
            sizes["ring"] = self.ring
        axes = {a: sizes[a] for a in AXES if a in sizes and (sizes[a] > 1 or a.startswith("ring_"))}
        return axes or {"ring": 1}

    @property
    def algorithm(self) -> Algorithm:
        return algorithm(self.axes)

    @property
    def devices(self) -> int:
        return self.data * self.ring * self.ulysses

    @property
    def name(self) -> str:
        sizes = "x".join(f"{AXIS_ABBREVIATIONS[a]}{n}" for a, n in self.axes.items())
        return f"{self.algorithm}{'-agkv' if self.kv_exchange == 'allgather' else ''}-{sizes}"

    @classmethod
    def from_axes(cls, axes: dict[str, int], kv_exchange: KvExchange = "ring") -> MeshShape:
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {AXES}")
        if ("ring_outer" in axes) != ("ring_inner" in axes) or ("ring" in axes and "ring_outer" in axes):
            raise ValueError(f"a mesh has either 'ring' or both 'ring_outer' and 'ring_inner', got {sorted(axes)}")
        ring = axes.get("ring", 1) * axes.get("ring_outer", 1) * axes.get("ring_inner", 1)
        return cls(data=axes.get("data", 1), ring=ring, ulysses=axes.get("ulysses", 1),
                   ring_outer=axes.get("ring_outer", 1), kv_exchange=kv_exchange)

    @classmethod
    def from_name(cls, name: str) -> MeshShape:
        """Parse a name written by ``name`` (the inverse: ``from_name(m.name) == m``)."""
        m = _NAME.fullmatch(name)
        if not m:
            raise ValueError(f"mesh name {name!r} is not <algorithm>[-agkv]-<axes> (e.g. usp-r2xu2, ring-agkv-r4)")
        by_abbreviation = {v: k for k, v in AXIS_ABBREVIATIONS.items()}
        axes = {}
        for token in m.group("axes").split("x"):
            abbreviation, size = re.fullmatch(r"([a-z]+)(\d+)", token).groups()
            if abbreviation not in by_abbreviation:
                raise ValueError(f"unknown axis {abbreviation!r} in mesh name {name!r}; known: {sorted(by_abbreviation)}")
            axes[by_abbreviation[abbreviation]] = int(size)
        mesh = cls.from_axes(axes, "allgather" if m.group("agkv") else "ring")
        if mesh.name != name:
            raise ValueError(f"mesh name {name!r} is not canonical: these axes are named {mesh.name!r}")
        return mesh


_NAME = re.compile(r"(?P<algorithm>[a-z_]+?)(?P<agkv>-agkv)?-(?P<axes>[a-z]+\d+(?:x[a-z]+\d+)*)")


def ring_position(coords: dict, sizes: dict) -> tuple[int, int]:
    """(index, size) of a device in the combined ring of a mesh with axis ``sizes``: its "ring"
    coordinate, or the double ring's o·I + i."""
    inner = sizes.get("ring_inner", 1)
    index = coords.get("ring", 0) + coords.get("ring_outer", 0) * inner + coords.get("ring_inner", 0)
    return index, sizes.get("ring", 1) * sizes.get("ring_outer", 1) * inner


def sequence_block(coords: dict, sizes: dict) -> int:
    """Which of the ring·Ulysses sequence blocks (layout order) the device at mesh ``coords``
    holds: r·U + u, r its combined ring index (:func:`ring_position`)."""
    return ring_position(coords, sizes)[0] * sizes.get("ulysses", 1) + coords.get("ulysses", 0)
