"""Where a GPU waits for its host inside a step, from a torch.profiler Chrome trace.

Each idle gap between kernels on the GPU inside a traced step (longer than ``min_us``) is listed
with the kernel that ended it, the CUDA runtime call that launched (or copied for) that kernel,
how long after the gap began the host issued it, and the innermost frames of this project
(``torch_impl/``, ``seqplan/``, ``benchmarks/``) on the Python stack at that moment
(``with_stack=True``). A launch issued late — well after the gap began — is host time on the
critical path; a launch issued before the gap began is a wait on the device's own queue.

    python -m benchmarks.trace_gaps TRACE.json[.gz] [--step-name step] [--min-us 20]

The trace's steps are the ``record_function(step_name)`` ranges of the host thread;
:func:`gaps` is the analysis (a list of typed rows), :func:`main` prints a table.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

PROJECT = ("torch_impl/", "seqplan/", "benchmarks/")


@dataclass(frozen=True)
class Gap:
    step: int
    start_us: float  # from the step's first kernel
    idle_us: float
    next_kernel: str
    launch: str  # the runtime call that issued the next kernel (cudaLaunchKernel, cudaMemcpyAsync, ...)
    launched_after_us: float  # host issue time of that call minus the gap's start (> 0: the host was late)
    frames: tuple[str, ...]  # the project's innermost Python frames at the launch, innermost first


def load(path) -> list[dict]:
    raw = Path(path).read_bytes()
    text = gzip.decompress(raw) if str(path).endswith(".gz") else raw
    trace = json.loads(text)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _device_events(events):
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def _frames_at(python_events, ts: float, tid) -> tuple[str, ...]:
    """Project frames enclosing host time ``ts`` on thread ``tid`` (innermost first): the backward's
    launches come from autograd's thread while the main thread waits in its own frames."""
    around = [e for e in python_events if e.get("tid") == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]
    around.sort(key=lambda e: e["ts"], reverse=True)
    return tuple(e["name"] for e in around if any(p in e["name"] for p in PROJECT))


def _issued(runtime: dict, device_event: dict) -> float:
    """Host time of the runtime call behind a device event (-1: none recorded)."""
    return runtime.get(device_event.get("args", {}).get("correlation"), {"ts": -1.0})["ts"]


def gaps(events: list[dict], step_name: str = "step", min_us: float = 20.0) -> list[Gap]:
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == step_name
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    device = _device_events(events)
    runtime = {e["args"]["correlation"]: e for e in events  # runtime and driver API launches (Triton: the driver's)
               if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "correlation" in e.get("args", {})}
    python = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    rows = []
    for n, step in enumerate(steps):
        # the step's device work: what its host range launched (the device runs it later)
        mine = [e for e in device if step["ts"] <= _issued(runtime, e) <= step["ts"] + step["dur"]]
        if not mine:
            continue
        first = mine[0]["ts"]
        end = mine[0]["ts"] + mine[0]["dur"]
        for e in mine[1:]:
            idle = e["ts"] - end
            if idle >= min_us:
                call = runtime.get(e["args"].get("correlation"), {})
                issued = call.get("ts", float("nan"))
                rows.append(Gap(n, end - first, idle, e["name"][:90], call.get("name", "?"), issued - end,
                                _frames_at(python, issued, call.get("tid"))[:4]))
            end = max(end, e["ts"] + e["dur"])
    return rows


def summary(rows: list[Gap]) -> str:
    lines = ["| step | at µs | idle µs | next kernel | issued by | host late µs | project frames |",
             "|---|---|---|---|---|---|---|"]
    for g in rows:
        lines.append(f"| {g.step} | {g.start_us:.0f} | {g.idle_us:.0f} | {g.next_kernel} | {g.launch} | "
                     f"{g.launched_after_us:.0f} | {' < '.join(g.frames)} |")
    return "\n".join(lines)


def main(argv=None) -> list[Gap]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trace_gaps", description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--step-name", default="step")
    ap.add_argument("--min-us", type=float, default=20.0)
    a = ap.parse_args(argv)
    rows = gaps(load(a.trace), a.step_name, a.min_us)
    print(summary(rows))
    return rows


if __name__ == "__main__":
    main()
