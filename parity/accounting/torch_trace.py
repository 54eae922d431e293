"""A tracer for torch.distributed: records, per pass, every collective this rank issues — kind,
calls and bytes on the wire by the contract's (docs/contract.md) definition — into a ``Traffic``.

torch's own CommDebugMode counts calls, not bytes. This tracer sees collectives where every API
ends up — the dispatcher ops of c10d (``all_gather_into_tensor``/``all_gather_single``,
``reduce_scatter_*``, ``all_reduce``, ``all_to_all_single``, whatever Python function issued them)
and of the functional collectives DTensor uses (``_c10d_functional.*``) — through a
``TorchDispatchMode``, and p2p at its Python entry points (``isend``/``send``, which
``batch_isend_irecv`` goes through). Bytes are *logical* (gloo emulates reduce-scatter with an
all-reduce internally; the trace records the reduce-scatter the caller asked for). A collective
over a group of one moves nothing and is not recorded (XLA removes those too).
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

from .model import Traffic


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    """Size of a c10d op's process group (a ScriptObject) or a functional op's group name."""
    import torch.distributed as dist

    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    return dist.ProcessGroup.unbox(group).size()


def _sized(op: str, args):
    """(kind, group size, bytes) of one dispatcher collective, None for ops that move nothing."""
    n = lambda i: _group_size(args[i])
    if op in ("c10d.send",):  # tensors, pg, dst, tag
        return "p2p", n(1), sum(_nbytes(t) for t in args[0])
    if op == "c10d._allgather_base_":  # output, input, pg
        return "all-gather", n(2), Fraction(_nbytes(args[0]) * (n(2) - 1), n(2))
    if op == "c10d._reduce_scatter_base_":  # output, input, pg, op
        return "reduce-scatter", n(2), Fraction(_nbytes(args[1]) * (n(2) - 1), n(2))
    if op == "c10d.allreduce_":  # tensors, pg, op
        return "all-reduce", n(1), Fraction(2 * sum(_nbytes(t) for t in args[0]) * (n(1) - 1), n(1))
    if op == "c10d.alltoall_base_":  # output, input, pg, splits
        return "all-to-all", n(2), Fraction(_nbytes(args[1]) * (n(2) - 1), n(2))
    if op in ("_c10d_functional.all_reduce", "_c10d_functional.all_reduce_"):  # input, reduce op, group
        return "all-reduce", n(2), Fraction(2 * _nbytes(args[0]) * (n(2) - 1), n(2))
    if op == "_c10d_functional.all_gather_into_tensor":  # input, group size, group
        return "all-gather", n(2), _nbytes(args[0]) * (n(2) - 1)
    if op == "_c10d_functional.reduce_scatter_tensor":  # input, reduce op, group size, group
        return "reduce-scatter", n(3), Fraction(_nbytes(args[0]) * (n(3) - 1), n(3))
    if op == "_c10d_functional.all_to_all_single":  # input, out splits, in splits, group
        return "all-to-all", n(3), Fraction(_nbytes(args[0]) * (n(3) - 1), n(3))
    if op in _MOVES_NOTHING:
        return None
    raise NotImplementedError(f"CommTracer cannot size {op}; add it to parity.accounting.torch_trace")


# recv_: its bytes are the peer's send; wait/wrap/barrier carry no payload.
_MOVES_NOTHING = {"c10d.recv_", "c10d.recv_any_source_", "c10d.barrier", "c10d.monitored_barrier_",
                  "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"}


class CommTracer:
    """``with CommTracer() as tr: ...; with tr.phase("bwd"): ...`` then ``tr.traffic``.

    Active for everything this thread dispatches, autograd's backward included."""

    def __init__(self):
        self.traffic = Traffic()
        self.pass_ = "fwd"
        self._mode = None

    @contextlib.contextmanager
    def phase(self, pass_: str):
        previous, self.pass_ = self.pass_, pass_
        try:
            yield self
        finally:
            self.pass_ = previous

    def _record(self, func, args) -> None:
        namespace = func.namespace
        if namespace not in ("c10d", "_c10d_functional"):
            return
        found = _sized(f"{namespace}.{func._opname}", args)
        if found and found[1] > 1:
            kind, _, nbytes = found
            self.traffic.add(self.pass_, kind, Fraction(nbytes))

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tracer._record(func, args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._mode = None


def same_on_every_rank(per_rank: list[dict]) -> Traffic:
    """The ``Traffic`` all ranks reported (``Traffic.rows()`` each); ranks that moved different
    traffic are an error — the model is per device and the same for all."""
    if any(rows != per_rank[0] for rows in per_rank):
        raise AssertionError(f"ranks moved different traffic: {per_rank}")
    traffic = Traffic()
    for (pass_, kind), (calls, nbytes) in per_rank[0].items():
        traffic.add(pass_, kind, nbytes, calls)
    return traffic
