"""Unit — logit soft-capping (``softcap``, Gemma 2) at the block layer of both frameworks: the
value is checked before anything runs; ``"auto"`` routes a capped block only to a kernel that
applies the cap (the portable one here; every fused backend's ``supports`` refuses it, even with
every fused kernel made available as on a CUDA machine); a fused backend named explicitly runs
capped blocks on the portable kernel — its own op is never called, so it never computes
uncapped attention — and a fused kernel handed ``softcap=`` directly fails loudly. The capped
kernels themselves are checked against float64 in test_blockwise_reference.py, whole calls
against the oracle in the parity tiers."""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp

import jax_impl.block as jblock
import torch_impl.block as tblock
from jax_impl.config import AttentionConfig as JaxConfig
from jax_impl.kernels.fused import fused_backend
from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
from seqplan.schedule import BLOCK_MASKS, BlockMask
from seqplan.validation import check_softcap
from torch_impl.config import AttentionConfig as TorchConfig

JAX_FUSED = ("cudnn", "fa3", "fa3_varlen", "cudnn_varlen")
TORCH_FUSED = ("aten_cpu", "aten_flash", "aten_cudnn", "aten_varlen", "aten_window")
# every static kind, with and without documents and a window
MASKS = [BlockMask(m.kind, documents=d, window=w) for m in BLOCK_MASKS for d in (False, True) for w in (None, (3, 1))]
DTYPES = ("bfloat16", "float16", "float32")


def test_softcap_is_a_positive_finite_float_or_none():
    assert check_softcap(None) is None
    for ok in (50, 0.05, np.float32(2.5), 1e9):
        assert check_softcap(ok) == float(ok) and isinstance(check_softcap(ok), float)
    for bad in ("30", True, [1.0], np.ones(2), object()):
        with pytest.raises(TypeError, match="softcap must be None or a positive float"):
            check_softcap(bad)
    for bad in (0, 0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="softcap must be a finite positive number"):
            check_softcap(bad)
    for config in (JaxConfig, TorchConfig):
        assert config(True, "zigzag", 0.25, softcap=30).softcap == 30.0
        assert config(True, "zigzag", 0.25).softcap is None
        with pytest.raises(ValueError, match="softcap"):
            config(True, "zigzag", 0.25, softcap=-2.0)


@contextlib.contextmanager
def available_everywhere(block, names):
    """The real backends ``names`` (their kernels and ``supports``) made available, as on a CUDA
    machine with every optional kernel installed; the originals restored after."""
    originals = {n: block.get_backend(n) for n in names}
    try:
        for backend in originals.values():
            block.register_backend(block.BlockBackend(backend.name, backend.fwd, backend.bwd,
                                                      supports=backend.supports, available=lambda: True))
        yield
    finally:
        for backend in originals.values():
            block.register_backend(backend)


@pytest.mark.parametrize("block, fused", [(jblock, JAX_FUSED), (tblock, TORCH_FUSED)], ids=["jax", "torch"])
def test_auto_routes_capped_blocks_only_to_a_kernel_that_caps(block, fused):
    """Every fused backend refuses soft-capping for every mask and dtype, the portable kernel
    takes it; on CUDA with every fused kernel available, "auto" sends each capped block (every
    mask, dtype, determinism) to the portable kernel while the same block uncapped goes to a
    fused one (so the availability here is real); a named fused backend resolves to it too."""
    for name in fused:
        assert not any(block.get_backend(name).supports(m, d, softcap=True) for m in MASKS for d in DTYPES), name
    assert all(block.get_backend("reference").supports(m, d, softcap=True) for m in MASKS for d in DTYPES)
    with available_everywhere(block, fused):
        uncapped = set()
        for mask, dtype, det in itertools.product(MASKS, ("bfloat16", "float16"), (False, True)):
            kw = dict(device_kind="cuda", dtype=dtype, mask=mask, deterministic=det)
            uncapped.add(block.resolve_backend("auto", **kw))
            assert block.resolve_backend("auto", softcap=True, **kw) == "reference", (mask, dtype, det)
        assert uncapped & set(fused), "no fused kernel was reachable: the check above proves nothing"
        for name in fused:
            if name != "aten_cudnn":  # refused in deterministic mode, not the point here
                assert block.resolve_backend(name, device_kind="cuda", dtype="bfloat16", mask=MASKS[0],
                                             softcap=True) == "reference"


def test_a_named_fused_jax_backend_never_runs_capped_blocks_itself(monkeypatch):
    """A fused adapter (fused.py, on an op pair that computes plain uncapped attention and counts
    its calls) named explicitly with a softcap: forward and backward equal the portable kernel's
    capped results for every mask, and its op is never called; without a softcap it is. A fused
    kernel handed ``softcap=`` directly raises (a TypeError) rather than ignoring it."""
    calls = []

    def fwd_op(q, k, v, causal, scale):
        calls.append("fwd")
        return reference_block_fwd(q, k, v, BLOCK_MASKS[1] if causal else BLOCK_MASKS[0], scale)

    def bwd_op(do, q, k, v, o, lse, causal, scale):
        calls.append("bwd")
        return reference_block_bwd(do, q, k, v, o, lse, BLOCK_MASKS[1] if causal else BLOCK_MASKS[0], scale)

    monkeypatch.setitem(jblock._BACKENDS, "plain_fused", fused_backend("plain_fused", fwd_op, bwd_op))
    rng = np.random.default_rng(3)
    q, do = (jnp.asarray(rng.standard_normal((1, 8, 4, 16)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.bfloat16) for _ in range(2))
    capped = jblock.get_backend("plain_fused", softcap=0.8)
    for mask in BLOCK_MASKS:
        o, lse = capped.fwd(q, k, v, mask, 0.25)
        grads = capped.bwd(do, q, k, v, o, lse, mask, 0.25, None)
        o_r, lse_r = reference_block_fwd(q, k, v, mask, 0.25, softcap=0.8)
        want = (o_r, lse_r, *reference_block_bwd(do, q, k, v, o_r, lse_r, mask, 0.25, softcap=0.8))
        for got, w in zip((o, lse, *grads), want):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
        o_u, _ = reference_block_fwd(q, k, v, mask, 0.25)
        assert np.abs(np.asarray(o_u, np.float32) - np.asarray(o, np.float32)).max() > 0.05  # the cap shows
    assert calls == []
    jblock.get_backend("plain_fused").fwd(q, k, v, BLOCK_MASKS[0], 0.25)
    assert calls == ["fwd"]
    with pytest.raises(TypeError, match="softcap"):
        jblock.get_backend("cudnn").fwd(q, k, v, BLOCK_MASKS[0], 0.25, softcap=0.8)


def test_a_named_aten_backend_runs_capped_blocks_on_the_portable_kernel():
    """torch's aten_cpu (a real fused kernel on this CPU) named with a softcap gives the portable
    kernel's capped results, forward and backward, for every static mask — not its own uncapped
    ones, which differ; handed ``softcap=`` directly it raises."""
    gen = torch.Generator().manual_seed(4)
    q, do = (torch.randn(1, 8, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 8, 2, 16, generator=gen) for _ in range(2))
    capped, plain, ref = (tblock.get_backend("aten_cpu", softcap=0.8), tblock.get_backend("aten_cpu"),
                          tblock.get_backend("reference"))
    for mask in BLOCK_MASKS:
        o, lse = capped.fwd(q, k, v, mask, 0.25)
        grads = capped.bwd(do, q, k, v, o, lse, mask, 0.25)
        o_r, lse_r = ref.fwd(q, k, v, mask, 0.25, softcap=0.8)
        want = (o_r, lse_r, *ref.bwd(do, q, k, v, o_r, lse_r, mask, 0.25, softcap=0.8))
        for got, w in zip((o, lse, *grads), want):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
        assert (plain.fwd(q, k, v, mask, 0.25)[0] - o).abs().max() > 0.05
    with pytest.raises(TypeError, match="softcap"):
        plain.fwd(q, k, v, BLOCK_MASKS[0], 0.25, softcap=0.8)
