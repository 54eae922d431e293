"""USP (unified sequence parallelism): Ulysses inside, ring outside, on one 2-D mesh (3-D with
the double ring's two ring axes).

Device (r, u) holds block r*U + u of the layout-ordered sequence. The Ulysses all-to-all within
ring group r gathers ring shard r (for h/U heads); ring attention then runs across the R groups
with the chosen layout; the inverse all-to-all restores the sequence split.

    q: [b, t/(R·U), h, d]  ->  o: [b, t/(R·U), h, d], lse: [b, h, t/(R·U)]
"""

from __future__ import annotations

from functools import partial

from seqplan.axes import RING, ULYSSES
from seqplan.shared import check_shared_exchange
from seqplan.validation import dtype_name, validate_local

from .allgather import allgather_attention
from .comm import axis_size
from .double_ring import double_ring_attention
from .ring import ring_attention
from .ulysses import ulysses_attention

# kv_exchange -> the per-device attention over the ring axis (same signature, same layouts)
KV_EXCHANGE = {"ring": ring_attention, "allgather": allgather_attention}


def usp_attention(q, k, v, ring_axis: str | tuple[str, str] = RING, ulysses_axis: str = ULYSSES, *, causal: bool = False,
                  layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                  return_lse: bool = True, kv_exchange: str = "ring", deterministic: bool | None = None,
                  segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                  shared_tokens: int | None = None, head_groups: int = 1):
    """Ulysses over ``ulysses_axis`` around ring (or all-gather-KV) attention over ``ring_axis``;
    a pair of axes ``(outer, inner)`` is the double ring. ``segment_ids``: this device's ids
    [b, t/(R·U)] or None; ``window``, ``sinks`` ([h]), ``softcap`` and ``token_index`` ([b, t/(R·U)]
    or None: it follows the sequence through the all-to-all as the ids do) as in
    ``ring_attention``; ``shared_tokens``: all-gather KV's shared prefix of each ring shard
    (``allgather_attention``); ``head_groups``: the Ulysses all-to-all in head groups that overlap
    each other's attention (``ulysses_attention``). Returns (o, lse)."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale, ulysses=axis_size(ulysses_axis))
    if kv_exchange not in KV_EXCHANGE:
        raise ValueError(f"kv_exchange must be one of {tuple(KV_EXCHANGE)}, got {kv_exchange!r}")
    attend = double_ring_attention if isinstance(ring_axis, tuple) else KV_EXCHANGE[kv_exchange]
    ring = partial(attend, axis_name=ring_axis, layout=layout,
                   **check_shared_exchange(shared_tokens, "double_ring" if isinstance(ring_axis, tuple) else "usp",
                                           kv_exchange))
    return ulysses_attention(q, k, v, ulysses_axis, causal=causal, scale=scale, block_backend=block_backend,
                             attend=ring, return_lse=return_lse, deterministic=deterministic,
                             segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
                             token_index=token_index, head_groups=head_groups)
