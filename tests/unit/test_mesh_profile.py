"""Tier 1 — what the 4-GPU profile script (``benchmarks/mesh_profile_jax.py``) reads from a trace.

Why: its numbers decide the next cut on the GPUs, where nothing can be debugged — the idle time
split into steps and gaps, and the XLA-fusion time attributed to the phase that launched it must
be right before a device minute is spent on them. (The GPU trace itself cannot be made here; the
HLO op names can, from a CPU compile of the same named scopes.)"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp

from benchmarks import mesh_profile_jax as mp


def test_the_idle_is_split_into_steps_and_the_gaps_inside_them():
    rows = [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 1.6, 1.9), ("d", 2.5, 3.0),  # step 1: span 3, busy 2
            ("a", 50.0, 51.0), ("b", 51.01, 52.0), ("d", 53.0, 54.0)]  # step 2 (a 30 ms host sleep before it)
    got = mp.idle_inside_steps(rows, 2)
    assert got["steps_found"] == 2 and got["span_ms"] == [3.0, 4.0] and got["busy_in_span_ms"] == [2.0, 2.99]
    assert got["idle_inside_ms_per_step"] == pytest.approx((1.0 + 1.01) / 2)
    first = got["longest_gaps"][0]
    assert first == {"ms": 1.0, "after": "b", "before": "d"}  # step 2's gap, between the kernels either side
    assert all(g["ms"] > mp.GAP_MS for g in got["longest_gaps"])  # 10 µs between a and b: launch spacing, unlisted


def test_fusion_time_is_summed_by_the_phase_that_launched_it():
    def f(x):
        with jax.named_scope("shared_prefix.plan"):
            y = jnp.sin(x) * 2
        with jax.named_scope("shared_prefix.local_part"):
            return jnp.sum(jnp.cos(y) ** 2)

    names = mp.op_names(jax.jit(jax.grad(f)).lower(jnp.ones(1000)).compile().as_text())
    scopes = {mp.scope_of(op) for op in names.values()}
    assert {"fwd shared_prefix.plan", "fwd shared_prefix.local_part", "bwd shared_prefix.plan"} <= scopes, scopes
    kernel = next(k for k, op in names.items() if mp.scope_of(op) == "bwd shared_prefix.plan")
    rows = [(kernel, 0.0, 2.0), (kernel, 10.0, 12.0), ("loop_fusion_not_in_the_hlo", 3.0, 4.0),
            ("flash::FlashAttnFwdSm90 kernel", 5.0, 9.0), ("MemcpyD2D", 9.0, 11.0)]  # attention, copies: not "other"
    assert mp.other_by_scope(rows, names, steps=2) == {"bwd shared_prefix.plan": 2.0, "unmapped": 0.5}


def test_kernels_are_told_apart_by_kind_and_a_trace_in_the_wrong_unit_is_refused():
    """The profiles' kinds (``mesh_profile_jax.kind_of``, used by the attention profiles and the
    whole-model one, ``benchmarks/llama_profile_jax.py``): cuBLAS's Hopper GEMMs are named
    ``sm90_xmma_gemm_*`` / ``nvjet_*`` and FA3's kernels are CUTLASS templates — a GEMM read as
    attention (as an "sm90" mark once did), or FA3 as a GEMM, would put time in the wrong kind."""
    assert mp.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert mp.kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert mp.kind_of("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90>>") \
        == "attention"
    assert mp.kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert mp.kind_of("memcpy128") == "copy"
    assert mp.kind_of("loop_multiply_fusion_3") == "other"
    rows = [("nvjet_hsh_a", 0.0, 2.0), ("ncclDevKernel_AllGather_RING_LL", 1.0, 4.0),  # 1 of its 3 ms under the GEMM
            ("loop_add_fusion", 4.5, 5.0),  # step 1: span 5, busy 4.5
            ("nvjet_hsh_a", 50.0, 52.0), ("ncclDevKernel_AllGather_RING_LL", 51.0, 54.0), ("loop_add_fusion", 54.5, 55.0)]
    got = mp.summarize({"/device:GPU:0": rows}, steps=2, send_recv=("p2p",))["per_gpu"]["/device:GPU:0"]
    assert got["kernel_ms_per_step"] == {"gemm": 2.0, "nccl": 3.0, "other": 0.5}
    assert got["exposed_ms_per_step"] == {"all-gather": {"kernel": 3.0, "exposed": pytest.approx(2.0)}}
    assert got["busy_ms_per_step"] == pytest.approx(4.5) and got["idle_inside_ms_per_step"] == pytest.approx(0.5)
    assert got["launches_per_step"] == {"gemm": 1, "nccl": 1, "other": 1}
    # the same kernels in seconds (the first 2x H200 call's bug): the trace no longer splits into its steps
    seconds = [(name, lo * 1e-3, hi * 1e-3) for name, lo, hi in rows]
    with pytest.raises(ValueError, match="splits into 1 steps, not 2"):
        mp.summarize({"/device:GPU:0": seconds}, steps=2, send_recv=("p2p",))
