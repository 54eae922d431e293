"""Tier ``gpu`` (marker ``gpu``): CUDA kernels, the one-GPU replay of every strategy, and NCCL
worlds at long context, which no CPU run exercises. Everything one GPU can run runs on one GPU; a
test that needs more GPUs skips with "needs N GPUs". Run through the device tool:

    JAX_PLATFORMS=cuda python -m pytest tests/gpu

(the root conftest puts JAX on simulated CPU devices unless JAX_PLATFORMS says otherwise, and
turns JAX's GPU memory preallocation off so that torch shares the GPU)."""

import os

# cuBLAS reads its workspace setting when its first handle is made: set before any test touches
# CUDA, so that the deterministic-mode tests' portable kernel runs under torch's strict switch
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
