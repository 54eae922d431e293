"""Does a torch SDPA op take grouped K/V heads (GQA) as they are, and what does expanding them cost?

Why (issue 47): ``torch_impl``'s aten adapters used to expand GQA K/V to every query head with
``repeat_interleave`` before each block's forward and backward, and sum the expanded dK/dV back.
On 4x H200 (torch 2.11, 2026-11-27) both CUDA ops took K/V at their own head count and returned
dK/dV at it, within the expanded call's error, and the adapters pass them through since; this
probe keeps the question asked on whatever torch and GPU a run has (the old expansion is
reproduced here, for the comparison).

For each op pair (``aten_cudnn`` and ``aten_flash`` on a GPU, ``aten_cpu`` on the CPU), causal,
[b, h, t, d] in bf16 on a GPU (float32 on the CPU):

1. **check**, at ``--check-seq`` tokens: the op on unexpanded K/V — does it run, and do o, lse,
   dq, dk, dv equal a float32 autograd truth (K/V expanded inside the graph, so dK/dV are the
   group sums) within the tolerance the expanded call itself reaches (×2, plus a floor)?
2. **time**, at ``--seq`` tokens, only where the check passed: forward+backward with the
   expansion and fold (what the adapters did before) against the op on unexpanded K/V (what they do).

Rows go to ``$OUT/gqa_probe.json`` as they come (a killed call keeps them).
Usage: ``python -m benchmarks.gqa_probe [--seq 32768 --heads 32 --kv-heads 8] [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from torch_impl.kernels.aten import aten_ops

F32 = torch.float32


@dataclass
class ProbeRow:
    op: str
    phase: str  # "check" | "time"
    seq: int
    heads: int
    kv_heads: int
    runs_unexpanded: bool | None = None
    error: str | None = None
    worst_error_unexpanded: float | None = None  # max over o, lse, dq, dk, dv, relative to the truth's scale
    worst_error_expanded: float | None = None
    passed: bool | None = None
    expanded_ms: float | None = None
    unexpanded_ms: float | None = None


def _truth(q, k, v, do, scale: float):
    """float32 causal attention with K/V expanded inside the graph: o, lse, dq, dk, dv."""
    q, k, v, do = (x.detach().to(F32).requires_grad_(x is not do) for x in (q, k, v, do))
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ ke.transpose(-1, -2)) * scale
    t = q.shape[2]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ ve
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse.detach(), dq, dk, dv


def _call(op: str, q, k, v, do, scale: float, expand: bool):
    """o, lse, dq, dk, dv ([b, h, t, d]; lse [b, h, t]) of one causal forward and backward of the raw
    op pair: on K/V expanded to every query head with their gradients summed back in float32
    (``expand``: what the adapters did before 2026-11-27) or on K/V as they are (what they do now)."""
    b, h, t, _ = q.shape
    hk = k.shape[1]
    fwd, bwd = aten_ops(op)
    if expand:
        k, v = (x.repeat_interleave(h // hk, dim=1) for x in (k, v))
    o, lse = fwd(q, k, v, True, scale)
    dq, dk, dv = bwd(do, q, k, v, o, lse, True, scale)[:3]
    if expand:
        dk, dv = (g.float().reshape(b, hk, h // hk, t, -1).sum(2) for g in (dk, dv))
    return o, lse, dq, dk, dv


def _worst(got, truth) -> float:
    return max(float((g.float() - w).abs().max()) / max(float(w.abs().max()), 1e-6) for g, w in zip(got, truth))


def _inputs(b, h, hk, t, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda heads: torch.randn(b, heads, t, d, generator=g).to(device=device, dtype=dtype)
    return make(h), make(hk), make(hk), make(h)


def _time_ms(fn, device, iters: int) -> float:
    fn()  # warm-up (and the autotuning some ops do)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return min(times)


def probe(op: str, args, device, dtype, emit) -> None:
    scale = 1 / math.sqrt(args.head_dim)
    q, k, v, do = _inputs(1, args.heads, args.kv_heads, args.check_seq, args.head_dim, device, dtype)
    truth = _truth(q, k, v, do, scale)
    row = ProbeRow(op, "check", args.check_seq, args.heads, args.kv_heads)
    row.worst_error_expanded = _worst(_call(op, q, k, v, do, scale, expand=True), truth)
    try:
        got = _call(op, q, k, v, do, scale, expand=False)
        row.runs_unexpanded = all(g.shape == w.shape for g, w in zip(got, truth))
        if not row.runs_unexpanded:
            row.error = "shapes " + ", ".join(str(tuple(g.shape)) for g in got)
        else:
            row.worst_error_unexpanded = _worst(got, truth)
    except Exception as exc:  # noqa: BLE001 — the op refusing grouped heads is an answer, not a crash
        row.runs_unexpanded, row.error = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    row.passed = bool(row.runs_unexpanded) and row.worst_error_unexpanded <= 2 * row.worst_error_expanded + 1e-3
    emit(row)
    if not row.passed:
        return
    q, k, v, do = _inputs(1, args.heads, args.kv_heads, args.seq, args.head_dim, device, dtype, seed=1)
    timed = ProbeRow(op, "time", args.seq, args.heads, args.kv_heads, passed=True)
    timed.expanded_ms = _time_ms(lambda: _call(op, q, k, v, do, scale, expand=True), device, args.iters)
    timed.unexpanded_ms = _time_ms(lambda: _call(op, q, k, v, do, scale, expand=False), device, args.iters)
    emit(timed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--check-seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on whatever device there is")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq, args.check_seq, args.heads, args.kv_heads, args.head_dim, args.iters = 256, 128, 4, 2, 32, 1
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), F32)
    ops = ("aten_cudnn", "aten_flash") if cuda else ("aten_cpu",)
    out = os.path.join(os.environ.get("OUT", "."), "gqa_probe.json")
    rows: list[dict] = []

    def emit(row: ProbeRow) -> None:
        rows.append(asdict(row))
        with open(out, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "rows": rows}, f, indent=1)
        print(json.dumps(asdict(row)), flush=True)

    for op in ops:
        probe(op, args, device, dtype, emit)


if __name__ == "__main__":
    main()
