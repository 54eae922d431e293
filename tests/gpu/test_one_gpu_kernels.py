"""One GPU: every block backend of both frameworks through the block interface the strategies call
— forward and the backward with the given lse — for every mask kind (full, causal, strict) against
the portable kernel and a float64 truth (``parity.probes.kernels``, the contract's (docs/contract.md) low-precision
policy), at 4096-token blocks. A backend not installed here is skipped with its reason."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_tasks import jax_on_gpu, needs_gpus

pytestmark = [needs_gpus(1)]

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

    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
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



VERIFIED = [("jax", b) for b in ("reference", "cudnn", "fa3")] + [("torch", b) for b in ("reference", "aten_flash",
                                                                                          "aten_cudnn")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
@pytest.mark.parametrize("framework,backend", VERIFIED, ids=lambda x: x)
def test_block_backend_matches_float64_truth_at_4096_tokens(framework, backend, mask, dtype, seed):
    """MHA/GQA/MQA at d 128 and GQA at d 64, 4096 × 4096 (and for full masks the zigzag ring's 2048 × 4096 and
    4096 × 2048) through ``fwd`` then ``bwd``: every tensor within the policy of the truth."""
    if framework == "jax" and not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    from parity.probes import kernels

    # MHA / GQA / MQA at d 128, and GQA at d 64: every head layout and both head dims, without the
    # full product (each new shape costs a compilation).
    cases = [c for c in kernels.cases(4096, {framework: (backend,)}, [dtype], [64, 128])
             if c.mask == mask and (c.head_dim == 128 or (c.heads, c.kv_heads) == (8, 2))]
    results = kernels.verify(cases, seed, print)
    skipped = [r.status for r in results if r.status.startswith("skipped")]
    if backend == "fa3" and skipped and all("flash_attn3_jax" in s for s in skipped):
        pytest.skip(skipped[0])
    bad = [(r.case.tq, r.case.tk, r.status, {n: (t.max_abs, t.tolerance) for n, t in r.tensors.items() if not t.ok})
           for r in results if r.status != "pass"]
    assert not bad, bad
