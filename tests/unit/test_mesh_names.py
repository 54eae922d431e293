"""One mesh vocabulary: parity.core's names round-trip, and the algorithm a case's MeshShape
names is the one seqplan's validation (which both implementations call) picks for every mesh of
the case matrix and the property tier."""

from __future__ import annotations

import dataclasses

import pytest

from parity.core import names
from parity.core.cases import MESHES, Case, pairwise_matrix
from parity.core.mesh import MeshShape, algorithm
from parity.core.names import KV_EXCHANGES
from seqplan import axes, schedule, validation
from seqplan.validation import validate

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
def test_mesh_names_the_algorithm_validation_picks(data, ring, ulysses, ring_outer):
    """MeshShape's algorithm (which names cases and benchmark rows) == what seqplan's public
    validate decides for the same mesh on valid shapes (the decision both implementations run)."""
    mesh = MeshShape(data, ring, ulysses, ring_outer)
    shape = (2 * data, 64, 8, 16)
    got = validate(shape, shape, shape, ("float32",) * 3, mesh.axes, layout="zigzag", kv_exchange="ring", scale=None)
    assert got.algorithm == mesh.algorithm == algorithm(mesh.axes), mesh.name


def test_the_vocabulary_has_one_definition():
    """parity.core.names re-exports seqplan's tuples (the same objects), not copies."""
    assert names.LAYOUTS is schedule.LAYOUTS and names.DTYPES is validation.DTYPES
    assert names.KV_EXCHANGES is validation.KV_EXCHANGES and names.AXES is axes.CANONICAL_ORDER


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
