"""Figures from committed benchmark results — ``python -m benchmarks plot RESULTS.json ... --out docs/figures/``.

Per results file, one PNG per kind of rows it holds (deterministic names, ``<file stem>-<kind>.png``):

- ``throughput``: the unmasked rows — fwd+bwd TFLOP/s per GPU of every verified strategy row
  beside the same run's single-GPU ceilings and other projects' rows (torch context_parallel...),
  at the file's longest sequence;
- ``documents``: the packed-document rows — per balance mix, the verified ringbridge rows
  (framework, strategy, layout) as a fraction of their framework's same-run varlen anchor;
- ``scaling``: the weak-scaling rows (``--weak``: the same tokens per GPU on 1, 2, 4 … GPUs) —
  fwd+bwd TFLOP/s per GPU against the GPU count, one line per framework, strategy and tokens per GPU.

``--together NAME`` draws the files' rows as one set (``NAME-<kind>.png``): one framework's run beside
the other's, each row still over its own run's anchor or ceiling.

Only rows with a throughput are drawn, and of ringbridge's only those marked ``verified`` (the
driver gives an unverified row no throughput; files written before the check existed carry no
mark, so their ringbridge rows are never drawn).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OURS = ("jax_impl", "torch_impl")


def _rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return [r for r in rows if r.get("tflops_per_gpu") and not r.get("fwd_only")
            and (r["framework"] not in OURS or r.get("verified") is True)]


def _label(row: dict) -> str:
    mesh = f"u{row['ulysses']}r{row['ring']}" if row["devices"] > 1 else "1 GPU"
    layout = "" if row["layout"] in ("-", None) else f" {row['layout'].split(' (')[0]}"
    return f"{row['framework']} {row['strategy']} {mesh}{layout}"


def _throughput(rows: list[dict], title: str, out: Path, plt) -> Path | None:
    plain = [r for r in rows if (r.get("extra") or {}).get("documents", "none") == "none"
             and not (r.get("extra") or {}).get("window") and not (r.get("extra") or {}).get("variant")
             and not (r.get("extra") or {}).get("weak_scaling")]
    if not any(r["framework"] in OURS for r in plain):
        return None
    longest = max(r["seq_len"] for r in plain)
    plain = sorted((r for r in plain if r["seq_len"] == longest), key=lambda r: r["tflops_per_gpu"])
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(plain) + 1.2))
    colors = ["tab:blue" if r["framework"] in OURS else "tab:gray" for r in plain]
    ax.barh([_label(r) for r in plain], [r["tflops_per_gpu"] for r in plain], color=colors)
    ax.set_xlabel("fwd+bwd TFLOP/s per GPU")
    ax.set_title(f"{title}: {longest:,} tokens\n(blue: ringbridge, verified; gray: ceilings and other projects)",
                 fontsize=9)
    return _save(fig, out, plt)


def _documents(rows: list[dict], title: str, out: Path, plt) -> Path | None:
    docs = [r for r in rows if r["framework"] in OURS and (r.get("extra") or {}).get("documents", "none") != "none"
            and r.get("efficiency")]
    if not docs:
        return None
    mixes = list(dict.fromkeys(r["extra"]["documents"] for r in docs))
    labels = sorted({_label(r) for r in docs})
    fig, ax = plt.subplots(figsize=(9, 0.22 * len(labels) * len(mixes) + 1.5))
    height = 0.8 / len(mixes)
    for i, mix in enumerate(mixes):
        best = {}
        for r in docs:
            if r["extra"]["documents"] == mix:
                best[_label(r)] = max(best.get(_label(r), 0.0), r["efficiency"])
        ax.barh([j + i * height for j in range(len(labels))], [best.get(lab, 0.0) for lab in labels], height=height,
                label=mix)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(labels))], labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("TFLOP/s per GPU ÷ the framework's one-GPU varlen anchor on the same ids (same run)")
    ax.set_title(f"{title}: packed documents", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out, plt)


def _scaling(rows: list[dict], title: str, out: Path, plt) -> Path | None:
    weak = [r for r in rows if r["framework"] in OURS and (r.get("extra") or {}).get("weak_scaling")]
    lines: dict[str, dict[int, float]] = {}
    for r in weak:
        name = f"{r['framework']} {r['strategy']}, {r['seq_len'] // r['devices']:,} tokens per GPU"
        points = lines.setdefault(name, {})
        points[r["devices"]] = max(points.get(r["devices"], 0.0), r["tflops_per_gpu"])
    lines = {name: points for name, points in sorted(lines.items()) if len(points) > 1}
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in lines.items():
        gpus = sorted(points)
        ax.plot(gpus, [points[g] for g in gpus], marker="o", label=name)
    ax.set_xticks(sorted({g for points in lines.values() for g in points}))
    ax.set_xlabel("GPUs (the same tokens per GPU)")
    ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}: weak scaling (verified rows)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out, plt)


def _save(fig, out: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": None})  # no version stamp: the same rows, the same bytes
    plt.close(fig)
    return out


def plot(paths: list[Path], out_dir: Path, together: str | None = None) -> list[Path]:
    """Every figure the results files hold (module docstring), written under ``out_dir``; with
    ``together``, the files' rows drawn as one set under that name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    sets = [(_rows(path), path.stem) for path in paths]
    if together:
        sets = [([row for rows, _ in sets for row in rows], together)]
    for rows, stem in sets:
        for kind, draw in (("throughput", _throughput), ("documents", _documents), ("scaling", _scaling)):
            figure = draw(rows, stem, out_dir / f"{stem}-{kind}.png", plt)
            if figure is not None:
                written.append(figure)
    return written


def plot_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks plot", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="benchmarks/results/*.json files")
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    ap.add_argument("--together", default=None, metavar="NAME", help="draw the files' rows as one set, named NAME")
    a = ap.parse_args(argv)
    for figure in plot(a.results, a.out, a.together):
        print(figure)
