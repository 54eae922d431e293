"""What the host is doing while a GPU idles inside a traced JAX step (issue 46).

``mesh_profile_jax.py`` finds the idle time inside a step (gaps between kernels, most of them right
after a ``MemcpyD2H``: a ``lax.switch`` index read back) and outside it (the wall time minus the
device's first-to-last kernel), but not its cause: the device half of a trace cannot say whether
the host was waiting on the copy, updating a CUDA graph, allocating, or back in Python. This reads
the host half of the same ``jax.profiler`` trace (its ``trace.json.gz``; host and device share one
clock there): for every gap longer than ``--min-gap-us`` inside a step, the innermost host events
(an event holding no other event of its thread) that overlap it, and per step the host's path from
the call (``PjitFunction``) to the first kernel and from the last kernel to the step's wait ending.

    python -m benchmarks.host_gaps TRACE [--gpu 0] [--min-gap-us 50] [--out FILE.json]

TRACE: a ``*.trace.json.gz`` or a folder holding one (the newest is read).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field

STEP_BREAK_US = 10_000.0  # the traced steps are 30 ms of host sleep apart (mesh_profile_jax.py)
# XLA's per-execution host work before and around the thunks (event names as XLA's TraceMe writes
# them): their cost grows with the program, not the batch — every thunk of every branch is
# prepared and initialized on each execution
PHASES = ("ParseArguments", "CommonPjRtLoadedExecutable::ExecutePrepare", "Build buffer allocations",
          "Thunks::Prepare", "Thunks::Initialize", "command_buffer::update", "cuGraphLaunch", "MemcpyD2H",
          "cuLaunchHostFunc", "CommonPjRtClient::CreateOutputs")


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # µs, the trace's clock
    end: float
    thread: str = ""


@dataclass
class Gap:
    step: int
    start: float
    end: float
    after: str  # the kernel the device finished before idling
    before: str  # the kernel it ran next
    host: list[dict] = field(default_factory=list)  # innermost host events overlapping it

    @property
    def us(self) -> float:
        return self.end - self.start


def newest_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}")
    return max(found, key=os.path.getmtime)


def read_trace(path: str, gpu: int = 0) -> tuple[list[Span], list[Span]]:
    """(GPU ``gpu``'s kernels and copies, every host event), each with its thread's name."""
    with gzip.open(newest_trace(path)) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device, host = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        process = processes.get(e["pid"], "")
        span = Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), threads.get((e["pid"], e["tid"]), ""))
        if process == f"/device:GPU:{gpu}":
            device.append(span)
        elif process.startswith("/host"):
            host.append(span)
    return device, host


def steps_of(device: list[Span], step_break_us: float = STEP_BREAK_US) -> list[list[Span]]:
    """The device's spans grouped into steps at idle stretches longer than ``step_break_us``."""
    steps: list[list[Span]] = []
    reach = float("-inf")
    for span in sorted(device, key=lambda s: s.start):
        if span.start - reach > step_break_us:
            steps.append([])
        steps[-1].append(span)
        reach = max(reach, span.end)
    return steps


def gaps_of(steps: list[list[Span]], min_gap_us: float) -> list[Gap]:
    gaps = []
    for number, spans in enumerate(steps):
        reach, last = spans[0].end, spans[0]
        for span in spans[1:]:
            if span.start - reach >= min_gap_us:
                gaps.append(Gap(number, reach, span.start, last.name[:80], span.name[:80]))
            if span.end >= reach:
                reach, last = span.end, span
    return gaps


def innermost(host: list[Span]) -> list[Span]:
    """The host events that hold no other event of their thread (what the thread was actually in)."""
    leaves = []
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for span in host:
        by_thread[span.thread].append(span)
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s.start, -s.end))
        for i, span in enumerate(spans):
            following = spans[i + 1] if i + 1 < len(spans) else None
            if following is None or following.start >= span.end:
                leaves.append(span)
    return leaves


def overlap(span: Span, start: float, end: float) -> float:
    return max(0.0, min(span.end, end) - max(span.start, start))


def attribute(gaps: list[Gap], host: list[Span], top: int = 6) -> dict[str, float]:
    """Fill each gap's ``host`` with the innermost host events overlapping it (longest overlap
    first) and return the overlap summed per (thread, event name) over all gaps, in µs."""
    leaves = sorted(innermost(host), key=lambda s: s.start)
    totals: dict[str, float] = defaultdict(float)
    for gap in gaps:
        hits = [(overlap(s, gap.start, gap.end), s) for s in leaves if s.start < gap.end and s.end > gap.start]
        hits.sort(key=lambda h: -h[0])
        gap.host = [{"thread": s.thread[:40], "name": s.name[:80], "overlap_us": round(o, 1),
                     "starts_us": round(s.start - gap.start, 1)} for o, s in hits[:top]]
        for o, s in hits:
            totals[f"{s.thread[:40]} | {s.name[:80]}"] += o
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step_edges(steps: list[list[Span]], host: list[Span], call: str = "PjitFunction") -> list[dict]:
    """Per step: the host call's start to the first kernel, and the last kernel to the end of the
    host event that waited for it (the outermost host event ending after it), in µs."""
    calls = sorted((s for s in host if s.name.startswith(call)), key=lambda s: s.start)
    rows = []
    for spans in steps:
        first, last = min(s.start for s in spans), max(s.end for s in spans)
        before = [c for c in calls if c.start <= first]
        row = {"span_us": round(last - first, 1)}
        if before:
            row["call_to_first_kernel_us"] = round(first - before[-1].start, 1)
            row["call_returns_after_first_kernel_us"] = round(before[-1].end - first, 1)
        waits = [s for s in host if s.start < last < s.end and "block_until_ready" in s.name]
        if waits:
            row["last_kernel_to_wait_end_us"] = round(min(w.end for w in waits) - last, 1)
        rows.append(row)
    return rows


def phases(host: list[Span], steps: int, names=PHASES) -> dict[str, float]:
    """µs per step the host spends in each of ``names`` (an event counts when its name starts with
    one; nested events of one name are counted once, at the outermost)."""
    totals: dict[str, float] = defaultdict(float)
    for name in names:
        spans = sorted((s for s in host if s.name.startswith(name)), key=lambda s: s.start)
        reach = float("-inf")
        for span in spans:
            if span.start >= reach:
                totals[name] += span.end - span.start
                reach = span.end
    return {name: round(totals[name] / max(1, steps), 1) for name in names if name in totals}


def summary(trace: str, gpu: int = 0, min_gap_us: float = 50.0, detail: int = 40) -> dict:
    """What :func:`main` prints and writes for one GPU of one trace (``detail``: the longest gaps
    listed with their host events)."""
    device, host = read_trace(trace, gpu)
    steps = steps_of(device)
    gaps = gaps_of(steps, min_gap_us)
    totals = attribute(gaps, host)
    return {"trace": newest_trace(trace), "gpu": gpu, "steps": len(steps), "gaps": len(gaps),
            "gap_us_per_step": round(sum(g.us for g in gaps) / max(1, len(steps)), 1),
            "edges": step_edges(steps, host),
            "host_phases_us_per_step": phases(host, len(steps)),
            "host_in_gaps_us_per_step": {k: round(v / max(1, len(steps)), 1) for k, v in list(totals.items())[:30]},
            "gaps_detail": [asdict(g) | {"us": round(g.us, 1)} for g in sorted(gaps, key=lambda g: -g.us)[:detail]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--min-gap-us", type=float, default=50.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    result = summary(args.trace, args.gpu, args.min_gap_us)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "gaps_detail"}, indent=1))
    return result


if __name__ == "__main__":
    main()
