"""USP (unified sequence parallelism): Ulysses inside, ring outside, on one 2-D DeviceMesh (3-D
with the double ring's two ring dimensions).

Rank (r, u) holds block r*U + u of the layout-ordered sequence. The Ulysses all-to-all within
ring group r gathers ring shard r (for h/U heads); ring attention then runs across the R groups
with the chosen layout; the inverse all-to-all restores the sequence split.

    q: [b, t/(R·U), h, d]  segment_ids: [b, t/(R·U)] or None  ->  o: [b, t/(R·U), h, d], lse: [b, h, t/(R·U)]
    window: static, as for the ring; sinks: [h] on every rank, sliced to the rank's head block by Ulysses

Packed documents: this rank's ids are all-gathered over the Ulysses group (ring shard r's ids)
and then, inside the ring attention, over the ring group(s).
"""

from __future__ import annotations

from functools import partial

from seqplan.shared import check_shared_exchange
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .allgather import allgather_attention
from .comm import axis_size
from .double_ring import double_ring_attention
from .ring import ring_attention
from .ulysses import ulysses_attention

# kv_exchange -> the per-rank attention over the ring group (same signature, same layouts)
KV_EXCHANGE = {"ring": ring_attention, "allgather": allgather_attention}


def usp_attention(q, k, v, ring_group=None, ulysses_group=None, *, segment_ids=None, window=None, sinks=None,
                  softcap=None, token_index=None,
                  causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                  block_backend: str = "auto", return_lse: bool = True, kv_exchange: str = "ring",
                  deterministic: bool | None = None, shared_tokens: int | None = None, head_groups: int = 1):
    """Ulysses over ``ulysses_group`` around ring (or all-gather-KV) attention over ``ring_group``;
    a pair of groups ``(outer, inner)`` is the double ring. ``segment_ids``: packed documents,
    this rank's local shard of the ids [b, t/(R·U)] (layout order). ``window``, ``sinks``,
    ``softcap``: see ``ring_attention`` (sinks: the full [h] on every rank, ``.grad`` this rank's contribution).
    ``token_index``: this rank's original token indices [b, t/(R·U)] or None; it follows the
    sequence through the all-to-all as the ids do (see ``ring_attention``).
    ``shared_tokens``: all-gather KV's shared prefix of each ring shard (``allgather_attention``).
    ``head_groups``: the Ulysses all-to-alls in head groups that overlap each other's attention
    (``ulysses_attention``). Returns (o, lse)."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale, ulysses=axis_size(ulysses_group))
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    if kv_exchange not in KV_EXCHANGE:
        raise ValueError(f"kv_exchange must be one of {tuple(KV_EXCHANGE)}, got {kv_exchange!r}")
    attend = double_ring_attention if isinstance(ring_group, tuple) else KV_EXCHANGE[kv_exchange]
    ring = partial(attend, group=ring_group, layout=layout,
                   **check_shared_exchange(shared_tokens, "double_ring" if isinstance(ring_group, tuple) else "usp",
                                           kv_exchange))
    return ulysses_attention(q, k, v, ulysses_group, segment_ids=segment_ids, window=window, sinks=sinks,
                             softcap=softcap, token_index=token_index,
                             causal=causal, scale=scale, block_backend=block_backend, attend=ring,
                             return_lse=return_lse, deterministic=deterministic, head_groups=head_groups)
