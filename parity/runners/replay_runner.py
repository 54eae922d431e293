"""Run a parity case through the one-device *replay* of its strategy (``jax_impl.replay`` /
``torch_impl.replay``): every virtual device's work of the case's mesh — the same schedule, block
kernels, merges, casts and float32 accumulators as the real loops — run device after device on
ONE device, the communication replaced by indexing into the resident global arrays.

``check_case`` uses a replay runner when a case needs more devices than are present (one GPU:
every multi-device case), so the same inputs, oracle and policy judge it; its verdict says
``mode="replay"``. Results are o, lse, dq, dk, dv as float64 NumPy arrays in original token order,
like every ``Runner``'s. A case with packed documents passes the global segment ids in layout order
(``segment_ids=``; nothing at all without), a case with a window its ``window=``, a case with
sinks the float32 ``sinks=`` [h] (the replays' grads then end with dsinks, every virtual device's
share summed), a token-index case its per-document zigzag (``permutation(case, x)``, per row) and
the global ``token_index=`` in layout order. jax, torch and the implementations are imported inside the methods.
"""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs, from_layout, permutation, to_layout, without_token_index
from ..core.names import Device
from .base import option_keywords
from .jax_control import dense_control

__all__ = ["JaxReplayRunner", "TorchReplayRunner", "strategy_of"]


def strategy_of(case: Case, module):
    """The ``Strategy`` of ``module`` (jax_impl.replay or torch_impl.replay) that stands for the
    case's mesh. A "data" axis only splits the batch: the replay runs the whole batch."""
    return module.Strategy(ring=case.ring, ulysses=case.ulysses, outer=case.ring_outer,
                           kv_exchange=case.kv_exchange)


def _keywords(case: Case, strategy, block_backend: str) -> dict:
    if case.shared_prefix:  # the replays gather every shard: the shared prefix runs on a mesh only
        raise ValueError("the one-device replay has no shared prefix (shared_prefix): run the case on its mesh")
    return dict(strategy=strategy, causal=case.causal, layout=case.layout, scale=case.scale,
                block_backend=block_backend, **option_keywords(window=case.window, softcap=case.softcap))


GRADS = ("dq", "dk", "dv", "dsinks")  # what replay_attention_grads returns (dsinks only with sinks)


class JaxReplayRunner:
    """``Runner`` replaying a case with ``jax_impl.replay`` on JAX's first device: forward and
    backward compiled as one program (as ``JaxRunner`` compiles the mesh run)."""

    mode = "replay"

    def __init__(self, block_backend: str = "auto"):
        self.block_backend = block_backend

    def device_count(self, devices: Device = "cpu") -> int:
        """The replay needs one device, whatever the mesh."""
        return 1_000_000

    def run_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> dict[str, np.ndarray]:
        import jax
        import jax.numpy as jnp

        from jax_impl import replay

        kw = _keywords(case, strategy_of(case, replay), self.block_backend)

        @jax.jit
        def forward_backward(q, k, v, do, dlse, ids, sinks, index):  # ids, sinks, index: arguments, or None
            kw_options = kw | option_keywords(segment_ids=ids, sinks=sinks, token_index=index)
            o, lse = replay.replay_attention(q, k, v, **kw_options)
            return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, dlse, **kw_options))

        perm = permutation(case, x)
        y = to_layout(x, perm)
        dtype = jnp.dtype(case.dtype)
        cast = [jnp.asarray(np.asarray(a, np.float32).astype(dtype)) for a in (y.q, y.k, y.v, y.do)]
        ids = None if y.segment_ids is None else jnp.asarray(y.segment_ids, jnp.int32)
        sinks = None if y.sinks is None else jnp.asarray(np.asarray(y.sinks, np.float32))
        index = None if y.token_index is None else jnp.asarray(y.token_index, jnp.int32)
        dlse = jnp.asarray(y.dlse, jnp.float32) if case.lse_cotangent else None  # None: o's cotangent alone
        out = forward_backward(*cast, dlse, ids, sinks, index)
        got = {n: np.asarray(t).astype(np.float64) for n, t in zip(("o", "lse", *GRADS), out)}
        return from_layout(got, perm)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        return dense_control(case, x)


def torch_device(devices: Device) -> str:
    """Where an in-process torch run goes: the current CUDA device for ``gpu``, else the CPU."""
    if devices == "gpu":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


class TorchReplayRunner:
    """``Runner`` replaying a case with ``torch_impl.replay`` in this process, on the GPU for
    ``devices="gpu"`` (else the CPU); its dense control runs on the same device."""

    mode = "replay"

    def __init__(self, block_backend: str = "auto", devices: Device = "cpu"):
        self.block_backend, self.devices = block_backend, devices

    def device_count(self, devices: Device = "cpu") -> int:
        return 1_000_000

    def _tensors(self, case: Case, arrays):
        import torch

        device, dtype = torch_device(self.devices), getattr(torch, case.dtype)
        return [torch.tensor(np.asarray(a, np.float32), device=device).to(dtype) for a in arrays]

    def run_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> dict[str, np.ndarray]:
        import torch

        from torch_impl import replay

        kw = _keywords(case, strategy_of(case, replay), self.block_backend)
        perm = permutation(case, x)
        y = to_layout(x, perm)
        q, k, v, do = self._tensors(case, (y.q, y.k, y.v, y.do))
        dlse = torch.tensor(np.asarray(y.dlse, np.float32), device=q.device) if case.lse_cotangent else None
        ids = None if y.segment_ids is None else torch.tensor(y.segment_ids, device=q.device)
        sinks = None if y.sinks is None else torch.tensor(np.asarray(y.sinks, np.float32), device=q.device)
        index = None if y.token_index is None else torch.tensor(y.token_index, device=q.device)
        kw |= option_keywords(segment_ids=ids, sinks=sinks, token_index=index)
        with torch.no_grad():
            o, lse = replay.replay_attention(q, k, v, **kw)
            grads = replay.replay_attention_grads(q, k, v, o, lse, do, dlse, **kw)
        out = {"o": o, "lse": lse} | dict(zip(GRADS, grads))
        return from_layout({n: t.detach().double().cpu().numpy() for n, t in out.items()}, perm)

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's dtype on the replay's device (the low-precision control; with
        the case's documents: dense ids in original order; its window and sinks, dsinks by
        autograd)."""
        import torch

        import torch_impl

        x = without_token_index(x)
        q, k, v, do = self._tensors(case, (x.q, x.k, x.v, x.do))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ids = None if x.segment_ids is None else torch.tensor(x.segment_ids, device=q.device)
        sinks = None if x.sinks is None else torch.tensor(np.asarray(x.sinks, np.float32), device=q.device,
                                                          requires_grad=True)
        o, lse = torch_impl.dense_attention(q, k, v, causal=case.causal, scale=case.scale,
                                            **option_keywords(segment_ids=ids, window=case.window, sinks=sinks,
                                                              softcap=case.softcap))
        torch.autograd.backward((o, lse), (do, torch.tensor(np.asarray(x.dlse, np.float32), device=q.device)))
        out = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        out |= {} if sinks is None else {"dsinks": sinks.grad}
        return {n: t.detach().double().cpu().numpy() for n, t in out.items()}
