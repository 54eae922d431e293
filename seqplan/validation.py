"""Input checks for ``sequence_parallel_attention``, run on shapes alone, before any collective.

Every constraint raises ``ValueError`` (or ``TypeError`` for dtypes) naming the constraint and the
offending numbers. Shapes here are *global*: [batch, seq, heads, head_dim].
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, get_args

from .axes import DATA, KNOWN_AXES, RING, RING_INNER, RING_OUTER, ULYSSES
from .layouts import LAYOUTS, seq_multiple

Dtype = Literal["float32", "bfloat16", "float16"]
KvExchange = Literal["ring", "allgather"]  # ring hops, or one all-gather of K/V
Algorithm = Literal["local", "ring", "ulysses", "usp", "double_ring", "double_ring_usp"]
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_EXCHANGES: tuple[str, ...] = get_args(KvExchange)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)


@dataclass(frozen=True)
class Decomposition:
    """How a validated call splits the work: mesh sizes per role and the algorithm they pick."""

    data: int
    ring: int
    ulysses: int
    algorithm: Algorithm
    ring_outer: int = 1  # double ring only: ring = ring_outer * ring_inner
    ring_inner: int = 1


def algorithm_of(axes) -> Algorithm:
    """The algorithm a mesh with these axis names runs (docs/contract.md: the names pick it)."""
    has_ulysses = ULYSSES in axes
    if RING_OUTER in axes:
        return "double_ring_usp" if has_ulysses else "double_ring"
    if RING in axes and has_ulysses:
        return "usp"
    return "ring" if RING in axes else "ulysses" if has_ulysses else "local"


def _check_double_ring(mesh_sizes: dict, kv_exchange: str) -> None:
    """The double ring needs both of its axes, replaces ``"ring"``, and is a KV ring."""
    double = [a for a in (RING_OUTER, RING_INNER) if a in mesh_sizes]
    if not double:
        return
    if len(double) == 1:
        raise ValueError(f"the double ring needs both mesh axes {RING_OUTER!r} and {RING_INNER!r}, got only {double[0]!r}")
    if RING in mesh_sizes:
        raise ValueError(f"mesh axis {RING!r} cannot be combined with the double ring's {RING_OUTER!r} x {RING_INNER!r}")
    if min(mesh_sizes[RING_OUTER], mesh_sizes[RING_INNER]) < 2:
        raise ValueError(f"the double ring needs {RING_OUTER!r} and {RING_INNER!r} of size >= 2 each, got "
                         f"{mesh_sizes[RING_OUTER]} x {mesh_sizes[RING_INNER]}; with one ring of devices use {RING!r}")
    if kv_exchange != "ring":
        raise ValueError(f"kv_exchange={kv_exchange!r} has no double-ring form: use kv_exchange='ring' with "
                         f"{RING_OUTER!r} x {RING_INNER!r}, or a single {RING!r} axis for all-gather KV")


def dtype_name(dtype) -> str:
    """A JAX or torch dtype as validation's name for it ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def _check_qkv(q_shape, k_shape, v_shape, dtypes, *, what: str, kv_may_be_float32: bool = False) -> None:
    """Ranks, dtypes and agreeing sizes of q, k, v (``what`` names the shapes in messages)."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{what}{name} must be rank-4 [batch, seq, heads, head_dim], got shape {tuple(shape)}")
    q_dtype, k_dtype, v_dtype = dtypes
    if kv_may_be_float32:
        if k_dtype != v_dtype or k_dtype not in (q_dtype, "float32"):
            raise TypeError(f"k and v must share one dtype, q's or float32, got {tuple(dtypes)}")
    elif len(set(dtypes)) != 1:
        raise TypeError(f"q, k, v must share one dtype, got {tuple(dtypes)}")
    if q_dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {DTYPES}, got {q_dtype}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"{what}k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    (b, s, h, d), (bk, sk, hk, dk) = q_shape, k_shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(f"{what}q and k must agree in batch, seq and head_dim, got q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)}")
    if hk < 1 or h % hk:
        raise ValueError(f"heads % kv_heads must be 0, got heads={h}, kv_heads={hk}")


INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def shape_and_dtype(array) -> tuple:
    """(shape, dtype name) of an optional array (segment ids, sinks) for the checks; ((), None) for None."""
    if array is None:
        return (), None
    return tuple(array.shape), dtype_name(array.dtype)


def check_local_masks(q_shape, *, segment_ids, token_index, sinks, window):
    """The optional mask arguments of a per-algorithm entry (this device's shards; arrays of
    either framework or None), checked in one order: segment ids and token indices [b, t] like
    q's first two dimensions, the window, the sinks [h]. Returns the window as (left, right) or None."""
    check_segment_ids(*shape_and_dtype(segment_ids), q_shape, what="local ")
    check_token_index(*shape_and_dtype(token_index), q_shape, what="local ")
    window = check_window(window)
    check_sinks(*shape_and_dtype(sinks), q_shape[2])
    return window


def _check_per_token(name: str, shape, dtype: str | None, q_shape, what: str) -> None:
    """An optional per-token int array of shape [b, t], q being [b, t, h, d] (``dtype`` None: absent)."""
    if dtype is None:
        return
    if dtype not in INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (one of {INT_DTYPES}), got {dtype}")
    if tuple(shape) != tuple(q_shape[:2]):
        raise ValueError(f"{what}{name} must be [batch, seq] = {tuple(q_shape[:2])} like q's first two "
                         f"dimensions, got shape {tuple(shape)}")


def check_segment_ids(ids_shape, ids_dtype: str | None, q_shape, *, what: str = "") -> None:
    """``segment_ids`` (packed documents) of shape [b, t] and integer dtype, q being [b, t, h, d]
    (``what``: "local " where the shapes are one device's shards). ``ids_dtype`` None: no ids."""
    _check_per_token("segment_ids", ids_shape, ids_dtype, q_shape, what)


def check_token_index(index_shape, index_dtype: str | None, q_shape, *, what: str = "") -> None:
    """``token_index`` (the original token index of every token, layout order) of shape [b, t]
    and integer dtype, q being [b, t, h, d] (``what``: "local " for one device's shards), like
    ``segment_ids``. ``index_dtype`` None: no token indices (the static layout's)."""
    _check_per_token("token_index", index_shape, index_dtype, q_shape, what)


def check_token_index_range(lo: int, hi: int, seq_len: int, *, what: str = "") -> None:
    """The values a caller can see (concrete arrays: not tracers under ``jit``; a torch rank: its
    shard) lie in [0, seq_len) — the global sequence length; ``lo``/``hi`` their min and max."""
    if lo < 0 or hi >= seq_len:
        raise ValueError(f"{what}token_index values must lie in [0, {seq_len}) (original token indices of a "
                         f"sequence of {seq_len}), got min {lo}, max {hi}")


def check_window(window) -> tuple[int, int] | None:
    """``window`` as ``(left, right)``: None, a non-negative int w (= (w, w)) or a pair of them."""
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) and not isinstance(window, bool) else window
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
        raise TypeError(f"window must be None, an int or a (left, right) pair of ints, got {window!r}")
    if min(pair) < 0:
        raise ValueError(f"window extents must be >= 0, got {tuple(pair)}")
    return int(pair[0]), int(pair[1])


def check_softcap(softcap) -> float | None:
    """``softcap`` (logit soft-capping, Gemma 2: every scaled logit x becomes softcap · tanh(x /
    softcap)) as a float: None, or a finite positive real number (TypeError for anything else
    that is not a real number — a bool, a string, an array; ValueError for zero, a negative
    number, inf or nan)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a positive float, got {type(softcap).__name__} {softcap!r}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite positive number (the cap on |logit|) or None, got {softcap!r}")
    return float(softcap)


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_sinks(sinks_shape, sinks_dtype: str | None, heads: int) -> None:
    """``sinks`` (attention-sink logits): one float per query head, [heads]. ``sinks_dtype``
    None: no sinks."""
    if sinks_dtype is None:
        return
    if sinks_dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must have a floating dtype (one of {FLOAT_DTYPES}), got {sinks_dtype}")
    if tuple(sinks_shape) != (heads,):
        raise ValueError(f"sinks must be [heads] = ({heads},), one logit per query head, got shape {tuple(sinks_shape)}")


def _check_options(layout: str | None, kv_exchange: str | None, scale) -> None:
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if kv_exchange is not None and kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {kv_exchange!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")


def _check_head_split(heads: int, kv_heads: int, ulysses: int) -> None:
    if heads % ulysses:
        raise ValueError(f"heads % {ULYSSES!r} mesh size must be 0, got heads={heads}, {ULYSSES}={ulysses}")
    if kv_heads % ulysses and ulysses % kv_heads:
        raise ValueError(
            f"kv_heads and the {ULYSSES!r} size must divide one another (kv heads are split, or "
            f"replicated up to it), got kv_heads={kv_heads}, {ULYSSES}={ulysses}")


def check_head_groups(head_groups, heads: int, kv_heads: int, ulysses: int) -> int:
    """Ulysses in head groups: the heads split into ``head_groups`` consecutive groups (query group
    g = heads [g·h/G, (g+1)·h/G), reading K/V heads [g·hk/G, (g+1)·hk/G)), each group's
    all-to-all in flight while another group attends. Every group must itself be a valid Ulysses
    head split, so G divides both head counts and each group's split passes the Ulysses rule.
    ``ulysses`` 1 (no Ulysses axis) admits only 1: there is no all-to-all to overlap."""
    if isinstance(head_groups, bool) or not isinstance(head_groups, numbers.Integral) or head_groups < 1:
        raise ValueError(f"head_groups must be a positive int, got {head_groups!r}")
    groups = int(head_groups)
    if groups == 1:
        return 1
    if ulysses == 1:
        raise ValueError(f"head_groups > 1 overlaps the Ulysses all-to-all and needs a {ULYSSES!r} mesh axis "
                         f"larger than 1, got head_groups={groups}, {ULYSSES}={ulysses}")
    if heads % groups or kv_heads % groups:
        raise ValueError(f"head_groups must divide heads and kv_heads, got head_groups={groups}, heads={heads}, "
                         f"kv_heads={kv_heads}")
    try:
        _check_head_split(heads // groups, kv_heads // groups, ulysses)
    except ValueError as err:
        raise ValueError(f"each of the head_groups={groups} groups must be a Ulysses head split on its own "
                         f"({heads // groups} heads, {kv_heads // groups} kv heads a group): {err}") from None
    return groups


def validate_local(q_shape, k_shape, v_shape, dtypes, *, layout: str | None, scale, ulysses: int = 1) -> None:
    """Check one device's shards before any collective, in the per-device entry points.

    Shapes are *local*: q [b, t, h, d], k and v [b, t, hk, d] (``t`` this device's tokens).
    ``layout``: the ring's layout (``None``: no ring, Ulysses alone). ``ulysses``: the size of the
    Ulysses group the heads are split over (1: none). K/V may be float32 where q is not (Ulysses
    hands replicated K/V heads on in float32); the ring computes them in q's dtype."""
    _check_qkv(q_shape, k_shape, v_shape, dtypes, what="local ", kv_may_be_float32=True)
    _check_options(layout, None, scale)
    _check_head_split(q_shape[2], k_shape[2], ulysses)
    multiple = 1 if layout is None else seq_multiple(layout, 1)
    if q_shape[1] % multiple:
        raise ValueError(f"local seq % {multiple} must be 0 for layout {layout!r} (each device's shard is split "
                         f"in two halves), got local seq={q_shape[1]}")


def validate(q_shape, k_shape, v_shape, dtypes, mesh_sizes: dict, *, layout: str, kv_exchange: str,
             scale) -> Decomposition:
    """Check one call; ``dtypes`` is (q, k, v) dtype names, ``mesh_sizes`` maps axis name -> size."""
    _check_qkv(q_shape, k_shape, v_shape, dtypes, what="")
    (b, s, h, _), hk = q_shape, k_shape[2]
    _check_options(layout, kv_exchange, scale)

    unknown = [a for a in mesh_sizes if a not in KNOWN_AXES]
    if unknown:
        raise ValueError(f"unknown mesh axis names {unknown}; known: {KNOWN_AXES}")
    _check_double_ring(mesh_sizes, kv_exchange)

    data, ulysses, ring_outer, ring_inner = (int(mesh_sizes.get(a, 1)) for a in (DATA, ULYSSES, RING_OUTER, RING_INNER))
    ring = int(mesh_sizes.get(RING, 1)) * ring_outer * ring_inner  # the combined ring
    ring_name = f"{RING_OUTER}*{RING_INNER}" if RING_OUTER in mesh_sizes else RING
    if b % data:
        raise ValueError(f"batch % {DATA!r} mesh size must be 0, got batch={b}, {DATA}={data}")
    _check_head_split(h, hk, ulysses)
    multiple = seq_multiple(layout, ring, ulysses)
    if s % multiple:
        raise ValueError(
            f"seq_len % {multiple} must be 0 for layout {layout!r} with {ring_name}={ring}, {ULYSSES}={ulysses}, "
            f"got seq_len={s}")
    return Decomposition(data=data, ring=ring, ulysses=ulysses, algorithm=algorithm_of(mesh_sizes),
                         ring_outer=ring_outer, ring_inner=ring_inner)
