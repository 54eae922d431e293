"""One mesh vocabulary: parity.core's names round-trip, its algorithm-by-mesh decision equals
jax_impl's and torch_impl's for every mesh of the case matrix and the property tier, and the
vocabulary copies the implementations keep equal parity.core's."""

from __future__ import annotations

import dataclasses

import pytest

from parity.core.cases import MESHES, Case, pairwise_matrix
from parity.core.mesh import MeshShape, algorithm
from parity.core.names import DTYPES, KV_EXCHANGES, LAYOUTS

# (data, ring, ulysses, ring_outer): the matrix's meshes, with and without a data axis
ALL_MESHES = sorted({(d, m[0], m[1], m[2] if len(m) == 3 else 1) for m in MESHES for d in (1, 2)}
                    | {(8, 1, 1, 1), (2, 2, 2, 1), (1, 8, 1, 4), (1, 8, 1, 2)})


@pytest.mark.parametrize("data, ring, ulysses, ring_outer, kv_exchange",
                         [(*m, kv) for m in ALL_MESHES for kv in KV_EXCHANGES if kv == "ring" or m[3] == 1])
def test_names_round_trip(data, ring, ulysses, ring_outer, kv_exchange):
    mesh = MeshShape(data, ring, ulysses, ring_outer, kv_exchange)
    assert MeshShape.from_name(mesh.name) == mesh
    assert Case(ring=ring, ulysses=ulysses, data=data, batch=data, ring_outer=ring_outer,
                kv_exchange=kv_exchange).name.startswith(mesh.name + "-")


def test_known_names():
    assert MeshShape(ring=2, ulysses=2).name == "usp-r2xu2"
    assert MeshShape(ring=4, ring_outer=2).name == "double_ring-ro2xri2"
    assert MeshShape(ring=4, kv_exchange="allgather").name == "ring-agkv-r4"
    assert MeshShape(data=8).name == "local-d8" and MeshShape().name == "ring-r1"
    with pytest.raises(ValueError, match="not canonical"):
        MeshShape.from_name("ring-r2xu2")  # axes r2, u2 select usp
    with pytest.raises(ValueError, match="unknown axis"):
        MeshShape.from_name("ring-q4")


@pytest.mark.parametrize("data, ring, ulysses, ring_outer", ALL_MESHES)
def test_algorithm_matches_both_implementations(data, ring, ulysses, ring_outer):
    """parity.core.mesh.algorithm == the algorithm jax_impl's and torch_impl's validation
    choose for the same mesh (through their public validate, on valid shapes)."""
    mesh = MeshShape(data, ring, ulysses, ring_outer)
    shape = (2 * data, 64, 8, 16)
    for impl in ("jax_impl", "torch_impl"):
        validation = pytest.importorskip(f"{impl}.validation")
        got = validation.validate(shape, shape, shape, ("float32",) * 3, mesh.axes, layout="zigzag",
                                  kv_exchange="ring", scale=None)
        assert got.algorithm == mesh.algorithm == algorithm(mesh.axes), (impl, mesh.name)


def test_implementation_vocabularies_equal_the_core():
    for impl in ("jax_impl", "torch_impl"):
        validation = pytest.importorskip(f"{impl}.validation")
        layouts = pytest.importorskip(f"{impl}.layouts")
        assert tuple(layouts.LAYOUTS) == LAYOUTS and tuple(validation.DTYPES) == DTYPES
        assert tuple(validation.KV_EXCHANGES) == KV_EXCHANGES


def test_every_matrix_mesh_is_covered():
    assert {c.mesh.name for c in pairwise_matrix()} >= {MeshShape(ring=m[0], ulysses=m[1],
                                                                  ring_outer=m[2] if len(m) == 3 else 1).name
                                                        for m in MESHES}


@pytest.mark.parametrize("change, message", [
    ({"layout": "diagonal"}, "layout must be one of"), ({"dtype": "float64"}, "dtype must be one of"),
    ({"kv_exchange": "broadcast"}, "kv_exchange must be one of"), ({"heads": 8, "kv_heads": 3}, "heads % kv_heads"),
    ({"ring": 4, "ring_outer": 4}, "ring_inner >= 2"), ({"ring": 4, "ring_outer": 2, "kv_exchange": "allgather"},
                                                       "no double-ring form"),
    ({"data": 2, "batch": 3}, "batch % data"), ({"scale": -1.0}, "scale must be"), ({"seq": 0}, "seq must be"),
])
def test_invalid_cases_are_refused_at_construction(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(Case(), **change)
