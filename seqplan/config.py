"""The framework-free part of an attention call's static settings: :class:`AttentionConfig` (its
fields, their checks, and :meth:`AttentionConfig.for_call`, the defaults and the token-index mode
resolved), the softmax scale's default, and the environment defaults of ``check_ranks``
(``RINGBRIDGE_CHECK_RANKS=1``) and ``head_groups`` (``RINGBRIDGE_HEAD_GROUPS``). Each
implementation's ``config.py`` subclasses the config with its framework's transfer hook
(``comm``) and block kernels (``backend()``), and holds its ``deterministic`` default (XLA_FLAGS
for JAX, torch's deterministic-algorithms switch for torch)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from .schedule import LAYOUTS, kernel_window, one_call_mask, token_index_window
from .shared import check_shared_tokens_value
from .validation import KV_EXCHANGES, check_softcap, check_window

CHECK_RANKS_ENV = "RINGBRIDGE_CHECK_RANKS"
HEAD_GROUPS_ENV = "RINGBRIDGE_HEAD_GROUPS"


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


@dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one ring / all-gather / double-ring attention call: hashable, never
    an array (JAX passes it as a ``custom_vjp`` non-differentiable argument and keys compilations
    on it; torch keeps it on the autograd context for the backward). Each implementation's
    ``config.AttentionConfig`` subclasses it, adding only its framework's pieces: the type of
    ``comm`` (``COMM_TYPE``) and ``backend()``, the block kernels.

    causal:        mask by original token positions (the layout's permutation is undone by the plan).
    layout:        one of ``LAYOUTS``: how the sequence was permuted over the ring.
    scale:         softmax scale (already resolved: head_dim ** -0.5 when the caller gave none).
    block_backend: name of the block kernels (each implementation's ``block.get_backend``).
    deterministic: refuse block kernels that are not run-to-run deterministic.
    comm:          the transfers' hook (the implementation's ``comm.Comm``; the plain one unless a
                   probe installed one); None in seqplan's own configs, which move nothing.
    window:        the sliding window ``(left, right)`` on original positions, or None (an int w
                   or a list is normalised to the pair by ``validation.check_window``); stored as
                   the kernels apply it (``schedule.kernel_window``: causal makes right unbounded).
    softcap:       logit soft-capping (Gemma 2), a positive float or None: every scaled logit x
                   becomes softcap · tanh(x / softcap) before the softmax, in every block, forward
                   and backward (``validation.check_softcap``; ``backend()`` gives kernels that apply it).
    token_index:   the causal and window masks compare explicit per-row token indices (the call's
                   ``token_index`` array, gathered like segment ids) instead of the layout's
                   positions — a mode of its own: ``causal`` and ``window`` stay as the caller
                   gave them, and the call runs the non-causal schedule (:attr:`schedule_causal`)
                   with both masks as one window on the indices (:attr:`mask_window`:
                   ``schedule.token_index_window``, causal = ``(UNBOUNDED, 0)``), every visit one
                   whole-shard block decided at run time, and the ring is never truncated.
    shared_tokens: all-gather KV only: every token whose document also lies on another ring shard
                   sits within its shard's first ``shared_tokens`` positions (the per-document
                   hybrid's order), so only those K/V are gathered (``seqplan.shared``); None: all.
    """

    # What ``comm`` must be an instance of (TypeError otherwise): each implementation's Comm.
    COMM_TYPE: ClassVar[type] = object

    causal: bool
    layout: str
    scale: float
    block_backend: str = "auto"
    deterministic: bool = False
    comm: object = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    token_index: bool = False
    shared_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "window", checked_static_fields(self.causal, self.layout, self.scale, self.window))
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        object.__setattr__(self, "shared_tokens", check_shared_tokens_value(self.shared_tokens))
        if not isinstance(self.comm, self.COMM_TYPE):
            raise TypeError(f"comm must be a {self.COMM_TYPE.__name__}, got {type(self.comm).__name__}")

    @classmethod
    def for_call(cls, head_dim: int, *, causal: bool, layout: str, scale: float | None, block_backend: str,
                 deterministic: bool, comm, window=None, softcap=None, token_index: bool = False,
                 shared_tokens: int | None = None):
        """The config of a per-device call on queries of ``head_dim``, ``scale`` defaulted
        (:func:`resolve_scale`). ``deterministic`` and ``comm`` come resolved: each framework's
        ``make_config`` reads its own defaults. ``token_index``: the call passes explicit token
        indices (the mode of the same name: :attr:`schedule_causal`, :attr:`mask_window`)."""
        hook = {} if comm is None else {"comm": comm}  # None: the class's own transfer hook
        return cls(bool(causal), layout, resolve_scale(head_dim, scale), block_backend, deterministic, window=window,
                   softcap=softcap, token_index=bool(token_index), shared_tokens=shared_tokens, **hook)

    @property
    def schedule_causal(self) -> bool:
        """Whether the call walks the causal schedule (blocks shaped by the layout's positions):
        ``causal``, except with token indices, whose blocks are all decided at run time."""
        return self.causal and not self.token_index

    @property
    def mask_window(self) -> tuple[int, int] | None:
        """The window the blocks' masks apply: ``window`` (as the kernels take it); with token
        indices the causal and window masks as one window on them (``schedule.token_index_window``)."""
        return token_index_window(self.window, self.causal) if self.token_index else self.window

    @property
    def reach_window(self) -> tuple[int, int] | None:
        """The window the static schedule may truncate the ring by (``schedule.window_reach``):
        ``window`` on the layout's positions; None with token indices, whose positions the layout
        does not know."""
        return None if self.token_index else self.window

    def one_call_mask(self, documents: bool):
        """``schedule.one_call_mask`` of this call: the mask all-gather-KV's one varlen call per
        device must take, or None."""
        return one_call_mask(self.schedule_causal, self.mask_window, self.token_index, documents)


def replay_config(cls, q, causal, layout, scale, block_backend, deterministic, window, softcap,
                  token_index=None):
    """A one-device replay's config (both frameworks' ``replay._config``): ``cls.for_call`` on q's
    head_dim with the class's own transfer hook; ``token_index`` the array or None (given, the
    causal and window masks become one window on the indices and the schedule the non-causal one)."""
    return cls.for_call(q.shape[-1], causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                        deterministic=bool(deterministic), comm=None, window=window, softcap=softcap,
                        token_index=token_index is not None)


def default_check_ranks(check_ranks: bool | None) -> bool:
    """``check_ranks``, or when None whether RINGBRIDGE_CHECK_RANKS=1 (torch: one small all-reduce
    per mesh dimension comparing every rank's local shapes, dtypes and options; JAX has nothing to
    check: one controller passes global arrays, which have one shape by construction)."""
    if check_ranks is not None:
        return bool(check_ranks)
    return os.environ.get(CHECK_RANKS_ENV) == "1"


def default_head_groups(head_groups, ulysses: int):
    """``head_groups``, or when None: ``RINGBRIDGE_HEAD_GROUPS`` (default 1) on a mesh whose Ulysses
    axis is larger than 1, and 1 elsewhere — one setting for every Ulysses strategy of a run (the
    benchmark driver's rows and the checks before them), which the rings ignore. The value is
    checked by ``seqplan.validation.check_head_groups``."""
    if head_groups is not None:
        return head_groups
    if ulysses == 1:
        return 1
    value = os.environ.get(HEAD_GROUPS_ENV, "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{HEAD_GROUPS_ENV} must be a positive int, got {value!r}") from None


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
    shared_tokens: all-gather KV's shared prefix of every ring shard (``seqplan.shared``), or None;
                   per batch: ``seqplan.chooser.LayoutChoice.layer_config`` sets it.
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
    shared_tokens: int | None = None

    def __post_init__(self):
        check_positive_ints(self, ("d_model", "heads", "kv_heads", "head_dim"))
        object.__setattr__(self, "shared_tokens", check_shared_tokens_value(self.shared_tokens))
        check_rope_heads(self.heads, self.kv_heads, self.head_dim)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {self.kv_exchange!r}")
        object.__setattr__(self, "window", check_window(self.window))
