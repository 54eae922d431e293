"""Tier ``multidevice`` (marker ``multidevice``): everything that needs a mesh — jax_impl on 8
simulated CPU devices, torch_impl in gloo worlds of 1-8 processes — against the float64 oracle
and each other: the all-pairs parity matrix, the harness itself, communication accounting, the
training steps, determinism, numerics at the edge and at scale, validation before collectives,
and the notebooks. It is the bulk of the suite's time (budget in docs/testing.md)."""
