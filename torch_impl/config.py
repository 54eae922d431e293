"""The static settings of one attention call (:class:`AttentionConfig`), and the environment
defaults of the API's keyword arguments — read here (and in ``seqplan.config``), at the API boundary, and nowhere else.

    RINGBRIDGE_CHECK_RANKS=1                       -> check_ranks=None means True
    torch.use_deterministic_algorithms(True) set   -> deterministic=None means True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

import seqplan.config

from .block import BlockBackend, get_backend
from .comm import Comm, current_comm


@dataclass(frozen=True)
class AttentionConfig(seqplan.config.AttentionConfig):
    """seqplan's :class:`seqplan.config.AttentionConfig` (the fields, their checks and
    ``for_call``) with torch's transfer hook and block kernels; kept on the autograd context for
    the backward, so hashable and never a tensor."""

    COMM_TYPE: ClassVar[type] = Comm
    comm: Comm = Comm()

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


@contextmanager
def deterministic_kernels(deterministic: bool) -> Iterator[None]:
    """Inside: torch's deterministic switch on when a call asked for ``deterministic=True`` and the
    process has it off (outside: as it was). torch picks a deterministic algorithm only under its
    global switch — FA2's backward (``aten_flash``), ``index_add_`` on CUDA — and ``fa4`` reads it
    for FlashAttention-4's own deterministic backward, so an explicit ``deterministic=True`` makes
    the call's kernels deterministic, not only the block backend's name checked. Turned on here in
    torch's warn-only form: an op with no deterministic algorithm (a cuBLAS product without
    ``CUBLAS_WORKSPACE_CONFIG``, in the portable kernel) warns, naming itself, instead of failing
    mid-call; a process that set the switch itself keeps its own strictness. The switch is
    process-wide: the attention's forward and backward hold it while they run (the autograd engine
    runs a CUDA backward on its device thread while the caller's thread waits in ``backward()``)."""
    if not deterministic or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def make_config(q, *, causal: bool, layout: str, scale: float | None, block_backend: str,
                deterministic: bool | None, window=None, softcap=None, token_index: bool = False,
                shared_tokens: int | None = None) -> AttentionConfig:
    """The config of a per-device call on ``q`` (for its head_dim), with this framework's defaults
    resolved (:func:`default_deterministic`) and the installed communication hook (``comm.using``);
    the rest, the token-index mode among it, is ``seqplan.config.AttentionConfig.for_call``."""
    return AttentionConfig.for_call(q.shape[-1], causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                                    deterministic=default_deterministic(deterministic), comm=current_comm(),
                                    window=window, softcap=softcap, token_index=token_index,
                                    shared_tokens=shared_tokens)
