"""Key tiles FlashAttention-3's varlen backward launches on each device of JAX's all-gather one call
with the shared prefix on the per-document hybrid — as one call, and as the two groups of
``jax_impl.kernels.groups`` — counted on the CPU from the devices' plans (no kernel runs).

    python -m benchmarks.launched_tiles [--seq 131072] [--ring 4] [--mixes short,heavy-tail,few-long]

Per head and step; each part of a device (the shared prefix, the local documents) is one call.
"Work" counts the key tiles that hold a key of their run (what a grid sized to the runs would
launch); "exact" what one call launches with exactly the device's runs as slots and its longest
run as the bound — a host-planned call (torch's), if its kernel's backward grid is FA2's / FA3's
kind (runs × bound tiles). The device's choice of slots, bound and threshold is ``groups.split_runs``'; this counts
the same rule in numpy (tests/unit/test_backward_groups.py holds the two equal).
docs/gpu/documents-2026-11-27-h200x4.md ("Run 8") fits ≈ 16 ns of a step per launched tile on 4× H200.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from .documents import fit_documents, mix_ids

TILE = 128


def _up(values, x):
    return min(v for v in values if v >= x)


def call_tiles(lengths: np.ndarray, sizes, ladder) -> int:
    """Key tiles one call launches over runs of ``lengths`` keys: slots x ceil(bound / 128)."""
    if not len(lengths):
        return 0
    return _up(sizes, len(lengths)) * -(-_up(ladder, int(lengths.max())) // TILE)


def split_tiles(lengths: np.ndarray, sizes, ladder) -> tuple[int, int]:
    """(tiles, θ) as ``groups.split_runs`` chooses: the cheapest split at a rung θ of ``ladder`` —
    runs over θ keys in one call, the rest in the other; the first rung on ties — if it launches at
    most ``SPLIT_AT_MOST`` of the one call's tiles, else the one call (θ the top rung)."""
    from jax_impl.kernels.groups import SPLIT_AT_MOST

    costs = [call_tiles(lengths[lengths > th], sizes, ladder) + call_tiles(lengths[lengths <= th], sizes, ladder)
             for th in ladder]
    best = int(np.argmin(costs))
    if costs[best] > SPLIT_AT_MOST * costs[-1]:
        best = len(ladder) - 1
    return costs[best], ladder[best]


def score_tiles(queries: int, keys: int, rows: int = 64) -> int:
    """The backward's (64-query x 128-key) tiles of one run with real work: its queries at the end
    of its keys (bottom-right causal), query block i seeing the keys up to its last query."""
    return sum(-(-(keys - queries + min(queries, i + rows)) // TILE) for i in range(0, queries, rows))


@dataclass(frozen=True)
class DeviceTiles:
    mix: str
    device: int
    runs: int
    work: int  # key tiles holding a key of their run
    exact: int  # key tiles one call launches with exact slots and bound (the grid of a host-planned call: torch's)
    one_call: int  # key tiles the one call launches
    two_groups: int  # key tiles with RINGBRIDGE_BACKWARD_GROUPS=2 (the split where it is taken)
    score: int  # score tiles with real work (what the kernel computes)


def device_tiles(mix: str, seq: int, ring: int) -> list[DeviceTiles]:
    """Every device's tiles on ``mix`` at ``seq`` tokens over a ring of ``ring`` (one row, the
    driver's fitted ids, the hybrid layout and the shared prefix the chooser would pass)."""
    from jax_impl.kernels.runs import PREFIX_SLOTS, prefix_length_ladder
    from seqplan.layouts import hybrid_layout
    from seqplan.shared import ring_shards, shared_tokens_for, split_runs

    ids = fit_documents(mix_ids(mix, 1, seq), ring, 2 * ring)
    layout = hybrid_layout(ids, ring)
    laid = np.take_along_axis(ids, layout.perm, 1)
    shared = shared_tokens_for(laid, ring)
    ids_all, index_all = ring_shards(laid, ring), ring_shards(layout.perm.astype(np.int32), ring)
    sizes = PREFIX_SLOTS  # one row: the plans' slot counts as they are
    rows = []
    for device in range(ring):
        parts = split_runs(ids_all, index_all, device=device, shared_tokens=shared, layout="contiguous")
        runs = work = exact = one = two = score = 0
        for part, keys in ((parts.shared, ring * shared), (parts.local, seq // ring)):
            if part is None:
                continue
            lengths, ladder = np.diff(part.cu_k), prefix_length_ladder(keys)
            runs += len(lengths)
            work += int(np.sum(-(-lengths // TILE)))
            exact += len(lengths) * -(-int(lengths.max()) // TILE)
            one += call_tiles(lengths, sizes, ladder)
            two += split_tiles(lengths, sizes, ladder)[0]
            score += sum(score_tiles(int(a), int(b)) for a, b in zip(np.diff(part.cu_q), lengths))
        rows.append(DeviceTiles(mix, device, runs, work, exact, one, two, score))
    return rows


def fit(profiles: list[dict], seq: int, ring: int, heads: int) -> tuple[float, float]:
    """(ns per score tile, ns per launched key tile), all heads: a least-squares fit of each GPU's
    attention time in ``profiles`` (``benchmarks/mesh_profile_jax.py``'s JSON of the one-call path)
    on the one call's counts for its mix."""
    x, y = [], []
    for profile in profiles:
        per_gpu = profile["per_gpu"]
        for row, gpu in zip(device_tiles(profile["mix"], seq, ring), sorted(per_gpu)):
            x.append([row.score * heads, row.one_call * heads])
            y.append(per_gpu[gpu]["kernel_ms_per_step"]["attention"] * 1e6)  # ns
    coef = np.linalg.lstsq(np.array(x, float), np.array(y), rcond=None)[0]
    return float(coef[0]), float(coef[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launched_tiles", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--ring", type=int, default=4)
    ap.add_argument("--mixes", default="short,heavy-tail,few-long")
    ap.add_argument("--fit", nargs="*", default=[], metavar="PROFILE_JSON",
                    help="mesh_profile_jax.py profiles of the shared-prefix path (same --seq / --ring): "
                         "fit the ns per launched tile on their per-GPU attention time")
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args(argv)
    if args.fit:
        import json

        profiles = [json.load(open(path)) for path in args.fit]
        per_score, per_launched = fit(profiles, args.seq, args.ring, args.heads)
        print(f"fit over {len(profiles)} profiles: {per_score:.1f} ns per score tile, {per_launched:.1f} ns per "
              "launched key tile (all heads)")
        return 0
    print(f"# Launched backward key tiles per head, {args.seq} tokens over {args.ring} devices "
          "(all-gather hybrid + shared prefix)\n")
    print("| mix | device | runs | tiles with work | exact slots and bound | one call (JAX) | two groups (JAX) |")
    print("|---|---|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        for r in device_tiles(mix, args.seq, args.ring):
            print(f"| {r.mix} | {r.device} | {r.runs} | {r.work} | {r.exact} | {r.one_call} | {r.two_groups} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
