"""What the host is doing while a GPU idles inside a traced JAX step (issue 46).

``mesh_profile_jax.py`` finds the idle time inside a step (gaps between kernels, most of them right
after a ``MemcpyD2H``: a ``lax.switch`` index read back) and outside it (the wall time minus the
device's first-to-last kernel), but not its cause: the device half of a trace cannot say whether
the host was waiting on the copy, updating a CUDA graph, allocating, or back in Python. This reads
the host half of the same ``jax.profiler`` trace (its ``trace.json.gz``; host and device share one
clock there): for every gap longer than ``--min-gap-us`` inside a step, what each host thread was
in during it (the deepest event open on that thread at each instant: a parent's own time between
its children counts as the parent's), XLA's per-execution phases step by step, and the host's
path from the call (``PjitFunction``) to the first kernel and from the last kernel to the step's
wait ending. Host times in such a trace are inflated by the profiler (its Python tracer most).

    python -m benchmarks.host_gaps TRACE [--gpu 0] [--min-gap-us 50] [--out FILE.json]

TRACE: a ``*.trace.json.gz`` or a folder holding one (the newest is read).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field

STEP_BREAK_US = 10_000.0  # the traced steps are 30 ms of host sleep apart (mesh_profile_jax.py)
# XLA's per-execution host work before and around the thunks (event names as XLA's TraceMe writes
# them): Prepare and Initialize visit every thunk of every branch on each execution
PHASES = ("ParseArguments", "CommonPjRtLoadedExecutable::ExecutePrepare", "Build buffer allocations",
          "Thunks::Prepare", "Thunks::Initialize", "command_buffer::update", "cuGraphLaunch", "MemcpyD2H",
          "cuLaunchHostFunc", "CommonPjRtClient::CreateOutputs")


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # µs, the trace's clock
    end: float
    thread: tuple = ()  # (pid, tid): a thread's identity (names repeat, or are missing)
    thread_name: str = ""


@dataclass
class Gap:
    step: int
    start: float
    end: float
    after: str  # the kernel the device finished before idling
    before: str  # the kernel it ran next
    host: list[dict] = field(default_factory=list)  # what the host threads were in during it

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Trace:
    path: str
    devices: dict[int, list[Span]]  # GPU number -> its kernels and copies
    host: list[Span]


def newest_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}")
    return max(found, key=os.path.getmtime)


def read_trace(path: str) -> Trace:
    """Every GPU's spans and every host event of the newest trace under ``path``, read once."""
    path = newest_trace(path)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices: dict[int, list[Span]] = defaultdict(list)
    host = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        process, thread = processes.get(e["pid"], ""), (e["pid"], e["tid"])
        span = Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), thread, names.get(thread, ""))
        if process.startswith("/device:GPU:"):
            devices[int(process.rsplit(":", 1)[1])].append(span)
        elif process.startswith("/host"):
            host.append(span)
    return Trace(path, dict(devices), host)


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


def step_windows(steps: list[list[Span]]) -> list[tuple[float, float]]:
    """Each step's share of the host's timeline: from halfway through the idle stretch before it
    to halfway through the one after (the first and last open-ended)."""
    bounds = [(min(s.start for s in step), max(s.end for s in step)) for step in steps]
    cuts = [(end + start) / 2 for (_, end), (start, _) in zip(bounds, bounds[1:])]
    return list(zip([float("-inf"), *cuts], [*cuts, float("inf")]))


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


def _thread_pieces(spans: list[Span]) -> list[Span]:
    """One thread's events as non-overlapping pieces, each named by the deepest event open there."""
    pieces: list[Span] = []
    stack: list[Span] = []
    at = float("-inf")  # where the last piece ended

    def close_until(time: float) -> float:
        """Pieces for the events that end by ``time``, deepest first; returns where they stop."""
        nonlocal at
        while stack and stack[-1].end <= time:
            top = stack.pop()
            if top.end > at:
                pieces.append(dataclasses.replace(top, start=at, end=top.end))
                at = top.end
        return at

    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        close_until(span.start)
        if stack and span.start > at:  # the enclosing event's own time before this child
            pieces.append(dataclasses.replace(stack[-1], start=at, end=span.start))
        at = max(at, span.start)
        stack.append(span)
    close_until(float("inf"))
    return pieces


def deepest(host: list[Span]) -> list[Span]:
    """Each thread's timeline as non-overlapping pieces, each named by the deepest event open
    there (a parent's time before, between and after its children is the parent's own)."""
    by_thread: dict[tuple, list[Span]] = defaultdict(list)
    for span in host:
        by_thread[span.thread].append(span)
    return [piece for spans in by_thread.values() for piece in _thread_pieces(spans)]


def _overlap(span: Span, start: float, end: float) -> float:
    return max(0.0, min(span.end, end) - max(span.start, start))


def attribute(gaps: list[Gap], host: list[Span], top: int = 6) -> dict[str, float]:
    """Fill each gap's ``host`` with what the host threads were in during it (:func:`deepest`,
    longest overlap first) and return the overlap summed per (thread, event name), in µs."""
    pieces = deepest(host)
    totals: dict[str, float] = defaultdict(float)
    for gap in gaps:
        hits: dict[tuple, list] = {}
        for piece in pieces:
            covered = _overlap(piece, gap.start, gap.end)
            if covered > 0:
                key = (piece.thread, piece.thread_name, piece.name)
                first = hits.get(key, [0.0, piece.start])
                hits[key] = [first[0] + covered, min(first[1], piece.start)]
        ranked = sorted(hits.items(), key=lambda kv: -kv[1][0])
        gap.host = [{"thread": f"{name[:30]} {tid[1]}", "name": event[:80], "overlap_us": round(us, 1),
                     "starts_us": round(begins - gap.start, 1)} for (tid, name, event), (us, begins) in ranked[:top]]
        for (tid, name, event), (us, _) in ranked:
            totals[f"{name[:30]} {tid[1]} | {event[:80]}"] += us
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step_edges(steps: list[list[Span]], host: list[Span], call: str = "PjitFunction") -> list[dict]:
    """Per step: the host call's start to the first kernel, and the last kernel to the end of the
    host's ``block_until_ready`` event around it (traced only with the profiler's Python tracer),
    in µs."""
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


def phases(host: list[Span], windows: list[tuple[float, float]], names=PHASES) -> dict[str, list[float]]:
    """µs the host spent in each of ``names`` in each step's window (:func:`step_windows`): an
    event counts when its name starts with one, summed over threads, nested events of one name on
    one thread counted once (at the outermost)."""
    found: dict[str, list[float]] = {}
    for name in names:
        per_step = [0.0] * len(windows)
        by_thread: dict[tuple, list[Span]] = defaultdict(list)
        for span in host:
            if span.name.startswith(name):
                by_thread[span.thread].append(span)
        for spans in by_thread.values():
            reach = float("-inf")
            for span in sorted(spans, key=lambda s: s.start):
                if span.start >= reach:
                    for i, (lo, hi) in enumerate(windows):
                        if lo <= span.start < hi:
                            per_step[i] += span.end - span.start
                    reach = span.end
        if any(per_step):
            found[name] = [round(us, 1) for us in per_step]
    return found


def summary(trace: Trace | str, gpu: int = 0, min_gap_us: float = 50.0, detail: int = 40) -> dict:
    """What :func:`main` prints and writes for one GPU of one trace (``detail``: the longest gaps
    listed with the host's events)."""
    trace = read_trace(trace) if isinstance(trace, str) else trace
    steps = steps_of(trace.devices.get(gpu, []))
    gaps = gaps_of(steps, min_gap_us)
    totals = attribute(gaps, trace.host)
    per_step = phases(trace.host, step_windows(steps))
    n = max(1, len(steps))
    return {"trace": trace.path, "gpu": gpu, "steps": len(steps), "gaps": len(gaps),
            "gap_us_per_step": round(sum(g.us for g in gaps) / n, 1),
            "gap_us_by_step": [round(sum(g.us for g in gaps if g.step == i), 1) for i in range(len(steps))],
            "edges": step_edges(steps, trace.host),
            "host_phases_us_by_step": per_step,
            "host_phases_us_median": {k: statistics.median(v) for k, v in per_step.items()},
            "host_in_gaps_us_per_step": {k: round(v / n, 1) for k, v in list(totals.items())[:30]},
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
