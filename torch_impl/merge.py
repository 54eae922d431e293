"""The stable LSE merge of two attention partials, written once for every algorithm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqplan.schedule import Part


def merge_partials(o, lse, o_b, lse_b):
    """Fold partial ``(o_b, lse_b)`` into ``(o, lse)``, in float32.

        o   ← o − σ(lse_b − lse)·(o − o_b)
        lse ← lse − log σ(lse − lse_b)

    o, o_b: [b, t, h, d]; lse, lse_b: [b, h, t]. An empty partial (lse_b = −inf) leaves (o, lse)
    unchanged; (o, lse) itself must be non-empty (the local diagonal block always is).
    """
    o, lse = o.float().clone(), lse.float().clone()
    merge_partials_into(o, lse, o_b, lse_b)
    return o, lse


def merge_partials_into(o, lse, o_b, lse_b) -> None:
    """``merge_partials`` in place: ``o`` and ``lse`` (float32) are overwritten, and the only
    temporary the size of ``o`` is ``o_b`` widened to float32 (none when it is float32 already) —
    the ring's forward merges R−1 times into the same accumulator, so this is what bounds its
    memory. ``o_b`` may be in the input dtype."""
    lse_b = lse_b.float()
    weight = torch.sigmoid(lse_b - lse)  # [b, h, t], from the old lse
    lse.sub_(F.logsigmoid(lse - lse_b))
    # o + σ·(o_b − o), the same update as o − σ·(o − o_b), in one pass over o: lerp reads o, o_b and
    # the row weights and writes o (its end in o's dtype: one widening copy of o_b first) — 18 bytes
    # an element of float32 traffic where a difference, a product and a subtraction moved 30.
    o.lerp_(o_b.to(o.dtype), weight.to(o.dtype).transpose(1, 2).unsqueeze(-1))  # lerp_ takes no mixed dtypes


class Float32Rows:
    """A block's output or gradient (``base`` [b, t, ...], rows on dim 1) that later blocks add
    into, widened to float32 only on the rows they touch.

    The own block covers every row of the shard; later blocks often cover a few — the window
    ring's halo block its first ``window`` rows, a block cropped to its shared documents those
    documents' rows. Widening the whole shard for them costs a float32 copy in and a cast out per
    tensor (2x H200, window ring of 2 at 64k tokens: 1.7 ms a step of copies on each rank, most of
    them these). Here a row is widened the first time a block asks for it (:meth:`rows`) and the
    rest stay as the kernel wrote them (a zigzag ring's rank 0 widens one half; a token-index block
    cropped to its shared documents, their rows). Exact: an untouched row comes out of
    :meth:`result` as it went in, which is what its float32 round trip gave; a touched row is
    accumulated in float32 as before. ``base`` (a kernel's fresh output) becomes the
    accumulator's: :meth:`result` writes the widened rows back into it."""

    def __init__(self, base):
        self.base = base
        self._wide = base if base.dtype == torch.float32 else None  # float32 rows valid on _spans
        self._spans: list[tuple[int, int]] = [] if self._wide is None else [(0, base.shape[1])]

    def rows(self, part):
        """The float32 rows ``part.bounds(t)`` (a :class:`seqplan.schedule.Part` or ``Span``), a view
        to add or merge into in place; widened from ``base`` the first time."""
        lo, hi = part.bounds(self.base.shape[1])
        self._widen(lo, hi)
        return self._wide.narrow(1, lo, hi - lo)

    def full(self):
        """Every row in float32 (the sinks enter every row: ``loop.finish_output``)."""
        return self.rows(Part.ALL)

    def result(self, dtype):
        """The accumulated tensor in ``dtype``: the widened rows cast once, the others the kernel's.
        It ends the accumulator: the rows are written into ``base`` when ``dtype`` is its dtype (the
        tensor returned is then ``base`` itself), so later adds would change what was returned."""
        t = self.base.shape[1]
        if self._spans == [(0, t)]:
            return self._wide.to(dtype)
        out = self.base.to(dtype)  # the base itself when its dtype is ``dtype``: it is this accumulator's
        for lo, hi in self._spans:
            out.narrow(1, lo, hi - lo).copy_(self._wide.narrow(1, lo, hi - lo))
        return out

    def _widen(self, lo: int, hi: int) -> None:
        if any(a <= lo and hi <= b for a, b in self._spans):
            return
        t = self.base.shape[1]
        if self._wide is None and (lo, hi) == (0, t):
            self._wide, self._spans = self.base.float(), [(0, t)]
            return
        if self._wide is None:
            self._wide = torch.empty(self.base.shape, dtype=torch.float32, device=self.base.device)
        cuts = sorted(self._spans + [(lo, hi)])
        merged: list[list[int]] = []
        for a, b in cuts:  # the union of the widened spans, each new row copied in once
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in _gaps(self._spans, lo, hi):
            self._wide.narrow(1, a, b - a).copy_(self.base.narrow(1, a, b - a))
        self._spans = [(a, b) for a, b in merged]


def _gaps(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no span in ``spans`` (disjoint, sorted) covers."""
    gaps, at = [], lo
    for a, b in spans:
        if b <= at or a >= hi:
            continue
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < hi:
        gaps.append((at, hi))
    return gaps
