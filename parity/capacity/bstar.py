"""B*: the batch at which mixed FSDP+TP training of an FFN stack becomes compute-bound, built
from the accounting model's own bytes (``parity.training.traffic_model.ffn_step_traffic``) and FLOPs, with
every modeling choice explicit (``Choices``).

Per block and device, with B = tokens a device computes on (TP ranks share them; global = B·X):

    T_math = m + a·B      a = FLOPs per token / C (+ memory bytes per token / W_hbm)
                          m = 0 (+ the weights' memory traffic / W_hbm: Adam, casts)
    T_X    = c            FSDP all-gather / reduce-scatter bytes over the X axis (weights: no B)
    T_Y    = y·B          TP all-reduce bytes over the Y axis (activations)

compute-bound when T_math ≥ max(T_X, T_Y) ("max": comms overlap each other and compute) or
T_math ≥ T_X + T_Y ("sum"). So B* = (c − m)/a (max, needs a ≥ y) or (c − m)/(a − y) (sum,
needs a > y), never below 0. ``Choices.memory`` adds the memory-bound term
(:func:`ffn_memory_bytes`, over the profile's ``hbm``); without it m = 0, the FLOPs-only model.
``M_X``, ``M_Y`` (mesh axes each parallelism spans) multiply the bandwidth: T_X = bytes/(M_X·W).
``mx_role="bytes"`` instead reads M_X as the number of gathered weight matrices (one published
CS336 answer), i.e. T_X = M_X·bytes_per_matrix/W. ``ring_factor=False`` drops the (n−1)/n.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, NamedTuple, get_args

from ..core.names import check_choice
from ..training.traffic_model import FFNStep, ffn_step_flops, ffn_step_traffic

Overlap = Literal["max", "sum"]  # comms overlap each other and compute, or add up
MxRole = Literal["bandwidth", "bytes"]  # M_X multiplies the bandwidth, or counts gathered matrices
Passes = Literal["fwd", "fwd+bwd"]

PROFILES = Path(__file__).with_name("profiles")
X_KINDS, Y_KINDS = ("all-gather", "reduce-scatter"), ("all-reduce",)


@dataclass(frozen=True)
class Hardware:
    """C (FLOP/s per device) and W per collective kind (bytes/s a device puts on one link)."""

    name: str
    flops: float
    bandwidth: dict
    hbm: float | None = None  # bytes/s read + written by a large elementwise copy (None: not known)

    @classmethod
    def load(cls, name_or_path: str) -> Hardware:
        path = Path(name_or_path)
        if not path.exists():
            path = PROFILES / f"{name_or_path}.json"
        data = json.loads(path.read_text())
        hbm = data.get("hbm")
        return cls(data["name"], float(data["flops"]), {k: float(v) for k, v in data["bandwidth"].items()},
                   None if hbm is None else float(hbm))

    @classmethod
    def simple(cls, name: str, flops: float, bandwidth: float, hbm: float | None = None) -> Hardware:
        return cls(name, flops, {k: bandwidth for k in ("p2p", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")},
                   hbm)


@dataclass(frozen=True)
class Choices:
    """Every modeling choice of B*, explicit. overlap: "max" (comms overlap each other and
    compute) or "sum"; ring_factor: (n-1)/n on the collectives' bytes; mx_role: "bandwidth" or
    "bytes" (M_X read as the number of gathered matrices); passes: "fwd" or "fwd+bwd"."""

    overlap: Overlap = "max"
    ring_factor: bool = True
    mx_role: MxRole = "bandwidth"
    passes: Passes = "fwd"
    memory: bool = False  # the memory-bound term in T_math (needs the hardware's hbm)

    def __post_init__(self):
        check_choice("overlap", self.overlap, get_args(Overlap))
        check_choice("mx_role", self.mx_role, get_args(MxRole))
        check_choice("passes", self.passes, get_args(Passes))
        for name in ("ring_factor", "memory"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def label(self) -> str:
        return (f"{self.overlap}, ring {'on' if self.ring_factor else 'off'}, M_X x {self.mx_role}, {self.passes}"
                + (", + memory" if self.memory else ""))


@dataclass(frozen=True)
class BStar:
    tokens_per_device: float  # B*: tokens each device computes on
    per_chip: float  # B*·X/N = B*/Y, the Scaling Book's B/N
    global_tokens: float  # B*·X
    x: float
    y: float


def ffn_memory_bytes(d_model: int, d_ff: int, x: int, y: int, passes: Passes, dtype_bytes: int = 2) -> tuple[float, float]:
    """(fixed, per token) bytes one device's memory-bound kernels move per FFN block, as the JAX
    reference step (``parity.training.jax_step``) runs: per token, gelu over [F/Y] (forward: read,
    write; backward: read the pre-activation and the gradient, write) and the residual add over
    [D] (read two, write one; its gradient's sum likewise), in the wire dtype; fixed, the
    device's float32 shard of W1 and W2 (2·D·F/(X·Y) parameters) cast to the wire dtype before
    its gather (4 + e bytes each) and, with the backward, Adam's three fused passes (m, v, then
    the parameter: 10 float32 elements each — ``step_model``'s optax count)."""
    e, shard = dtype_bytes, 2 * d_model * d_ff / (x * y)
    per_token = (2 * d_ff / y + 3 * d_model) * e
    fixed = shard * (4 + e)
    if passes == "fwd+bwd":
        per_token += (3 * d_ff / y + 3 * d_model) * e
        fixed += shard * 40
    return fixed, per_token


class Coefficients(NamedTuple):
    """One block's step-time terms per device (seconds), from the accounting model:
    T(B) = max-or-sum of (m + a·B) and (c + y·B) — ``a`` the compute (and, with the memory term,
    HBM) time per token, ``c`` the FSDP gathers' fixed time, ``y`` the TP collectives' time per
    token, ``m`` the fixed memory time (0 without the memory term)."""

    a: float
    c: float
    y: float
    m: float


def step_coefficients(d_model: int, d_ff: int, x: int, y: int, m_x: float, m_y: float, hw: Hardware,
                      ch: Choices) -> Coefficients:
    """:class:`Coefficients` per block from the accounting model at 1 and 2 tokens per device."""
    passes = ("fwd",) if ch.passes == "fwd" else ("fwd", "bwd")

    def measure(tokens_per_device: int):
        step = FFNStep("fsdp_tp", blocks=1, d_model=d_model, d_ff=d_ff, tokens=tokens_per_device * x, fsdp=x, tp=y)
        rows = ffn_step_traffic(step).rows()
        bx = sum(float(b) for (p, k), (_, b) in rows.items() if p in passes and k in X_KINDS)
        by = sum(float(b) for (p, k), (_, b) in rows.items() if p in passes and k in Y_KINDS)
        flops = sum(ffn_step_flops(step)[p] for p in passes)
        return bx, by, flops

    (bx1, by1, f1), (_, by2, f2) = measure(1), measure(2)  # weight bytes do not grow with B
    if not ch.ring_factor:
        bx1 *= x / (x - 1) if x > 1 else 1
        by1, by2 = (b * (y / (y - 1) if y > 1 else 1) for b in (by1, by2))
    a = (f2 - f1) / hw.flops
    w_x, w_y = hw.bandwidth["all-gather"], hw.bandwidth["all-reduce"]
    c = bx1 / (m_x * w_x) if ch.mx_role == "bandwidth" else m_x * (bx1 / 2) / w_x
    y_coef = (by2 - by1) / (m_y * w_y)
    m = 0.0
    if ch.memory:
        if hw.hbm is None:
            raise ValueError(f"the memory term needs the hardware's hbm bandwidth; {hw.name} has none")
        fixed, per_token = ffn_memory_bytes(d_model, d_ff, x, y, ch.passes)
        a, m = a + per_token / hw.hbm, fixed / hw.hbm
    return Coefficients(a, c, y_coef, m)


def critical_batch(d_model: int, d_ff: int, x: int, y: int, m_x: float, m_y: float, hw: Hardware,
                   choices: Choices = Choices()) -> BStar:
    """B* for a given mesh X (FSDP) × Y (TP); infinite when no batch makes it compute-bound, 0
    when the weights' memory traffic alone outlasts their collectives."""
    a, c, y_coef, m = step_coefficients(d_model, d_ff, x, y, m_x, m_y, hw, choices)
    if choices.overlap == "max":
        b = max(0.0, (c - m) / a) if a >= y_coef else math.inf
    else:  # "sum" (Choices validates the value)
        b = max(0.0, (c - m) / (a - y_coef)) if a > y_coef else math.inf
    return BStar(b, b / y, b * x, x, y)


def optimal_split(d_model: int, d_ff: int, devices: float, m_x: float, m_y: float, hw: Hardware,
                  choices: Choices = Choices()) -> BStar:
    """The Y (TP size, X = N/Y) minimising the global B*, treating Y as continuous and without
    the ring factor (as the Scaling Book's closed forms do): ternary search on log Y over [1, N].
    ``choices.ring_factor`` and ``choices.memory`` are ignored here."""
    # Without the ring factor a, c scale exactly as 1/Y and y_coef not at all: take them at
    # X = Y = 2 once and rescale, so that Y may be continuous.
    a2, c2, yc, _ = step_coefficients(d_model, d_ff, 2, 2, m_x, m_y, hw, replace(choices, ring_factor=False, memory=False))

    def global_b(log_y: float) -> float:
        y = math.exp(log_y)
        a, c = a2 * 2 / y, c2 * 2 / y
        b = (c / a if a >= yc else math.inf) if choices.overlap == "max" else (c / (a - yc) if a > yc else math.inf)
        return b * devices / y

    lo, hi = 0.0, math.log(devices)
    for _ in range(200):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if global_b(m1) <= global_b(m2):
            hi = m2
        else:
            lo = m1
    y = math.exp((lo + hi) / 2)
    g = global_b(math.log(y))
    x = devices / y
    return BStar(g / x, g / devices, g, x, y)


def ring_attention_min_tokens(hw: Hardware, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                              causal: bool = True) -> dict[str, float]:
    """Minimum tokens per device t at which one ring step's K/V transfer hides under that step's
    attention compute. Forward: 2·t·hk·d·e bytes vs 4·t²·h·d FLOPs (halved for a balanced causal
    step). Backward: K/V (e) plus float32 dK/dV (4 bytes) vs 2.5× the forward FLOPs."""
    w, c = hw.bandwidth["p2p"], hw.flops
    work = 0.5 if causal else 1.0
    fwd = 2 * kv_heads * dtype_bytes * c / (4 * heads * w * work)
    bwd = 2 * kv_heads * (dtype_bytes + 4) * c / (2.5 * 4 * heads * w * work)
    return {"fwd": fwd, "bwd": bwd}


@dataclass(frozen=True)
class Preset:
    """A named B* problem: the FFN's sizes, the mesh (X = FSDP, Y = TP; None: only the optimal
    split is computed), the mesh axes each parallelism spans (M_X, M_Y) and the hardware."""

    d_model: int
    d_ff: int
    x: int | None
    y: int | None
    m_x: float
    m_y: float
    hardware: Hardware

    def __post_init__(self):
        if (self.x is None) != (self.y is None):
            raise ValueError(f"give both X and Y or neither, got X={self.x}, Y={self.y}")


PRESETS = {
    # the question gives C and W; its memory rows use TPU v5p's datasheet HBM (not part of the question)
    "cs336-xxl": Preset(16384, 53248, x=16, y=4, m_x=2, m_y=1,
                        hardware=Hardware.simple("tpu-v5p (CS336: C=4.6e14, W=2*9e10; HBM 2.765e12 datasheet)",
                                                 4.6e14, 2 * 9e10, 2.765e12)),
    "llama2-13b": Preset(5120, 13824, x=None, y=None, m_x=2, m_y=1, hardware=Hardware.load("tpu-v5p")),
}
CHOICE_GRID = [Choices(o, r, m) for m in ("bandwidth", "bytes") for o in ("max", "sum") for r in (True, False)]
MEMORY_GRID = [Choices(o, True, "bandwidth", p, memory=True) for p in ("fwd", "fwd+bwd") for o in ("max", "sum")]


def table(preset: str | Preset, devices: int | None = None, hardware: Hardware | None = None) -> list[tuple[str, BStar]]:
    """B* of a preset under every choice in CHOICE_GRID (given X, Y) — and, when the hardware has an
    HBM bandwidth, MEMORY_GRID's (the memory-bound term added) — plus the optimal split;
    ``hardware`` replaces the preset's (e.g. a profile from ``python -m parity calibrate``)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    hw = hardware or p.hardware
    rows = []
    if p.x is not None:
        rows += [(ch.label(), critical_batch(p.d_model, p.d_ff, p.x, p.y, p.m_x, p.m_y, hw, ch)) for ch in CHOICE_GRID]
        if hw.hbm is not None:  # the memory-bound term (forward, and the whole step with Adam)
            rows += [(ch.label(), critical_batch(p.d_model, p.d_ff, p.x, p.y, p.m_x, p.m_y, hw, ch))
                     for ch in MEMORY_GRID]
    n = devices or (p.x * p.y if p.x else 4096)
    for overlap in ("max", "sum"):
        ch = Choices(overlap, False)
        rows.append((f"optimal X, {ch.label()} (N={n})", optimal_split(p.d_model, p.d_ff, n, p.m_x, p.m_y, hw, ch)))
    return rows


def print_table(preset: str, devices: int | None = None, hardware: str | None = None) -> int:
    """``python -m parity bstar``: the table of ``table`` for a preset (and hardware profile)."""
    from rich.console import Console
    from rich.table import Table

    hw = Hardware.load(hardware) if hardware else None
    title = f"B* for {preset}" + (f" on {hw.name}" if hw else "")
    out = Table(title=f"{title} (tokens: per device / per chip B/N / global)")
    for col in ("choices", "X", "Y", "B* per device", "B/N", "global B*"):
        out.add_column(col)
    for label, r in table(preset, devices, hw):
        out.add_row(label, f"{r.x:.4g}", f"{r.y:.4g}", f"{r.tokens_per_device:.4g}", f"{r.per_chip:.4g}",
                    f"{r.global_tokens:.4g}")
    Console(width=160).print(out)
    return 0
