"""GPU: torch_impl over NCCL on 4 GPUs at 16k tokens, bf16, causal, against a float32
single-GPU reference, with the bf16 single-GPU SDPA as the low-precision control (DESIGN.md's
policy: max error ≤ 2 × the control's + a quarter-ulp floor). Skipped without 4 CUDA GPUs; run
through the device tool: ``JAX_PLATFORMS=cuda python -m pytest -m gpu tests/gpu`` (the
conftest puts JAX on simulated CPU devices unless JAX_PLATFORMS says otherwise)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs"),
]

from gpu_tasks import bf16_case_task  # noqa: E402

SEQ, HEADS, KV_HEADS, HEAD_DIM = 16384, 8, 2, 128
MESHES = {
    "ring4-zigzag": ((("ring", 4),), "zigzag"),
    "ring4-stripe": ((("ring", 4),), "stripe"),
    "ring4-contiguous": ((("ring", 4),), "contiguous"),
    "ulysses4": ((("ulysses", 4),), "zigzag"),
    "usp-r2xu2": ((("ring", 2), ("ulysses", 2)), "zigzag"),
    "double-ring-2x2": ((("ring_outer", 2), ("ring_inner", 2)), "zigzag"),
}


@pytest.fixture(scope="module")
def nccl_world():
    """A getter, not a world: a failed case closes its world, and the next case gets a new one."""
    from parity.runners.torch_world import close_worlds, get_world

    yield lambda: get_world(4, "nccl")
    close_worlds()


@pytest.mark.parametrize("backend", ["aten_flash", "aten_cudnn"])
@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
def test_gpu_block_kernel_matches_portable_kernel(backend, mask):
    """One process, one GPU: the CUDA SDPA adapters (GQA expansion, strict mask by row shift,
    LSE shape) agree with the portable kernel on the same bf16 inputs, forward and backward."""
    from torch_impl.block import get_backend
    from torch_impl.schedule import BlockMask as Mask

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, hk, d = 1, 256, 8, 2, 128
    q, do = (torch.randn(b, t, h, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, t, hk, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    m = Mask(mask)
    ref, fast = get_backend("reference"), get_backend(backend)
    o_r, lse_r = ref.fwd(q, k, v, m, d**-0.5)
    o_f, lse_f = fast.fwd(q, k, v, m, d**-0.5)
    assert o_f.shape == o_r.shape and lse_f.shape == lse_r.shape == (b, h, t)
    torch.testing.assert_close(o_f.float(), o_r, atol=2e-2, rtol=2e-2)  # o comes back in bf16
    torch.testing.assert_close(lse_f, lse_r, atol=2e-3, rtol=1e-3)
    o = o_r.bfloat16()
    for g_f, g_r in zip(fast.bwd(do, q, k, v, o, lse_r, m, d**-0.5), ref.bwd(do, q, k, v, o, lse_r, m, d**-0.5)):
        torch.testing.assert_close(g_f.float(), g_r, atol=5e-2, rtol=5e-2)  # MHA grads come back in bf16


@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
def test_gpu_jax_cudnn_block_kernel_matches_portable_kernel(mask):
    """One GPU: jax_impl's cuDNN block kernels (the backward bound to cuDNN's primitive with the
    *given* o and lse) agree with the portable kernel on the same bf16 inputs."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from jax_impl.block import get_backend
    from jax_impl.schedule import BlockMask as Mask

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here")
    rng = np.random.default_rng(0)
    b, t, h, hk, d = 1, 256, 8, 2, 128
    q, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, hk, d)), jnp.bfloat16) for _ in range(2))
    m, scale = Mask(mask), d**-0.5
    ref, fast = get_backend("reference"), get_backend("cudnn")
    o_r, lse_r = ref.fwd(q, k, v, m, scale)
    o_f, lse_f = jax.jit(lambda q, k, v: fast.fwd(q, k, v, m, scale))(q, k, v)
    assert o_f.shape == o_r.shape and lse_f.shape == lse_r.shape == (b, h, t)
    np.testing.assert_allclose(np.asarray(o_f), np.asarray(o_r), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse_f), np.asarray(lse_r), atol=2e-3, rtol=1e-3)
    o = o_r.astype(jnp.bfloat16)
    fast_grads = jax.jit(lambda *a: fast.bwd(*a, m, scale))(do, q, k, v, o, lse_r)
    for g_f, g_r in zip(fast_grads, ref.bwd(do, q, k, v, o, lse_r, m, scale)):
        np.testing.assert_allclose(np.asarray(g_f), np.asarray(g_r), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["aten_flash", "aten_cudnn", "reference"])
@pytest.mark.parametrize("name", list(MESHES))
def test_bf16_causal_16k_matches_fp32_reference(name, backend, nccl_world, seed):
    axes, layout = MESHES[name]
    results = nccl_world().run(bf16_case_task, SEQ, HEADS, KV_HEADS, HEAD_DIM, axes, layout, backend, seed)
    lines = [f"rank {r} {t}: err {e:.3e} tol {tol:.3e}" for r, res in enumerate(results) for t, (e, tol) in res.items()]
    print(f"\n{name} {backend}:\n" + "\n".join(lines))
    assert all(e <= tol for res in results for e, tol in res.values()), "\n".join(lines)
