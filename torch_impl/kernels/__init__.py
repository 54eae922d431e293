"""The block kernels torch_impl can run, one module per kernel family, each adapting its kernels
to the block interface of ``block.py`` and registering them there:

- ``reference``: the portable einsum kernels (float32 accumulation, any device);
- ``aten``: torch's fused SDPA ops — ``aten_cpu``, ``aten_flash``, ``aten_cudnn`` (binds aten's
  underscore ops, which return the lse the ring needs);
- ``varlen``: ``aten_varlen``, document-masked blocks on FlashAttention-2's varlen kernels (one
  problem per document run, from ``seqplan.documents``);
- ``window``: ``aten_window``, windowed blocks on FlashAttention-2's sliding window (the block
  cropped to its band);
- ``fa4``: ``fa4``, FlashAttention-4's varlen kernels (optional: pip ``flash-attn-4``) for plain,
  causal, document, token-index and soft-capped blocks, and all-gather-KV's one call;
- ``flex``: torch's FlexAttention, every block mask (documents, windows) applied inside the kernel
  (binds the private flex backward operator, which takes the global o and lse).

Torch and library internals are confined to ``aten.py``, ``varlen.py``, ``window.py``, ``fa4.py`` and ``flex.py``, each
saying why. Unlike the algorithm files, this
folder differs from ``jax_impl/kernels/`` by nature: each framework binds its own kernels (JAX:
``reference``, ``fused``, ``cudnn``, ``fa3``, ``fa3_varlen``, ``packed``, ``runs``).
"""

from . import aten, fa4, flex, reference, varlen, window  # noqa: F401  (each registers its backends)
