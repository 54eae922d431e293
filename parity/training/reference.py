"""The reference training step of the accounting model's FFN stack: the case description shared
by the JAX and torch implementations (``parity.training.jax_step``, ``parity.training.torch_step``), its inputs,
and a float64 numpy oracle of one unsharded step (forward, loss, backward, one Adam update).

Shapes (letters as everywhere in parity): T tokens, D = d_model, F = d_ff, L blocks.
    x, y: [T, D]    W1: [L, D, F]    W2: [L, F, D]
    block: x ← x + gelu_tanh(x · W1) · W2        loss = ½ Σ (x_L − y)² / T
The step returns the loss, the gradient of the stack's input (as if an embedding preceded it,
so the first block's input-gradient all-reduce is live, as in real training), dW1, dW2, and the
parameters after one Adam step (β 0.9/0.999, ε 1e-8, as optax and torch default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.names import DTYPE_BYTES, DTYPES, Dtype
from .traffic_model import STRATEGIES, FFNStep, TrainStrategy


@dataclass(frozen=True)
class TrainCase:
    """One reference training step.

    strategy: dp | fsdp | tp | fsdp_tp | zero1 (``parity.training.traffic_model``).
    fsdp, tp: sizes of the mesh axes ("fsdp", "tp"); the step runs on fsdp·tp devices.
    dtype: activations, compute copies of the weights and everything on the wire; master
        weights and optimizer state are float32 always.
    """

    strategy: TrainStrategy
    fsdp: int = 1
    tp: int = 1
    blocks: int = 2
    d_model: int = 16
    d_ff: int = 64
    tokens: int = 32
    dtype: Dtype = "float32"
    lr: float = 1e-2
    seed: int = 0

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy in ("dp", "fsdp", "zero1") and self.tp != 1:
            raise ValueError(f"{self.strategy} uses the fsdp axis only; tp must be 1, got {self.tp}")
        if self.strategy == "tp" and self.fsdp != 1:
            raise ValueError(f"tp uses the tp axis only; fsdp must be 1, got {self.fsdp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.d_model % self.fsdp or (self.d_ff // self.tp) % self.fsdp:
            raise ValueError(f"d_model and d_ff/tp must be multiples of fsdp={self.fsdp}")
        self.model_step()  # the model's own divisibility checks

    @property
    def devices(self) -> int:
        return self.fsdp * self.tp

    @property
    def name(self) -> str:
        return f"{self.strategy}-x{self.fsdp}y{self.tp}-L{self.blocks}-{self.dtype}"

    def model_step(self, comm_bytes: int | None = None) -> FFNStep:
        """The analytical model's view of this step (``comm_bytes`` overrides the dtype's)."""
        return FFNStep(self.strategy, blocks=self.blocks, d_model=self.d_model, d_ff=self.d_ff, tokens=self.tokens,
                       fsdp=self.fsdp, tp=self.tp, comm_bytes=comm_bytes or DTYPE_BYTES[self.dtype])


@dataclass(frozen=True)
class TrainInputs:
    x: np.ndarray  # [T, D]
    y: np.ndarray  # [T, D]
    w1: np.ndarray  # [L, D, F]
    w2: np.ndarray  # [L, F, D]


def make_train_inputs(case: TrainCase) -> TrainInputs:
    """float32 values (exactly representable in both frameworks), fixed by the case's seed."""
    rng = np.random.default_rng(case.seed)
    t, d, f, n = case.tokens, case.d_model, case.d_ff, case.blocks
    as32 = lambda a: a.astype(np.float32)
    return TrainInputs(x=as32(rng.standard_normal((t, d))), y=as32(rng.standard_normal((t, d))),
                       w1=as32(rng.standard_normal((n, d, f)) / np.sqrt(d)),
                       w2=as32(rng.standard_normal((n, f, d)) / np.sqrt(f)))


_C = np.sqrt(2.0 / np.pi)


def gelu_tanh(h):
    return 0.5 * h * (1.0 + np.tanh(_C * (h + 0.044715 * h**3)))


def gelu_tanh_grad(h):
    u = np.tanh(_C * (h + 0.044715 * h**3))
    return 0.5 * (1.0 + u) + 0.5 * h * (1.0 - u**2) * _C * (1.0 + 3 * 0.044715 * h**2)


def adam_first_step(w, g, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam update from zero moments (bias-corrected: m̂ = g, v̂ = g²)."""
    m, v = (1 - b1) * g, (1 - b2) * g * g
    return w - lr * (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + eps)


def reference_step(case: TrainCase, inputs: TrainInputs) -> dict[str, np.ndarray]:
    """The unsharded step in float64: loss, dx, dw1, dw2, new_w1, new_w2."""
    x = inputs.x.astype(np.float64)
    w1, w2 = inputs.w1.astype(np.float64), inputs.w2.astype(np.float64)
    saved = []
    for layer in range(case.blocks):
        h = x @ w1[layer]
        saved.append((x, h))
        x = x + gelu_tanh(h) @ w2[layer]
    diff = x - inputs.y
    loss = 0.5 * np.sum(diff**2) / case.tokens
    dx = diff / case.tokens
    dw1, dw2 = np.zeros_like(w1), np.zeros_like(w2)
    for layer in reversed(range(case.blocks)):
        x_in, h = saved[layer]
        dw2[layer] = gelu_tanh(h).T @ dx
        dh = (dx @ w2[layer].T) * gelu_tanh_grad(h)
        dw1[layer] = x_in.T @ dh
        dx = dx + dh @ w1[layer].T
    return {"loss": np.array(loss), "dx": dx, "dw1": dw1, "dw2": dw2,
            "new_w1": adam_first_step(w1, dw1, case.lr), "new_w2": adam_first_step(w2, dw2, case.lr)}
