"""The static settings of one attention call (:class:`AttentionConfig`), and the environment
defaults of the API's keyword arguments — read here (and in ``seqplan.config``), at the API boundary, and nowhere else.

    RINGBRIDGE_CHECK_RANKS=1                       -> check_ranks=None means True
    torch.use_deterministic_algorithms(True) set   -> deterministic=None means True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqplan.config import checked_static_fields, resolve_scale
from seqplan.schedule import token_index_window
from seqplan.validation import check_softcap

from .block import BlockBackend, get_backend
from .comm import Comm, current_comm


@dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one ring / all-gather / double-ring attention call: hashable,
    never a tensor (kept on the autograd context for the backward). The same dataclass, with the
    same fields, is in jax_impl (where it is a ``custom_vjp`` non-differentiable argument).

    causal:        mask by original token positions (the layout's permutation is undone by the plan).
    layout:        one of ``LAYOUTS``: how the sequence was permuted over the ring.
    scale:         softmax scale (already resolved: head_dim ** -0.5 when the caller gave none).
    block_backend: name of the block kernels (``block.get_backend``).
    deterministic: refuse block kernels that are not run-to-run deterministic.
    comm:          the transfers' hook (``comm.Comm``; the plain one unless a probe installed one).
    window:        the sliding window ``(left, right)`` on original positions, or None (an int w
                   or a list is normalised to the pair by ``validation.check_window``); stored as
                   the kernels apply it (``schedule.kernel_window``: causal makes right unbounded).
    softcap:       logit soft-capping (Gemma 2), a positive float or None: every scaled logit x
                   becomes softcap · tanh(x / softcap) before the softmax, in every block, forward
                   and backward (``validation.check_softcap``; ``backend()`` gives kernels that apply it).
    token_index:   the causal and window masks compare explicit per-row token indices (the call's
                   ``token_index`` array, gathered like segment ids) instead of the layout's
                   positions: ``causal`` is then False and ``window`` the token-index window
                   (``schedule.token_index_window``: causal = ``(UNBOUNDED, 0)``), every visit one
                   whole-shard block decided at run time, and the ring is never truncated.
    """

    causal: bool
    layout: str
    scale: float
    block_backend: str = "auto"
    deterministic: bool = False
    comm: Comm = Comm()
    window: tuple[int, int] | None = None
    softcap: float | None = None
    token_index: bool = False

    def __post_init__(self):
        object.__setattr__(self, "window", checked_static_fields(self.causal, self.layout, self.scale, self.window))
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        if not isinstance(self.comm, Comm):
            raise TypeError(f"comm must be a Comm, got {type(self.comm).__name__}")

    def backend(self) -> BlockBackend:
        """The block kernels (an unknown or refused name raises here), soft-capping every block
        when ``softcap`` is set (``block.get_backend``)."""
        return get_backend(self.block_backend, deterministic=self.deterministic, softcap=self.softcap)


def default_deterministic(deterministic: bool | None) -> bool:
    """``deterministic``, or when None whether ``torch.use_deterministic_algorithms(True)`` is set
    (which is also what makes torch's own kernels, aten_flash's backward among them, deterministic)."""
    if deterministic is not None:
        return bool(deterministic)
    return torch.are_deterministic_algorithms_enabled()


def make_config(q, *, causal: bool, layout: str, scale: float | None, block_backend: str,
                deterministic: bool | None, window=None, softcap=None, token_index: bool = False) -> AttentionConfig:
    """The config of a per-device call on ``q`` (for its head_dim), with the defaults resolved and
    the installed communication hook (``comm.using``). ``token_index``: the call passes explicit
    token indices, so ``causal`` and ``window`` become one window on them
    (``schedule.token_index_window``) over the non-causal schedule."""
    if token_index:
        window, causal = token_index_window(window, bool(causal)), False
    return AttentionConfig(bool(causal), layout, resolve_scale(q.shape[-1], scale), block_backend,
                           default_deterministic(deterministic),
                           current_comm(), window, softcap, bool(token_index))
