"""The mesh a one-device replay stands for (:class:`Strategy`): its sizes, the api's mesh axes, the
schedule its real loops walk and each Ulysses coordinate's head groups — the same in both
implementations' ``replay.py`` and in the benchmarks that count a device's block calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .axes import RING, RING_INNER, RING_OUTER, ULYSSES
from .schedule import Exchange, Schedule, make_schedule, window_ring_schedule
from .validation import KV_EXCHANGES


@dataclass(frozen=True)
class Strategy:
    """The mesh a replay stands for. ``ring``: R, devices on the (combined) ring; ``ulysses``: U;
    ``outer``: O, the double ring's outer ring (1: a single ring; the inner ring is R / O);
    ``kv_exchange``: "ring" or "allgather" (a single ring only)."""

    ring: int = 1
    ulysses: int = 1
    outer: int = 1
    kv_exchange: str = "ring"

    def __post_init__(self):
        if min(self.ring, self.ulysses, self.outer) < 1:
            raise ValueError(f"ring, ulysses and outer must be >= 1, got {self.ring}, {self.ulysses}, {self.outer}")
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {self.kv_exchange!r}")
        if self.outer > 1 and (self.ring % self.outer or self.ring // self.outer < 2 or self.kv_exchange != "ring"):
            raise ValueError(f"a double ring needs ring = outer x inner with inner >= 2 and kv_exchange='ring', got "
                             f"ring={self.ring}, outer={self.outer}, kv_exchange={self.kv_exchange!r}")

    @property
    def devices(self) -> int:
        return self.ring * self.ulysses

    def mesh_sizes(self) -> dict[str, int]:
        """The api's mesh axes for this strategy (what ``validation.validate`` checks)."""
        sizes = {RING_OUTER: self.outer, RING_INNER: self.ring // self.outer} if self.outer > 1 else {RING: self.ring}
        return {**sizes, ULYSSES: self.ulysses}

    def schedule(self, layout: str, causal: bool, window: tuple[int, int] | None = None,
                 shard_len: int = 0) -> Schedule:
        """The schedule the real loops of this strategy walk (Ulysses alone: one device's)."""
        if self.outer > 1:
            return make_schedule(Exchange.DOUBLE_RING, layout, causal, self.outer, self.ring // self.outer)
        if self.kv_exchange == "allgather":
            return make_schedule(Exchange.ALLGATHER, layout, causal, 1, self.ring)
        # a window the ring truncates for and trims the hops of (kernel_window's form; shard_len = T / R tokens)
        return window_ring_schedule(layout, causal, window, shard_len, self.ring)

    def replay_schedule(self, config, seq: int) -> Schedule:
        """The schedule a replay of a call with ``config`` (an AttentionConfig) over ``seq`` tokens
        walks: the call's static schedule, its ring truncated only by a window on the layout's
        positions (``config.reach_window``)."""
        return self.schedule(config.layout, config.schedule_causal, config.reach_window, seq // self.ring)

    def head_groups(self, heads: int, kv_heads: int, u: int) -> tuple[slice, slice, bool]:
        """(query heads, KV heads, replicated) of Ulysses coordinate ``u``: with kv_heads < U each
        KV head is replicated U / kv_heads times and device u reads replica u of the result."""
        n = self.ulysses
        q_heads = slice(u * heads // n, (u + 1) * heads // n)
        if kv_heads >= n:
            return q_heads, slice(u * kv_heads // n, (u + 1) * kv_heads // n), False
        head = u // (n // kv_heads)
        return q_heads, slice(head, head + 1), True


class DeviceGrads(NamedTuple):
    """One virtual device's backward in a one-device replay (both frameworks' ``device_backward``).

    dq:            its queries' gradient [b, t/R, h/U, d] in q's dtype.
    contributions: {source ring shard: (dk, dv)} — the dK/dV it computed against each shard
                   (shards it computed no block against have none); float32 where blocks add
                   up, JAX's in q's dtype where the device's own block is its only one.
    dsinks:        with sinks, its rows' share of dsinks for its heads ([h/U] float32); else None."""

    dq: object
    contributions: dict
    dsinks: object = None


def ring_shard(x, r: int, size: int, heads: slice | None = None, head_axis: int = 2):
    """Ring shard ``r`` of ``size`` of a global array or tensor (any framework: plain slicing)
    along the sequence — axis 1 for [b, t, h, d] arrays, axis 2 for an lse [b, h, t]
    (``head_axis=1``) — and, given ``heads``, those heads."""
    axis = 1 if head_axis == 2 else 2
    t = x.shape[axis] // size
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(r * t, (r + 1) * t)
    if heads is not None:
        index[head_axis] = heads
    return x[tuple(index)]
