"""``python -m benchmarks.kernel_table``: every block backend of both frameworks and the peer
kernels, verified then timed on one GPU — a thin entry point; the logic is
``parity.probes.kernels`` (also ``python -m parity peers``).

    JAX_PLATFORMS=cuda python -m benchmarks.kernel_table --out DIR        (one GPU, ~4 minutes)
    python -m benchmarks.kernel_table --out DIR --backends reference --peers none --tokens 128 --no-timing
"""

from __future__ import annotations

import sys

from parity.core.devices import configure_jax_devices

if __name__ == "__main__":
    import torch

    configure_jax_devices("gpu" if torch.cuda.is_available() else "cpu")  # before jax starts
    from parity.probes.kernels import main

    sys.exit(main(prog="python -m benchmarks.kernel_table"))
