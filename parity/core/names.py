"""The harness's vocabulary, defined once: layouts, dtypes, KV exchanges, document patterns, mesh axes and the
algorithms a mesh selects (``Literal`` types for annotations, tuples for validation).

jax_impl and torch_impl keep their own copies (they may not import parity); tests assert that
every copy equals these."""

from __future__ import annotations

from typing import Literal, get_args

Layout = Literal["contiguous", "zigzag", "stripe"]
Dtype = Literal["float32", "bfloat16", "float16"]
KvExchange = Literal["ring", "allgather"]  # ring hops, or one all-gather of K/V
Algorithm = Literal["local", "ring", "ulysses", "usp", "double_ring", "double_ring_usp"]
Device = Literal["cpu", "gpu"]  # where a command runs: simulated CPU devices / gloo, or GPUs / NCCL
# Packed documents (segment_ids) of a parity case, drawn by parity.core.documents: none (no ids),
# a long-tailed mix, one document, every token its own, non-contiguous runs reusing earlier ids.
Documents = Literal["none", "mix", "one", "singletons", "interleaved"]

LAYOUTS: tuple[str, ...] = get_args(Layout)
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_EXCHANGES: tuple[str, ...] = get_args(KvExchange)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
DEVICES: tuple[str, ...] = get_args(Device)
DOCUMENTS: tuple[str, ...] = get_args(Documents)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DEVICES: Device = "cpu"  # the one default of every command's --devices

# Mesh axis names (docs/contract.md) in canonical order: ulysses fastest-varying, so a Ulysses group is
# consecutive ranks. The double ring replaces "ring" by ring_outer x ring_inner.
AXES = ("data", "ring", "ring_outer", "ring_inner", "ulysses")
AXIS_ABBREVIATIONS = {"data": "d", "ring": "r", "ring_outer": "ro", "ring_inner": "ri", "ulysses": "u"}


def check_choice(name: str, value, allowed: tuple) -> None:
    """ValueError naming the field and its allowed values unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
