"""Tier 1 — benchmarks/host_gaps.py, which reads the host half of a ``jax.profiler`` trace to say
what the host did while the GPU idled. A synthetic trace with a known answer: two steps, a gap in
each after a read-back, the host in a graph launch (nested inside its thunk) during the first and
in a D2H copy during the second."""

import gzip
import json

from benchmarks import host_gaps


def _trace(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "python3"}}]
    x = lambda pid, name, ts, dur, tid=0: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = []
    for step, t0 in enumerate((0.0, 50_000.0)):  # 50 ms apart: two steps
        events += [x(2, "PjitFunction(both)", t0, 900, 7), x(2, "Thunks::Prepare", t0 + 100, 200, 7),
                   x(2, "$api.py block_until_ready", t0 + 950, 2_000, 7),
                   x(1, "fusion_a", t0 + 400, 100), x(1, "MemcpyD2H", t0 + 500, 5),
                   x(1, "fusion_b", t0 + 700, 300),  # the gap: 505 -> 700 µs
                   x(3, "other_gpu_kernel", t0 + 505, 150)]  # another GPU: not GPU 0's
        inner = (x(2, "command_buffer_1", t0 + 510, 180, 7), x(2, "cuGraphLaunch (CudaGraph:1)", t0 + 520, 150, 7)) \
            if step == 0 else (x(2, "MemcpyD2H", t0 + 510, 180, 7),)
        events += list(inner)
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return path


def test_gaps_are_split_by_step_and_given_the_innermost_host_event(tmp_path):
    device, host = host_gaps.read_trace(str(_trace(tmp_path)), gpu=0)
    assert {s.name for s in device} == {"fusion_a", "MemcpyD2H", "fusion_b"}  # GPU 1 left out
    steps = host_gaps.steps_of(device)
    gaps = host_gaps.gaps_of(steps, min_gap_us=50)
    assert [(g.step, g.us, g.after, g.before) for g in gaps] == [(0, 195.0, "MemcpyD2H", "fusion_b"),
                                                              (1, 195.0, "MemcpyD2H", "fusion_b")]
    totals = host_gaps.attribute(gaps, host)
    assert gaps[0].host[0]["name"] == "cuGraphLaunch (CudaGraph:1)"  # not the thunk holding it
    assert gaps[1].host[0]["name"] == "MemcpyD2H"
    assert list(totals.items()) == [("python3 | MemcpyD2H", 180.0), ("python3 | cuGraphLaunch (CudaGraph:1)", 150.0)]
    edges = host_gaps.step_edges(steps, host)
    assert [e["call_to_first_kernel_us"] for e in edges] == [400.0, 400.0]
    assert [e["last_kernel_to_wait_end_us"] for e in edges] == [1950.0, 1950.0]  # wait ends at 2950
    assert host_gaps.phases(host, len(steps))["Thunks::Prepare"] == 200.0


def test_the_command_line_writes_its_summary(tmp_path):
    out = tmp_path / "gaps.json"
    _trace(tmp_path)
    result = host_gaps.main([str(tmp_path), "--out", str(out)])  # a folder: its newest trace
    assert json.loads(out.read_text())["gaps"] == result["gaps"] == 2
