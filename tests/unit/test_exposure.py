"""Tier 1 — the exposed-communication arithmetic ``llama_scale``'s prediction reads
(``parity.capacity.exposure``). Why: on the GPU the fraction comes from a profile that no CPU test
can produce, so the interval arithmetic and the NCCL kernel names are pinned here on hand-made
kernel timelines whose answers are known."""

from __future__ import annotations

import pytest

from parity.capacity.exposure import collective_kinds, exposed_times, fractions, send_recv_kinds


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
