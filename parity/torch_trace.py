"""A tracer for torch.distributed: records, per pass, every collective this rank issues — kind,
calls and bytes on the wire by DESIGN.md's definition — into a ``Traffic``.

torch's own CommDebugMode counts calls of DTensor-level collectives only and misses p2p; this
wraps the c10d entry points themselves (``batch_isend_irecv``, ``isend``/``send``,
``all_to_all_single``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``),
and counts *logical* bytes (gloo emulates reduce-scatter with an
all-reduce internally; the trace still records a reduce-scatter of the caller's input).
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

from .accounting import Traffic


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


class CommTracer:
    """``with CommTracer() as tr: ...; with tr.phase("bwd"): ...`` then ``tr.traffic``."""

    def __init__(self):
        self.traffic = Traffic()
        self.pass_ = "fwd"
        self._saved: list = []

    @contextlib.contextmanager
    def phase(self, pass_: str):
        previous, self.pass_ = self.pass_, pass_
        try:
            yield self
        finally:
            self.pass_ = previous

    def _record(self, kind: str, nbytes) -> None:
        self.traffic.add(self.pass_, kind, Fraction(nbytes))

    def _wrap(self, module, name: str, count):
        real = getattr(module, name)

        def traced(*args, **kwargs):
            count(*args, **kwargs)
            return real(*args, **kwargs)

        traced.__wrapped__ = real
        self._saved.append((module, name, real))
        setattr(module, name, traced)

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            n = _size(group)
            self._record("all-to-all", Fraction(_nbytes(input) * (n - 1), n))

        def all_gather(output, input, group=None, **kw):
            n = _size(group)
            self._record("all-gather", Fraction(_nbytes(output) * (n - 1), n))

        def reduce_scatter(output, input, op=None, group=None, **kw):
            n = _size(group)
            self._record("reduce-scatter", Fraction(_nbytes(input) * (n - 1), n))

        def all_reduce(tensor, op=None, group=None, **kw):
            n = _size(group)
            self._record("all-reduce", Fraction(2 * _nbytes(tensor) * (n - 1), n))

        def p2p(tensor, *a, **kw):
            self._record("p2p", _nbytes(tensor))

        # batch_isend_irecv issues each op through isend/irecv, and P2POp accepts only the
        # functions c10d itself holds: wrap them where c10d looks them up, and re-export.
        for name in ("isend", "send"):
            self._wrap(c10d, name, p2p)
            self._saved.append((dist, name, getattr(dist, name)))
            setattr(dist, name, getattr(c10d, name))
        self._wrap(dist, "all_to_all_single", a2a)
        self._wrap(dist, "all_gather_into_tensor", all_gather)
        self._wrap(dist, "reduce_scatter_tensor", reduce_scatter)
        self._wrap(dist, "all_reduce", all_reduce)
        return self

    def __exit__(self, *exc):
        while self._saved:
            module, name, real = self._saved.pop()
            setattr(module, name, real)
