"""Backend ``"cudnn"``: XLA's cuDNN fused attention (bf16 / fp16, NVIDIA GPUs).

Why JAX's private API (``jax._src.cudnn.fused_attention_stablehlo``): the ring's block backward
needs the *global* o and lse (after every block was merged), and JAX's public
``jax.nn.dot_product_attention(implementation="cudnn")`` differentiates only with its own. So the
forward asks the private wrapper for its residual (the lse) and the backward binds cuDNN's
backward primitive directly with the o and lse it is given. Those names are JAX internals that
can change in any release: they are used here and nowhere else, imported at the first call, and
checked on a GPU by ``tests/gpu/test_one_gpu_kernels.py``.

    cudnn_attention_fwd(q, k, v, causal, scale)               -> (o, lse)
    cudnn_attention_bwd(do, q, k, v, o, lse, causal, scale)   -> (dq, dk, dv)

Shapes as in ``fused.py`` (layout BTNH; GQA heads native).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..block import register_backend
from .fused import fused_backend


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo  # private: see the module docstring

    return fused_attention_stablehlo


def cudnn_attention_fwd(q, k, v, causal: bool, scale: float):
    """cuDNN's forward with its lse: [b, h, t] float32, natural log."""
    fa = _fa()
    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask_type, qkv_layout="BTNH",
                                    return_residual=True)


def cudnn_attention_bwd(do, q, k, v, o, lse, causal: bool, scale: float):
    """cuDNN's backward primitive with the given (global) ``o`` and ``lse``."""
    fa = _fa()
    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    unused = jnp.zeros(0, q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused, lse, o, do,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask_type,
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
    return grads[:3]


register_backend(fused_backend("cudnn", cudnn_attention_fwd, cudnn_attention_bwd))
