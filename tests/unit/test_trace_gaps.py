"""Tier 1 — benchmarks/trace_gaps.py reads a torch.profiler Chrome trace: an idle gap on the GPU
inside a step is found with the kernel that ended it, the runtime call that issued it, how late
the host issued it, and the project's frames on the host stack then (a synthetic trace: the GPU
trace itself comes from a GPU run)."""

from __future__ import annotations

import gzip
import json

from benchmarks import trace_gaps


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace():
    return [
        _x("user_annotation", "step", 0, 1000),
        _x("python_function", "torch_impl/loop.py(735): grad_visits", 350, 200),
        _x("python_function", "numpy/core.py(1): reduce", 390, 20),
        _x("python_function", "seqplan/documents.py(104): document_runs", 380, 50),
        _x("python_function", "torch_impl/loop.py(1): waiting_elsewhere", 300, 300, tid=2),  # another thread
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=2),  # queued: no host delay
        _x("cuda_runtime", "cudaLaunchKernel", 400, 5, correlation=3),  # issued late, inside document_runs
        _x("kernel", "fwd_kernel", 100, 200, correlation=1),
        _x("kernel", "small", 305, 10, correlation=2),  # 5 µs after: launch spacing, not a gap
        _x("kernel", "bwd_kernel", 450, 300, correlation=3),
        _x("cuda_driver", "cuLaunchKernel", 700, 5, correlation=4),  # a driver-API launch (Triton's)
        _x("kernel", "triton_kernel", 750, 100, correlation=4),  # the GPU busy to 850, not idle
        _x("cuda_runtime", "cudaLaunchKernel", 720, 5, correlation=5),
        _x("kernel", "after", 855, 10, correlation=5),  # queued behind the driver's kernel: no gap
        _x("kernel", "other_step", 2000, 10, correlation=99),  # no runtime call in the step: not its work
    ]


def test_a_late_launch_is_a_gap_with_its_host_frames(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace()}).encode()))
    (gap,) = trace_gaps.gaps(trace_gaps.load(path), min_us=20)
    assert (gap.step, gap.start_us, gap.idle_us, gap.next_kernel, gap.launch) == (0, 215, 135, "bwd_kernel",
                                                                                  "cudaLaunchKernel")
    assert gap.launched_after_us == 85  # the host issued it 85 µs into the 135 µs gap
    assert gap.frames == ("seqplan/documents.py(104): document_runs", "torch_impl/loop.py(735): grad_visits")
    assert "| 0 | 215 | 135 | bwd_kernel |" in trace_gaps.summary([gap])


def test_short_gaps_are_launch_spacing():
    assert trace_gaps.gaps(_trace(), min_us=200) == []
