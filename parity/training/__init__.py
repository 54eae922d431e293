"""The FFN training steps the accounting model is checked against: the analytical traffic and
FLOPs (``traffic_model``), the float64 reference step (``reference``), and the JAX
(shard_map + flax + optax, ``jax_step``) and torch (FSDP2 + DTensor, ``torch_step``) steps.
``traffic_model`` and ``reference`` are NumPy only; the steps import their framework."""
