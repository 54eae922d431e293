"""Tier 1 — benchmarks/host_gaps.py, which reads the host half of a ``jax.profiler`` trace to say
what the host did while the GPU idled. Synthetic traces with known answers: two steps, a gap in
each after a read-back; the host in a graph launch nested in its thunk during the first, in the
conditional's own wait (its copy done) during the second; per-step phases summed over threads."""

import gzip
import json

from benchmarks import host_gaps
from benchmarks.host_gaps import Span

x = lambda pid, name, ts, dur, tid=0: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def _write(tmp_path, events, threads=((2, 7, "python3"),)):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}}]
    meta += [{"ph": "M", "name": "thread_name", "pid": p, "tid": t, "args": {"name": n}} for p, t, n in threads]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return path


def _two_steps(tmp_path):
    events = []
    for step, t0 in enumerate((0.0, 50_000.0)):  # 50 ms apart: two steps
        events += [x(2, "PjitFunction(both)", t0, 900, 7), x(2, "Thunks::Prepare", t0 + 100, 200, 7),
                   x(2, "$api.py block_until_ready", t0 + 950, 2_000, 7),
                   x(1, "fusion_a", t0 + 400, 100), x(1, "MemcpyD2H", t0 + 500, 5),
                   x(1, "fusion_b", t0 + 700, 300),  # the gap: 505 -> 700 µs
                   x(3, "other_gpu_kernel", t0 + 505, 150)]  # GPU 1's, not GPU 0's
        if step == 0:  # a graph launch inside its command buffer's thunk, a one-off update
            events += [x(2, "command_buffer_1", t0 + 510, 180, 7), x(2, "cuGraphLaunch (CudaGraph:1)", t0 + 520, 150, 7),
                       x(2, "command_buffer::update", t0 + 310, 40, 7)]
        else:  # the conditional: its copy, then its own wait for the index
            events += [x(2, "cond.1", t0 + 505, 190, 7), x(2, "MemcpyD2H", t0 + 505, 10, 7)]
    return _write(tmp_path, events)


def test_gaps_are_split_by_step_and_given_the_deepest_host_event(tmp_path):
    trace = host_gaps.read_trace(str(_two_steps(tmp_path)))
    assert sorted(trace.devices) == [0, 1] and {s.name for s in trace.devices[0]} == {"fusion_a", "MemcpyD2H", "fusion_b"}
    steps = host_gaps.steps_of(trace.devices[0])
    gaps = host_gaps.gaps_of(steps, min_gap_us=50)
    assert [(g.step, g.us, g.after, g.before) for g in gaps] == [(0, 195.0, "MemcpyD2H", "fusion_b"),
                                                              (1, 195.0, "MemcpyD2H", "fusion_b")]
    totals = host_gaps.attribute(gaps, trace.host)
    first = {h["name"]: h["overlap_us"] for h in gaps[0].host}
    # the thunk's own time is 10 µs before its launch and 20 after; the call's, the 5 + 10 outside the thunk
    assert first == {"cuGraphLaunch (CudaGraph:1)": 150.0, "command_buffer_1": 30.0, "PjitFunction(both)": 15.0}
    second = {h["name"]: h["overlap_us"] for h in gaps[1].host}
    assert second == {"cond.1": 180.0, "MemcpyD2H": 10.0, "PjitFunction(both)": 5.0}  # the wait after the copy
    assert totals["python3 7 | cond.1"] == 180.0 and list(totals)[0] == "python3 7 | cond.1"
    edges = host_gaps.step_edges(steps, trace.host)
    assert [e["call_to_first_kernel_us"] for e in edges] == [400.0, 400.0]
    assert [e["last_kernel_to_wait_end_us"] for e in edges] == [1950.0, 1950.0]  # wait ends at 2950
    by_step = host_gaps.phases(trace.host, host_gaps.step_windows(steps))
    assert by_step["Thunks::Prepare"] == [200.0, 200.0]
    assert by_step["command_buffer::update"] == [40.0, 0.0]  # a one-off, not a per-step cost


def test_threads_are_told_apart_by_id_and_phases_summed_over_them(tmp_path):
    """Two threads of one name (and one with none): each keeps its own deepest event, and a phase
    that runs on both at once counts twice, nested events of its name on one thread once."""
    a, b, c = (2, 7), (2, 8), (2, 9)
    host = [Span("outer", 0, 100, a, "exec"), Span("Thunks::Prepare", 50, 150, b, "exec"),
            Span("Thunks::Prepare", 60, 90, b, "exec"), Span("Thunks::Prepare", 0, 40, c, "")]
    pieces = host_gaps.deepest(host)
    assert sorted((p.thread, p.name, p.start, p.end) for p in pieces) == [
        (a, "outer", 0, 100), (b, "Thunks::Prepare", 50, 60), (b, "Thunks::Prepare", 60, 90),
        (b, "Thunks::Prepare", 90, 150), (c, "Thunks::Prepare", 0, 40)]
    assert host_gaps.phases(host, [(float("-inf"), float("inf"))])["Thunks::Prepare"] == [140.0]  # 100 + 40


def test_the_command_line_writes_its_summary(tmp_path):
    out = tmp_path / "gaps.json"
    _two_steps(tmp_path)
    result = host_gaps.main([str(tmp_path), "--out", str(out)])  # a folder: its newest trace
    assert json.loads(out.read_text())["gaps"] == result["gaps"] == 2
    assert result["gap_us_by_step"] == [195.0, 195.0] and result["host_phases_us_median"]["Thunks::Prepare"] == 200.0
