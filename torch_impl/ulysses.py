"""Ulysses (DeepSpeed-Ulysses) attention: trade the sequence split for a head split.

Per rank of a Ulysses process group of size U:

    q: [b, t/U, h, d] --all-to-all--> [b, t, h/U, d] --attend--> o --all-to-all--> [b, t/U, h, d]
    segment_ids: [b, t/U] --all-gather--> [b, t] (member order, as the all-to-all concatenates)
    sinks: [h] (the full tensor on every rank) --slice--> [h/U] (rank u's head block)

When kv_heads < U, each KV head is replicated U // kv_heads times first, so that every rank
receives exactly the KV head its query heads read. Gradients flow through the all-to-alls
(``comm._AllToAll`` is its own transpose) and through the replication (its transpose sums).
Replicated K/V heads are handed to the inner attention in float32 (which computes and sends them
in q's dtype), so the replicas' dK/dV leave it unrounded, come back through the all-to-all in
float32 and are summed there (``gather_kv_heads``): summing replicas rounded to bf16 lost
accuracy (dv 4.4× the unsharded error in a fuzzed MQA case).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from seqplan.config import resolve_scale
from seqplan.validation import (
    check_head_groups,
    check_local_masks,
    check_softcap,
    dtype_name,
    validate_local,
)

from .block import get_backend
from .comm import axis_size, gather_shards, heads_to_seq, seq_to_heads, start_heads_to_seq, start_seq_to_heads
from .config import check_deterministic_ready, default_deterministic
from .ring import ring_attention


class _ReplicatedToHeads(torch.autograd.Function):
    """Replicate KV heads and all-to-all them; backward in float32 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group, reps: int):
        ctx.group, ctx.reps, ctx.dtype = group, reps, x.dtype
        return seq_to_heads(x.repeat_interleave(reps, dim=2), group).float()  # handed on in float32

    @staticmethod
    def backward(ctx, g):
        back = heads_to_seq(g, ctx.group)  # float32 (the output's dtype): [b, t/U, hk·reps, d]
        b, t, h, d = back.shape
        return back.reshape(b, t, h // ctx.reps, ctx.reps, d).sum(3).to(ctx.dtype), None, None


def gather_kv_heads(x, group, ulysses_size: int):
    """K or V into the head split: [b, t/U, hk, d] -> [b, t, max(hk, U)/U, d]. With hk < U the
    heads are replicated first, and the backward brings the replicas' gradients home in float32
    and sums them there (one float32 all-to-all instead of one in the input dtype)."""
    kv_heads = x.shape[2]
    if kv_heads >= ulysses_size:
        return seq_to_heads(x, group)
    return _ReplicatedToHeads.apply(x, group, ulysses_size // kv_heads)


def _segment_ids_to_heads(segment_ids, group):
    """Segment ids (or token indices) into the head split's sequence: [b, t/U] -> int32 [b, t] (member u's tokens at
    u·t/U, the order ``seq_to_heads`` concatenates q in); ``None`` stays ``None``."""
    if segment_ids is None or group is None:
        return segment_ids
    ids = segment_ids.to(torch.int32)  # as the ring gathers them (4 bytes a token, whatever the caller's dtype)
    return gather_shards(ids, group).movedim(0, 1).reshape(ids.shape[0], -1)  # [U, b, t/U] -> [b, U·t/U]


def _sinks_of_head_block(sinks, group, n: int):
    """The sinks of the query heads this rank attends over after ``seq_to_heads``: [h] -> [h/U]
    (head block u, u this rank's index in ``group``); a slice, so autograd brings its gradient
    back into the caller's [h] tensor (zeros for the other head blocks)."""
    if sinks is None or group is None:
        return sinks
    per = sinks.shape[0] // n
    u = dist.get_group_rank(group, dist.get_rank())
    return sinks[u * per:(u + 1) * per]


def ulysses_attention(q, k, v, group=None, *, segment_ids=None, window=None, sinks=None, softcap=None,
                      token_index=None, causal: bool = False,
                      scale: float | None = None, block_backend: str = "auto", attend: Callable | None = None,
                      return_lse: bool = True, deterministic: bool | None = None, head_groups: int = 1):
    """Ulysses attention over process group ``group``. ``attend(q, k, v, *, segment_ids, window,
    sinks, softcap, token_index, causal, scale, block_backend, deterministic)`` computes attention on the gathered
    sequence (default: one rank's attention; USP passes ring attention over the ring group).
    ``segment_ids``: packed documents, this rank's local shard of the integer ids [b, t/U]
    (layout order; no gradient), all-gathered over ``group`` and handed to ``attend``.
    ``window``: see ``ring_attention`` (positions are the gathered sequence's). ``sinks``: the
    full [h] logits on every rank; ``attend`` gets this rank's head block [h/U], and
    ``sinks.grad`` receives this rank's contribution (its heads, its rows; summed over ranks it
    is the full gradient). ``softcap``: as in ``ring_attention`` (checked here, before the
    all-to-all), passed on to ``attend``. ``token_index``: this rank's original token indices
    [b, t/U] or None, all-gathered over ``group`` like the ids (the sequence they index follows
    the all-to-all) and handed to ``attend``. ``head_groups`` G: the heads in G consecutive
    groups (``seqplan.validation.check_head_groups``); every group's all-to-alls are issued
    asynchronously and waited for only where their result is read, so one group's all-to-all
    travels while another group attends, forward and backward (``comm.PendingAllToAll``). The
    same attention as G = 1, head for head. Returns ``(o, lse)``: o like q, lse [b, h, t/U]
    float32 (``None`` when ``return_lse`` is False: its all-to-all is skipped).
    """
    n = axis_size(group)
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=None,
                   scale=scale, ulysses=n)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    softcap = check_softcap(softcap)
    groups = check_head_groups(head_groups, q.shape[2], k.shape[2], n)
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic, q.device)
    get_backend(block_backend, deterministic=deterministic)  # an unknown or refused kernel fails here
    scale = resolve_scale(q.shape[-1], scale)
    attend = partial(attend or partial(ring_attention, group=None, layout="contiguous"), window=window,
                     softcap=softcap, causal=causal, scale=scale, block_backend=block_backend,
                     deterministic=deterministic)
    ids = _segment_ids_to_heads(segment_ids, group)  # [b, t] or None
    index = _segment_ids_to_heads(token_index, group)  # [b, t] or None: gathered as the ids are
    if groups > 1:
        return _in_head_groups(q, k, v, sinks, group, n, groups, attend, ids, index, return_lse)
    q_h = seq_to_heads(q, group)  # [b, t, h/U, d]
    k_h, v_h = (gather_kv_heads(x, group, n) for x in (k, v))  # [b, t, max(hk, U)/U, d]
    o_h, lse_h = attend(q_h, k_h, v_h, segment_ids=ids, sinks=_sinks_of_head_block(sinks, group, n),
                        token_index=index)
    if not return_lse:  # skip the LSE all-to-all nobody reads (XLA drops it in JAX too)
        return heads_to_seq(o_h, group), None
    # lse_h: [b, h/U, t] -> [b, h, t/U]: split the sequence, gather the heads.
    lse = heads_to_seq(lse_h.transpose(1, 2).unsqueeze(-1), group)[..., 0]
    return heads_to_seq(o_h, group), lse.transpose(1, 2)


def _in_head_groups(q, k, v, sinks, group, n: int, groups: int, attend: Callable, ids, index, return_lse: bool):
    """Ulysses over ``groups`` consecutive head groups, pipelined: every group's q / k / v
    all-to-all is issued first (they travel in group order), then group g attends as soon as its
    own have arrived, while g+1's travel, and its o (and lse) all-to-all is issued at once. K/V
    heads that must be replicated (a group's kv heads < U) go through ``gather_kv_heads`` when
    their group attends (not overlapped). Returns (o, lse) as ``ulysses_attention``."""
    split_kv = k.shape[2] // groups >= n  # each group's K/V heads split over U (in flight), not replicated
    qs, ks, vs = (x.chunk(groups, dim=2) for x in (q, k, v))
    inputs = [(start_seq_to_heads(qg, group),
               *((start_seq_to_heads(x, group) for x in (kg, vg)) if split_kv else (kg, vg)))
              for qg, kg, vg in zip(qs, ks, vs)]
    sinks_g = [None] * groups if sinks is None else sinks.chunk(groups)
    outs = []
    for (q_in, k_in, v_in), sinks_group in zip(inputs, sinks_g):
        k_h, v_h = ((x.result() for x in (k_in, v_in)) if split_kv
                    else (gather_kv_heads(x, group, n) for x in (k_in, v_in)))
        o_h, lse_h = attend(q_in.result(), k_h, v_h, segment_ids=ids, sinks=_sinks_of_head_block(sinks_group, group, n),
                            token_index=index)
        lse_out = None if not return_lse else start_heads_to_seq(lse_h.transpose(1, 2).unsqueeze(-1), group)
        outs.append((start_heads_to_seq(o_h, group), lse_out))
    o = torch.cat([o_out.result() for o_out, _ in outs], dim=2)
    if not return_lse:
        return o, None
    return o, torch.cat([lse_out.result()[..., 0] for _, lse_out in outs], dim=2).transpose(1, 2)
