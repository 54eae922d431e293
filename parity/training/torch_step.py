"""The FFN training step in torch: FSDP2 ``fully_shard`` and DTensor ``parallelize_module``
(Colwise W1, Rowwise W2) on the 2-D DeviceMesh ("fsdp", "tp") — gloo on CPU, NCCL on GPUs — and
explicit DP and ZeRO-1, each traced by ``parity.accounting.torch_trace`` per pass (fwd / bwd / step).

- FSDP, FSDP+TP: one ``fully_shard`` unit per Linear (one all-gather and one reduce-scatter per
  weight matrix, as the model counts), ``MixedPrecisionPolicy(param_dtype=reduce_dtype=dtype)``
  (float32 sharded master weights, ``dtype`` on the wire), reshard after forward (the backward
  gathers again), gradient divide factor 1 (the loss is already the global mean's share).
- TP only, DP, ZeRO-1: a ``dtype`` compute copy of the model and float32 master weights.
  DP all-reduces each gradient after the backward (DDP would bucket several into one call);
  ZeRO-1 reduce-scatters each gradient, steps Adam on this rank's float32 row block and
  all-gathers the updated ``dtype`` weights.
torch Linear stores W1 as ``w1.weight`` [F, D] = W1ᵀ (and W2 as [D, F]).
"""

from __future__ import annotations

import numpy as np

from ..runners.torch_world import get_world, make_mesh
from .reference import TrainCase, TrainInputs


def _build(case: TrainCase, inputs: TrainInputs | None, device):
    """The plain float32 stack; weights from ``inputs`` (or torch's default init when None)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class FFNBlock(nn.Module):
        def __init__(self, layer: int):
            super().__init__()
            self.w1 = nn.Linear(case.d_model, case.d_ff, bias=False, device=device)
            self.w2 = nn.Linear(case.d_ff, case.d_model, bias=False, device=device)
            if inputs is None:
                return
            with torch.no_grad():
                self.w1.weight.copy_(torch.from_numpy(inputs.w1[layer].T.copy()))
                self.w2.weight.copy_(torch.from_numpy(inputs.w2[layer].T.copy()))

        def forward(self, x):  # x: [T/X, D]
            return x + self.w2(F.gelu(self.w1(x), approximate="tanh"))

    return nn.Sequential(*[FFNBlock(i) for i in range(case.blocks)])


def _full(t):
    """A full tensor from a DTensor (a collective: call outside the traced region) or a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Rig:
    """One rank's sharded model, float32 master weights, optimizer and compute copy."""

    def __init__(self, case: TrainCase, inputs: TrainInputs | None, device_type: str):
        import copy

        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.case = case
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        self.dtype = dtype = getattr(torch, case.dtype)
        self.mesh = mesh = make_mesh(device_type, (("fsdp", case.fsdp), ("tp", case.tp)))
        self.fsdp_group = mesh.get_group("fsdp")
        self.xi = mesh.get_local_rank("fsdp")
        model = _build(case, inputs, self.device)
        if case.strategy in ("tp", "fsdp_tp"):
            for block in model:
                parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if case.strategy in ("fsdp", "fsdp_tp"):
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
            for block in model:
                fully_shard(block.w1, mesh=mesh["fsdp"], mp_policy=policy)
                fully_shard(block.w2, mesh=mesh["fsdp"], mp_policy=policy)
            fully_shard(model, mesh=mesh["fsdp"], mp_policy=policy)
            for module in model.modules():  # each unit reduces its own gradients: sum, not mean
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            self.master, self.compute = list(model.parameters()), None
        else:
            self.master = list(model.parameters())  # float32 (DTensor shards under TP)
            self.compute = copy.deepcopy(model).to(dtype)
            if case.strategy == "zero1":  # this rank's row block of each float32 weight
                self.master = [p.detach().chunk(case.fsdp, dim=0)[self.xi].clone().requires_grad_() for p in self.master]
        self.opt = torch.optim.Adam(self.master, lr=case.lr, foreach=False)
        self.run = self.compute if self.compute is not None else model

    def tokens(self, a):
        """This rank's rows of a [T, D] array."""
        n = self.case.tokens // self.case.fsdp
        return a[self.xi * n:(self.xi + 1) * n]

    def step(self, x, y, tracer):
        """Forward, backward, optimizer step, each pass under ``tracer.phase``; (loss, grads)."""
        import torch
        import torch.distributed as dist

        from torch_impl.comm import gather_shards

        case, group = self.case, self.fsdp_group
        with tracer.phase("fwd"):
            loss = 0.5 * torch.sum(torch.square(self.run(x).float() - y)) / case.tokens
        with tracer.phase("bwd"):
            loss.backward()
            grads = [p.grad for p in self.run.parameters()]
            if case.strategy == "dp":
                for g in grads:
                    dist.all_reduce(g, group=group)
            if case.strategy == "zero1":
                grads = [_reduce_scatter_rows(g, case.fsdp, group) for g in grads]
        with tracer.phase("step"):
            if self.compute is not None:
                for m, g in zip(self.master, grads):
                    m.grad = g.float()
            self.opt.step()
            with torch.no_grad():
                if case.strategy == "zero1":
                    for p, m in zip(self.compute.parameters(), self.master):
                        p.copy_(gather_shards(m.to(self.dtype), group).reshape(p.shape))
                elif self.compute is not None:
                    for p, m in zip(self.compute.parameters(), self.master):
                        p.copy_(m)
        return loss, grads


def step_task(case: TrainCase, inputs: TrainInputs, device_type: str) -> dict:
    """Runs on every rank: one traced training step. Rank 0 also returns the full gradients and
    updated weights; every rank returns its loss share, input gradient and traffic rows."""
    import logging

    import torch
    import torch.distributed as dist

    from ..accounting.torch_trace import CommTracer

    rig = _Rig(case, inputs, device_type)
    x = torch.from_numpy(rig.tokens(inputs.x)).to(rig.device, rig.dtype).requires_grad_()
    y = torch.from_numpy(rig.tokens(inputs.y)).to(rig.device)
    with CommTracer() as tracer:
        loss, grads = rig.step(x, y, tracer)
    out = {"coords": (rig.xi, rig.mesh.get_local_rank("tp")), "loss": float(loss), "dx": x.grad.detach().double().cpu().numpy(),
           "traffic": tracer.traffic.rows()}
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # 2-D gathers warn
    full = lambda ts: [_full(t).detach().double().cpu().numpy() for t in ts]
    master = rig.master
    if case.strategy == "zero1":
        grads, master = _gather_rows(grads, rig.fsdp_group), _gather_rows(master, rig.fsdp_group)
    weights = full(p.grad if rig.compute is None else g for p, g in zip(master, grads)), full(master)
    if dist.get_rank() == 0:
        out["grads"], out["weights"] = weights
    return out


def timed_step_task(case: TrainCase, device_type: str, warmup: int, iters: int) -> float:
    """Runs on every rank: median seconds per training step (random weights and tokens)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from ..accounting.torch_trace import CommTracer

    rig = _Rig(case, None, device_type)
    n = case.tokens // case.fsdp
    x = torch.randn(n, case.d_model, device=rig.device, dtype=rig.dtype, requires_grad=True)
    y = torch.randn(n, case.d_model, device=rig.device)
    times, untraced = [], CommTracer()  # never entered: its phases only label
    for i in range(warmup + iters):
        for p in rig.master:
            p.grad = None
        for p in rig.run.parameters():
            p.grad = None
        _sync(device_type)
        dist.barrier()
        start = time.perf_counter()
        rig.step(x, y, untraced)
        _sync(device_type)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()


def _reduce_scatter_rows(g, n: int, group):
    """This rank's row block of the sum over ranks of ``g`` (rows split into n blocks)."""
    from torch_impl.comm import scatter_shard_sums

    return scatter_shard_sums(g.reshape(n, g.shape[0] // n, *g.shape[1:]), group)


def _gather_rows(shards, group):
    from torch_impl.comm import gather_shards

    return [gather_shards(s.detach(), group).reshape(-1, *s.shape[1:]) for s in shards]


def _run(case: TrainCase, inputs: TrainInputs, devices: str) -> list[dict]:
    backend, device_type = ("nccl", "cuda") if devices == "gpu" else ("gloo", "cpu")
    return get_world(case.devices, backend).run(step_task, case, inputs, device_type)


def run_step(case: TrainCase, inputs: TrainInputs, *, devices: str = "cpu") -> dict[str, np.ndarray]:
    """One training step; the same keys as ``parity.training.reference.reference_step``."""
    ranks = _run(case, inputs, devices)
    first_tp = sorted((r for r in ranks if r["coords"][1] == 0), key=lambda r: r["coords"][0])
    root = next(r for r in ranks if "grads" in r)
    g, w = root["grads"], root["weights"]  # per block: w1.weight [F, D], w2.weight [D, F]
    return {"loss": np.array(sum(r["loss"] for r in first_tp)), "dx": np.concatenate([r["dx"] for r in first_tp]),
            "dw1": np.stack([a.T for a in g[0::2]]), "dw2": np.stack([a.T for a in g[1::2]]),
            "new_w1": np.stack([a.T for a in w[0::2]]), "new_w2": np.stack([a.T for a in w[1::2]])}


def measure_traffic(case: TrainCase, inputs: TrainInputs, *, devices: str = "cpu"):
    """Per-device ``Traffic`` of one step; every rank must report the same."""
    from ..accounting.torch_trace import same_on_every_rank

    per_rank = [r["traffic"] for r in _run(case, inputs, devices)]
    return same_on_every_rank(per_rank)
