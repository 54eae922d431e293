"""ringbridge's parity harness: a float64 oracle, the case matrix, per-framework runners and the
numerics policy. Framework runners (``parity.run_jax``, later ``parity.run_torch``) are imported
lazily, so either framework may be absent."""
