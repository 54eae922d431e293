"""All-gather-KV attention (``kv_exchange="allgather"``: llama3-style context parallelism,
MaxText's default) as a ``torch.autograd.Function``, over the same ring group, layouts and step
plan as ring attention.

Per rank of a ring process group of size R, rank r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: one all-gather of K and of V (issued asynchronously, so it runs while the rank's own
block computes), then the blocks of the step plan against each shard in turn (step i visits
shard (r - i) mod R, as the ring does), merged by LSE. Backward: float32 dK/dV for every shard,
one reduce-scatter of each brings every shard's sum home. Memory: the gathered K/V (R shards)
are saved for the backward — the price of no transfer inside the loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .block import get_backend
from .comm import axis_size, gather_shards, scatter_shard_sums
from .layouts import step_plan
from .ring import _add_grads, _block_for_step, attention_with_vjp, grad_block, merge_block

F32 = torch.float32


def allgather_attention(q, k, v, group=None, *, causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto"):
    """All-gather-KV attention over process group ``group`` (``None``: one rank). Inputs are this
    rank's ring shard in layout order. Returns ``(o, lse)``; differentiable through autograd."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _allgather(q, k, v, group, causal, layout, scale, block_backend)


def _forward(q, k, v, group, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    n = axis_size(group)
    if n > 1:
        (k_all, k_work), (v_all, v_work) = (gather_shards(x, group, async_op=True) for x in (k, v))
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # step 0: own K/V, while K/V gather
    if n == 1:
        return o, lse, None
    o = o.float()  # the float32 accumulator (kernels may return the input dtype)
    k_work.wait()
    v_work.wait()
    rank = dist.get_group_rank(group, dist.get_rank())
    for step in range(1, n):
        src = (rank - step) % n
        merge_block(backend, scale, q, _block_for_step(plan, step, rank), (k_all[src], v_all[src]), (o, lse))
    return o, lse, (k_all, v_all)


def _backward(q, k, v, o, lse, kv_all, do, dlse, group, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    n = axis_size(group)
    if n == 1:
        return dq, dk, dv
    dq, dk, dv = dq.float(), dk.float(), dv.float()  # the float32 accumulators (kernels may return bf16)
    rank = dist.get_group_rank(group, dist.get_rank())
    dk_all, dv_all = (torch.zeros(x.shape, dtype=F32, device=x.device) for x in kv_all)
    dk_all[rank], dv_all[rank] = dk, dv
    for step in range(1, n):
        src = (rank - step) % n
        block = _block_for_step(plan, step, rank)
        grads = grad_block(backend, scale, (q, o, lse, do, dlse), block, (kv_all[0][src], kv_all[1][src]))
        _add_grads(block, grads, dq, (dk_all[src], dv_all[src]))
    return dq, scatter_shard_sums(dk_all, group), scatter_shard_sums(dv_all, group)


_allgather = attention_with_vjp(_forward, _backward)
