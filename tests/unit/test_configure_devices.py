"""Tier 1 — ``parity.core.devices.configure_jax_devices`` on GPUs: the XLA flags a timed JAX step
runs under (only the environment is touched; JAX is not started).

Why: the capacity commands (``llama_scale --framework jax``, ``tp_sweep --framework jax``) time
whole steps whose collectives can overlap compute only under XLA's latency-hiding scheduler —
without it the FSDP × TP step ran its gathers in sequence on 4 GPUs (2026-11-27) — and the
benchmark driver (``benchmarks/bench_jax.py``, from the same constant) has always set it; a
caller's own value must win."""

from __future__ import annotations

import pytest

from parity.core.devices import OVERLAP_FLAG, configure_jax_devices


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    return monkeypatch


@pytest.mark.parametrize("autotune", [False, True])
def test_gpu_steps_run_under_the_latency_hiding_scheduler(env, autotune):
    import os

    configure_jax_devices("gpu", autotune=autotune)
    flags = os.environ["XLA_FLAGS"].split()
    assert OVERLAP_FLAG in flags
    assert ("--xla_gpu_autotune_level=0" in flags) == (not autotune)  # untuned GEMMs unless timed


def test_a_callers_scheduler_setting_wins(env):
    import os

    env.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    configure_jax_devices("gpu", autotune=True)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_gpu_enable_latency_hiding_scheduler=false"]

