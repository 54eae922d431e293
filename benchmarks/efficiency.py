"""Replay efficiency (issue 28): one virtual device's block-kernel calls, each timed alone as a
bare kernel call, summed — against the device's replayed work (kernels plus merges, casts and
accumulators). Efficiency = Σ bare kernels / replayed time; 1.0 means no overhead beyond them.

The device's calls come from the schedule the real loops walk (``replay.Strategy.schedule``,
``schedule.device_visits``): each visited block is ``q[q_part]`` against ``k, v[kv_part]`` of
the ring shard (T / R tokens), on this device's heads (H / U query heads, max(Hk, U) / U KV
heads); a skipped block (None) costs nothing. The forward and the backward visit the same blocks.
Problems with packed documents or windows are not covered (their blocks decide at run time).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCall:
    """One distinct block-kernel call of a device: mask kind, query and key lengths, heads."""

    mask: str
    tq: int
    tk: int
    heads: int
    kv_heads: int


def device_blocks(spec, problem, device: int) -> Counter:
    """{BlockCall: calls} of virtual ``device`` (ring index device // U) of ``spec``."""
    from seqplan.schedule import device_visits
    from seqplan.strategy import Strategy

    if problem.documents != "none" or problem.window is not None:
        raise ValueError("replay efficiency covers unmasked problems only (masked blocks decide at run time)")
    strategy = Strategy(ring=spec.ring, ulysses=spec.ulysses, outer=spec.outer, kv_exchange=spec.kv_exchange)
    shard = problem.seq // spec.ring
    schedule = strategy.schedule(spec.layout, problem.causal, None, shard)
    heads = problem.heads // spec.ulysses
    kv_heads = max(problem.kv_heads, spec.ulysses) // spec.ulysses if spec.ulysses > 1 else problem.kv_heads
    calls: Counter = Counter()
    for visit in device_visits(schedule, device // spec.ulysses):
        if visit.block is None:
            continue
        q_lo, q_hi = visit.block.q_part.bounds(shard)
        k_lo, k_hi = visit.block.kv_part.bounds(shard)
        calls[BlockCall(visit.block.mask.kind.value, q_hi - q_lo, k_hi - k_lo, heads, kv_heads)] += 1
    return calls


def _clock(run, sync, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def time_call(framework: str, backend: str, call: BlockCall, problem, iters: int, warmup: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one bare block call, with the kernel ``backend``
    resolves to for its mask, on the default device."""
    b, d = problem.batch, problem.head_dim
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        from jax_impl.block import device_kind_of, get_backend, resolve_backend
        from seqplan.schedule import BlockMask

        dt = jnp.dtype(problem.dtype)
        keys = jax.random.split(jax.random.key(0), 4)
        q, do = (jax.random.normal(k_, (b, call.tq, call.heads, d), dt) for k_ in keys[:2])
        k, v = (jax.random.normal(k_, (b, call.tk, call.kv_heads, d), dt) for k_ in keys[2:])
        mask, scale = BlockMask(call.mask), d**-0.5
        kernel = get_backend(resolve_backend(backend, device_kind=device_kind_of(q), dtype=dt, mask=mask))
        fwd = jax.jit(lambda q, k, v: kernel.fwd(q, k, v, mask, scale))
        both = jax.jit(lambda q, k, v, do: kernel.bwd(do, q, k, v, *kernel.fwd(q, k, v, mask, scale), mask, scale,
                                                     None))
        sync = lambda: None
        return (_clock(lambda: jax.block_until_ready(fwd(q, k, v)), sync, iters, warmup),
                _clock(lambda: jax.block_until_ready(both(q, k, v, do)), sync, iters, warmup))
    import torch

    from seqplan.schedule import BlockMask
    from torch_impl.block import get_backend, resolve_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, problem.dtype)
    q, do = (torch.randn(b, call.tq, call.heads, d, device=device, dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, call.tk, call.kv_heads, d, device=device, dtype=dt) for _ in range(2))
    mask, scale = BlockMask(call.mask), d**-0.5
    kernel = get_backend(resolve_backend(backend, device_kind=device, dtype=dt, mask=mask))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def both():
        o, lse = kernel.fwd(q, k, v, mask, scale)
        kernel.bwd(do, q, k, v, o, lse, mask, scale, None)

    with torch.no_grad():
        return (_clock(lambda: kernel.fwd(q, k, v, mask, scale), sync, iters, warmup),
                _clock(both, sync, iters, warmup))


def kernels_ms(framework: str, backend: str, spec, problem, device: int, iters: int, warmup: int) -> dict:
    """Σ bare-kernel ms of ``device``'s calls (forward; forward + backward) and the calls themselves."""
    calls = device_blocks(spec, problem, device)
    fwd = both = 0.0
    for call, count in calls.items():
        f, fb = time_call(framework, backend, call, problem, iters, warmup)
        fwd, both = fwd + count * f, both + count * fb
    return {"kernels_fwd_ms": fwd, "kernels_fwd_bwd_ms": both,
            "calls": {f"{c.mask} {c.tq}x{c.tk} h{c.heads}/{c.kv_heads}": n for c, n in calls.items()}}
