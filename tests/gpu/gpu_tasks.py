"""What the GPU tests share (importable by name): how many GPUs there are and the skip marker
that says so (``needs_gpus``), and what each rank of an NCCL world runs."""

from __future__ import annotations

import pytest


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """Skip unless at least ``n`` CUDA GPUs are present, saying so."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPU{'s' if n > 1 else ''}, found {gpu_count()}")


def jax_on_gpu() -> bool:
    try:
        import jax
    except ImportError:
        return False
    return jax.default_backend() == "gpu"



def bf16_case_task(seq: int, heads: int, kv_heads: int, head_dim: int, mesh_axes: tuple, layout: str,
                   block_backend: str, seed: int) -> dict:
    """One bf16 causal case at long context: every rank builds the same global inputs, runs its
    shard through torch_impl, and compares its shard with a float32 single-GPU reference (SDPA on
    the same bf16-rounded values, autograd) and the bf16 single-GPU control (SDPA in bf16).
    Returns per-tensor (max error, tolerance) under the contract's (docs/contract.md) low-precision policy."""
    import torch
    import torch.nn.functional as F

    import torch_impl
    from parity.core.mesh import ring_position
    from parity.core.numerics import LOWP_ABS_FLOOR, LOWP_FACTOR
    from parity.runners.torch_runner import make_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)
    b = 1
    q, do = (torch.randn(b, seq, heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, seq, kv_heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(2))

    def dense(dtype):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)]
        qd, kd, vd = (x.transpose(1, 2) for x in leaves)
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True).transpose(1, 2)
        o.backward(do.to(dtype))
        return {"o": o.detach().float(), **{n: x.grad.float() for n, x in zip(("dq", "dk", "dv"), leaves)}}

    ref, control = dense(torch.float32), dense(torch.bfloat16)

    mesh = make_mesh("cuda", mesh_axes)
    sizes = dict(mesh_axes)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    ulysses = sizes.get("ulysses", 1)
    ring_coord, ring = ring_position(coords, sizes)  # the combined ring (double ring: o·I + i of O·I)
    perm = torch.as_tensor(torch_impl.layout_permutation(seq, layout, ring, ulysses), device=device)
    block = ring_coord * ulysses + coords.get("ulysses", 0)
    mine = perm[block * seq // (ring * ulysses):(block + 1) * seq // (ring * ulysses)]
    local = [x[:, mine].detach().clone().requires_grad_() for x in (q, k, v)]
    o = torch_impl.sequence_parallel_attention(*local, mesh, causal=True, layout=layout, block_backend=block_backend)
    o.backward(do[:, mine])
    torch.cuda.synchronize()
    got = {"o": o.detach().float(), **{n: x.grad.float() for n, x in zip(("dq", "dk", "dv"), local)}}
    out = {}
    for name, value in got.items():
        r, c = ref[name][:, mine], control[name][:, mine]
        err = float((value - r).abs().max())
        tol = LOWP_FACTOR * float((c - r).abs().max()) + LOWP_ABS_FLOOR["bfloat16"] * float(r.abs().max())
        out[name] = (err, tol)
    return out
