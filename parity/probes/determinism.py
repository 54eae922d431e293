"""Run-to-run determinism of ring attention per block kernel, on GPUs (or CPU):

    python -m parity determinism --devices gpu [--ring 2] [--seq 16384] [--repeats 5]

Each framework runs the same forward + backward ``--repeats`` times on identical inputs (ring over
``--ring`` devices, bf16, causal zigzag) for every block backend, and reports per tensor whether
every repeat is bitwise equal to the first. torch also runs with
``torch.use_deterministic_algorithms(True)``; JAX reads ``--xla_gpu_deterministic_ops`` from
XLA_FLAGS (run the command twice to compare). The findings are in docs/decisions.md
("Determinism on GPUs"); ``NONDETERMINISTIC`` in each block.py is what they found.
"""

from __future__ import annotations

import json
import os

from ..core.names import Device

TENSORS = ("o", "dq", "dk", "dv")


def torch_task(backends, seq: int, heads: int, head_dim: int, repeats: int, deterministic: bool) -> dict:
    """On every rank: {backend: {tensor: all repeats equal}} (or {backend: "error text"})."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic mode
    import torch
    import torch.distributed as dist

    import torch_impl

    from ..runners.torch_world import make_mesh

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = dist.get_world_size()
    mesh = make_mesh(device.type, (("ring", n),))
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    shape = (1, seq // n, heads, head_dim)
    q, k, v, do = (torch.randn(shape, device=device, generator=gen).to(torch.bfloat16) for _ in range(4))
    out = {}
    torch.use_deterministic_algorithms(deterministic)
    try:
        for backend in backends:
            try:
                runs = []
                for _ in range(repeats):
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    o = torch_impl.sequence_parallel_attention(qq, kk, vv, mesh, causal=True, layout="zigzag",
                                                               block_backend=backend)
                    o.backward(do)
                    runs.append({"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad})
                out[backend] = {t: all(torch.equal(r[t], runs[0][t]) for r in runs[1:]) for t in TENSORS}
            except Exception as err:  # noqa: BLE001 — a backend that refuses is a finding too
                out[backend] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        torch.use_deterministic_algorithms(False)
    return out


def jax_check(backends, ring: int, seq: int, heads: int, head_dim: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_impl

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ring]), ("ring",))
    sharding = NamedSharding(mesh, P(None, "ring", None, None))
    keys = jax.random.split(jax.random.key(1234), 4)
    q, k, v, do = (jax.device_put(jax.random.normal(key, (1, seq, heads, head_dim), jnp.bfloat16), sharding)
                   for key in keys)
    out = {}
    for backend in backends:
        try:
            @jax.jit
            def step(q, k, v, do, backend=backend):
                o, vjp = jax.vjp(lambda q, k, v: jax_impl.sequence_parallel_attention(
                    q, k, v, mesh, causal=True, layout="zigzag", block_backend=backend), q, k, v)
                return (o, *vjp(do))

            runs = [[np.asarray(x.astype(jnp.float32)) for x in step(q, k, v, do)] for _ in range(repeats)]
            out[backend] = {t: all(np.array_equal(r[i], runs[0][i]) for r in runs[1:]) for i, t in enumerate(TENSORS)}
        except Exception as err:  # noqa: BLE001 — a backend that refuses is a finding too
            out[backend] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


def run_determinism(devices: Device = "cpu", ring: int = 2, seq: int = 16384, heads: int = 8, head_dim: int = 128,
                    repeats: int = 5, frameworks=("jax", "torch"), jax_backends=("reference", "cudnn", "fa3"),
                    torch_backends=("reference", "aten_flash", "aten_cudnn"), json_path: str | None = None) -> int:
    """``python -m parity determinism``: print per framework, backend and tensor whether every
    repeat equals the first (JAX must already be configured for ``devices``)."""
    results = {}
    shape = (seq, heads, head_dim, repeats)
    if "jax" in frameworks:
        flags = os.environ.get("XLA_FLAGS", "")
        label = "jax" + (" (xla_gpu_deterministic_ops)" if "xla_gpu_deterministic_ops=true" in flags else "")
        results[label] = jax_check(list(jax_backends), ring, *shape)
    if "torch" in frameworks:
        from ..runners.torch_runner import world_backend
        from ..runners.torch_world import World

        with World(ring, world_backend(devices)[0], timeout_s=300) as world:
            for deterministic in (False, True):
                per_rank = world.run(torch_task, list(torch_backends), *shape, deterministic)
                merged = {}
                for backend in per_rank[0]:
                    answers = [r[backend] for r in per_rank]
                    merged[backend] = next((a for a in answers if isinstance(a, str)), None) or {
                        t: all(a[t] for a in answers) for t in TENSORS}
                results["torch" + (" (use_deterministic_algorithms)" if deterministic else "")] = merged
    for label, per_backend in results.items():
        for backend, verdict in per_backend.items():
            text = verdict if isinstance(verdict, str) else "  ".join(
                f"{t} {'same' if same else 'DIFFERS'}" for t, same in verdict.items())
            print(f"{label:42s} {backend:11s} {text}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0
