"""flash_attn3_jax 0.2.3's backward FFI target, called with workspaces of the size the kernel uses.

Why (docs/gpu/fa3-finding.md): the library's lowering allocates the two float32 workspaces the
FFI handler hands to the backward kernels — ``softmax_d`` (rowsum(dO∘O)) and
``softmax_lse_log2`` — as ``[b, h, round_up(t_q, 128)]``, but the kernels index them with the
stride ``round_up(t_q, kBlockM)``, where ``kBlockM`` is the handler's own tile height (sm90,
head dim 128 or a head dim the wheel rounds up to 128: 80 without a mask, 64 causal or windowed).
Whenever ``round_up(t_q, 80) > round_up(t_q, 128)`` (every t_q that is a multiple of 128 but not
of 640, 4096 included) the preprocessing kernel writes past both buffers' ends, into whatever XLA
placed next — the other workspace among it, which the main kernel then reads as log2(LSE).

``flash_mha_bwd`` below binds the same FFI target with the same inputs and attributes, and only
sizes those two outputs ``[b, h, t_q + 128]``: at least ``round_up(t_q, m)`` for every tile
height m <= 128 the sm90 backward uses (64, 80, 96, 128), so no tile rule has to be mirrored.

    flash_mha_bwd(do, q, k, v, o, lse, scale, causal) -> (dq, dk, dv)
    do, q, o: [b, t, h, d]; k, v: [b, s, hk, d] (bf16 or fp16, d a multiple of 8);
    lse: [b, h, t] float32 (natural log, as the library's forward returns it)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The widest tile height (rows of queries) of any sm90 backward configuration.
MAX_TILE_ROWS = 128


def flash_mha_bwd(do, q, k, v, o, lse, scale: float, causal: bool, *, deterministic: bool = False):
    """FlashAttention-3's backward through flash_attn3_jax's FFI target ``flash_mha_bwd``, with
    workspaces large enough for the kernel's own row rounding (see the module docstring)."""
    import flash_attn3_jax.flash_hlo  # noqa: F401  (registers the library's FFI targets)

    b, t, h, d = q.shape
    hk = k.shape[2]
    if d % 8:
        raise ValueError(f"head_dim must be a multiple of 8 for the fa3 kernels, got {d}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or any(x.dtype != q.dtype for x in (do, k, v, o)):
        raise TypeError(f"do, q, k, v, o must share one dtype, bfloat16 or float16; got "
                        f"{[str(x.dtype) for x in (do, q, k, v, o)]}")
    if h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk})")
    rows = t + MAX_TILE_ROWS
    result_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),  # dq
        jax.ShapeDtypeStruct(k.shape, k.dtype),  # dk
        jax.ShapeDtypeStruct(v.shape, v.dtype),  # dv
        jax.ShapeDtypeStruct((b, h, rows), jnp.float32),  # softmax_d workspace
        jax.ShapeDtypeStruct((b, h, rows), jnp.float32),  # softmax_lse_log2 workspace
    ]
    absent = jnp.zeros((0,), jnp.int32)  # cu_seqlens_q/k, seqused_q/k: not varlen
    dq, dk, dv, _, _ = jax.ffi.ffi_call(
        "flash_mha_bwd", result_types, has_side_effect=False,
        input_layouts=[None] * 10, output_layouts=[None] * 5,
    )(do, q, k, v, o, lse.astype(jnp.float32), absent, absent, absent, absent,
      max_seqlen_q_val=t, max_seqlen_q_has_value=True, max_seqlen_k_val=k.shape[1], max_seqlen_k_has_value=True,
      softmax_scale_val=float(scale), softmax_scale_has_value=True, is_causal=bool(causal),
      window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=bool(deterministic), sm_margin=0)
    return dq, dk, dv
