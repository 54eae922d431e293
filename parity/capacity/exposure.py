"""How much of each collective kind a step leaves exposed — measured on a calibration step, used
to predict other steps (``llama_scale``'s ``predicted_s``).

A collective is *exposed* for as long as its kernel runs while no compute kernel does: the device
waits on the link. Per kind (``p2p``, ``all-to-all``, ``all-gather``, ``reduce-scatter``,
``all-reduce``, docs/contract.md's names), the exposed fraction is the kind's NCCL kernel time not
covered by any non-NCCL kernel, over the kind's NCCL kernel time, from a CUDA profile of one step
(after warm-up steps) on every rank, averaged over the ranks. The prediction of another step then
reads ``T_math + Σ_kind bytes_kind / W_kind × fraction_kind``: the link time the model predicts,
scaled by the share the calibration step could not hide.

NCCL runs a ring's send / receive and an all-to-all as the same ``SendRecv`` kernel; the step's
own traffic says which of the two kinds it carries (:func:`send_recv_kinds`). On gloo (the CPU
check) collectives run on the calling thread and block it: nothing overlaps, every fraction is 1
(:data:`SERIAL`) and the prediction equals the serial bound.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile

KINDS = ("p2p", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")
SERIAL = "serial (gloo: a collective blocks the calling thread)"
_NCCL_NAMES = {"allgather": ("all-gather",), "reducescatter": ("reduce-scatter",), "allreduce": ("all-reduce",),
               "alltoall": ("all-to-all",)}


def send_recv_kinds(traffic_kinds) -> tuple[str, ...]:
    """The kinds an NCCL ``SendRecv`` kernel carries in a step whose modelled traffic has
    ``traffic_kinds``: p2p, all-to-all, or both (then each gets the kernels' one fraction)."""
    found = tuple(k for k in ("p2p", "all-to-all") if k in traffic_kinds)
    return found or ("p2p",)


def collective_kinds(kernel_name: str, send_recv: tuple[str, ...]) -> tuple[str, ...] | None:
    """The kinds an NCCL kernel's name says it runs (None: not an NCCL kernel)."""
    name = kernel_name.lower().replace("_", "")
    if "nccl" not in name:
        return None
    for key, kinds in _NCCL_NAMES.items():
        if key in name:
            return kinds
    return send_recv if "sendrecv" in name or "send" in name or "recv" in name else ("unknown",)


def _merged(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, disjoint (starts, ends) covering ``intervals``."""
    starts: list[float] = []
    ends: list[float] = []
    for lo, hi in sorted(intervals):
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _covered(lo: float, hi: float, starts: list[float], ends: list[float]) -> float:
    """Length of [lo, hi) covered by the disjoint intervals (starts, ends)."""
    total, i = 0.0, max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(starts) and starts[i] < hi:
        total += max(0.0, min(hi, ends[i]) - max(lo, starts[i]))
        i += 1
    return total


def exposed_times(kernels: list[tuple[str, float, float]], send_recv: tuple[str, ...]) -> dict[str, dict]:
    """Per collective kind: ``{"kernel_s", "exposed_s"}`` from a step's GPU kernels, each
    ``(name, start_s, end_s)``: the NCCL kernels' time, and the part of it (overlapping NCCL
    kernels merged per kind) during which no compute kernel runs."""
    compute = _merged([(lo, hi) for name, lo, hi in kernels if collective_kinds(name, send_recv) is None])
    per_kind: dict[str, list[tuple[float, float]]] = {}
    for name, lo, hi in kernels:
        for kind in collective_kinds(name, send_recv) or ():
            per_kind.setdefault(kind, []).append((lo, hi))
    out = {}
    for kind, intervals in per_kind.items():
        starts, ends = _merged(intervals)
        busy = sum(e - s for s, e in zip(starts, ends))
        hidden = sum(_covered(s, e, *compute) for s, e in zip(starts, ends))
        out[kind] = {"kernel_s": busy, "exposed_s": busy - hidden}
    return out


def profiled_kernels(step, sync) -> list[tuple[str, float, float]]:
    """The GPU kernels of one ``step()`` under torch.profiler: (name, start_s, end_s)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return [(e["name"], e["ts"] * 1e-6, (e["ts"] + e.get("dur", 0)) * 1e-6) for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


def xla_trace_kernels(trace_dir: str) -> dict[str, list[tuple[str, float, float]]]:
    """The GPU kernels of the newest ``jax.profiler`` trace under ``trace_dir``, per GPU process
    name: (name, start_s, end_s), as :func:`profiled_kernels` gives torch's. A JAX step is one
    process for every GPU (single controller): each GPU is one ``/device:GPU:N`` process of the
    trace. The newest: every ``jax.profiler.trace`` into the same directory adds a run beside the
    earlier ones (three processes of one GPU call that each profiled the same path all read the
    first one's trace on 2026-11-29)."""
    import glob
    import gzip
    from collections import defaultdict

    found = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no trace under {trace_dir}")
    with gzip.open(max(found, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    kernels: dict[str, list] = defaultdict(list)
    for e in events:
        process = names.get(e.get("pid"), "")
        if e.get("ph") == "X" and "/device:GPU" in process and "dur" in e:
            kernels[process].append((e["name"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
    return dict(kernels)


def fractions(per_rank: list[dict[str, dict]], kinds) -> dict[str, float]:
    """Exposed fraction per kind of ``kinds``, averaged over the ranks' :func:`exposed_times`: the
    ranks' exposed time over their kernel time (1.0 for a kind no rank's profile shows: nothing
    measured says it hides)."""
    out = {}
    for kind in kinds:
        kernel = sum(r.get(kind, {}).get("kernel_s", 0.0) for r in per_rank)
        exposed = sum(r.get(kind, {}).get("exposed_s", 0.0) for r in per_rank)
        out[kind] = exposed / kernel if kernel > 0 else 1.0
    return out
