"""Analytical traffic and FLOPs of one training step of an FFN stack under DP, FSDP, TP,
FSDP+TP and ZeRO-1 — the training-parallelism half of the accounting model, and what the B*
calculator is built on.

The model: L blocks of ``x + W2·gelu(W1·x)``, W1: [D, F], W2: [F, D]; a step sees B tokens.
Communication dtypes (the contract): bf16 weights, activations and gradients on the
wire (``comm_bytes``), fp32 master weights and optimizer state (never communicated).

Per device and block, with N devices on mesh ("fsdp" = X, "tp" = Y):
- DP (X):   bwd all-reduce of dW1, dW2.
- FSDP (X): fwd all-gather W1, W2; bwd all-gather them again and reduce-scatter dW1, dW2.
- TP (Y):   W1 column-, W2 row-parallel: fwd all-reduce of the block output [B, D];
            bwd all-reduce of the input gradient [B, D].
- FSDP+TP:  FSDP over X of the [D, F/Y] shards, TP over Y on B/X tokens.
- ZeRO-1 (X): bwd reduce-scatter of dW1, dW2; step all-gather of the updated W1, W2.
One call per weight matrix (or activation) per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

from ..accounting.model import Traffic

TrainStrategy = Literal["dp", "fsdp", "tp", "fsdp_tp", "zero1"]
STRATEGIES: tuple[str, ...] = get_args(TrainStrategy)


@dataclass(frozen=True)
class FFNStep:
    """One training step: ``blocks`` × (D → F → D), ``tokens`` per step (global), mesh sizes."""

    strategy: TrainStrategy
    blocks: int = 2
    d_model: int = 16
    d_ff: int = 64
    tokens: int = 32
    fsdp: int = 1  # X: data / FSDP / ZeRO-1 axis size
    tp: int = 1  # Y: tensor-parallel axis size
    comm_bytes: int = 2  # bf16 on the wire

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.tokens % self.fsdp or self.d_ff % self.tp or (self.d_model * self.d_ff // self.tp) % self.fsdp:
            raise ValueError(f"tokens % fsdp, d_ff % tp and (d_model·d_ff/tp) % fsdp must be 0: {self}")

    @property
    def tokens_per_device(self) -> int:
        """Tokens each device computes on (TP ranks share theirs)."""
        return self.tokens // self.fsdp

    @property
    def weight_elems(self) -> int:
        """Elements of W1 (= of W2) a device computes with: [D, F/Y]."""
        return self.d_model * self.d_ff // self.tp


def _ring(n: int) -> Fraction:
    return Fraction(n - 1, n)


def ffn_step_traffic(step: FFNStep) -> Traffic:
    """Per-device traffic of one training step (fwd, bwd, step passes)."""
    t, e, s = Traffic(), step.comm_bytes, step.strategy
    x, y = step.fsdp, step.tp
    w = step.weight_elems * e  # one weight matrix (or its gradient) on the wire
    act = step.tokens_per_device * step.d_model * e  # one activation [B/X, D]
    for _ in range(step.blocks):
        for _matrix in range(2):
            if s == "dp" and x > 1:
                t.add("bwd", "all-reduce", 2 * _ring(x) * w)
            if s in ("fsdp", "fsdp_tp") and x > 1:
                t.add("fwd", "all-gather", _ring(x) * w)
                t.add("bwd", "all-gather", _ring(x) * w)
                t.add("bwd", "reduce-scatter", _ring(x) * w)
            if s == "zero1" and x > 1:
                t.add("bwd", "reduce-scatter", _ring(x) * w)
                t.add("step", "all-gather", _ring(x) * w)
        if s in ("tp", "fsdp_tp") and y > 1:
            t.add("fwd", "all-reduce", 2 * _ring(y) * act)
            t.add("bwd", "all-reduce", 2 * _ring(y) * act)
    return t


def ffn_step_flops(step: FFNStep) -> dict[str, int]:
    """Matmul FLOPs per device: fwd 2 matmuls × 2·(B/X)·D·(F/Y) per block; bwd twice that."""
    fwd = step.blocks * 2 * 2 * step.tokens_per_device * step.d_model * step.d_ff // step.tp
    return {"fwd": fwd, "bwd": 2 * fwd}
