"""Run-to-run determinism of ring attention per block kernel, on GPUs (or CPU):

    python -m parity determinism --devices gpu [--ring 2] [--seq 16384] [--repeats 5]
        [--kv-heads H] [--documents short|heavy-tail|few-long]

Each framework runs the same forward + backward ``--repeats`` times on identical inputs (ring over
``--ring`` devices, bf16, causal zigzag; with ``--documents`` the balance mix's packed documents,
its ids laid out like the tokens) for every block backend, and reports per tensor whether every
repeat is bitwise equal to the first. torch runs three modes (:data:`TORCH_MODES`): its default;
``torch.use_deterministic_algorithms(True)`` (strict: under warn-only torch's FA2 backward stays
atomic); and ``deterministic=True`` passed to the call with the switch off — which the call holds
on while its kernels run. Refused kernels raise in the last two (a finding, printed). Set
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` on GPUs (set here when absent). JAX reads
``--xla_gpu_deterministic_ops`` from XLA_FLAGS (run the command twice to compare). The findings
are in docs/decisions.md ("Determinism on GPUs"); ``NONDETERMINISTIC`` in each block.py is what
they found.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..core.names import Device

TENSORS = ("o", "dq", "dk", "dv")


@dataclass(frozen=True)
class TorchMode:
    """How a torch run asks for determinism: torch's global switch (strict) and the call's
    ``deterministic`` argument."""

    label: str
    switch: bool
    argument: bool | None


TORCH_MODES = (
    TorchMode("torch", False, None),
    TorchMode("torch (use_deterministic_algorithms)", True, None),
    TorchMode("torch (deterministic=True argument)", False, True),
)


def _mix(documents: str):
    from .balance import MIXES

    mixes = {m.name: m for m in MIXES}
    if documents not in mixes:
        raise ValueError(f"--documents takes one of {sorted(mixes)}, not {documents!r}")
    return mixes[documents]


def probe_ids(documents: str | None, seq: int, ring: int) -> np.ndarray | None:
    """[seq] int32 ids of the balance mix ``documents`` laid out as the ring's zigzag shards (rank r
    holds ``ids[r * seq // ring : (r + 1) * seq // ring]``), or None."""
    if documents is None:
        return None
    from seqplan.layouts import layout_permutation

    return _mix(documents).segment_ids(seq)[layout_permutation(seq, "zigzag", ring)].astype(np.int32)


def torch_task(backends, seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int, mode: TorchMode,
               documents: str | None = None) -> dict:
    """On every rank: {backend: {tensor: all repeats equal}} (or {backend: "error text"})."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic mode
    import torch
    import torch.distributed as dist

    import torch_impl

    from ..runners.torch_world import make_mesh

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = make_mesh(device.type, (("ring", n),))
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    shard = seq // n
    q, do = (torch.randn((1, shard, heads, head_dim), device=device, generator=gen).to(torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn((1, shard, kv_heads, head_dim), device=device, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    ids = probe_ids(documents, seq, n)
    segment_ids = None if ids is None else torch.as_tensor(ids[None, rank * shard:(rank + 1) * shard], device=device)
    out = {}
    torch.use_deterministic_algorithms(mode.switch)
    try:
        for backend in backends:
            try:
                runs = []
                for _ in range(repeats):
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    o = torch_impl.sequence_parallel_attention(qq, kk, vv, mesh, causal=True, layout="zigzag",
                                                               block_backend=backend, segment_ids=segment_ids,
                                                               deterministic=mode.argument)
                    o.backward(do)
                    runs.append({"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad})
                out[backend] = {t: all(torch.equal(r[t], runs[0][t]) for r in runs[1:]) for t in TENSORS}
            except Exception as err:  # noqa: BLE001 — a backend that refuses is a finding too
                out[backend] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        torch.use_deterministic_algorithms(False)
    return out


def jax_check(backends, ring: int, seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int,
              documents: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_impl

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ring]), ("ring",))
    sharding = NamedSharding(mesh, P(None, "ring", None, None))
    keys = jax.random.split(jax.random.key(1234), 4)
    shapes = ((1, seq, heads, head_dim), (1, seq, kv_heads, head_dim), (1, seq, kv_heads, head_dim),
              (1, seq, heads, head_dim))
    q, k, v, do = (jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), sharding)
                   for key, shape in zip(keys, shapes))
    ids = probe_ids(documents, seq, ring)
    ids = None if ids is None else jax.device_put(jnp.asarray(ids[None]), NamedSharding(mesh, P(None, "ring")))
    out = {}
    for backend in backends:
        try:
            @jax.jit
            def step(q, k, v, do, ids, backend=backend):
                o, vjp = jax.vjp(lambda q, k, v: jax_impl.sequence_parallel_attention(
                    q, k, v, mesh, causal=True, layout="zigzag", block_backend=backend, segment_ids=ids), q, k, v)
                return (o, *vjp(do))

            runs = [[np.asarray(x.astype(jnp.float32)) for x in step(q, k, v, do, ids)] for _ in range(repeats)]
            out[backend] = {t: all(np.array_equal(r[i], runs[0][i]) for r in runs[1:]) for i, t in enumerate(TENSORS)}
        except Exception as err:  # noqa: BLE001 — a backend that refuses is a finding too
            out[backend] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


def run_determinism(devices: Device = "cpu", ring: int = 2, seq: int = 16384, heads: int = 8, head_dim: int = 128,
                    repeats: int = 5, frameworks=("jax", "torch"), jax_backends=("reference", "cudnn", "fa3"),
                    torch_backends=("reference", "aten_flash", "aten_cudnn"), json_path: str | None = None,
                    kv_heads: int | None = None, documents: str | None = None) -> int:
    """``python -m parity determinism``: print per framework, backend and tensor whether every
    repeat equals the first (JAX must already be configured for ``devices``). ``kv_heads``:
    default ``heads``; ``documents``: a balance mix's name (packed documents) or None."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads or seq % (2 * ring):
        raise ValueError(f"--kv-heads must divide --heads and --seq must be a multiple of 2 * ring "
                         f"(got heads {heads}, kv_heads {kv_heads}, seq {seq}, ring {ring})")
    if documents is not None:
        _mix(documents)  # an unknown mix fails here, before any device work
    results = {}
    shape = (seq, heads, kv_heads, head_dim, repeats)
    if "jax" in frameworks:
        flags = os.environ.get("XLA_FLAGS", "")
        label = "jax" + (" (xla_gpu_deterministic_ops)" if "xla_gpu_deterministic_ops=true" in flags else "")
        results[label] = jax_check(list(jax_backends), ring, *shape, documents=documents)
    if "torch" in frameworks:
        from ..runners.torch_runner import world_backend
        from ..runners.torch_world import World

        with World(ring, world_backend(devices)[0], timeout_s=300) as world:
            for mode in TORCH_MODES:
                per_rank = world.run(torch_task, list(torch_backends), *shape, mode, documents)
                merged = {}
                for backend in per_rank[0]:
                    answers = [r[backend] for r in per_rank]
                    merged[backend] = next((a for a in answers if isinstance(a, str)), None) or {
                        t: all(a[t] for a in answers) for t in TENSORS}
                results[mode.label] = merged
    for label, per_backend in results.items():
        for backend, verdict in per_backend.items():
            text = verdict if isinstance(verdict, str) else "  ".join(
                f"{t} {'same' if same else 'DIFFERS'}" for t, same in verdict.items())
            print(f"{label:48s} {backend:11s} {text}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"seq": seq, "ring": ring, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                       "repeats": repeats, "documents": documents, "results": results}, f, indent=1)
    return 0
