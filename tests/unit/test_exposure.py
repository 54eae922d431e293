"""Tier 1 — the exposed-communication arithmetic ``llama_scale``'s prediction reads
(``parity.capacity.exposure``). Why: on the GPU the fraction comes from a profile that no CPU test
can produce, so the interval arithmetic and the NCCL kernel names are pinned here on hand-made
kernel timelines whose answers are known."""

from __future__ import annotations

import pytest

from parity.capacity.exposure import collective_kinds, exposed_times, fractions, send_recv_kinds, xla_trace_kernels


def test_collective_kinds_from_nccl_kernel_names():
    ring = send_recv_kinds({"p2p", "all-gather"})
    assert collective_kinds("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ring) == ("all-gather",)
    assert collective_kinds("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", ring) == ("reduce-scatter",)
    assert collective_kinds("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ring) == ("all-reduce",)
    assert collective_kinds("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ring) == ("p2p",)
    assert collective_kinds("ncclDevKernel_SendRecv", send_recv_kinds({"all-to-all"})) == ("all-to-all",)
    assert collective_kinds("sm90_xmma_gemm_bf16bf16_bf16f32", ring) is None  # compute


def test_exposed_time_is_the_collectives_time_outside_every_compute_kernel():
    kernels = [
        ("gemm", 0.0, 4.0), ("flash_fwd", 5.0, 6.0),              # compute: [0, 4) and [5, 6)
        ("ncclDevKernel_AllGather", 3.0, 7.0),                     # 1 hidden under gemm, 1 under flash: 2 exposed
        ("ncclDevKernel_AllGather", 6.5, 8.0),                     # overlaps the previous: merged [3, 8)
        ("ncclDevKernel_ReduceScatter_Sum", 1.0, 2.0),             # wholly hidden
        ("ncclDevKernel_SendRecv", 9.0, 10.0),                     # wholly exposed
    ]
    got = exposed_times(kernels, ("p2p",))
    assert got["all-gather"] == {"kernel_s": 5.0, "exposed_s": 3.0}
    assert got["reduce-scatter"] == {"kernel_s": 1.0, "exposed_s": 0.0}
    assert got["p2p"] == {"kernel_s": 1.0, "exposed_s": 1.0}


def test_fractions_average_over_ranks_and_count_an_unseen_kind_whole():
    ranks = [{"all-gather": {"kernel_s": 4.0, "exposed_s": 1.0}}, {"all-gather": {"kernel_s": 2.0, "exposed_s": 2.0}}]
    got = fractions(ranks, ["all-gather", "p2p"])
    assert got["all-gather"] == pytest.approx(0.5)
    assert got["p2p"] == 1.0


def test_an_xla_trace_gives_each_gpus_kernels_in_seconds(tmp_path):
    """``jax.profiler``'s trace (µs, one process per GPU, host threads beside them) read as the
    torch profile is: per GPU, (name, start_s, end_s) — only complete events on a GPU process."""
    import gzip
    import json

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
              {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "ncclDevKernel_AllGather", "ts": 1000.0, "dur": 500.0},
              {"ph": "X", "pid": 2, "name": "fusion", "ts": 2000.0, "dur": 250.0},
              {"ph": "X", "pid": 3, "name": "host op", "ts": 0.0, "dur": 9.0},
              {"ph": "i", "pid": 1, "name": "an instant", "ts": 5.0}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels = xla_trace_kernels(str(tmp_path))
    assert kernels == {"/device:GPU:0": [("ncclDevKernel_AllGather", 1e-3, 1.5e-3)],
                       "/device:GPU:1": [("fusion", 2e-3, 2.25e-3)]}
    assert exposed_times(kernels["/device:GPU:0"], ("p2p",))["all-gather"]["exposed_s"] == pytest.approx(5e-4)
    with pytest.raises(FileNotFoundError, match="no trace"):
        xla_trace_kernels(str(tmp_path / "plugins" / "missing"))
    # a later trace into the same folder (another process, another run) is the one read
    import os

    later = tmp_path / "plugins" / "profile" / "a-later-run"
    later.mkdir()
    with gzip.open(later / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events[:1] + [{"ph": "X", "pid": 1, "name": "later", "ts": 0.0, "dur": 1.0}]}, f)
    for newest, name in ((later, "later"), (folder, "ncclDevKernel_AllGather")):  # each in turn the newest
        os.utime(newest / "host.trace.json.gz", (2e9, 2e9))
        os.utime(({later, folder} - {newest}).pop() / "host.trace.json.gz", (1e9, 1e9))
        assert xla_trace_kernels(str(tmp_path))["/device:GPU:0"][0][0] == name
