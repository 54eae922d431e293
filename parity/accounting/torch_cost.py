"""What a torch step executes, counted op by op: FLOPs of every matrix product and bytes every
dispatcher op reads and writes, by class — torch's measurement of the step-time model
(``parity.training.step_model``), as ``hlo_cost`` is JAX's and ``torch_trace`` is torch's for
the communication model.

A ``TorchDispatchMode`` sees every aten op the step dispatches, autograd's backward and the
optimizer included. Rules (eager torch runs one kernel per op, so each op moves its own bytes):

- a view (an output that aliases an input: ``view``, ``t``, ``transpose``, ``expand``, ``slice``,
  ...) and an allocation (``empty*``) move nothing;
- any other op reads each tensor argument once (its elements × element size) and writes each
  output; an in-place op (``add_``, ``_foreach_mul_``, ...) writes the tensors it mutates;
  ``copy_`` reads its source and writes its destination; a ``_foreach_*`` op counts every
  tensor of its lists;
- FLOPs: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` = 2·m·n·k per product (class ``matmul``).

Classes: ``attention`` while :meth:`TorchCost.region` ("attention") is open (the caller wraps
the attention's forward and backward), likewise ``optimizer``; ``matmul`` for the products;
``other`` for the rest.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
        "_local_scalar_dense", "item", "is_nonzero", "set_", "resize_", "_has_compatible_shallow_copy_type",
        "record_stream", "_unsafe_view", "_record_function_enter_new", "_record_function_exit", "promote_types"}
MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
# Arguments a kernel does not stream: it gathers a few elements (or reads only the shape) —
# (op, argument index) -> read as many elements as the op's output has (None: nothing).
SPARSE_READS = {("embedding", 0): "output", ("nll_loss_forward", 0): "rows",
                ("nll_loss_backward", 1): None}


def _tensors(x):
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _matmul_flops(name: str, args, out) -> int:
    if name in ("mm", "bmm"):
        a = args[0]
    else:  # addmm / baddbmm (bias, a, b)
        a = args[1]
    k = a.shape[-1]
    return 2 * out.numel() * k


@dataclass
class TorchCost:
    """``with TorchCost() as cost: step()`` then ``cost.flops``, ``cost.bytes`` (by class) and
    ``cost.ops`` (by class and op name: [calls, bytes])."""

    flops: dict = field(default_factory=lambda: defaultdict(float))
    bytes: dict = field(default_factory=lambda: defaultdict(float))
    ops: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    log: list | None = None  # (class, op, moved bytes, argument shapes) of every op when a list is given
    _region: str | None = None
    _mode: object = None

    @contextlib.contextmanager
    def region(self, name: str):
        """Everything dispatched inside counts as class ``name`` (products too)."""
        previous, self._region = self._region, name
        try:
            yield self
        finally:
            self._region = previous

    def record(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[-1]
        if name in FREE:
            return
        schema = func._schema
        returns_alias = [r.alias_info for r in schema.returns]
        if returns_alias and all(a is not None and not a.is_write for a in returns_alias):
            return  # a view
        mutated = [t for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                          schema.arguments[len(args):]])
                   if arg.alias_info is not None and arg.alias_info.is_write for t in _tensors(value)]
        sparse = {i: how for (op, i), how in SPARSE_READS.items() if op == name}
        inputs = [t for i, a in enumerate(args) if i not in sparse for t in _tensors(a)] + _tensors(list(kwargs.values()))
        extra = 0
        for i, how in sparse.items():
            if how == "output":
                extra += sum(_nbytes(t) for t in _tensors(out))
            elif how == "rows":  # one element of each row
                extra += args[i].shape[0] * args[i].element_size()
        if name == "copy_":
            moved = _nbytes(args[1]) + _nbytes(args[0])
        elif name in ("zero_", "fill_") or name.startswith("_foreach_zero"):
            moved = sum(_nbytes(t) for t in mutated)
        else:
            outputs = [] if mutated and all(a is not None for a in returns_alias) else _tensors(out)
            moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs) + \
                sum(_nbytes(t) for t in mutated) + extra
        cls = self._region or ("matmul" if name in MATMUL else "other")
        if name in MATMUL:
            self.flops[cls] += _matmul_flops(name, args, out)
        self.bytes[cls] += moved
        if self.log is not None:
            self.log.append((cls, name, moved, [(tuple(t.shape), str(t.dtype)[6:]) for t in inputs + _tensors(out)]))
        entry = self.ops[(cls, name)]
        entry[0] += 1
        entry[1] += moved

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        cost = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                cost.record(func, args, kwargs, out)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False
