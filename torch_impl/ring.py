"""Ring attention (contiguous / zigzag / stripe layouts) as a ``torch.autograd.Function``.

Per rank of a ring process group of size R, rank r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    segment_ids: [b, t/R] or None    sinks: [h] or None
                                                  ->    o: [b, t/R, h, d], lse: [b, h, t/R]

It walks :func:`schedule.ring_schedule`, step for step as jax_impl does. Forward: K/V rotate R-1
times with batched isend/irecv to the next rank; each hop is started before the block that uses
the K/V in hand, so the transfer overlaps the compute; receive buffers are allocated once and
reused (double-buffered). Backward: K/V rotate again, starting from the K/V the forward received
for step 1 (saved for backward, so R-2 hops); float32 dK/dV accumulators travel with them, one
hop behind, and a final hop brings them home (R hops); dQ stays local.
A window shorter than a shard (contiguous, nothing visible ahead) leaves one K/V hop, trimmed to
the rows the window reads (``schedule.window_halo``).
"""

from __future__ import annotations

from seqplan.schedule import window_ring_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import attention_with_vjp, walk_backward, walk_forward


def ring_attention(q, k, v, group=None, *, segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                   causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None):
    """Ring attention over process group ``group`` (``None``: one rank, plain attention).

    Inputs are this rank's ring shard in layout order (shapes in the module docstring; k/v may be
    float32 where q is not). ``segment_ids``: packed documents, this rank's local shard of the
    integer ids, [b, t/R] in layout order (compared as int32; no gradient): query i sees key j
    only if their ids are equal. They are all-gathered once over the ring (not sent with the
    K/V), and a block whose queries and keys share no document is skipped, forward and backward.
    ``window``: sliding window — None, an int w (= (w, w)) or ``(left, right)`` of non-negative
    ints: query at original position i sees key j only if i - left <= j <= i + right (causal:
    also j <= i). A block out of the window's reach is skipped, forward and backward.
    ``sinks``: attention-sink logits, the FULL float [h] tensor on every rank (or None): each
    row's softmax denominator gains exp(sinks[h]), with no value vector; lse includes it. Its
    ``.grad`` receives THIS rank's contribution (the rows it holds): summing it over the
    sequence-parallel ranks (and data ranks), as DDP / FSDP over those dimensions do, gives the
    full gradient. ``softcap``: None or a positive float (Gemma 2's logit soft-capping): every
    scaled logit x becomes softcap · tanh(x / softcap) before the softmax, in every block, forward
    and backward (the sinks are not capped; checked with the config, before any collective).
    ``token_index``: this rank's original token indices [b, t/R] (layout order) or None (the
    layout's): the causal mask and the window compare them (key j visible from query i under
    ``causal`` only if token_index[j] <= token_index[i]); every ring shard's are all-gathered
    once, as the segment ids are.
    Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R]. Differentiable through
    torch.autograd (o and lse; q, k, v and sinks). ``deterministic``: see
    ``config.default_deterministic``.
    """
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here, before any collective
    return _ring(q, k, v, (None, group), config, segment_ids, sinks, token_index)


def _schedule(groups, config: AttentionConfig, shard_len: int):
    """The ring's schedule: truncated to the shards a window reaches where that is built
    (``schedule.window_reach``: the contiguous layout under a causal or right-0 window; never on
    token indices, which the layout's positions say nothing about), its hops carrying only the
    rows the window reads where it has one K/V hop (``schedule.window_halo``)."""
    size = axis_size(groups[1])
    return window_ring_schedule(config.layout, config.schedule_causal, config.reach_window, shard_len, size)


def _forward(q, k, v, groups, config: AttentionConfig, masks):
    """(o, lse, kv_first): see ``loop.walk_forward``."""
    return walk_forward(q, k, v, groups, config, _schedule(groups, config, k.shape[1]), masks)


def _backward(q, k, v, o, lse, kv_first, do, dlse, groups, config: AttentionConfig, masks):
    return walk_backward(q, k, v, o, lse, kv_first, do, dlse, groups, config, _schedule(groups, config, k.shape[1]),
                         masks)


_ring = attention_with_vjp(_forward, _backward)
