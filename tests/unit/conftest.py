"""Tier ``unit`` (marker ``unit``): pure functions — the oracle, the case matrix and mesh names,
the traffic model and HLO counter on handwritten input, B*, the block kernels and step plans on one
device, the mirror between jax_impl and torch_impl, the layering and the package build. No mesh,
no worker process: the whole tier takes seconds, so it runs first and on every change."""
