"""Where JAX runs, set in one place before JAX starts (imports nothing but ``os``)."""

from __future__ import annotations

import os

SIMULATED_CPU_DEVICES = 8


def configure_jax_devices(devices: str = "cpu") -> None:
    """``"cpu"``: JAX on 8 simulated CPU devices (effective only before JAX is imported).
    ``"gpu"``: real GPUs, without JAX preallocating the memory torch worker processes need."""
    if devices == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={SIMULATED_CPU_DEVICES}".strip()
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
