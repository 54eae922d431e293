"""``sequence_parallel_attention`` on this rank's local shards and a ``DeviceMesh``.

The mesh's ``mesh_dim_names`` choose the algorithm (docs/contract.md): ``"ring"`` -> ring attention,
``"ulysses"`` -> Ulysses, both -> USP, ``"ring_outer"`` + ``"ring_inner"`` -> the double ring
(with ``"ulysses"``: double-ring USP), ``"data"`` shards the batch. The rank at ring coordinate
r (o·I + i in the double ring) and Ulysses coordinate u holds sequence block r*U + u (layout
order) of its batch shard:

    q: [b/D, t/(R·U), h, d]   k, v: [b/D, t/(R·U), hk, d]   ->   o like q, lse: [b/D, h, t/(R·U)]

Validation runs on shapes alone, identically on every rank, before any collective. Ranks that
pass *different* local shapes, dtypes or options are caught only with ``check_ranks=True`` (by
default ``RINGBRIDGE_CHECK_RANKS=1``: one small all-reduce per mesh dimension, before validation
and before any attention collective); see ``comm.check_ranks_agree`` for what goes unnoticed
without it.
"""

from __future__ import annotations

import struct
from functools import partial

from .axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from .block import get_backend
from .comm import check_ranks_agree
from .config import default_check_ranks, default_deterministic
from .double_ring import double_ring_attention
from .layouts import LAYOUTS
from .ulysses import ulysses_attention
from .usp import KV_EXCHANGE, usp_attention
from .validation import DTYPES, KV_EXCHANGES, Decomposition, dtype_name, validate


def _code(value, known: tuple) -> int:
    return known.index(value) if value in known else -1


def _signature(q, k, v, *, causal, layout, scale, kv_exchange, return_lse) -> dict:
    """What every rank must agree on, as small ints (names by their index in validation's and the
    layouts' tuples, scale by its float64 bit pattern)."""
    dtypes = tuple(_code(dtype_name(x.dtype), DTYPES) for x in (q, k, v))
    scale_bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    options = (int(bool(causal)), _code(layout, LAYOUTS), _code(kv_exchange, KV_EXCHANGES), int(bool(return_lse)))
    return {"q shape": tuple(q.shape), "k shape": tuple(k.shape), "v shape": tuple(v.shape),
            f"dtypes (index in {DTYPES})": dtypes, "causal, layout, kv_exchange, return_lse": options,
            "scale (float64 bits)": (scale_bits,)}


def _per_device(algorithm: str, mesh, *, layout: str, return_lse: bool, kv_exchange: str, **kw):
    if algorithm == "usp":
        return partial(usp_attention, ring_group=mesh.get_group(RING), ulysses_group=mesh.get_group(ULYSSES),
                       layout=layout, return_lse=return_lse, kv_exchange=kv_exchange, **kw)
    if algorithm.startswith("double_ring"):
        groups = (mesh.get_group(RING_OUTER), mesh.get_group(RING_INNER))
        if algorithm == "double_ring_usp":
            return partial(usp_attention, ring_group=groups, ulysses_group=mesh.get_group(ULYSSES), layout=layout,
                           return_lse=return_lse, **kw)
        return partial(double_ring_attention, group=groups, layout=layout, **kw)
    if algorithm == "ulysses":
        return partial(ulysses_attention, group=mesh.get_group(ULYSSES), return_lse=return_lse, **kw)
    group = mesh.get_group(RING) if algorithm == "ring" else None
    return partial(KV_EXCHANGE[kv_exchange], group=group, layout=layout, **kw)


def global_shape(local_shape, mesh_sizes: dict) -> tuple[int, ...]:
    """The global [b, t, heads, d] a local shard of ``local_shape`` belongs to."""
    if len(local_shape) != 4:
        return tuple(local_shape)
    b, t, h, d = local_shape
    seq_split = 1
    for axis in (RING, RING_OUTER, RING_INNER, ULYSSES):
        seq_split *= mesh_sizes.get(axis, 1)
    return (b * mesh_sizes.get(DATA, 1), t * seq_split, h, d)


def sequence_parallel_attention(q, k, v, mesh, *, causal: bool = False, layout: str = "zigzag",
                                scale: float | None = None, kv_exchange: str = "ring",
                                return_lse: bool = False, block_backend: str = "auto",
                                deterministic: bool | None = None, check_ranks: bool | None = None):
    """Attention of this rank's ``q`` shard against ``k, v`` shards (layout order), sequence-
    parallel over ``mesh`` (a ``DeviceMesh``). Returns o (and lse if ``return_lse``).

    ``deterministic``: refuse block kernels that are not run-to-run deterministic (default:
    ``torch.are_deterministic_algorithms_enabled()``). ``check_ranks``: compare every rank's local
    shapes, dtypes and options before any attention collective (default: RINGBRIDGE_CHECK_RANKS=1;
    see the module docstring)."""
    deterministic = default_deterministic(deterministic)
    if default_check_ranks(check_ranks):
        check_ranks_agree(_signature(q, k, v, causal=causal, layout=layout, scale=scale, kv_exchange=kv_exchange,
                                     return_lse=return_lse), mesh)
    names = mesh.mesh_dim_names or ()
    sizes = {name: mesh.size(i) for i, name in enumerate(names)}
    decomposition: Decomposition = validate(
        *(global_shape(x.shape, sizes) for x in (q, k, v)), tuple(dtype_name(x.dtype) for x in (q, k, v)),
        sizes, layout=layout, kv_exchange=kv_exchange, scale=scale)
    get_backend(block_backend, deterministic=deterministic)  # an unknown or refused kernel fails before any collective
    per_device = _per_device(decomposition.algorithm, mesh, layout=layout, causal=causal, scale=scale,
                             block_backend=block_backend, return_lse=return_lse, kv_exchange=kv_exchange,
                             deterministic=deterministic)
    o, lse = per_device(q, k, v)
    return (o, lse) if return_lse else o
