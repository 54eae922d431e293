"""Layouts for packed documents on one GPU (issue 36): the anchors and the report.

    python -m benchmarks.layouts anchors --seq 131072 --ring 8 --out anchors.json   # on the GPU
    python -m benchmarks.layouts report anchors.json rows1.json rows2.json ...      # anywhere

``anchors``: per balance mix (``parity.probes.balance.MIXES``), each framework's fastest fused
varlen kernel on the whole sequence — torch FA2 varlen, flash_attn3_jax ``flash_mha_varlen`` —
over the ids the per-row layouts replay (fitted to R: ``benchmarks.documents.fit_documents``) and
over the raw mix (what the static zigzag replays); each checked at 4096 tokens against the
portable kernel first (``benchmarks.masked``). ``report``: from the replay rows of ``python -m
benchmarks --gpus 1 --documents MIX --layout zigzag,document-zigzag,document-hybrid
--replay-devices all`` (every device timed), per (framework, mix, layout): each device's fwd+bwd
time, the busiest, ``time_balance`` (busiest / mean), the busiest against the anchor ÷ R (the
fitted ids' anchor for the per-row layouts, the raw mix's for static ones) and against the
static zigzag ring's busiest — the issue's three targets, as a markdown table; one entry per
strategy too (``--strategies zigzag-r8,allgather-r8``: the ring, and all-gather-KV's one varlen
call per device).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _problem(mix: str, seq: int, ring: int, fitted: bool):
    from .common import Problem

    return Problem(seq=seq, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, documents=mix,
                   fit_ring=ring if fitted else 0, fit_multiple=2 * ring)


def anchors(seq: int, ring: int) -> dict:
    """{framework: {mix: {"fitted": anchor, "raw": anchor}}} (``benchmarks.masked``'s anchors)."""
    from .documents import mix_names
    from .masked import anchor, jax_anchor

    out: dict = {"torch": {}, "jax": {}}
    for framework, fn in (("torch", anchor), ("jax", jax_anchor)):
        for mix in mix_names():
            out[framework][mix] = {}
            for fitted in (True, False):
                key = "fitted" if fitted else "raw"
                try:
                    out[framework][mix][key] = fn(seq, HEADS, KV_HEADS, HEAD_DIM, problem=_problem(mix, seq, ring,
                                                                                                  fitted))
                except Exception as err:  # noqa: BLE001 — one anchor failing must not lose the others
                    out[framework][mix][key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                print(framework, mix, key, out[framework][mix][key], flush=True)
    return out


def _rows(paths) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    return rows


def summarize(anchor_table: dict, rows: list[dict], ring: int) -> list[dict]:
    """One entry per (framework, mix, layout) from the fwd+bwd replay rows (module docstring)."""
    groups: dict = {}
    for r in rows:
        extra = r.get("extra", {})
        if r.get("fwd_only") or "replay_device" not in extra or r.get("ms_per_iter") is None:
            continue
        framework = r["framework"].split("_")[0]
        key = (framework, extra.get("documents"), r["layout"], r.get("strategy", "ring"))
        groups.setdefault(key, {"verified": True, "ms": {}, "resolved": extra.get("resolved"), "one_call": True})
        groups[key]["one_call"] &= bool(extra.get("one_call"))  # every device ran all-gather-KV's one varlen call
        groups[key]["ms"][extra["replay_device"]] = r["ms_per_iter"]
        groups[key]["verified"] &= bool(r.get("verified"))
    out = []
    for (framework, mix, layout, strategy), g in sorted(groups.items()):
        ms = [g["ms"][d] for d in sorted(g["ms"])]
        busiest, mean = max(ms), sum(ms) / len(ms)
        fitted = layout.startswith("document-")
        a = anchor_table.get(framework, {}).get(mix, {}).get("fitted" if fitted else "raw", {})
        anchor_ms = a.get("fwd_bwd_ms")
        zigzag = groups.get((framework, mix, "zigzag", "ring"))  # the static zigzag ring: the baseline
        out.append({
            "framework": framework, "mix": mix, "layout": layout, "strategy": strategy, "devices": len(ms),
            "device_ms": ms,
            "busiest_ms": busiest, "mean_ms": mean, "time_balance": busiest / mean,
            "anchor_kernel": a.get("kernel"), "anchor_ms": anchor_ms, "anchor_verified": a.get("verified"),
            "busiest_vs_anchor_share": None if not anchor_ms else busiest / (anchor_ms / ring),
            "busiest_vs_zigzag": None if not zigzag else busiest / max(zigzag["ms"].values()),
            "verified": g["verified"] and len(ms) == ring, "resolved": g["resolved"], "one_call": g["one_call"]})
    return out


def markdown(entries: list[dict], ring: int) -> str:
    def f(x, spec=".3f"):
        return "—" if x is None else format(x, spec)

    lines = [f"| framework | mix | layout | strategy | devices | busiest ms | mean ms | time_balance (≤ 1.10) | "
             f"busiest ÷ (anchor ÷ {ring}) (≤ 1.10) | anchor ms | vs zigzag's busiest (≤ 1) | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        strategy = e.get("strategy", "ring") + (" (one call)" if e.get("one_call") else "")
        lines.append(f"| {e['framework']} | {e['mix']} | {e['layout']} | {strategy} | {e['devices']} "
                     f"| {f(e['busiest_ms'], '.2f')} | {f(e['mean_ms'], '.2f')} | {f(e['time_balance'])} "
                     f"| {f(e['busiest_vs_anchor_share'])} | "
                     f"{f(e['anchor_ms'], '.2f')} | {f(e['busiest_vs_zigzag'])} | "
                     f"{'yes' if e['verified'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a_anchor = sub.add_parser("anchors")
    a_anchor.add_argument("--seq", type=int, default=131072)
    a_anchor.add_argument("--ring", type=int, default=8)
    a_anchor.add_argument("--out", required=True)
    a_report = sub.add_parser("report")
    a_report.add_argument("anchors")
    a_report.add_argument("rows", nargs="+", help="results JSON of the replay runs")
    a_report.add_argument("--ring", type=int, default=8)
    a_report.add_argument("--json", default=None, help="also write the entries here")
    a = ap.parse_args(argv)
    if a.command == "anchors":
        Path(a.out).write_text(json.dumps(anchors(a.seq, a.ring), indent=1))
        return
    entries = summarize(json.loads(Path(a.anchors).read_text()), _rows(a.rows), a.ring)
    if a.json:
        Path(a.json).write_text(json.dumps(entries, indent=1))
    print(markdown(entries, a.ring))


if __name__ == "__main__":
    main()
