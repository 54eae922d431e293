"""A driver run in MagiAttention's published 8×H100 setting, forward and backward apart, beside
their figures (issue 51; docs/benchmarks.md, "Against MagiAttention's figures").

    python -m benchmarks --gpus 8 --seqs 65536 --documents quarter-capped --heads 64 --kv-heads 8 \\
        --passes both --layout zigzag,document-hybrid,document-hybrid-shared \\
        --meshes ring-r8,ring-agkv-r8,usp-r2xu4,ulysses-u8 --machine h100x8-magi
    python -m benchmarks.magi benchmarks/results/DATE-h100x8-magi.json      # the table

Their setting: 8k tokens per GPU, GQA 64 : 8, head_dim 128, bf16, causal packed documents of at
most a quarter of the tokens, TFLOP/s per GPU on the mask area with the backward counted at 2.5×
the forward — the driver's own convention (visible pairs; ×3.5 forward + backward), so the
numbers compare directly. The driver times forward alone and forward + backward (``--passes
both``); the backward's rate here is its 2.5 F over the difference of the two times. Both are
the slowest rank's (torch: a MAX all-reduce of the ranks' medians; JAX: one program over all
devices). Their figures were read off the blog's charts (±5 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

# MagiAttention's blog benchmark, 8× H100, 64k tokens, varlen causal: (forward, backward) TFLOP/s per GPU
PUBLISHED = {"MagiAttention": (459.0, 360.0), "Ulysses (FA3)": (278.0, 332.0), "USP": (260.0, 325.0),
             "LoongTrain": (259.0, 320.0), "Ring-P2P": (89.0, 97.0)}
BACKWARD_FACTOR = 2.5  # their convention, and the driver's (×3.5 = 1 + 2.5 forward + backward)


@dataclass(frozen=True)
class PassRates:
    """One configuration's rates per GPU: forward, backward (2.5 F over t_fb - t_f), both."""

    name: str
    forward: float
    backward: float | None
    both: float | None
    verified: bool | None


def _key(row: dict) -> tuple:
    extra = row.get("extra", {})
    return (row["framework"], row["strategy"], row["layout"], row["seq_len"], extra.get("mesh"),
            extra.get("block_backend"), extra.get("documents"))


def pass_rates(rows: list[dict]) -> list[PassRates]:
    """Pairs each forward-only row with its forward + backward row (same framework, strategy,
    layout, length, mesh, backend, documents); a pair with a failed or missing side keeps what
    was measured."""
    pairs: dict[tuple, dict] = {}
    for row in rows:
        if row.get("tflops_per_gpu") and row.get("ms_per_iter"):
            pairs.setdefault(_key(row), {})["fwd" if row["fwd_only"] else "both"] = row
    out = []
    for key, pair in pairs.items():
        fwd, both = pair.get("fwd"), pair.get("both")
        if fwd is None:
            continue
        flops_per_gpu = fwd["tflops_per_gpu"] * fwd["ms_per_iter"]  # TFLOP·ms: F per GPU
        backward = None
        if both is not None and both["ms_per_iter"] > fwd["ms_per_iter"]:
            backward = BACKWARD_FACTOR * flops_per_gpu / (both["ms_per_iter"] - fwd["ms_per_iter"])
        verified = [r.get("verified") for r in (fwd, both) if r is not None]
        name = f"{key[0]} {key[1]} {key[2]}" + (f" ({key[4]})" if key[4] else "")
        out.append(PassRates(name, fwd["tflops_per_gpu"], backward, both and both["tflops_per_gpu"],
                             None if None in verified else all(verified)))
    return out


def table(rates: list[PassRates]) -> str:
    lines = ["| configuration | forward | backward | fwd+bwd | verified |", "|---|---|---|---|---|"]
    show = lambda x: "—" if x is None else f"{x:.1f}"
    for r in sorted(rates, key=lambda r: -(r.both or 0)):
        lines.append(f"| {r.name} | {show(r.forward)} | {show(r.backward)} | {show(r.both)} | "
                     f"{'—' if r.verified is None else 'yes' if r.verified else 'NO'} |")
    for name, (f, b) in PUBLISHED.items():
        lines.append(f"| {name} (published, 8× H100) | {f:.0f} | {b:.0f} | "
                     f"{(1 + BACKWARD_FACTOR) / (1 / f + BACKWARD_FACTOR / b):.0f} | — |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.magi", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a driver results JSON (benchmarks/results/DATE-MACHINE.json)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        rows = json.load(f)["rows"]
    print(table(pass_rates(rows)))


if __name__ == "__main__":
    main()
