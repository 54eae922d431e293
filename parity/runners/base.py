"""What a framework runner is (``Runner``), what stands in for one that cannot run
(``Unavailable``), how the harness gets either (``load_runner``), and how every runner passes a
case's packed documents, window, sinks, soft-cap and token indices (``option_keywords``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, Protocol, get_args, runtime_checkable

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs
from ..core.names import Device

Framework = Literal["jax", "torch"]
FRAMEWORKS: tuple[str, ...] = get_args(Framework)


@runtime_checkable
class Runner(Protocol):
    """One framework's way of running a parity case. Results are o, lse, dq, dk, dv as float64
    NumPy arrays in original token order, and for a case with sinks dsinks [h] (the full
    gradient: every device's rows)."""

    def device_count(self, devices: Device = "cpu") -> int:
        """How many devices a case may use on ``devices``."""

    def run_case(self, case: Case, x: Inputs, *, devices: Device = "cpu") -> dict[str, np.ndarray]:
        """``sequence_parallel_attention`` forward and backward on the case's mesh."""

    def run_control(self, case: Case, x: Inputs) -> dict[str, np.ndarray]:
        """Dense attention in the case's dtype on one device (the low-precision control)."""


def option_keywords(*, segment_ids=None, window=None, sinks=None, softcap=None, token_index=None) -> dict:
    """The keywords a framework call takes for packed documents, a sliding window, attention
    sinks, logit soft-capping and explicit token indices — only those that are set (not None), so
    a call without them is exactly what it was."""
    given = {"segment_ids": segment_ids, "window": window, "sinks": sinks, "softcap": softcap,
             "token_index": token_index}
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class Unavailable:
    """A framework that cannot run here, and why (reported as *skipped*, never as passed)."""

    reason: str


def load_runner(framework: Framework) -> Runner | Unavailable:
    """The framework's runner, or ``Unavailable`` when the framework cannot be imported."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    try:
        importlib.import_module(framework)
        module = importlib.import_module(f"parity.runners.{framework}_runner")
    except ImportError as err:
        return Unavailable(f"{framework} not available: {err}")
    return module.RUNNER


def shared_keywords(case, laid_ids) -> dict:
    """``{"shared_tokens": P}`` for a shared-prefix case — P from its ids in layout order [b, t]
    (``seqplan.shared.shared_tokens_for`` over the case's ring) — else ``{}``."""
    if not case.shared_prefix:
        return {}
    from seqplan.shared import shared_tokens_for

    return {"shared_tokens": shared_tokens_for(laid_ids, case.ring)}
