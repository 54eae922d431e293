"""Backend ``"fa3"``: FlashAttention-3 through flash_attn3_jax (Hopper GPUs, bf16 / fp16),
with its backward mended and fenced.

**Why the library's internals.** The ring's block backward needs the *global* o and lse; the
library's public ``flash_mha`` returns no lse and differentiates only with its own. The forward
therefore calls the library's internal ``flash_attn3_jax.flash._flash_mha_fwd`` (o and lse).
The backward cannot use the library's ``_flash_mha_bwd`` at all: in flash_attn3_jax 0.2.3 its
lowering declares the backward's two float32 workspaces (``softmax_d``, ``softmax_lse_log2``) as
``[b, h, round_up(t_q, 128)]``, while the kernels index them with stride ``round_up(t_q, kBlockM)``,
and kBlockM is 80 for a non-causal backward on sm90 (64 causal). For every t_q that is a multiple
of 128 but not of 640 — 4096 among them — the preprocess kernel writes past both buffers into
whatever XLA placed next: full-mask gradients off by up to 1e6× the dense control, or NaN,
different between identical calls (docs/gpu/fa3-finding.md, H100, 2026-11-23). So
:func:`flash_mha_bwd` binds the library's own FFI target ``flash_mha_bwd`` with the same inputs
and attributes and only sizes those two outputs ``[b, h, t_q + 128]`` (at least
``round_up(t_q, m)`` for every tile height m <= 128 the sm90 backward uses). Every fa3 backward,
every mask, goes through it; verified on H100 as accurate as cuDNN (worst ratio to the dense
control 0.56 full, 1.08 causal) and as fast as before (632 TFLOP/s full-mask fwd+bwd, 32k tokens).

**Pinned.** That call depends on the FFI target's name and attribute list in 0.2.3, a private
interface: :func:`flash_mha_bwd` raises for any other installed version. **Fallback switch**:
:data:`UNVERIFIED_VERSION_BACKWARD` says what the backend's backward does when the installed
version is not :data:`VERIFIED_VERSION` — ``"cudnn"`` (default): every fa3 block's backward runs
on cuDNN's backward primitive (``cudnn.py``; fa3's forward o and lse are right and cuDNN's
backward takes any correct o/lse), with a warning; ``"raise"``: refuse. Never the library's
own backward. ``"auto"`` routes to fa3 only at the verified version (``available``).
fa3's outputs carry no shard_map varying-axes type: ``typed_for_shard_map=False``.

    flash_mha_fwd(q, k, v, causal, scale, window=(-1, -1))             -> (o, lse)
    flash_mha_bwd(do, q, k, v, o, lse, causal, scale, window=(-1, -1)) -> (dq, dk, dv)

``window``: FA3's own sliding window (the fused adapter's band of a windowed block, ``fused.py``).

do, q, o: [b, t, h, d]; k, v: [b, s, hk, d] (one dtype, bf16 or fp16; d a multiple of 8);
lse: [b, h, t] float32, natural log (as the library's forward returns it).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import warnings

import jax
import jax.numpy as jnp

from ..block import register_backend
from ..config import kernels_deterministic
from .cudnn import cudnn_attention_bwd
from .fused import fused_backend

PACKAGE = "flash_attn3_jax"
VERIFIED_VERSION = "0.2.3"  # the version the workspace mend was verified with (H100, 2026-11-23)
UNVERIFIED_VERSION_BACKWARD = "cudnn"  # "cudnn" or "raise": see the module docstring
# The widest tile height (rows of queries) of any sm90 backward configuration.
MAX_TILE_ROWS = 128


@functools.lru_cache(maxsize=1)
def installed_version() -> str | None:
    """flash_attn3_jax's installed version (None: not installed), without importing it when the
    package metadata says (cached: "auto" asks at every block call it traces)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec(PACKAGE) is None:
            return None
        import flash_attn3_jax

        return getattr(flash_attn3_jax, "__version__", "unknown")


def verified() -> bool:
    """The installed flash_attn3_jax is the version the backward mend was verified with."""
    return installed_version() == VERIFIED_VERSION


def _require_package() -> None:
    if installed_version() is None:
        raise RuntimeError(f"block backend 'fa3' needs the {PACKAGE} package (Hopper GPUs; verified: "
                           f"{VERIFIED_VERSION})")


def flash_mha_fwd(q, k, v, causal: bool, scale: float, window: tuple[int, int] = (-1, -1)):
    """FlashAttention-3's forward: (o in the input dtype, lse [b, h, t] float32). ``window``: the
    kernel's own sliding window (left, right), bottom-right aligned, -1 unbounded."""
    _require_package()
    from flash_attn3_jax.flash import _flash_mha_fwd  # internal: the public API returns no lse

    return _flash_mha_fwd(q, k, v, softmax_scale=scale, is_causal=causal, window_size=tuple(window))[:2]


def forward_ffi(q, k, v, cu_q, cu_k, lse_shape, max_q: int, max_k: int, causal: bool, scale: float):
    """The FFI target ``flash_mha_fwd`` with the inputs and attributes of flash_attn3_jax 0.2.3's own
    lowering, for the varlen forward (``fa3_varlen``: packed [total, h, d] with offsets, no window,
    the lse buffer ``lse_shape`` the caller declares at its real size; the dense forward goes
    through the library's own ``_flash_mha_fwd``). Returns (o shaped like q, the lse buffer)."""
    import flash_attn3_jax.flash_hlo  # noqa: F401  (registers the library's FFI targets)

    result_types = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32),
                    jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)]
    none_i32, none_f32, none_q = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), q.dtype)
    o, lse, _, _ = jax.ffi.ffi_call(
        "flash_mha_fwd", result_types, has_side_effect=False, input_layouts=[None] * 21, output_layouts=[None] * 4,
    )(q, k, v, none_q, none_q, none_q,  # k_new, v_new, q_v
      cu_q, cu_k, none_i32, none_i32, none_i32,  # cu_seqlens_k_new, seqused_q, seqused_k
      none_i32, none_i32, none_i32, none_q, none_q, none_i32,  # page table, kv batch, left pad, rotary
      none_f32, none_f32, none_f32, none_i32,  # q / k / v descale, scheduler metadata
      max_seqlen_q=max_q, max_seqlen_q_has_value=True, max_seqlen_k=max_k, max_seqlen_k_has_value=True,
      softmax_scale_val=float(scale), softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
      is_causal=bool(causal), window_size_left=-1, window_size_right=-1,
      attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, num_splits=1,  # no split: dummy accumulators
      sm_margin=0)
    return o, lse


def flash_mha_bwd(do, q, k, v, o, lse, causal: bool, scale: float, window: tuple[int, int] = (-1, -1), *,
                  deterministic: bool = False):
    """FlashAttention-3's backward through flash_attn3_jax's FFI target ``flash_mha_bwd``, with
    workspaces large enough for the kernel's own row rounding (module docstring). Only for
    flash_attn3_jax == :data:`VERIFIED_VERSION`."""
    version = installed_version()
    if version != VERIFIED_VERSION:
        raise RuntimeError(f"fa3's mended backward binds {PACKAGE} {VERIFIED_VERSION}'s FFI target 'flash_mha_bwd' "
                           f"(a private interface); installed: {version}. Re-verify it on a GPU "
                           "(tests/gpu/test_one_gpu_kernels.py) before changing VERIFIED_VERSION.")
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
      window_size_left=int(window[0]), window_size_right=int(window[1]), softcap=0.0,
      deterministic=bool(deterministic), sm_margin=0)
    return dq, dk, dv


def fenced_backward(do, q, k, v, o, lse, causal: bool, scale: float, window: tuple[int, int] = (-1, -1)):
    """The fa3 backend's backward: the mended call, or the documented fallback (never the library's;
    a windowed block has none: cuDNN's backward here takes no window, so it raises)."""
    if verified():  # FA3's own deterministic mode when the call being traced asked for determinism
        return flash_mha_bwd(do, q, k, v, o, lse, causal, scale, window, deterministic=kernels_deterministic())
    _require_package()
    if UNVERIFIED_VERSION_BACKWARD != "cudnn" or tuple(window) != (-1, -1):
        flash_mha_bwd(do, q, k, v, o, lse, causal, scale, window)  # raises, naming the versions
    warnings.warn(f"{PACKAGE} {installed_version()} is not the verified {VERIFIED_VERSION}: fa3 blocks' backward "
                  "runs on cuDNN's backward (fa3.UNVERIFIED_VERSION_BACKWARD)", stacklevel=2)
    return cudnn_attention_bwd(do, q, k, v, o, lse, causal, scale)


register_backend(fused_backend("fa3", flash_mha_fwd, fenced_backward, typed_for_shard_map=False, available=verified,
                               windowed=True))
