"""``sequence_parallel_attention`` on this rank's local shards and a ``DeviceMesh``.

The mesh's ``mesh_dim_names`` choose the algorithm (docs/contract.md): ``"ring"`` -> ring attention,
``"ulysses"`` -> Ulysses, both -> USP, ``"ring_outer"`` + ``"ring_inner"`` -> the double ring
(with ``"ulysses"``: double-ring USP), ``"data"`` shards the batch. The rank at ring coordinate
r (o·I + i in the double ring) and Ulysses coordinate u holds sequence block r*U + u (layout
order) of its batch shard:

    q: [b/D, t/(R·U), h, d]   k, v: [b/D, t/(R·U), hk, d]   segment_ids: [b/D, t/(R·U)] or None
    token_index: [b/D, t/(R·U)] or None                     sinks: [h] or None (the full tensor on every rank)
    ->   o like q, lse: [b/D, h, t/(R·U)]

``segment_ids`` (packed documents) and ``token_index`` (original token indices) are this rank's
local shards of the integer arrays, in the same layout order and split as q (the JAX API takes
global arrays instead).

Validation runs on shapes alone, identically on every rank, before any collective. Ranks that
pass *different* local shapes, dtypes or options are caught only with ``check_ranks=True`` (by
default ``RINGBRIDGE_CHECK_RANKS=1``: one small all-reduce per mesh dimension, before validation
and before any attention collective); see ``comm.check_ranks_agree`` for what goes unnoticed
without it.
"""

from __future__ import annotations

import numbers
import struct
import weakref
from functools import partial

import torch

from seqplan.axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from seqplan.config import default_check_ranks, default_head_groups
from seqplan.layouts import LAYOUTS
from seqplan.shared import check_shared_exchange
from seqplan.validation import (
    DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    KV_EXCHANGES,
    Decomposition,
    check_head_groups,
    check_segment_ids,
    check_sinks,
    check_softcap,
    check_token_index,
    check_token_index_range,
    check_window,
    dtype_name,
    shape_and_dtype,
    validate,
)

from .block import get_backend
from .comm import check_ranks_agree
from .config import check_deterministic_ready, default_deterministic
from .double_ring import double_ring_attention
from .loop import declared_host_ids
from .ulysses import ulysses_attention
from .usp import KV_EXCHANGE, usp_attention


def _code(value, known: tuple) -> int:
    return known.index(value) if value in known else -1


def _window_code(window) -> tuple[int, int]:
    """``window`` as (left, right); None -> (-1, -1), anything check_window refuses -> (-2, -2)
    (every rank then reaches validation, which raises its error)."""
    try:
        pair = check_window(window)
    except (TypeError, ValueError):
        return (-2, -2)
    return (-1, -1) if pair is None else pair


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _softcap_code(softcap) -> int:
    """``softcap`` by its float64 bit pattern; None -> -1, anything check_softcap refuses -> -2
    (every rank then reaches validation, which raises its error)."""
    try:
        value = check_softcap(softcap)
    except (TypeError, ValueError):
        return -2
    return -1 if value is None else _float_bits(value)


def _signature(q, k, v, *, causal, layout, scale, kv_exchange, return_lse, segment_ids=None, window=None,
               sinks=None, softcap=None, token_index=None, head_groups=1) -> dict:
    """What every rank must agree on, as small ints (names by their index in validation's and the
    layouts' tuples, scale by its float64 bit pattern; no segment_ids: shape (), dtype -1; window
    by :func:`_window_code`; no sinks: shape (), dtype -1; softcap by :func:`_softcap_code`; no
    token_index: shape (), dtype -1; head_groups: the int, -1 for anything else — ranks that split
    the heads differently would issue different all-to-alls and hang)."""
    dtypes = tuple(_code(dtype_name(x.dtype), DTYPES) for x in (q, k, v))
    scale_bits = -1 if scale is None else _float_bits(scale)
    options = (int(bool(causal)), _code(layout, LAYOUTS), _code(kv_exchange, KV_EXCHANGES), int(bool(return_lse)))
    ids_shape = () if segment_ids is None else tuple(segment_ids.shape)
    ids_dtype = -1 if segment_ids is None else _code(dtype_name(segment_ids.dtype), INT_DTYPES)
    sinks_shape, sinks_dtype = shape_and_dtype(sinks)
    index_shape, index_dtype = shape_and_dtype(token_index)
    return {"q shape": tuple(q.shape), "k shape": tuple(k.shape), "v shape": tuple(v.shape),
            f"dtypes (index in {DTYPES})": dtypes, "causal, layout, kv_exchange, return_lse": options,
            "scale (float64 bits)": (scale_bits,), "segment_ids shape": ids_shape,
            f"segment_ids dtype (index in {INT_DTYPES})": (ids_dtype,),
            "window (left, right; -1: none)": _window_code(window), "sinks shape": sinks_shape,
            f"sinks dtype (index in {FLOAT_DTYPES})": (_code(sinks_dtype, FLOAT_DTYPES),),
            "softcap (float64 bits; -1: none)": (_softcap_code(softcap),), "token_index shape": index_shape,
            f"token_index dtype (index in {INT_DTYPES})": (-1 if index_dtype is None else _code(index_dtype, INT_DTYPES),),
            "head_groups": (int(head_groups) if isinstance(head_groups, numbers.Integral)
                            and not isinstance(head_groups, bool) else -1,)}


def _check_segment_ids(segment_ids, q) -> None:
    """This rank's ids against its q (local shapes), on q's device."""
    if segment_ids is None:
        return
    check_segment_ids(segment_ids.shape, dtype_name(segment_ids.dtype), q.shape, what="local ")
    if segment_ids.device != q.device:
        raise ValueError(f"segment_ids must be on q's device {q.device}, got {segment_ids.device}")


def _check_token_index(token_index, q, seq_len: int, documents: bool = False) -> None:
    """This rank's token indices against its q (local shapes), on q's device, every value in
    [0, seq_len) — the global sequence length (one device-to-host copy of their min and max; the
    other ranks' values are not compared: that would take a collective). The copy waits for the
    GPU's queued work (a sync, 2 of them a step in the 4x H200 profile of all-gather KV on
    documents): a tensor whose values passed is not read again while it is unchanged
    (:func:`_range_passed`) — a model's layers pass the same one."""
    if token_index is None:
        return
    check_token_index(*shape_and_dtype(token_index), q.shape, what="local ")
    if token_index.device != q.device:
        raise ValueError(f"token_index must be on q's device {q.device}, got {token_index.device}")
    held = declared_host_ids()
    if (documents and held is not None and held.token_index is not None
            and held.token_index.shape == (token_index.shape[0], seq_len)):
        # the block applies to this call (loop._call_host_shards): its range, read on the host; the call
        # compares the gathered indices with the block's on the device (NaN where they differ)
        check_token_index_range(*held.index_range(), seq_len, what="host_ids ")
        return
    if token_index.numel() and not _range_passed(token_index, seq_len):
        lo, hi = torch.stack(token_index.long().aminmax()).tolist()  # one host copy: each one is a sync
        check_token_index_range(lo, hi, seq_len, what="local ")
        _remember_range(token_index, seq_len)


# Token-index tensors whose values passed the range check: id → (weak reference, the tensor's
# version counter then, seq_len). The version counter moves with every in-place write through
# torch (views included), so an entry answers only for the same tensor, unchanged, against the
# same length; an entry leaves with its tensor. Writes torch does not see (through ``.data``, a
# NumPy or DLPack view, a custom kernel's raw pointer) are not seen here either; inference-mode
# tensors have no version counter and are read every call.
_PASSED: dict[int, tuple] = {}


def _range_passed(token_index, seq_len: int) -> bool:
    if token_index.is_inference():  # no version counter: checked every call
        return False
    entry = _PASSED.get(id(token_index))
    return entry is not None and entry[0]() is token_index and entry[1:] == (token_index._version, seq_len)


def _remember_range(token_index, seq_len: int) -> None:
    if token_index.is_inference():
        return
    key = id(token_index)
    _PASSED[key] = (weakref.ref(token_index, lambda _: _PASSED.pop(key, None)), token_index._version, seq_len)


def _check_sinks(sinks, q) -> None:
    """The sinks: [heads], floating, on q's device."""
    check_sinks(*shape_and_dtype(sinks), q.shape[2])
    if sinks is not None and sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def _per_device(algorithm: str, mesh, *, layout: str, return_lse: bool, kv_exchange: str, head_groups: int = 1,
                **kw):
    # head_groups (checked: 1 unless there is a Ulysses axis) reaches only the Ulysses algorithms
    if algorithm == "usp":
        return partial(usp_attention, ring_group=mesh.get_group(RING), ulysses_group=mesh.get_group(ULYSSES),
                       layout=layout, return_lse=return_lse, kv_exchange=kv_exchange, head_groups=head_groups, **kw)
    if algorithm.startswith("double_ring"):
        groups = (mesh.get_group(RING_OUTER), mesh.get_group(RING_INNER))
        if algorithm == "double_ring_usp":
            return partial(usp_attention, ring_group=groups, ulysses_group=mesh.get_group(ULYSSES), layout=layout,
                           return_lse=return_lse, head_groups=head_groups, **kw)
        return partial(double_ring_attention, group=groups, layout=layout, **kw)
    if algorithm == "ulysses":
        return partial(ulysses_attention, group=mesh.get_group(ULYSSES), return_lse=return_lse,
                       head_groups=head_groups, **kw)
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
                                deterministic: bool | None = None, check_ranks: bool | None = None,
                                segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                                shared_tokens: int | None = None, head_groups: int | None = None):
    """Attention of this rank's ``q`` shard against ``k, v`` shards (layout order), sequence-
    parallel over ``mesh`` (a ``DeviceMesh``). Returns o (and lse if ``return_lse``).

    ``segment_ids``: packed documents — this rank's local shard of the integer ids, [b/D, t/(R·U)]
    like q's first two dimensions, layout order, on q's device (no gradient): query i sees key j
    only if their ids are equal (and, causal, j <= i by original position). Blocks whose queries
    and keys share no document are skipped, forward and backward.

    ``window``: sliding window — None, an int w (= (w, w)) or ``(left, right)`` of non-negative
    ints: query at original position i sees key j only if i - left <= j <= i + right (causal:
    also j <= i; the meaning of ``jax.nn.dot_product_attention``'s ``local_window_size``).
    Blocks out of the window's reach are skipped, forward and backward.

    ``sinks``: attention-sink logits (gpt-oss), a float [heads] tensor — the FULL tensor on every
    rank, on q's device — or None: each row's softmax denominator gains exp(sinks[h]) with no
    value vector, and the returned lse includes it. ``sinks.grad`` receives THIS rank's
    contribution (the rows and heads it computed); summing it over the sequence-parallel (and
    data) ranks — as DDP / FSDP over those dimensions do — gives the full gradient.

    ``softcap``: logit soft-capping (Gemma 2's ``attn_logit_softcapping``), None or a positive
    float: every scaled logit x = scale·q·k becomes softcap · tanh(x / softcap) before the
    softmax, in every block, forward and backward (the sinks are not capped; the lse is that of
    the capped logits). Blocks run on a kernel that applies it: the portable one under "auto",
    or ``block_backend="flex"`` (a score_mod); an aten backend named with it runs capped blocks on
    the portable kernel (torch's aten attention ops take no soft-capping).

    ``token_index``: the original token index of every token — this rank's local shard of an
    integer [b, t] array in layout order, [b/D, t/(R·U)] like q's first two dimensions, on q's
    device (no gradient) — or None: the positions the static ``layout`` implies. Given, it
    replaces those positions for ``causal`` and ``window``: with ``causal``, query i sees key j
    only if token_index[j] <= token_index[i]; a window compares token indices too. It is how a
    per-row layout such as the per-document zigzag (``seqplan.layouts.document_layout``, whose
    ``token_index`` it takes) is run. Every ring shard's indices are all-gathered once per call
    (int32, as the segment ids); blocks are then decided per call from each row's index range,
    on the non-causal schedule (no hop is saved by a window). Checked on each rank: shape, an
    integer dtype, and every local value in [0, t) (t the global sequence length; one
    device-to-host copy); ``check_ranks`` compares shape and dtype across ranks. Not the layers'
    RoPE ``positions``, which restart at every document (``seqplan.layouts.rope_positions``
    derives them from token_index and segment_ids).

    ``shared_tokens``: with ``kv_exchange="allgather"`` (ring or USP) and causal packed documents,
    a promise that every token whose document also lies on another ring shard sits within the
    first ``shared_tokens`` tokens of its ring shard — the per-document hybrid layout's order;
    ``seqplan.chooser.choose_layout`` gives the value — so only those K/V are gathered and their
    dK / dV reduce-scattered, the rest attending locally while the gather runs
    (``seqplan.shared``). Checked on the gathered ids: a ``ValueError`` on every rank when broken.

    ``head_groups``: with a Ulysses axis, the heads in this many consecutive groups, each through
    its own all-to-alls and attention, so that one group's all-to-all can travel while another
    group attends, forward and backward (torch issues them asynchronously; in JAX, XLA's
    latency-hiding scheduler places them) — the same attention, head for head. For steps whose
    attention is short beside the all-to-all (a sliding window: on 4× H200 the all-to-all was a
    quarter of USP's windowed step). It must divide heads and kv_heads, and each group must be a
    valid Ulysses split on its own; None reads ``RINGBRIDGE_HEAD_GROUPS`` (default 1) on meshes with
    a Ulysses axis and means 1 on the others.

    ``deterministic``: refuse block kernels that are not run-to-run deterministic (default:
    ``torch.are_deterministic_algorithms_enabled()``). ``check_ranks``: compare every rank's local
    shapes, dtypes and options before any attention collective (default: RINGBRIDGE_CHECK_RANKS=1;
    see the module docstring)."""
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic, q.device)
    names = mesh.mesh_dim_names or ()
    sizes = {name: mesh.size(i) for i, name in enumerate(names)}
    head_groups = default_head_groups(head_groups, sizes.get(ULYSSES, 1))  # ranks read their own environment
    if default_check_ranks(check_ranks):
        check_ranks_agree(_signature(q, k, v, causal=causal, layout=layout, scale=scale, kv_exchange=kv_exchange,
                                     return_lse=return_lse, segment_ids=segment_ids, window=window, sinks=sinks,
                                     softcap=softcap, token_index=token_index, head_groups=head_groups),
                          mesh)
    decomposition: Decomposition = validate(
        *(global_shape(x.shape, sizes) for x in (q, k, v)), tuple(dtype_name(x.dtype) for x in (q, k, v)),
        sizes, layout=layout, kv_exchange=kv_exchange, scale=scale)
    _check_segment_ids(segment_ids, q)
    _check_token_index(token_index, q, global_shape(q.shape, sizes)[1], documents=segment_ids is not None)
    window, softcap = check_window(window), check_softcap(softcap)
    _check_sinks(sinks, q)
    get_backend(block_backend, deterministic=deterministic)  # an unknown or refused kernel fails before any collective
    shared = check_shared_exchange(shared_tokens, decomposition.algorithm, kv_exchange)
    groups = check_head_groups(head_groups, q.shape[2], k.shape[2], decomposition.ulysses)
    per_device = _per_device(decomposition.algorithm, mesh, layout=layout, causal=causal, scale=scale,
                             block_backend=block_backend, return_lse=return_lse, kv_exchange=kv_exchange,
                             deterministic=deterministic, head_groups=groups, **shared)
    o, lse = per_device(q, k, v, segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
                        token_index=token_index)
    return (o, lse) if return_lse else o
