"""Ring attention (contiguous / zigzag / stripe layouts) as a ``jax.custom_vjp``.

Per device, inside ``shard_map`` over a ring axis of size R, device r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

It walks :func:`schedule.ring_schedule`. Forward: K/V rotate R-1 times with ``lax.ppermute``;
each hop is issued before the block that uses the K/V in hand, so the transfer overlaps the
compute. Partials merge by LSE (float32). Backward: K/V rotate again, starting from the K/V the
forward received for step 1 (kept as a residual, so R-2 hops); float32 dK/dV accumulators travel
with them, one hop behind, and a final hop brings them home (R hops); dQ stays local. Which
block is computed at each step comes from the schedule's step plan, so causal work is balanced
and a fully masked block is skipped. A window shorter than a shard (contiguous, nothing visible
ahead) leaves one K/V hop, trimmed to the rows the window reads (``schedule.window_halo``).
"""

from __future__ import annotations

from seqplan.axes import RING
from seqplan.schedule import return_distance, window_ring_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import (
    attention_with_vjp,
    backward_visit,
    gather_segment_ids,
    gather_token_index,
    ring_index,
    shift_halo,
    walk,
    walk_forward,
)


def ring_attention(q, k, v, axis_name: str | None = RING, *, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None,
                   segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """Ring attention over mesh axis ``axis_name`` (``None``: one device, plain attention).

    Call inside ``shard_map``; inputs are this device's ring shard in layout order (shapes in the
    module docstring; k/v may be float32 where q is not). ``segment_ids``: this device's ids
    [b, t/R] (packed documents: a query sees only keys of its own id) or None. ``window``: None,
    w or ``(left, right)``: query at original position i sees keys i - left..i + right.
    ``sinks``: [h] float logits (the same on every device) or None: each row's softmax
    denominator gains exp(sinks[h]); differentiable. ``softcap``: None or a positive float (Gemma
    2's logit soft-capping): every scaled logit x becomes softcap · tanh(x / softcap) before the
    softmax, in every block, forward and backward (the sinks are not capped; checked with the
    config, before any collective). ``token_index``: this device's original token indices
    [b, t/R] (layout order) or None (the layout's): the causal mask and the window compare them
    (key j visible from query i under ``causal`` only if token_index[j] <= token_index[i]);
    every ring shard's are all-gathered once, as the segment ids are. Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R]
    (with the sink). ``deterministic``: see ``config.default_deterministic``.
    """
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here
    return _ring(q, k, v, segment_ids, token_index, sinks, axis_name, config)


def _schedule(axis_name, config: AttentionConfig, shard_len: int):
    """The ring's schedule: truncated to the shards a window reaches where that is built
    (``schedule.window_reach``: the contiguous layout under a causal or right-0 window; never on
    token indices, which the layout's positions say nothing about), its hops carrying only the
    rows the window reads where it has one K/V hop (``schedule.window_halo``)."""
    size = axis_size(axis_name)
    return window_ring_schedule(config.layout, config.schedule_causal, config.reach_window, shard_len, size)


def _forward(q, k, v, ids, index, axis_name, config: AttentionConfig):
    """(o, lse, (kv_first, ids_all, index_all)): see ``loop.walk_forward``, ``loop.gather_segment_ids``
    and ``loop.gather_token_index``."""
    ids_all = gather_segment_ids(ids, axis_name, config.comm)
    index_all = gather_token_index(index, axis_name, config.comm)
    o, lse, kv_first = walk_forward(q, k, v, axis_name, config, _schedule(axis_name, config, k.shape[1]), ids_all,
                                    index_all)
    return o, lse, (kv_first, ids_all, index_all)


def _backward(q, k, v, o, lse, extra, do, dlse, axis_name, config: AttentionConfig):
    schedule = _schedule(axis_name, config, k.shape[1])
    kv_first, ids_all, index_all = extra
    visit = backward_visit((q, o, lse, do, dlse), config, schedule, ring_index(axis_name), k.shape[1], ids_all,
                           index_all, rows=schedule.halo)

    def send_dkv(step, state):  # dK/dV of the shard just visited move on with it; R hops bring them home
        if step.dkv_hop is None:
            return state
        dq, dk_acc, dv_acc = state
        acc = (dk_acc, dv_acc)  # with a halo only its rows travel; the rest stay this device's own
        return (dq, *shift_halo(config.comm, acc, step.dkv_hop, axis_name, schedule.halo, into=acc,
                                **return_distance(schedule, step.dkv_hop)))

    return walk(schedule, (k, v), None, visit, comm=config.comm, axes=axis_name, after_step=send_dkv,
                kv_first=kv_first)


_ring = attention_with_vjp(_forward, _backward)
