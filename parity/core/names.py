"""The harness's vocabulary: layouts, dtypes, KV exchanges and the algorithms a mesh selects come
from ``seqplan`` (the plan both implementations share: one definition); the harness's own words —
document patterns, where a command runs, mesh-name abbreviations — are defined here
(``Literal`` types for annotations, tuples for validation)."""

from __future__ import annotations

from typing import Literal, get_args

from seqplan.axes import CANONICAL_ORDER
from seqplan.schedule import LAYOUTS, Layout
from seqplan.validation import ALGORITHMS, DTYPES, KV_EXCHANGES, Algorithm, Dtype, KvExchange

__all__ = ["ALGORITHMS", "AXES", "AXIS_ABBREVIATIONS", "DEFAULT_DEVICES", "DEVICES", "DOCUMENTS", "DTYPES",
           "DTYPE_BYTES", "KV_EXCHANGES", "LAYOUTS", "Algorithm", "Device", "Documents", "Dtype", "KvExchange",
           "Layout", "check_choice"]

Device = Literal["cpu", "gpu"]  # where a command runs: simulated CPU devices / gloo, or GPUs / NCCL
# Packed documents (segment_ids) of a parity case, drawn by parity.core.documents: none (no ids),
# a long-tailed mix, one document, every token its own, non-contiguous runs reusing earlier ids;
# "short": many short documents around one long one (the benchmark's short balance mix, reduced) —
# outside the case matrices (MATRIX_DOCUMENTS), the shared-prefix verification's pattern.
Documents = Literal["none", "mix", "one", "singletons", "interleaved", "short"]

DEVICES: tuple[str, ...] = get_args(Device)
DOCUMENTS: tuple[str, ...] = get_args(Documents)
MATRIX_DOCUMENTS: tuple[str, ...] = DOCUMENTS[:-1]  # the patterns the case matrices cross
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DEVICES: Device = "cpu"  # the one default of every command's --devices

# Mesh axis names (docs/contract.md) in canonical order: ulysses fastest-varying, so a Ulysses group is
# consecutive ranks. The double ring replaces "ring" by ring_outer x ring_inner.
AXES = CANONICAL_ORDER
AXIS_ABBREVIATIONS = {"data": "d", "ring": "r", "ring_outer": "ro", "ring_inner": "ri", "ulysses": "u"}


def check_choice(name: str, value, allowed: tuple) -> None:
    """ValueError naming the field and its allowed values unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
