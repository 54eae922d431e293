"""Tier 1 — the block calls a virtual device makes (benchmarks.efficiency.device_blocks), the
numerator of issue 28's replay efficiency, counted from the schedule: if they were wrong, every
efficiency figure would compare the replay with the wrong bare kernels. Worked by hand from the
step plans (docs/contract.md: zigzag's half blocks, contiguous's skipped later shards)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from benchmarks.bench_replay import STRATEGIES
from benchmarks.common import Problem
from benchmarks.efficiency import BlockCall, device_blocks

PROBLEM = Problem(seq=1024, heads=8, kv_heads=2, head_dim=64)


@pytest.mark.parametrize("name, device, expected", [
    ("zigzag-r4", 0, {BlockCall("causal", 256, 256, 8, 2): 1, BlockCall("full", 128, 256, 8, 2): 3}),
    ("zigzag-r4", 3, {BlockCall("causal", 256, 256, 8, 2): 1, BlockCall("full", 256, 128, 8, 2): 3}),
    ("contiguous-r4", 0, {BlockCall("causal", 256, 256, 8, 2): 1}),
    ("contiguous-r4", 3, {BlockCall("causal", 256, 256, 8, 2): 1, BlockCall("full", 256, 256, 8, 2): 3}),
    ("stripe-r4", 1, {BlockCall("causal", 256, 256, 8, 2): 2, BlockCall("strict", 256, 256, 8, 2): 2}),
    ("ulysses-u4", 2, {BlockCall("causal", 1024, 1024, 2, 1): 1}),  # KV heads replicated up to U = 4
    ("usp-r2xu2", 3, {BlockCall("causal", 512, 512, 4, 1): 1, BlockCall("full", 512, 256, 4, 1): 1}),
])
def test_device_block_calls_follow_the_step_plan(name, device, expected):
    assert dict(device_blocks(STRATEGIES[name], PROBLEM, device)) == expected


def test_the_floor_counts_the_float32_accumulator_and_its_copy():
    """Issue 28's floor, fwd+bwd, 2 devices of 2048 tokens, 8 / 2 heads, d 64, bf16 (bytes)."""
    p = Problem(seq=4096, heads=8, kv_heads=2, head_dim=64)
    q, kv, kv32 = 2048 * 8 * 64 * 2, 2048 * 2 * 64 * 2, 2048 * 2 * 64 * 4
    assert p.min_bytes_per_device(2, False) == 2 * q + 2 * kv + 2048 * 8 * 4 + 2 * kv + 2 * q + 2 * kv + 4 * kv32
    assert p.min_bytes_per_device(2, True) == 2 * q + 2 * kv + 2048 * 8 * 4 + 2 * kv
