"""Mesh axis names (docs/contract.md): the mesh's axis names choose the algorithm."""

DATA = "data"  # shards the batch
RING = "ring"  # K/V travel around this axis
ULYSSES = "ulysses"  # all-to-all heads <-> sequence inside this axis
RING_OUTER = "ring_outer"  # double ring (LoongTrain): outer ring, across nodes
RING_INNER = "ring_inner"  # double ring: inner ring, inside a node

KNOWN_AXES = (DATA, RING, RING_OUTER, RING_INNER, ULYSSES)
# Canonical order; ulysses is fastest-varying so a Ulysses group is consecutive ranks.
CANONICAL_ORDER = (DATA, RING, RING_OUTER, RING_INNER, ULYSSES)
