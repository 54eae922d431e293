"""Run one parity case with torch_impl: gloo worker processes on CPU (NCCL on GPUs).

The parent slices nothing: every rank receives the global inputs (layout order, NumPy), takes
its own shard by its mesh coordinates, runs forward and backward, and returns its shard of the
results, which the parent stitches back together in original order. Attention sinks are the full
[h] tensor on every rank and each rank's ``sinks.grad`` is its own rows' contribution (the API's
contract): the parent sums them into the full dsinks. torch and torch_impl are
imported inside the functions (the workers import them; the parent only for the control).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np

from seqplan.layouts import static_token_index

from ..core.cases import Case
from ..core.inputs import (
    SINK_TENSORS,
    Inputs,
    case_tensors,
    from_layout,
    permutation,
    to_layout,
    without_token_index,
)
from ..core.names import Device
from .base import option_keywords, shared_keywords
from .torch_world import get_world, make_mesh

__all__ = ["TorchRunner", "RUNNER", "make_mesh", "rank_task", "traffic_task", "measure_attention_traffic",
           "world_backend"]


def world_backend(devices: Device) -> tuple[str, str]:
    """(process-group backend, device type) for ``devices``."""
    return ("nccl", "cuda") if devices == "gpu" else ("gloo", "cpu")


def _shard(x: np.ndarray, case: Case, coords: dict, seq_dim: int) -> np.ndarray:
    """This rank's block: batch block of "data", sequence block r*U + u."""
    b = x.shape[0] // case.data
    t = x.shape[seq_dim] // (case.ring * case.ulysses)
    block, d = case.sequence_block(coords), coords.get("data", 0)
    x = x[d * b:(d + 1) * b]
    return np.take(x, np.arange(block * t, (block + 1) * t), axis=seq_dim)


def _device(device_type: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


HOST_IDS_ENV = "RINGBRIDGE_HOST_IDS"  # "1": the harness's torch calls read the batch's ids from the host


def host_ids_if_asked(segment_ids, token_index=None):
    """``torch_impl.host_ids(segment_ids, token_index)`` when ``RINGBRIDGE_HOST_IDS=1`` and there
    are ids, else None — the one reading of that switch, for this runner's checks and the
    benchmark's timed rows (a row and its check run the same path)."""
    if os.environ.get(HOST_IDS_ENV) != "1" or segment_ids is None:
        return None
    import torch_impl

    return torch_impl.host_ids(segment_ids, token_index)


def host_ids_block(x: Inputs, case: Case, coords: dict):
    """:func:`host_ids_if_asked` over this rank's data block of the global ids (and token
    indices), or a block that does nothing."""
    if x.segment_ids is None:
        return contextlib.nullcontext()
    b, d = x.segment_ids.shape[0] // case.data, coords.get("data", 0)
    rows = lambda a: None if a is None else a[d * b:(d + 1) * b]
    return host_ids_if_asked(rows(x.segment_ids), rows(x.token_index)) or contextlib.nullcontext()


def rank_task(case: Case, x: Inputs, device_type: str, block_backend: str) -> dict:
    """Runs on every rank: forward + backward of this rank's shard (with this rank's shard of the
    segment ids, [b/D, t/(R·U)] int32 in layout order, when the case has packed documents, and of
    the token indices, likewise, when it passes them; the case's window; the full float32 sinks [h]
    when it has sinks); returns its shards and, with sinks, this rank's ``sinks.grad`` as "dsinks"."""
    import torch

    import torch_impl

    mesh = make_mesh(device_type, tuple(case.mesh_axes.items()))
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    device, dtype = _device(device_type), getattr(torch, case.dtype)

    def local(arr, seq_dim=1, dt=dtype, grad=False):
        t = torch.tensor(_shard(arr, case, coords, seq_dim), dtype=torch.float32, device=device).to(dt)
        return t.requires_grad_(grad)

    q, k, v = (local(a, grad=True) for a in (x.q, x.k, x.v))
    ids = None if x.segment_ids is None else torch.tensor(_shard(x.segment_ids, case, coords, 1), device=device)
    index = None if x.token_index is None else torch.tensor(_shard(x.token_index, case, coords, 1), device=device)
    sinks = None if x.sinks is None else torch.tensor(x.sinks, dtype=torch.float32, device=device, requires_grad=True)
    with host_ids_block(x, case, coords):
        o, lse = torch_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=case.causal, layout=case.layout, scale=case.scale, kv_exchange=case.kv_exchange,
            return_lse=True, block_backend=block_backend,
            **option_keywords(segment_ids=ids, window=case.window, sinks=sinks, softcap=case.softcap, token_index=index),
            **shared_keywords(case, x.segment_ids))  # x: the global arrays in layout order, the same on every rank
    if case.lse_cotangent:
        torch.autograd.backward((o, lse), (local(x.do), local(x.dlse, seq_dim=2, dt=torch.float32)))
    else:  # o's cotangent alone, as a training step: the kernels get no dlse
        o.backward(local(x.do))
    out = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:  # this rank's contribution (None: its rows never reached the sinks, impossible)
        out["dsinks"] = sinks.grad
    return {"coords": coords, **{n: t.detach().float().cpu().numpy() for n, t in out.items()}}


def _stitch(case: Case, shards: list[dict]) -> dict[str, np.ndarray]:
    """Reassemble per-rank shards into global layout-order arrays; dsinks, every rank's
    contribution, summed (in float64, rank order)."""
    def key(s):
        return s["coords"].get("data", 0), case.sequence_block(s["coords"])

    out = {}
    for name in case_tensors(case):
        if name in SINK_TENSORS:
            out[name] = np.sum([s[name].astype(np.float64) for s in sorted(shards, key=key)], axis=0)
            continue
        seq_dim = 2 if name == "lse" else 1
        rows: dict[int, list] = {}
        for s in sorted(shards, key=key):
            rows.setdefault(key(s)[0], []).append(s[name])
        out[name] = np.concatenate([np.concatenate(rows[d], axis=seq_dim) for d in sorted(rows)], axis=0)
    return {n: a.astype(np.float64) for n, a in out.items()}


class TorchRunner:
    """``Runner`` for torch_impl: ``task`` runs on every rank of a cached world of the case's
    size (replaceable by fault-injection tests)."""

    def __init__(self, block_backend: str = "auto", task=rank_task):
        self.block_backend, self.task = block_backend, task

    def device_count(self, devices: Device = "cpu") -> int:
        """GPUs for NCCL worlds; on CPU a gloo world can have any number of processes (8 is what
        the matrix needs and what 2 cores tolerate)."""
        if devices == "gpu":
            import torch

            return torch.cuda.device_count()
        return 8

    def run_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> dict[str, np.ndarray]:
        """o, lse, dq, dk, dv from ``torch_impl.sequence_parallel_attention``, in original order."""
        return self.start_case(case, x, devices=devices)()

    def start_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> Callable[[], dict[str, np.ndarray]]:
        """Start the case on its world's ranks and return at once; calling the result waits for
        them and gives what ``run_case`` gives (``check_case`` overlaps this with other work)."""
        backend, device_type = world_backend(devices)
        perm = permutation(case, x)  # [t], or [b, t] for a token-index case (the per-document zigzag)
        world = get_world(case.devices, backend)
        world.submit(self.task, case, to_layout(x, perm), device_type, self.block_backend)
        return lambda: from_layout(_stitch(case, world.collect()), perm)

    def replay(self, devices: Device = "cpu"):
        """The same backend replaying a case in this process on one device (the GPU for
        ``gpu``): ``parity.runners.replay_runner.TorchReplayRunner``."""
        from .replay_runner import TorchReplayRunner

        return TorchReplayRunner(self.block_backend, devices)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's own dtype, in this process: the low-precision control (with
        the case's documents: dense ids in original order; its window and sinks, dsinks by
        autograd)."""
        import torch

        import torch_impl

        dtype, x = getattr(torch, case.dtype), without_token_index(x)
        q, k, v = (torch.tensor(a, dtype=torch.float32).to(dtype).requires_grad_() for a in (x.q, x.k, x.v))
        ids = None if x.segment_ids is None else torch.tensor(x.segment_ids)
        sinks = None if x.sinks is None else torch.tensor(x.sinks, dtype=torch.float32, requires_grad=True)
        o, lse = torch_impl.dense_attention(q, k, v, causal=case.causal, scale=case.scale,
                                            **option_keywords(segment_ids=ids, window=case.window, sinks=sinks,
                                                              softcap=case.softcap))
        torch.autograd.backward((o, lse), (torch.tensor(x.do, dtype=torch.float32).to(dtype),
                                           torch.tensor(x.dlse, dtype=torch.float32)))
        out = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        out |= {} if sinks is None else {"dsinks": sinks.grad}
        return {n: t.detach().double().numpy() for n, t in out.items()}


RUNNER = TorchRunner()


def traffic_task(case: Case, device_type: str, return_lse: bool) -> dict:
    """Runs on every rank: forward and backward of random shards (and, with packed documents, local
    segment ids of one document: the ids' values change no byte; with token indices, this rank's
    shard of the static layout's; the case's window; with sinks,
    random float32 sinks [h] that take a gradient) under the comm tracer; returns this rank's
    traffic rows."""
    import torch

    import torch_impl

    from ..accounting.torch_trace import CommTracer

    mesh = make_mesh(device_type, tuple(case.mesh_axes.items()))
    b = case.batch // case.data
    t = case.seq // (case.ring * case.ulysses)
    dtype, device = getattr(torch, case.dtype), _device(device_type)
    q = torch.randn(b, t, case.heads, case.head_dim, device=device).to(dtype).requires_grad_()
    k, v = (torch.randn(b, t, case.kv_heads, case.head_dim, device=device).to(dtype).requires_grad_() for _ in range(2))
    ids = None if case.documents == "none" else torch.zeros(b, t, dtype=torch.int32, device=device)
    index = None
    if case.token_index:  # this rank's shard of the static layout's indices (their values change no byte either)
        coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        static = static_token_index(case.seq, case.layout, case.ring, case.batch, case.ulysses)
        index = torch.tensor(_shard(static, case, coords, 1), device=device)
    sinks = torch.randn(case.heads, device=device).requires_grad_() if case.sinks else None
    with CommTracer() as tracer:
        out = torch_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=case.causal, layout=case.layout, kv_exchange=case.kv_exchange, scale=case.scale,
            return_lse=return_lse, **option_keywords(segment_ids=ids, window=case.window, sinks=sinks,
                                                     softcap=case.softcap, token_index=index))
        outputs = out if return_lse else (out,)
        with tracer.phase("bwd"):
            torch.autograd.backward(outputs, [torch.randn_like(x) for x in outputs])
    return tracer.traffic.rows()


def measure_attention_traffic(case: Case, *, devices: Device = "cpu", return_lse: bool = True):
    """Per-device ``Traffic`` of torch_impl for ``case``; every rank must report the same."""
    from ..accounting.torch_trace import same_on_every_rank

    backend, device_type = world_backend(devices)
    per_rank = get_world(case.devices, backend).run(traffic_task, case, device_type, return_lse)
    return same_on_every_rank(per_rank)
