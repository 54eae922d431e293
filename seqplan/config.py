"""The framework-free part of an attention call's static settings: the checks every
``AttentionConfig`` runs on its fields, the softmax scale's default, and the environment default
of ``check_ranks`` (``RINGBRIDGE_CHECK_RANKS=1``). Each implementation's ``config.py`` holds its
``AttentionConfig`` (whose ``comm`` is its framework's transfer hook) and its ``deterministic``
default (XLA_FLAGS for JAX, torch's deterministic-algorithms switch for torch)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

from .schedule import LAYOUTS, kernel_window
from .validation import KV_EXCHANGES, check_window

CHECK_RANKS_ENV = "RINGBRIDGE_CHECK_RANKS"


def resolve_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: ``head_dim ** -0.5`` when the caller gave none."""
    return head_dim ** -0.5 if scale is None else float(scale)


def checked_static_fields(causal: bool, layout: str, scale: float, window) -> tuple[int, int] | None:
    """Check an AttentionConfig's layout and scale (ValueError naming the field) and return its
    window as the kernels apply it (``validation.check_window`` then ``schedule.kernel_window``:
    an int w or a list becomes the pair (left, right); causal makes right unbounded)."""
    window = kernel_window(check_window(window), causal)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return window


def default_check_ranks(check_ranks: bool | None) -> bool:
    """``check_ranks``, or when None whether RINGBRIDGE_CHECK_RANKS=1 (torch: one small all-reduce
    per mesh dimension comparing every rank's local shapes, dtypes and options; JAX has nothing to
    check: one controller passes global arrays, which have one shape by construction)."""
    if check_ranks is not None:
        return bool(check_ranks)
    return os.environ.get(CHECK_RANKS_ENV) == "1"


def check_positive_ints(config, names: Iterable[str]) -> None:
    """ValueError naming the field unless each of ``config``'s fields ``names`` is an int >= 1."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_rope_heads(heads: int, kv_heads: int, head_dim: int) -> None:
    """GQA's head grouping (H % Hk == 0) and RoPE's pairs (even head_dim)."""
    if heads % kv_heads:
        raise ValueError(f"heads % kv_heads must be 0, got {heads} % {kv_heads}")
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs: head_dim must be even, got {head_dim}")


@dataclass(frozen=True)
class AttentionLayerConfig:
    """The static shape and options of one attention layer (both implementations' layers take it).

    d_model:       D, the width of the layer's input and output.
    heads, kv_heads: H query heads and Hk key/value heads (H % Hk == 0: MHA, GQA, MQA).
    head_dim:      d (even: RoPE rotates pairs).
    rope_theta:    the RoPE base (rotate-half convention, as Hugging Face Llama).
    causal:        mask by original position (j <= i).
    layout:        the sequence layout of the inputs (JAX: the global arrays; torch: the local shards).
    window:        sliding window on original positions: None, w or (left, right).
    sinks:         one learned attention-sink logit per head (gpt-oss) when True.
    kv_exchange:   "ring" or "allgather" (how K/V reach the ring devices).
    block_backend: the block kernels ("auto" routes per block).
    """

    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    causal: bool = True
    layout: str = "zigzag"
    window: int | tuple[int, int] | None = None
    sinks: bool = False
    kv_exchange: str = "ring"
    block_backend: str = "auto"

    def __post_init__(self):
        check_positive_ints(self, ("d_model", "heads", "kv_heads", "head_dim"))
        check_rope_heads(self.heads, self.kv_heads, self.head_dim)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {self.kv_exchange!r}")
        object.__setattr__(self, "window", check_window(self.window))
