"""The harness's floor: cases and mesh names, the float64 oracle, inputs, the numerics policy and
comparison — NumPy only. Nothing here imports jax, flax, optax, torch, jax_impl or torch_impl
(tests/unit/test_layering.py checks it in a fresh interpreter), so everything above may import it."""
