"""What deterministic mode costs and whether it holds, per torch block backend, on one GPU: the
measurements behind ``torch_impl.block.NONDETERMINISTIC_WHEN_REQUESTED`` and the deterministic
rows of ``AUTO_ROUTES``.

For each case (causal, no documents; packed documents of a balance mix; a sliding window) and each
backend that runs it, in two modes — torch's default, and ``torch.use_deterministic_algorithms(True)``,
the switch a ``deterministic=True`` call holds while its kernels run
(``torch_impl.config.deterministic_kernels``). Strict, not warn-only: under warn-only torch's FA2
backward warns and stays atomic (measured, 2026-11-29). A backend the library refuses in that mode
is a row saying so. Run it with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (the portable kernel's check):

1. **check** — torch_impl on one rank (``ring_attention``, no group: the whole sequence one causal
   block) at ``--check-seq`` tokens, 8 / 2 heads, bf16, against the portable kernel in float32 on
   the same (upcast) inputs: relative max error of o, dq, dk, dv (≤ 2e-2 passes). A row whose check
   fails is neither repeated nor timed.
2. **repeats** — ``--repeats`` fwd+bwd steps at ``--seq`` tokens, 32 / 8 heads, d 128, on identical
   inputs: whether each of o, dq, dk, dv is bitwise equal to the first step's.
3. **time** — fwd+bwd, median of ``--iters`` steps, each waited for (CUDA events).

Rows go to ``OUT/determinism-cost.jsonl`` as they come (a killed call keeps them), a table to
``OUT/determinism-cost.md`` at the end.

    python -m benchmarks.determinism_cost --out DIR                  (one GPU; fa4 where installed)
    python -m benchmarks.determinism_cost --out DIR --smoke          (CPU: the portable kernel, small)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.one_gpu_documents import PASS
from benchmarks.one_gpu_documents_torch import device_name, random_inputs
from parity.probes.determinism import TENSORS

MODES = ("default", "deterministic")


@dataclass(frozen=True)
class Case:
    """One attention problem: packed documents of a balance mix (or none) and a window (or none)."""

    name: str
    documents: str | None = None
    window: tuple[int, int] | None = None


CASES = (Case("causal"), Case("documents-short", documents="short"), Case("documents-few-long", documents="few-long"),
         Case("window-4096", window=(4096, 0)))
# the backends that run each kind of case on a GPU: the fused kernels "auto" picks or could pick
GPU_BACKENDS = {"causal": ("fa4", "aten_flash", "aten_cudnn"), "documents": ("fa4", "aten_varlen"),
                "window": ("fa4", "aten_window")}


def _kind(case: Case) -> str:
    return "documents" if case.documents else "window" if case.window else "causal"


@contextlib.contextmanager
def _mode(mode: str):
    """torch's deterministic switch on for "deterministic", off for "default"."""
    import torch

    torch.use_deterministic_algorithms(mode == "deterministic")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _ids(case: Case, seq: int):
    import torch

    if case.documents is None:
        return None
    from parity.probes.balance import MIXES

    mix = next(m for m in MIXES if m.name == case.documents)
    return torch.as_tensor(mix.segment_ids(seq)[None].astype(np.int32), device=device_name())


def _step(case: Case, backend: str, ids):
    """fwd+bwd of torch_impl on one rank: (q, k, v, do) -> (o, dq, dk, dv)."""
    import torch

    import torch_impl

    def step(q, k, v, do):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = torch_impl.ring_attention(*leaves, causal=True, layout="contiguous", segment_ids=ids, window=case.window,
                                      block_backend=backend)[0]
        return (o.detach(), *torch.autograd.grad(o, leaves, do))

    return step


def check(case: Case, backend: str, mode: str, seq: int) -> dict:
    """``backend`` in bf16 against the portable kernel in float32 on the same (upcast) inputs."""
    import torch

    low = random_inputs(seq, 8, 2, 128, torch.bfloat16, seed=1)
    ids = _ids(case, seq)
    with _mode(mode):
        got = _step(case, backend, ids)(*low)
    want = _step(case, "reference", ids)(*(x.float() for x in low))
    errors = {name: float((g.float() - w).abs().max() / w.abs().max()) for name, g, w in zip(TENSORS, got, want)}
    return {"errors": errors, "passed": all(np.isfinite(e) and e <= PASS for e in errors.values())}


def repeats_and_time(case: Case, backend: str, mode: str, seq: int, repeats: int, iters: int, warmup: int,
                     heads: int = 32, kv_heads: int = 8) -> dict:
    """Bitwise equality of ``repeats`` identical steps, then the step's median ms."""
    import torch

    from benchmarks.masked import cuda_ms

    x = random_inputs(seq, heads, kv_heads, 128, torch.bfloat16, seed=0)
    step = _step(case, backend, _ids(case, seq))
    with _mode(mode):
        runs = [step(*x) for _ in range(repeats)]
        same = {t: all(torch.equal(r[i], runs[0][i]) for r in runs[1:]) for i, t in enumerate(TENSORS)}
        del runs
        ms = cuda_ms(lambda: step(*x), iters, warmup) if device_name() == "cuda" else None
    return {"bitwise_same": same, "ms": ms}


def _row_text(r: dict) -> str:
    if "error" in r:
        return f"| {r['case']} | {r['backend']} | {r['mode']} | {r['error'][:120]} | | | |"
    e = r["check"]["errors"]
    errors = " / ".join(f"{e[t]:.1e}" for t in TENSORS)
    if not r["check"]["passed"]:
        return f"| {r['case']} | {r['backend']} | {r['mode']} | {errors} (FAILED) | not run | | |"
    same = r["bitwise_same"]
    differs = [t for t in TENSORS if not same[t]]
    ms = "" if r["ms"] is None else f"{r['ms']:.2f}"
    return (f"| {r['case']} | {r['backend']} | {r['mode']} | {errors} | "
            f"{'identical' if not differs else 'differ: ' + ', '.join(differs)} | {ms} | {r.get('ratio', '')} |")


def markdown(rows: list[dict], command: str, versions: str) -> str:
    lines = [f"# Deterministic mode per torch block backend, one GPU — {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{command}`; {versions}", "",
             "| case | backend | mode | check o / dq / dk / dv (rel. max err.) | repeats | fwd+bwd ms | ms ÷ default |",
             "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_row_text(r) for r in rows]) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.determinism_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--check-seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    ap.add_argument("--backends", default="", help="comma-separated: only these (default: each case's GPU backends)")
    ap.add_argument("--smoke", action="store_true", help="CPU: the portable kernel, 512 / 256 tokens, 2 repeats")
    args = ap.parse_args(argv)
    import torch

    import torch_impl.block as block

    if args.smoke:
        args.seq, args.check_seq, args.repeats, args.iters, args.warmup = 512, 256, 2, 1, 0
    chosen = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in chosen]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; cases: {sorted(chosen)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "determinism-cost.jsonl"
    rows: list[dict] = []
    only = [b for b in args.backends.split(",") if b]
    for name in args.cases.split(","):
        case = chosen[name]
        backends = ("reference",) if args.smoke else GPU_BACKENDS[_kind(case)]
        for backend in (b for b in backends if not only or b in only):
            if not block.get_backend(backend).available():
                continue
            default_ms = None
            for mode in MODES:
                row = {"case": case.name, "backend": backend, "mode": mode, "seq": args.seq,
                       "check_seq": args.check_seq, "repeats": args.repeats}
                try:
                    row["check"] = check(case, backend, mode, args.check_seq)
                    if row["check"]["passed"]:
                        row.update(repeats_and_time(case, backend, mode, args.seq, args.repeats, args.iters,
                                                    args.warmup))
                        default_ms = row["ms"] if mode == "default" else default_ms
                        if mode != "default" and row["ms"] and default_ms:
                            row["ratio"] = round(row["ms"] / default_ms, 3)
                except Exception as err:  # noqa: BLE001 — a backend that fails in a mode is a finding
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                rows.append(row)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(_row_text(row), flush=True)
    versions = f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    command = "python -m benchmarks.determinism_cost " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    (out / "determinism-cost.md").write_text(markdown(rows, command, versions))
    return rows


if __name__ == "__main__":
    main()
