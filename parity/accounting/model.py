"""The analytical communication model: what each device puts on the wire, per pass and per
collective kind, as docs/contract.md defines "bytes":

    p2p / ppermute: the buffer sent          all-to-all:     (n-1)/n of the buffer
    all-gather:     (n-1)/n of the output    reduce-scatter: (n-1)/n of the input
    all-reduce:     2(n-1)/n of the buffer

A "call" is one collective on one buffer (a ring hop of K and V is two calls). The JAX count
(``parity.accounting.hlo``, from compiled HLO) and the torch count (``parity.accounting.torch_trace``)
must equal this model exactly, bytes and calls. The model reads an attention configuration by its
attributes (``AttentionConfig``), so it needs no case type of the harness.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from ..core.names import DTYPE_BYTES

PASSES = ("fwd", "bwd", "step")  # step: the optimizer step (ZeRO-1 parameter all-gather)
KINDS = ("p2p", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")
FRAMEWORKS = ("jax", "torch")  # the model differs per framework only for attention sinks
__all__ = ["PASSES", "KINDS", "DTYPE_BYTES", "FRAMEWORKS", "Traffic", "AttentionConfig", "a2a_bytes",
           "allreduce_bytes", "attention_traffic"]


class AttentionConfig(Protocol):
    """What the attention model reads (``parity.core.cases.Case`` is one): global sizes and the
    mesh's axis sizes, ``ring`` being the combined ring of ``ring_outer`` x inner devices."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    data: int
    ring: int
    ulysses: int
    ring_outer: int
    kv_exchange: str
    documents: str  # packed documents ("none": no segment ids); a config without the attribute has none
    window: tuple[int, int] | None  # sliding window; moves nothing different (yet: no hop truncation)
    sinks: bool  # attention sinks, float32 [heads] (JAX: their cotangent is all-reduced); default False
    token_index: bool  # explicit token indices passed (one more int32 gather, like the ids'); default False


@dataclass
class Traffic:
    """calls and bytes per (pass, kind) for one device. Bytes are exact fractions (the (n-1)/n
    factors), so equality is exact."""

    table: dict = field(default_factory=lambda: defaultdict(lambda: [0, Fraction(0)]))

    def add(self, pass_: str, kind: str, nbytes, calls: int = 1) -> None:
        if pass_ not in PASSES or kind not in KINDS:
            raise ValueError(f"unknown pass/kind {pass_!r}/{kind!r}")
        entry = self.table[(pass_, kind)]
        entry[0] += calls
        entry[1] += Fraction(nbytes)

    def rows(self) -> dict[tuple[str, str], tuple[int, Fraction]]:
        return {key: (c, b) for key, (c, b) in sorted(self.table.items()) if c or b}

    def bytes(self, pass_: str | None = None) -> Fraction:
        return sum((b for (p, _), (_, b) in self.rows().items() if pass_ in (None, p)), Fraction(0))

    def __eq__(self, other) -> bool:
        return isinstance(other, Traffic) and self.rows() == other.rows()

    def diff(self, other: Traffic, names=("model", "measured")) -> str:
        """Per-collective differences, one line each ('' when equal)."""
        lines = []
        for key in sorted(set(self.rows()) | set(other.rows())):
            a, b = self.rows().get(key, (0, 0)), other.rows().get(key, (0, 0))
            if a != b:
                lines.append(f"{key[0]} {key[1]}: {names[0]} {a[0]} calls / {float(a[1]):.0f} B, "
                             f"{names[1]} {b[0]} calls / {float(b[1]):.0f} B")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "Traffic(" + ", ".join(f"{p}/{k}: {c} calls {float(b):.0f} B" for (p, k), (c, b) in self.rows().items()) + ")"


def a2a_bytes(buffer: int, n: int) -> Fraction:
    return Fraction(buffer * (n - 1), n)


def allreduce_bytes(buffer: int, n: int) -> Fraction:
    return Fraction(2 * buffer * (n - 1), n)


def attention_traffic(case: AttentionConfig, *, return_lse: bool = True, framework: str | None = None) -> Traffic:
    """Per-device traffic of ``sequence_parallel_attention`` for ``case`` (forward, and the
    backward of a loss that uses o and, when returned, lse).

    Ulysses (U > 1): all-to-all of q, k, v (KV heads replicated up to U first), o and, when
    returned, lse; the backward transposes each of them (dq, dk, dv, do, dlse), dk and dv in
    float32 when the KV heads were replicated.
    Ring (R > 1), on the ring shard of T/R tokens and h/U, max(hk, U)/U heads: forward R-1 hops
    of K and V; backward R-2 hops of K and V (it starts from the forward's first received K/V)
    and R hops of float32 dK and dV. The double ring (R = O·I) moves the same in the forward and
    R-1 K/V hops in the backward (it keeps nothing from the forward), plus the same R dK/dV hops.
    All-gather KV (R > 1): forward one all-gather of K and of V (each (R-1)/R of the gathered R
    shards); backward one reduce-scatter of float32 dK and of dV over the R shards.
    Packed documents (``documents`` other than "none"): the forward all-gathers each device's
    int32 segment ids [b/D, t/(R·U)] once — over Ulysses (to the ring shard), then over the ring
    (the double ring: over the inner ring, then the outer) — and the backward reuses them; no ids
    ride on the K/V hops.
    Explicit token indices (``token_index``, int32 [b, t] per device, placed like the ids): the
    same all-gathers once more, whether or not there are segment ids — the forward gathers them
    over the same groups, the backward reuses them; nothing rides on the K/V hops.
    A sliding window (``window``) truncates the single ring where ``schedule.window_reach`` says
    (the contiguous layout under a causal or right-0 window reaching a < R-1 shards back):
    forward a K/V hops, backward a-1, and a+1 hops of float32 dK/dV (a along the ring, one
    straight home); with a = 1 — or on a ring of 2, whole — and a left reach w shorter than a shard
    every hop carries w rows, not the shard (``schedule.window_halo``). Everywhere else it moves
    what the call moves without it (blocks out of reach are skipped, not their transfers).
    Attention sinks (``sinks``, float32 [h], replicated) differ per ``framework`` (required with
    sinks): torch moves nothing for them (``sinks.grad`` is each rank's contribution); JAX's
    shard_map transposes the replicated input into all-reductions of its cotangent in the
    backward (``_sinks_traffic``).
    """
    if getattr(case, "sinks", False) and framework not in FRAMEWORKS:
        raise ValueError(f"attention sinks move different bytes per framework: framework must be one of {FRAMEWORKS}, "
                         f"got {framework!r}")
    t = Traffic()
    e = DTYPE_BYTES[case.dtype]
    b, ring, uly = case.batch // case.data, case.ring, case.ulysses
    kv_heads = max(case.kv_heads, uly) if uly > 1 else case.kv_heads
    d = case.head_dim
    if uly > 1:
        tokens = case.seq // (ring * uly)  # per device, before the all-to-all
        q_buf, kv_buf, lse_buf = b * tokens * case.heads * d * e, b * tokens * kv_heads * d * e, b * tokens * case.heads * 4
        # Replicated KV heads (hk < U): their gradients come back in float32 (summed there).
        dkv_buf = b * tokens * kv_heads * d * 4 if case.kv_heads < uly else kv_buf
        for pass_, kv in (("fwd", kv_buf), ("bwd", dkv_buf)):  # each all-to-all and its transpose
            for buf in [q_buf, kv, kv, q_buf] + ([lse_buf] if return_lse else []):
                t.add(pass_, "all-to-all", a2a_bytes(buf, uly))
    if ring > 1 and case.kv_exchange == "allgather":  # gather K and V once; reduce-scatter f32 dK, dV
        shard = b * (case.seq // ring) * (kv_heads // uly) * d
        t.add("fwd", "all-gather", 2 * (ring - 1) * shard * e, calls=2)
        t.add("bwd", "reduce-scatter", 2 * (ring - 1) * shard * 4, calls=2)
    elif ring > 1:
        reach, halo = _window_reach(case)
        rows = case.seq // ring if halo is None else halo  # the rows of a ring shard each hop carries
        shard = b * rows * (kv_heads // uly) * d  # K (or V) elements a hop carries
        fwd_hops = ring - 1 if reach is None else reach
        kv_hops = ring - 1 if case.ring_outer > 1 else max(fwd_hops - 1, 0)
        dkv_hops = ring if reach is None else reach + 1 if reach else 0
        if fwd_hops:
            t.add("fwd", "p2p", 2 * fwd_hops * shard * e, calls=2 * fwd_hops)
        if kv_hops:
            t.add("bwd", "p2p", 2 * kv_hops * shard * e, calls=2 * kv_hops)
        if dkv_hops:
            t.add("bwd", "p2p", 2 * dkv_hops * shard * 4, calls=2 * dkv_hops)
    int32_per_token = b * (case.seq // (ring * uly)) * 4  # one device's int32 [b/D, t/(R·U)]
    groups = (uly, ring // case.ring_outer, case.ring_outer)
    if getattr(case, "documents", "none") != "none":
        _int32_gathers(t, int32_per_token, *groups)  # the segment ids
    if getattr(case, "token_index", False):
        _int32_gathers(t, int32_per_token, *groups)  # the token indices
    if getattr(case, "sinks", False) and framework == "jax":
        _sinks_traffic(t, case.heads * 4, case.data * ring, uly)
    return t


def _window_reach(case) -> tuple[int | None, int | None]:
    """The truncated single ring's reach and halo for ``case`` (None, None: the whole ring, whole
    shards), by the rule the implementations use (``schedule.window_ring_schedule`` on the window as
    the kernels see it); the schedule module is pure Python, imported here without any framework."""
    window = getattr(case, "window", None)
    if window is None or case.ring_outer > 1 or case.kv_exchange != "ring" or getattr(case, "token_index", False):
        return None, None  # token indices: the window is on them, and the layout's positions promise nothing
    from seqplan.schedule import kernel_window, window_ring_schedule

    schedule = window_ring_schedule(case.layout, case.causal, kernel_window(tuple(window), case.causal),
                                    case.seq // case.ring, case.ring)
    return schedule.reach, schedule.halo


def _sinks_traffic(t: Traffic, sinks_bytes: int, others: int, uly: int) -> None:
    """JAX's backward all-reduces the sinks' float32 cotangent, as compiled with a typed
    (check_vma) shard_map — what every CPU backend is: under Ulysses, the inner attention's
    cotangent of its h/U heads over the ``others`` = data × ring devices that share them, then the
    full [h] over Ulysses; without Ulysses, [h] over the data × ring devices (none on one device).
    (An untyped backend, fa3 on a GPU, sums [h] once over every device instead.)"""
    if uly > 1 and others > 1:
        t.add("bwd", "all-reduce", allreduce_bytes(sinks_bytes // uly, others))
    n = uly if uly > 1 else others
    if n > 1:
        t.add("bwd", "all-reduce", allreduce_bytes(sinks_bytes, n))


def _int32_gathers(t: Traffic, local_bytes: int, *groups: int) -> None:
    """The forward all-gathers of one per-token int32 array (the segment ids, or the token
    indices) over each group in turn (Ulysses, then the ring's inner and outer rings; a group of 1
    is none): each moves (n-1)/n of an output n times its input."""
    for n in groups:
        if n > 1:
            t.add("fwd", "all-gather", (n - 1) * local_bytes)
            local_bytes *= n
