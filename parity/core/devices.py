"""Where JAX runs, set in one place before JAX starts (imports nothing but ``os``): the CLI, the
probes, the notebooks and the test session all call ``configure_jax_devices``."""

from __future__ import annotations

import os

SIMULATED_CPU_DEVICES = 8
# XLA's latency-hiding scheduler: collectives issued early and overlapped with compute, as a JAX
# training job on GPUs sets it. Without it the timed FSDP x TP step ran its weight gathers in
# sequence with the GEMMs (4x H200, 2026-11-27: 0.94-1.09x the serial bound, 1.15-2.09x the overlap bound).
OVERLAP_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"


def configure_jax_devices(devices: str = "cpu", autotune: bool = False) -> None:
    """``"cpu"``: JAX on 8 simulated CPU devices, compiled at LLVM optimization level 0 (both
    effective only before JAX is imported). ``"gpu"``: real GPUs, without JAX preallocating the
    memory torch worker processes need.

    Why level 0 on CPU: the harness compiles hundreds of small, distinct programs (every case is a
    new shape) and runs each once; at level 0 each compile-and-run took 22–63 % less (4 cases
    measured). The HLO passes — what the accounting check counts — are unchanged; only machine-code
    optimization is skipped. An ``xla_backend_optimization_level`` already in XLA_FLAGS wins.

    ``autotune`` (GPU): keep XLA's GEMM autotuning — for programs whose matmuls are timed (the
    step-time model's steps). Without it (the default) XLA runs untuned GEMM configurations.
    On GPUs the latency-hiding scheduler is on (:data:`OVERLAP_FLAG`), as the benchmark driver
    has it; a value of that flag already in XLA_FLAGS wins."""
    if devices == "cpu" and os.environ.get("JAX_PLATFORMS", "cpu") not in ("", "cpu"):
        # A test session with JAX_PLATFORMS=cuda (the GPU tier): JAX on the GPU, configured as for "gpu".
        configure_jax_devices("gpu", autotune)
        return
    if devices == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={SIMULATED_CPU_DEVICES}"
        if "xla_backend_optimization_level" not in flags:
            flags += " --xla_backend_optimization_level=0"
        os.environ["XLA_FLAGS"] = flags.strip()
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # XLA's GEMM autotuning cost ~13 s per new shape (H100, 2026-11-23); the harness compiles
        # many shapes once each and times none of the GEMMs it would tune.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_autotune_level" not in flags and not autotune:
            flags += " --xla_gpu_autotune_level=0"
        if "xla_gpu_enable_latency_hiding_scheduler" not in flags:
            flags += " " + OVERLAP_FLAG
        os.environ["XLA_FLAGS"] = flags.strip()
