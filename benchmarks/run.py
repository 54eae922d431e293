"""``python -m benchmarks``: the JAX and torch benchmarks in one run on this machine's GPUs, then
one results table (markdown + JSON) in ``benchmarks/results/<date>-<machine>.md``.

    python -m benchmarks [--seqs 32768,131072] [--meshes ring-r4,ulysses-u4,usp-r2xu2,double_ring-ro2xri2,ring-agkv-r4]
    python -m benchmarks --gpus 1 --machine h100 [...]      # one GPU: per-device work through the replay
    python -m benchmarks report PART.json [PART.json ...]   # table from saved parts
    python -m benchmarks plot RESULTS.json ... --out docs/figures/   # figures from results files

Every ringbridge row's path is verified before it counts (``benchmarks/verify.py``): the
``verified`` column; a failing path is a failing row, not a throughput. ``--gpus 1`` runs
``benchmarks/bench_replay.py`` in this process (see there) and writes
``results/<date>-<machine>-1gpu.md/.json``.

The JAX part runs in its own process (one process, every GPU); the torch part under
``torchrun`` (one process per GPU). Each row's efficiency is its TFLOP/s per GPU over the best
single-GPU ceiling of its own framework measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from .common import Row

RESULTS = Path(__file__).parent / "results"
JAX_FRAMEWORKS = ("jax_impl", "jax_impl_mc", "fa3_jax", "jax_cudnn_ceiling", "fa3_jax_ceiling", "jax_varlen_anchor",
                  "jax_window_anchor")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "torch", "flash_attn3_jax", "yunchang"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            out[name] = "not installed"
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = "unknown"
    return out


def queued_tflops(row: dict) -> float | None:
    """The row's TFLOP/s per GPU at its queued step time (``extra.queued_ms``: the host running
    ahead), or None where it has none."""
    queued = row.get("extra", {}).get("queued_ms")
    if not queued or not row.get("tflops_per_gpu") or not row.get("ms_per_iter"):
        return None
    return row["tflops_per_gpu"] * row["ms_per_iter"] / queued


def add_efficiency(rows: list[dict]) -> list[dict]:
    """efficiency = TFLOP/s/GPU over the best same-mode single-GPU ceiling of the row's framework;
    with packed documents, over its framework's varlen anchor on the same ids (same documents,
    same fitting); with a sliding window (no documents), over its framework's window anchor with
    the same window (timed at the ceiling's length: a window's work per token does not grow with
    the length) — all counted on the visible pairs. ``queued_efficiency``: the same at both sides'
    queued step times (:func:`queued_tflops`), where both have one — and None where any of the
    reference's candidates (a ceiling kernel, an anchor) was timed only waited: the best of a
    subset is not the reference."""
    def family(r):
        return "jax" if r["framework"] in JAX_FRAMEWORKS else "torch"

    def ids_key(r):
        e = r.get("extra", {})
        return family(r), r["seq_len"], e.get("documents"), e.get("fit_ring", 0), e.get("fit_multiple", 1)

    def window_key(r):
        return family(r), tuple(r.get("extra", {}).get("window") or ())

    def reference_of(r):
        """(table, key) of the reference ``r`` is measured against, or None."""
        documents = r.get("extra", {}).get("documents") not in (None, "none")
        windowed = not documents and bool(r.get("extra", {}).get("window"))
        if r["fwd_only"] and (documents or windowed):
            return None  # the anchors are timed forward + backward only
        if documents:
            return "anchors", ids_key(r)
        if windowed:
            return "windows", window_key(r)
        return "best", (family(r), r["fwd_only"])

    waited = lambda r: r.get("tflops_per_gpu")
    for field, rate in (("efficiency", waited), ("queued_efficiency", queued_tflops)):
        tables: dict[str, dict] = {"best": {}, "anchors": {}, "windows": {}}
        partial = set()  # references timed waited but not queued: a queued ratio there would be over a subset
        for r in rows:
            if waited(r) and not rate(r) and r["framework"].endswith(("_ceiling", "_varlen_anchor", "_window_anchor")):
                partial.add((family(r), r["fwd_only"]) if r["framework"].endswith("_ceiling") else
                            ids_key(r) if r["framework"].endswith("_varlen_anchor") else window_key(r))
            if not rate(r):
                continue
            if r["framework"].endswith("_ceiling"):
                key = (family(r), r["fwd_only"])
                tables["best"][key] = max(tables["best"].get(key, 0.0), rate(r))
            if r["framework"].endswith("_varlen_anchor"):
                tables["anchors"][ids_key(r)] = rate(r)
            if r["framework"].endswith("_window_anchor"):
                tables["windows"][window_key(r)] = rate(r)
        for r in rows:
            where = reference_of(r)
            reference = tables[where[0]].get(where[1]) if where and where[1] not in partial else None
            r[field] = rate(r) / reference if reference and rate(r) else None
    return rows


def _backend_cell(extra: dict) -> str:
    """Block backend, plus the overlap probe's variant or the multi-controller process count."""
    cell = extra.get("block_backend", "")
    if extra.get("resolved"):  # "auto" (or a named backend) -> the kernel of each mask kind
        cell += " → " + ", ".join(f"{m}: {k}" for m, k in extra["resolved"].items())
    if extra.get("replay_device") is not None:
        cell += f" (device {extra['replay_device']})"
    if extra.get("variant"):
        cell += f" ({extra['variant']})"
    if extra.get("controllers"):
        cell += f" ({extra['controllers']} processes)"
    if extra.get("one_call") is not None:  # all-gather-KV: every device on the one varlen call, or not
        cell += " (one varlen call)" if extra["one_call"] else " (walks the blocks)"
    if extra.get("kernel"):  # a varlen anchor: the kernel that ran
        cell += extra["kernel"]
    return cell


def _layout_cell(r: dict) -> str:
    """The layout, and the documents the row's ids were drawn from (fitted to R for a per-row layout)."""
    extra = r.get("extra", {})
    if extra.get("documents") in (None, "none"):
        return r["layout"]
    fit = f", fitted to R {extra['fit_ring']}" if extra.get("fit_ring") else ""
    return f"{r['layout']} ({extra['documents']}{fit})"


def _replay_note(extra: dict) -> str:
    """One-GPU replay rows: replay efficiency (Σ bare kernels / the device's replayed time) and the
    compute-side temporaries over the floor (benchmarks/efficiency.py, bench_replay.py)."""
    parts = []
    if extra.get("tflops_own_pairs") is not None:
        parts.append(f"{extra['tflops_own_pairs']:.0f} TFLOP/s on its own pairs")
    if extra.get("replay_efficiency") is not None:
        parts.append(f"replay efficiency {extra['replay_efficiency']:.3f} (kernels {extra['kernels_ms']:.2f} ms)")
    if extra.get("temporaries_vs_floor") is not None:
        parts.append(f"temporaries {extra['temporaries_vs_floor']:.2f}× floor")
    return "; ".join(parts) + ("; " if parts else "")


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Benchmark — {meta['date']} — {meta['machine']}", "",
             f"Command: `{meta['command']}`  ", f"Versions: {json.dumps(meta['versions'])}  ",
             "Problem: bf16, batch 1, causal, 32 heads (kv heads as listed), head_dim 128; FLOPs = 4·b·h·s²·d/2 "
             "forward (with --documents or --window: 4·h·d·(visible pairs), the mask area), ×3.5 forward+backward. "
             "Efficiency: TFLOP/s/GPU over the best single-GPU ceiling of the "
             "same framework in this run (packed documents: over its framework's varlen anchor on the same ids, "
             "`*_varlen_anchor`). Memory: torch max_memory_allocated; JAX compiled memory analysis "
             "(arguments + outputs + temporaries); ×floor: over q, k, v, o, lse, one arriving K/V pair (+ dq, dk, "
             "dv, do and the float32 dK/dV accumulator and its travelling copy) — `Problem.floor_terms`.", "",
             "Queued: ms per step with the run's steps queued before one wait (the host running ahead, as in "
             "training), and the efficiency at both sides' queued times.", "",
             "| framework | strategy | layout | seq_len | ulysses | ring | fwd_only | backend | iters/s | ms/iter "
             "| spread ms | queued ms | peak MB/dev | ×floor | TFLOP/s/GPU | efficiency | queued efficiency | verified "
             "| note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["framework"], r["strategy"], _layout_cell(r), str(r["seq_len"]), str(r["ulysses"]), str(r["ring"]),
            "fwd" if r["fwd_only"] else "fwd+bwd", _backend_cell(r.get("extra", {})),
            _fmt(r.get("iters_per_s"), ".2f"), _fmt(r.get("ms_per_iter"), ".2f"), _fmt(r.get("ms_spread"), ".2f"),
            _fmt(r.get("extra", {}).get("queued_ms"), ".2f"),
            _fmt(r.get("peak_mb_per_device"), ".0f"), _fmt(r.get("memory_vs_floor"), ".2f"),
            _fmt(r.get("tflops_per_gpu"), ".1f"), _fmt(r.get("efficiency"), ".2f"), _fmt(r.get("queued_efficiency"), ".2f"),
            {True: "yes", False: "**FAILED**", None: "—"}[r.get("verified")],
            (_replay_note(r.get("extra", {})) + (r.get("note") or "")).replace("|", "/")[:160]]) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], command: str, machine: str, versions: dict | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine, "command": command,
            "versions": versions or _versions()}
    rows = add_efficiency(rows)
    stem = RESULTS / f"{meta['date']}-{machine}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(rows, meta))
    return stem.with_suffix(".md")


def report_main(argv: list[str]) -> None:
    """``python -m benchmarks report PART.json ...``: the table from saved parts (``--verdicts``:
    mark ringbridge's rows from a verdict file, as the driver does)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks report")
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--machine", default="h200x4")
    ap.add_argument("--command", default="python -m benchmarks")
    ap.add_argument("--versions", default=None, help="JSON: the versions on the machine that measured the parts")
    ap.add_argument("--verdicts", default=None, help="verdicts.json of benchmarks.verify: mark the rows from it")
    a = ap.parse_args(argv)
    rows = [r for p in a.parts for r in json.loads(Path(p).read_text())]
    for r in rows:  # parts written before finish() knew the probe: it does no attention math
        if r.get("extra", {}).get("variant") == "comm-only":
            r["tflops_per_gpu"] = None
    if a.verdicts:
        from .verify import mark_rows

        rows = mark_rows(rows, json.loads(Path(a.verdicts).read_text()))
    print(write(rows, a.command, a.machine, json.loads(a.versions) if a.versions else None))


def _side(name: str, command: list[str], out: Path, env: dict) -> Path | None:
    """Run one timing side; its part file even if it failed part-way (rows are saved as measured)."""
    done = subprocess.run(command, env=env)
    if done.returncode != 0:
        print(f"{name} side exited {done.returncode}; keeping the rows it saved", flush=True)
    return out if out.exists() else None


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        from .plot import plot_main

        plot_main(argv[1:])
        return
    if argv[:1] == ["report"]:
        report_main(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="h200x4")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--only", choices=("jax", "torch"), default=None)
    ap.add_argument("--parts-dir", default=None,
                    help="where the verdicts and each side's rows go (created; refused if it holds parts already)")
    ap.add_argument("--no-verify", action="store_true", help="do not verify the timed paths (rows: verified unknown)")
    ap.add_argument("--jax-multi-controller", action="store_true",
                    help="also run jax_impl with one process per GPU (torchrun + jax.distributed.initialize)")
    a, rest = ap.parse_known_args(argv)
    if a.gpus == 1:
        _one_gpu(a, rest, argv)
        return
    from .common import check_layouts, shared_arguments

    flags, _ = shared_arguments("").parse_known_args(["--out", "-", *rest])
    check_layouts(flags.layout, flags.documents)  # before any GPU work
    rows = _multi_gpu_rows(a, rest, _parts_dir(a.parts_dir), flags)
    print(write(rows, "python -m benchmarks " + " ".join(argv), a.machine))


def _one_gpu(a, rest: list[str], argv: list[str]) -> None:
    """``--gpus 1``: every strategy's per-device work through the replay (``bench_replay``)."""
    from . import bench_replay

    rows = bench_replay.main(rest)
    if "--smoke" in rest:  # a CPU check of the code path: no results file
        print(markdown(add_efficiency([r.to_dict() for r in rows]), {"date": "smoke", "machine": "cpu",
                                                                      "command": " ".join(argv), "versions": {}}))
    elif "--dry-run" not in rest:
        print(write([r.to_dict() for r in rows], "python -m benchmarks " + " ".join(argv), f"{a.machine}-1gpu"))


def _parts_dir(given: str | None) -> Path:
    """The folder the verdicts and each side's rows are written to as they come: created, or
    refused when it holds parts already (before any GPU work)."""
    parts_dir = Path(given or f"/tmp/ringbridge-parts-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    if parts_dir.exists() and any(parts_dir.glob("*.json")):
        raise SystemExit(f"--parts-dir {parts_dir} already holds parts: name an empty or new folder")
    parts_dir.mkdir(parents=True, exist_ok=True)
    print(f"parts in {parts_dir}", flush=True)
    return parts_dir


def _multi_gpu_rows(a, rest: list[str], parts_dir: Path, flags) -> list[dict]:
    """Every timed path verified first (its own process), then each side in its own processes —
    JAX single-controller, torch under torchrun, optionally JAX one process per GPU — each side's
    rows kept if another fails, marked with the verdicts; ``flags``: the sides' shared flags
    (``--weak``'s ring sizes each start a torch world of their own)."""
    from .common import weak_worlds

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    verdicts_path = parts_dir / "verdicts.json"
    if not a.no_verify:  # every path checked before anything is timed, in its own process
        subprocess.run([sys.executable, "-m", "benchmarks.verify", "--out", str(verdicts_path), "--gpus", str(a.gpus),
                        *(["--only", a.only] if a.only else []), *rest], env=env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.gpus}"]
    parts = []
    if a.only in (None, "jax"):
        out = parts_dir / "jax_rows.json"
        parts.append(_side("jax", [sys.executable, "-m", "benchmarks.bench_jax", "--out", str(out), *rest], out, env))
    if a.only in (None, "torch"):
        out = parts_dir / "torch_rows.json"
        parts.append(_side("torch", [*torchrun, "-m", "benchmarks.bench_torch", "--out", str(out), *rest], out, env))
        for n in weak_worlds(flags, a.gpus):  # --weak: a world of n ranks for the ring over n GPUs
            out = parts_dir / f"torch_weak_{n}_rows.json"
            weak_run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
            parts.append(_side(f"torch --weak on {n}", [*weak_run, "-m", "benchmarks.bench_torch", "--weak-only",
                                                        "--out", str(out), *rest], out, env))
    if a.jax_multi_controller and a.only in (None, "jax"):  # last: a failure here loses no other part
        parts.append(_multi_controller_part(a.gpus, torchrun, rest, parts_dir / "jax_mc_rows.json", env))
    rows = [r for p in parts if p is not None for r in json.loads(p.read_text())]
    if a.no_verify:
        return rows
    from .verify import mark_rows

    return mark_rows(rows, json.loads(verdicts_path.read_text()) if verdicts_path.exists() else {})


def _multi_controller_part(gpus: int, torchrun: list[str], rest: list[str], out: Path, env: dict) -> Path:
    """jax_impl with one process per GPU (framework ``jax_impl_mc``); a failed run is one row saying so."""
    done = subprocess.run([*torchrun, "-m", "benchmarks.bench_jax", "--multi-controller", "--out", str(out), *rest],
                          env=env)
    mc_rows = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else [
        Row("jax_impl", "-", "-", 0, gpus, 0, 0, False, note=f"multi-controller run failed (exit {done.returncode})"
            ).to_dict()]
    for r in mc_rows:
        r["framework"] = "jax_impl_mc"  # same code, one process per GPU
    out.write_text(json.dumps(mc_rows))
    return out


if __name__ == "__main__":
    main()
