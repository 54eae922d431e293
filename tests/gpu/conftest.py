"""Tier ``gpu`` (marker ``gpu``): CUDA kernels and NCCL worlds at long context, which no CPU run
exercises. Skipped without GPUs; run through the device tool
(``JAX_PLATFORMS=cuda python -m pytest -m gpu tests/gpu``)."""
