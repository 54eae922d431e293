"""Unit — the block-backend registry of both frameworks: ``"auto"`` resolves by its table
(device kind, dtype, mask, deterministic) and only to available backends; the routing backend
dispatches each call as ``resolve_backend`` says; fa3 is fenced (pinned version, documented
fallback, never the library's backward); the fused adapters' strict mask (causal kernel shifted
one row) is the strict mask. Stand-in backends replace the GPU kernels on the CPU."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp

import jax_impl.block as jblock
import torch_impl.block as tblock
from jax_impl.kernels import fa3
from jax_impl.kernels.fused import fused_backend
from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
from seqplan.schedule import BLOCK_MASKS, CAUSAL_MASK, FULL_MASK, STRICT_MASK, BlockMask, MaskKind

MASKS = ("full", "causal", "strict")


@contextlib.contextmanager
def stand_ins(block, calls: list, **names_available):
    """Register counting stand-ins under ``names`` (available as given); restore the originals."""
    originals = {n: block.get_backend(n) for n in names_available}

    def make(name, available):
        reference = block.get_backend("reference")

        def fwd(*a):
            calls.append((name, "fwd"))
            return reference.fwd(*a)

        def bwd(*a):
            calls.append((name, "bwd"))
            return reference.bwd(*a)

        return block.BlockBackend(name, fwd, bwd, available=lambda: available)

    try:
        for name, available in names_available.items():
            block.register_backend(make(name, available))
        yield
    finally:
        for backend in originals.values():
            block.register_backend(backend)


def test_cpu_and_float32_resolve_to_the_portable_kernel():
    for block in (jblock, tblock):
        for dtype in ("float32", "bfloat16", "float16"):
            for mask in MASKS:
                for det in (False, True):
                    assert block.resolve_backend("auto", device_kind="cpu", dtype=dtype, mask=mask,
                                                 deterministic=det) == "reference"
                    assert block.resolve_backend("auto", device_kind="cuda", dtype="float32", mask=mask,
                                                 deterministic=det) == "reference"
        assert block.get_backend("auto").name == "reference"  # a CPU-only process: one choice


def test_jax_cuda_routes_fa3_when_verified_else_cudnn():
    """bf16 goes to fa3 in both modes (FA3's deterministic backward, measured bitwise reproducible on
    an H200: docs/gpu/determinism-fa3-2026-11-29-h200.md), fp16 and an absent fa3 to cuDNN."""
    calls = []
    with stand_ins(jblock, calls, fa3=True, cudnn=True):
        for mask in MASKS:
            for det in (False, True):
                assert jblock.resolve_backend("auto", device_kind="cuda", dtype=jnp.bfloat16, mask=BlockMask(mask),
                                              deterministic=det) == "fa3"
                assert jblock.resolve_backend("auto", device_kind="cuda", dtype="float16", mask=mask,
                                              deterministic=det) == "cudnn"
    # document blocks: FA3's varlen kernel in both modes (the real fa3 / cudnn backends, which take no
    # documents, stay registered; a stand-in would claim every mask)
    with stand_ins(jblock, calls, fa3_varlen=True):
        for kind in (MaskKind.FULL, MaskKind.CAUSAL):
            for det in (False, True):
                assert jblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16", deterministic=det,
                                              mask=BlockMask(kind, documents=True)) == "fa3_varlen"
    with stand_ins(jblock, calls, fa3=False, cudnn=True):
        for mask in MASKS:
            for det in (False, True):
                assert jblock.resolve_backend("auto", device_kind="cuda", dtype="bfloat16", mask=mask,
                                              deterministic=det) == "cudnn"
    assert jblock.resolve_backend("auto", device_kind="rocm", dtype="bfloat16", mask="full") == "reference"


def test_torch_cuda_routes_aten_cudnn_or_deterministic_aten_flash():
    calls = []
    with stand_ins(tblock, calls, aten_cudnn=True, aten_flash=True, fa4=False):  # FA4 installed: its own test
        for mask in MASKS:
            for dtype in ("bfloat16", "float16", torch.bfloat16):
                assert tblock.resolve_backend("auto", device_kind="cuda", dtype=dtype, mask=mask) == "aten_cudnn"
                assert tblock.resolve_backend("auto", device_kind="cuda", dtype=dtype, mask=mask,
                                              deterministic=True) == "aten_flash"
    with pytest.raises(RuntimeError, match="not deterministic"):
        tblock.resolve_backend("aten_cudnn", device_kind="cuda", dtype="bfloat16", mask="full", deterministic=True)
    with pytest.raises(ValueError, match="unknown block backend"):
        tblock.resolve_backend("nope", device_kind="cpu", dtype="float32", mask="full")


def test_routing_backend_dispatches_each_call_by_its_inputs(monkeypatch):
    """With inputs reported on CUDA, bf16 blocks of every mask go to fa3 (in both modes: FA3's
    deterministic backward in deterministic mode) or, with fp16, to cudnn; float32 blocks to the
    portable kernel — and the results are the kernel's own."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 8, 4, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.bfloat16) for _ in range(2))
    monkeypatch.setattr(jblock, "device_kind_of", lambda x: "cuda")
    calls = []
    with stand_ins(jblock, calls, fa3=True, cudnn=True):
        for det, dtype, expected in ((False, jnp.bfloat16, "fa3"), (True, jnp.bfloat16, "fa3"),
                                     (True, jnp.float16, "cudnn")):
            auto = jblock.routing_backend(det)
            q_, k_, v_ = (x.astype(dtype) for x in (q, k, v))
            for mask in BLOCK_MASKS:
                calls.clear()
                o, lse = auto.fwd(q_, k_, v_, mask, 0.25)
                auto.bwd(q_, q_, k_, v_, o, lse, mask, 0.25, None)
                assert calls == [(expected, "fwd"), (expected, "bwd")]
                o_ref, _ = reference_block_fwd(q_, k_, v_, mask, 0.25)
                np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
        calls.clear()
        jblock.routing_backend(False).fwd(q.astype(jnp.float32), k, v, FULL_MASK, 0.25)
        assert calls == []  # float32: the portable kernel, not a stand-in


def test_fa3_is_pinned_and_fenced(monkeypatch):
    """No flash_attn3_jax here: fa3 is unavailable to "auto", its mended backward refuses any
    version but 0.2.3, and an unverified version's backward goes to cuDNN's (with a warning) or
    raises, as the module's switch says — never to the library's own backward."""
    assert jblock.get_backend("fa3").typed_for_shard_map is False
    assert fa3.VERIFIED_VERSION == "0.2.3"
    monkeypatch.setattr(fa3, "installed_version", lambda: "0.2.4")
    assert not fa3.verified() and not jblock.get_backend("fa3").available()
    with pytest.raises(RuntimeError, match="0.2.3.*installed: 0.2.4"):
        fa3.flash_mha_bwd(None, None, None, None, None, None, False, 1.0)
    routed = []
    monkeypatch.setattr(fa3, "cudnn_attention_bwd", lambda *a: routed.append(a) or ("dq", "dk", "dv"))
    with pytest.warns(UserWarning, match="runs on cuDNN's backward"):
        assert fa3.fenced_backward(*range(6), False, 1.0) == ("dq", "dk", "dv")
    assert len(routed) == 1
    monkeypatch.setattr(fa3, "UNVERIFIED_VERSION_BACKWARD", "raise")
    with pytest.raises(RuntimeError, match="installed: 0.2.4"):
        fa3.fenced_backward(*range(6), False, 1.0)
    monkeypatch.setattr(fa3, "installed_version", lambda: None)
    with pytest.raises(RuntimeError, match="needs the flash_attn3_jax package"):
        fa3.fenced_backward(*range(6), False, 1.0)


@pytest.mark.parametrize("mask", [CAUSAL_MASK, STRICT_MASK, FULL_MASK])
def test_fused_adapter_expresses_every_mask_with_a_causal_flag(mask):
    """The adapter the fused kernels share, on an op pair that only knows a causal flag (the
    portable kernel's): strict blocks come out as the portable strict kernel's, row 0 empty."""
    def fwd_op(q, k, v, causal, scale):
        return reference_block_fwd(q, k, v, CAUSAL_MASK if causal else FULL_MASK, scale)

    def bwd_op(do, q, k, v, o, lse, causal, scale):
        return reference_block_bwd(do, q, k, v, o, lse, CAUSAL_MASK if causal else FULL_MASK, scale)

    adapted = fused_backend("causal_only", fwd_op, bwd_op)
    rng = np.random.default_rng(1)
    q, do = (jnp.asarray(rng.standard_normal((1, 6, 4, 8)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(2))
    got, want = adapted.fwd(q, k, v, mask, 0.3), reference_block_fwd(q, k, v, mask, 0.3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    o, lse = want
    for g, w in zip(adapted.bwd(do, q, k, v, o, lse, mask, 0.3), reference_block_bwd(do, q, k, v, o, lse, mask, 0.3)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
