"""The block kernels jax_impl can run, one module per kernel family, each adapting its kernels to
the block interface of ``block.py`` and registering them there:

- ``reference``: the portable einsum kernels (float32 accumulation, any device);
- ``fused``: what every fused kernel needs around it (strict mask by a one-row shift, float32
  outputs, the lse-cotangent fallback) — no third-party code;
- ``cudnn``: XLA's cuDNN fused attention (binds JAX's private cuDNN primitives);
- ``packed``: ``cudnn_varlen``, document-masked blocks on cuDNN's packed layout (one segment per
  document run, computed on the device with static shapes);
- ``fa3``: FlashAttention-3 through flash_attn3_jax 0.2.3 (binds its private forward and its FFI
  backward with corrected workspaces);
- ``fa3_varlen``: document-masked blocks on FA3's varlen kernels (the same library, the same mend);
- ``runs``: the per-block document runs both document backends take, computed on the device.

Third-party internals are confined to ``cudnn.py``, ``packed.py``, ``fa3.py`` and ``fa3_varlen.py``, each saying why. Optional
packages are imported at a kernel's first call, never here. Unlike the algorithm files, this
folder differs from ``torch_impl/kernels/`` by nature: each framework binds its own kernels
(torch: ``reference``, ``aten``, ``varlen``, ``flex``).
"""

from . import cudnn, fa3, fa3_varlen, packed, reference  # noqa: F401  (each registers its backends)
