"""The static settings of one attention call (:class:`AttentionConfig`), and the environment
defaults of the API's keyword arguments — read here (and in ``seqplan.config``), at the API boundary, and nowhere else.

    RINGBRIDGE_CHECK_RANKS=1                       -> check_ranks=None means True
    torch.use_deterministic_algorithms(True) set   -> deterministic=None means True
    CUBLAS_WORKSPACE_CONFIG                        -> checked, not a default: deterministic=True on CUDA
                                                      needs :4096:8 or :16:8 (check_deterministic_ready)
"""

from __future__ import annotations

import os
import threading
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


# cuBLAS is reproducible only with one of these workspace settings, read when the process starts;
# torch's deterministic switch refuses a cuBLAS product without one
CUBLAS_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def check_deterministic_ready(deterministic: bool, device) -> None:
    """ValueError, before any collective, when ``deterministic=True`` on CUDA would run the call's
    kernels under torch's strict deterministic switch (:func:`deterministic_kernels`, or the
    process's own) in a process whose cuBLAS is not set up for it: under that switch the portable
    kernel's cuBLAS products raise unless ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` or ``:16:8``,
    and cuBLAS reads it only at start-up. A process whose switch is on in warn-only form only gets
    torch's warnings: nothing is asked."""
    if not deterministic or torch.device(device).type != "cuda":
        return
    if torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled():
        return
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace not in CUBLAS_DETERMINISTIC_WORKSPACES:
        raise ValueError(f"deterministic=True on CUDA runs the call's kernels under torch's deterministic switch, which "
                         f"needs CUBLAS_WORKSPACE_CONFIG set to one of {CUBLAS_DETERMINISTIC_WORKSPACES} before the "
                         f"process starts (it is {workspace!r}), as torch's own deterministic mode does")


# how many calls hold the switch now, and whether the first of them turned it on (then the last turns it off)
_HOLD = {"calls": 0, "turned_on": False}
_HOLD_LOCK = threading.Lock()


@contextmanager
def deterministic_kernels(deterministic: bool) -> Iterator[None]:
    """Inside: torch's deterministic switch on when a call asked for ``deterministic=True`` (outside:
    as it was). torch picks a deterministic algorithm only under its strict switch — FA2's backward
    (``aten_flash``, ``aten_varlen``, ``aten_window``; under ``warn_only=True`` it warns and stays
    atomic, measured 2026-11-29), ``index_add_`` on CUDA — and ``fa4`` reads it for
    FlashAttention-4's own deterministic backward, so an explicit ``deterministic=True`` makes the
    call's kernels deterministic, not only the block backend's name checked
    (:func:`check_deterministic_ready` saw, before any collective, that cuBLAS is set up for it). A
    process that set the switch itself keeps its own setting — in warn-only form FA2's kernels then
    stay non-deterministic, as torch's own warn-only mode leaves them. The switch is process-wide:
    the attention's forward and backward hold it while they run (the autograd engine runs a CUDA
    backward on its device thread while the caller's thread waits), counted across threads, so
    the last call to leave turns off what the first turned on."""
    if not deterministic:
        yield
        return
    with _HOLD_LOCK:
        if _HOLD["calls"] == 0:
            _HOLD["turned_on"] = not torch.are_deterministic_algorithms_enabled()
            if _HOLD["turned_on"]:
                torch.use_deterministic_algorithms(True)
        _HOLD["calls"] += 1
    try:
        yield
    finally:
        with _HOLD_LOCK:
            _HOLD["calls"] -= 1
            if _HOLD["calls"] == 0 and _HOLD["turned_on"]:
                torch.use_deterministic_algorithms(False)
                _HOLD["turned_on"] = False


def make_config(q, *, causal: bool, layout: str, scale: float | None, block_backend: str,
                deterministic: bool | None, window=None, softcap=None, token_index: bool = False,
                shared_tokens: int | None = None) -> AttentionConfig:
    """The config of a per-device call on ``q`` (for its head_dim), with this framework's defaults
    resolved (:func:`default_deterministic`) and the installed communication hook (``comm.using``);
    the rest, the token-index mode among it, is ``seqplan.config.AttentionConfig.for_call``."""
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic, q.device)
    return AttentionConfig.for_call(q.shape[-1], causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                                    deterministic=deterministic, comm=current_comm(),
                                    window=window, softcap=softcap, token_index=token_index,
                                    shared_tokens=shared_tokens)
