"""Ulysses (DeepSpeed-Ulysses) attention: trade the sequence split for a head split.

Per device, inside ``shard_map`` over a Ulysses axis of size U:

    q: [b, t/U, h, d] --all-to-all--> [b, t, h/U, d] --attend--> o --all-to-all--> [b, t/U, h, d]

When kv_heads < U, each KV head is replicated U // kv_heads times first, so that every device
receives exactly the KV head its query heads read. Gradients flow through the all-to-alls
(their transpose is the inverse all-to-all) and through the replication (its transpose sums).
Replicated K/V heads are handed to the inner attention in float32 (which computes and sends them
in q's dtype), so the replicas' dK/dV leave it unrounded, come back through the all-to-all in
float32 and are summed there (``gather_kv_heads``): summing replicas rounded to bf16 lost
accuracy (dv 4.4× the unsharded error in a fuzzed MQA case).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from seqplan.axes import ULYSSES
from seqplan.config import resolve_scale
from seqplan.validation import (
    check_head_groups,
    check_local_masks,
    check_softcap,
    dtype_name,
    validate_local,
)

from .block import get_backend
from .comm import axis_size, gather_shards, heads_to_seq, seq_to_heads
from .config import check_deterministic_ready, default_deterministic
from .ring import ring_attention


def _replicate_to_heads(x, axis_name: str, reps: int):
    """Replicate each KV head ``reps`` times, all-to-all in x's dtype, hand on in float32."""
    return seq_to_heads(jnp.repeat(x, reps, axis=2), axis_name).astype(jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _replicated_to_heads(x, axis_name: str, reps: int):
    return _replicate_to_heads(x, axis_name, reps)


def _replicated_to_heads_fwd(x, axis_name, reps):
    return _replicate_to_heads(x, axis_name, reps), jnp.zeros((0,), x.dtype)  # residual: x's dtype


def _replicated_to_heads_bwd(axis_name, reps, dtype_of, g):
    back = heads_to_seq(g, axis_name)  # float32 (the output's dtype): [b, t/U, hk·reps, d]
    b, t, h, d = back.shape
    return (back.reshape(b, t, h // reps, reps, d).sum(3).astype(dtype_of.dtype),)


_replicated_to_heads.defvjp(_replicated_to_heads_fwd, _replicated_to_heads_bwd)


def gather_kv_heads(x, axis_name: str, ulysses_size: int):
    """K or V into the head split: [b, t/U, hk, d] -> [b, t, max(hk, U)/U, d]. With hk < U the
    heads are replicated first, and the backward brings the replicas' gradients home in float32
    and sums them there (one float32 all-to-all instead of one in the input dtype)."""
    kv_heads = x.shape[2]
    if kv_heads >= ulysses_size:
        return seq_to_heads(x, axis_name)
    return _replicated_to_heads(x, axis_name, ulysses_size // kv_heads)


def _split_heads(x, groups: int, axis: int = 2):
    """x's heads in ``groups`` consecutive blocks (None stays None, one group is x itself)."""
    if x is None or groups == 1:
        return [x] * groups
    return jnp.split(x, groups, axis=axis)


def ulysses_attention(q, k, v, axis_name: str = ULYSSES, *, causal: bool = False, scale: float | None = None,
                      block_backend: str = "auto", attend: Callable | None = None,
                      return_lse: bool = True, deterministic: bool | None = None, segment_ids=None,
                      window=None, sinks=None, softcap=None, token_index=None, head_groups: int = 1):
    """Ulysses attention over ``axis_name``. ``attend(q, k, v, *, causal, scale, block_backend,
    deterministic, segment_ids, window, sinks, softcap, token_index)`` computes attention on the gathered
    sequence (default: one device's attention; USP passes ring attention over the ring axis).
    ``segment_ids``: this device's ids [b, t/U] or None; they are all-gathered over the axis
    (member order, as the all-to-all concatenates the sequence) for ``attend``. ``window``: as in
    ``ring_attention`` (the gathered sequence is one ring shard, so its positions are the
    ring's). ``sinks``: [h] float logits or None; ``attend`` gets this device's heads'
    ``sinks[u·h/U:(u+1)·h/U]``. ``softcap``: as in ``ring_attention`` (checked here, before the
    all-to-all), passed on to ``attend``. ``token_index``: this device's original token indices
    [b, t/U] or None, all-gathered over the axis like the ids (the sequence they index follows
    the all-to-all) and handed to ``attend``. ``head_groups`` G: the heads in G consecutive groups
    (``seqplan.validation.check_head_groups``), each through its own all-to-alls and ``attend``,
    so that XLA's scheduler can run one group's all-to-all under another group's attention (the
    Ulysses all-to-all is otherwise exposed whole: a quarter of a windowed step on 4 GPUs).
    The same attention as G = 1, head for head. Returns ``(o, lse)``: o like q, lse [b, h, t/U] float32
    (``None`` when ``return_lse`` is False: its all-to-all is skipped).
    """
    n = axis_size(axis_name)
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=None,
                   scale=scale, ulysses=n)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    softcap = check_softcap(softcap)
    groups = check_head_groups(head_groups, q.shape[2], k.shape[2], n)
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic)
    get_backend(block_backend, deterministic=deterministic)  # an unknown or refused kernel fails here
    scale = resolve_scale(q.shape[-1], scale)
    attend = partial(attend or partial(ring_attention, axis_name=None, layout="contiguous"), causal=causal, scale=scale,
                     block_backend=block_backend, deterministic=deterministic, window=window, softcap=softcap)
    ids = None if segment_ids is None else gather_shards(segment_ids.astype(jnp.int32), axis_name)  # [b, t]
    index = None if token_index is None else gather_shards(token_index.astype(jnp.int32), axis_name)  # [b, t]
    parts = [_through_heads(*group, axis_name, n, attend, ids, index, return_lse)
             for group in zip(*(_split_heads(x, groups) for x in (q, k, v)), _split_heads(sinks, groups, axis=0))]
    o = parts[0][0] if groups == 1 else jnp.concatenate([o for o, _ in parts], axis=2)
    if not return_lse:
        return o, None
    return o, parts[0][1] if groups == 1 else jnp.concatenate([lse for _, lse in parts], axis=1)


def _through_heads(q, k, v, sinks, axis_name: str, n: int, attend: Callable, ids, index, return_lse: bool):
    """One head group through Ulysses: all-to-all in, ``attend`` on this device's head block,
    all-to-all out. ``sinks``: the group's [h_g] logits or None. Returns (o [b, t/U, h_g, d],
    lse [b, h_g, t/U] or None)."""
    q_h = seq_to_heads(q, axis_name)  # [b, t, h_g/U, d]
    k_h, v_h = (gather_kv_heads(x, axis_name, n) for x in (k, v))  # [b, t, max(hk_g, U)/U, d]
    heads = q_h.shape[2]  # h_g/U: this device's head block of the group
    sinks_h = None if sinks is None else lax.dynamic_slice_in_dim(sinks, lax.axis_index(axis_name) * heads, heads)
    o_h, lse_h = attend(q_h, k_h, v_h, segment_ids=ids, sinks=sinks_h, token_index=index)
    if not return_lse:  # skip the LSE all-to-all (torch would otherwise run it; XLA drops it)
        return heads_to_seq(o_h, axis_name), None
    # lse_h: [b, h_g/U, t] -> [b, h_g, t/U]: split the sequence, gather the heads.
    lse = heads_to_seq(jnp.swapaxes(lse_h, 1, 2)[..., None], axis_name)[..., 0]
    return heads_to_seq(o_h, axis_name), jnp.swapaxes(lse, 1, 2)
