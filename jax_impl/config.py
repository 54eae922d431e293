"""The static settings of one attention call (:class:`AttentionConfig`), and the environment
defaults of the API's keyword arguments — read here (and in ``seqplan.config``), at the API boundary, and nowhere else.

    RINGBRIDGE_CHECK_RANKS=1                   -> check_ranks=None means True
    XLA_FLAGS has --xla_gpu_deterministic_ops=true  -> deterministic=None means True; deterministic=True
                                                    on a GPU requires it (check_deterministic_ready)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from dataclasses import dataclass
from typing import ClassVar

import seqplan.config

from .block import BlockBackend, get_backend
from .comm import Comm, current_comm


@dataclass(frozen=True)
class AttentionConfig(seqplan.config.AttentionConfig):
    """seqplan's :class:`seqplan.config.AttentionConfig` (the fields, their checks and
    ``for_call``) with JAX's transfer hook and block kernels; a ``custom_vjp`` non-differentiable
    argument, so hashable and never an array."""

    COMM_TYPE: ClassVar[type] = Comm
    comm: Comm = Comm()
    # dK / dV leave a device's only block in float32, not q's dtype: the caller's K/V came in
    # float32 (Ulysses' replicated KV heads, whose copies' gradients are summed after the call)
    float32_kv_grads: bool = False
    # o leaves the walk whole in float32: sinks follow, entered into every row in float32 (the halo
    # schedule's accumulator otherwise keeps the rows no block merges into in q's dtype: merge.Float32Rows)
    float32_output: bool = False

    def backend(self) -> BlockBackend:
        """The block kernels (an unknown or refused name raises here), soft-capping every block
        when ``softcap`` is set (``block.get_backend``)."""
        return get_backend(self.block_backend, deterministic=self.deterministic, softcap=self.softcap)


XLA_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _xla_deterministic() -> bool:
    """Whether XLA_FLAGS turns XLA's deterministic GPU ops on: its last ``--xla_gpu_deterministic_ops``
    wins, as XLA reads it (bare, ``=true`` or ``=1``: on)."""
    values = re.findall(r"--xla_gpu_deterministic_ops(?:=(\S*))?(?=\s|$)", os.environ.get("XLA_FLAGS", ""))
    return bool(values) and values[-1].lower() in ("", "true", "1")


def _default_platform() -> str:
    """The platform a traced call resolves for: the default device's (``jax.devices()[0]``), as
    "auto" resolves a traced block (``block.device_kind_of``)."""
    import jax

    return jax.devices()[0].platform


def default_deterministic(deterministic: bool | None) -> bool:
    """``deterministic``, or when None whether XLA was started with deterministic GPU ops. XLA
    reads XLA_FLAGS once, when its backend starts: ``deterministic=True`` can only refuse a block
    kernel that is not deterministic, never make XLA's own ops deterministic
    (:func:`check_deterministic_ready`)."""
    if deterministic is not None:
        return bool(deterministic)
    return _xla_deterministic()


# Whether the block backward being traced must be run-to-run deterministic: held by the custom_vjp's
# backward (loop.attention_with_vjp, and the replay's device_backward) from the call's config while
# it traces the backward, read by the kernels with a deterministic mode of their own (FA3's
# backward: kernels/fa3.py, kernels/fa3_varlen.py) as they emit their call — a trace-time fact, as
# torch_impl's deterministic_kernels holds torch's strict switch around its backward.
_DETERMINISTIC_KERNELS: contextvars.ContextVar[bool] = contextvars.ContextVar("deterministic_kernels", default=False)


@contextlib.contextmanager
def deterministic_kernels(deterministic: bool):
    """While the block backwards are traced: whether they must be deterministic."""
    token = _DETERMINISTIC_KERNELS.set(bool(deterministic))
    try:
        yield
    finally:
        _DETERMINISTIC_KERNELS.reset(token)


def kernels_deterministic() -> bool:
    """Whether the backward being traced asked for run-to-run determinism (:func:`deterministic_kernels`)."""
    return _DETERMINISTIC_KERNELS.get()


def check_deterministic_ready(deterministic: bool) -> None:
    """ValueError, at trace time (before any collective), for ``deterministic=True`` where a call
    resolves its kernels for a GPU (:func:`_default_platform`, the rule "auto" follows) and XLA was
    not started with deterministic ops: cuDNN's backward (fp16 blocks' kernel in that mode) and
    XLA's own scatters (the document blocks' dK / dV) are then run-to-run different, which only a
    flag read at start-up changes. On the CPU every kernel is reproducible: nothing is asked."""
    if not deterministic or _xla_deterministic():
        return
    if _default_platform() in GPU_PLATFORMS:
        raise ValueError(f"deterministic=True on a GPU needs XLA started with deterministic ops: set "
                         f"XLA_FLAGS={XLA_DETERMINISTIC} before JAX initialises its GPU backend (XLA reads its flags "
                         "once); without it cuDNN's backward and XLA's scatters differ run to run")


def make_config(q, *, causal: bool, layout: str, scale: float | None, block_backend: str,
                deterministic: bool | None, window=None, softcap=None, token_index: bool = False,
                shared_tokens: int | None = None) -> AttentionConfig:
    """The config of a per-device call on ``q`` (for its head_dim), with this framework's defaults
    resolved (:func:`default_deterministic`) and the installed communication hook (``comm.using``);
    the rest, the token-index mode among it, is ``seqplan.config.AttentionConfig.for_call``."""
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic)
    return AttentionConfig.for_call(q.shape[-1], causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                                    deterministic=deterministic, comm=current_comm(),
                                    window=window, softcap=softcap, token_index=token_index,
                                    shared_tokens=shared_tokens)
