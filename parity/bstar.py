"""B*: the batch at which mixed FSDP+TP training of an FFN stack becomes compute-bound, built
from the accounting model's own bytes (``training_model.ffn_step_traffic``) and FLOPs, with
every modeling choice explicit (``Choices``).

Per block and device, with B = tokens a device computes on (TP ranks share them; global = B·X):

    T_math = a·B          a = FLOPs per token / C
    T_X    = c            FSDP all-gather / reduce-scatter bytes over the X axis (weights: no B)
    T_Y    = y·B          TP all-reduce bytes over the Y axis (activations)

compute-bound when T_math ≥ max(T_X, T_Y) ("max": comms overlap each other and compute) or
T_math ≥ T_X + T_Y ("sum"). So B* = c/a (max, needs a ≥ y) or c/(a − y) (sum, needs a > y).
``M_X``, ``M_Y`` (mesh axes each parallelism spans) multiply the bandwidth: T_X = bytes/(M_X·W).
``mx_role="bytes"`` instead reads M_X as the number of gathered weight matrices (one published
CS336 answer), i.e. T_X = M_X·bytes_per_matrix/W. ``ring_factor=False`` drops the (n−1)/n.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .training_model import FFNStep, ffn_step_flops, ffn_step_traffic

PROFILES = Path(__file__).with_name("profiles")
X_KINDS, Y_KINDS = ("all-gather", "reduce-scatter"), ("all-reduce",)


@dataclass(frozen=True)
class Hardware:
    """C (FLOP/s per device) and W per collective kind (bytes/s a device puts on one link)."""

    name: str
    flops: float
    bandwidth: dict

    @classmethod
    def load(cls, name_or_path: str) -> "Hardware":
        path = Path(name_or_path)
        if not path.exists():
            path = PROFILES / f"{name_or_path}.json"
        data = json.loads(path.read_text())
        return cls(data["name"], float(data["flops"]), {k: float(v) for k, v in data["bandwidth"].items()})

    @classmethod
    def simple(cls, name: str, flops: float, bandwidth: float) -> "Hardware":
        return cls(name, flops, {k: bandwidth for k in ("p2p", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")})


@dataclass(frozen=True)
class Choices:
    overlap: str = "max"  # "max" | "sum"
    ring_factor: bool = True  # (n-1)/n on the collectives' bytes
    mx_role: str = "bandwidth"  # "bandwidth" | "bytes" (M_X read as the number of gathered matrices)
    passes: str = "fwd"  # "fwd" | "fwd+bwd"

    def label(self) -> str:
        return f"{self.overlap}, ring {'on' if self.ring_factor else 'off'}, M_X x {self.mx_role}, {self.passes}"


@dataclass(frozen=True)
class BStar:
    tokens_per_device: float  # B*: tokens each device computes on
    per_chip: float  # B*·X/N = B*/Y, the Scaling Book's B/N
    global_tokens: float  # B*·X
    x: float
    y: float


def _coefficients(d_model: int, d_ff: int, x: int, y: int, m_x: float, m_y: float, hw: Hardware, ch: Choices):
    """(a, c, y_coef) per block from the accounting model at 1 and 2 tokens per device."""
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
    return a, c, y_coef


def critical_batch(d_model: int, d_ff: int, x: int, y: int, m_x: float, m_y: float, hw: Hardware,
                   choices: Choices = Choices()) -> BStar:
    """B* for a given mesh X (FSDP) × Y (TP); infinite when no batch makes it compute-bound."""
    a, c, y_coef = _coefficients(d_model, d_ff, x, y, m_x, m_y, hw, choices)
    if choices.overlap == "max":
        b = c / a if a >= y_coef else math.inf
    elif choices.overlap == "sum":
        b = c / (a - y_coef) if a > y_coef else math.inf
    else:
        raise ValueError(f"overlap must be 'max' or 'sum', got {choices.overlap!r}")
    return BStar(b, b / y, b * x, x, y)


def optimal_split(d_model: int, d_ff: int, devices: float, m_x: float, m_y: float, hw: Hardware,
                  choices: Choices = Choices()) -> BStar:
    """The Y (TP size, X = N/Y) minimising the global B*, treating Y as continuous and without
    the ring factor (as the Scaling Book's closed forms do): ternary search on log Y over [1, N].
    ``choices.ring_factor`` is ignored here."""
    # Without the ring factor a, c scale exactly as 1/Y and y_coef not at all: take them at
    # X = Y = 2 once and rescale, so that Y may be continuous.
    a2, c2, yc = _coefficients(d_model, d_ff, 2, 2, m_x, m_y, hw, replace(choices, ring_factor=False))

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


PRESETS = {
    # name: (d_model, d_ff, X, Y, M_X, M_Y, hardware)
    "cs336-xxl": (16384, 53248, 16, 4, 2, 1, Hardware.simple("tpu-v5p (CS336: C=4.6e14, W=2*9e10)", 4.6e14, 2 * 9e10)),
    "llama2-13b": (5120, 13824, None, None, 2, 1, Hardware.load("tpu-v5p")),
}
CHOICE_GRID = [Choices(o, r, m) for m in ("bandwidth", "bytes") for o in ("max", "sum") for r in (True, False)]


def table(preset: str, devices: int | None = None) -> list[tuple[str, BStar]]:
    """B* of a preset under every choice in CHOICE_GRID (given X, Y), plus the optimal split."""
    d_model, d_ff, x, y, m_x, m_y, hw = PRESETS[preset]
    rows = []
    if x is not None:
        rows += [(ch.label(), critical_batch(d_model, d_ff, x, y, m_x, m_y, hw, ch)) for ch in CHOICE_GRID]
    n = devices or (x * y if x else 4096)
    for overlap in ("max", "sum"):
        ch = Choices(overlap, False)
        rows.append((f"optimal X, {ch.label()} (N={n})", optimal_split(d_model, d_ff, n, m_x, m_y, hw, ch)))
    return rows


def main(argv=None) -> int:
    import argparse

    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="python -m parity bstar", description="critical batch of FSDP+TP")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cs336-xxl")
    parser.add_argument("--devices", type=int, default=None, help="N for the optimal-X rows")
    args = parser.parse_args(argv)
    out = Table(title=f"B* for {args.preset} (tokens: per device / per chip B/N / global)")
    for col in ("choices", "X", "Y", "B* per device", "B/N", "global B*"):
        out.add_column(col)
    for label, r in table(args.preset, args.devices):
        out.add_row(label, f"{r.x:.4g}", f"{r.y:.4g}", f"{r.tokens_per_device:.4g}", f"{r.per_chip:.4g}",
                    f"{r.global_tokens:.4g}")
    Console(width=160).print(out)
    return 0
