"""The B* calculator reproduces the hand derivations it is built to explain (3
significant figures), from the accounting model's own bytes and FLOPs."""

from __future__ import annotations

import math

import pytest

from parity.capacity.bstar import Choices, Hardware, critical_batch, optimal_split, ring_attention_min_tokens
from parity.training.traffic_model import FFNStep, ffn_step_flops, ffn_step_traffic

TPU = Hardware.load("tpu-v5p")
CS336 = Hardware.simple("cs336", 4.6e14, 2 * 9e10)
XXL = dict(d_model=16384, d_ff=53248, x=16, y=4, m_x=2, m_y=1, hw=CS336)


def sig3(x: float) -> float:
    return float(f"{x:.3g}")


def test_dp_fsdp_bound_is_alpha():
    """Scaling Book, DP/FSDP: per layer T_math = 4BDF/(NC)·2 (bwd) vs T_comm = 2·2·(2DF)/W
    (all-reduce of bf16 grads) -> B/N > C/W = 4.59e14 / 1.8e11 = 2550 per chip."""
    assert sig3(TPU.flops / TPU.bandwidth["all-reduce"]) == 2550


def test_mixed_fsdp_tp_bounds_at_the_optimal_split():
    """Scaling Book, mixed FSDP+TP (no ring factor, fwd): T_math = 4BDF/(NC),
    T_FSDP = 4DF/(Y·W·M_X), T_TP = 4BD/(X·W·M_Y). Overlapped (max) and optimised over the split:
    B/N > α²/(M_X·M_Y·F); for LLaMA-2 13B, F = 13824, M_X = 2, M_Y = 1:
    2550² / (2·13824) = 235. Not overlapped (sum): X_opt balances the two comms and
    B/N > 4α²/(M_X·M_Y·F) = 941."""
    best_max = optimal_split(5120, 13824, 4096, 2, 1, TPU, Choices("max", ring_factor=False))
    best_sum = optimal_split(5120, 13824, 4096, 2, 1, TPU, Choices("sum", ring_factor=False))
    assert sig3(best_max.per_chip) == 235
    assert sig3(best_sum.per_chip) == 941
    assert math.isclose(best_max.y, 13824 / 2550, rel_tol=1e-3)  # Y_max = M_Y·F/α


def test_cs336_xxl_published_answer_lets_m_x_multiply_bytes():
    """CS336 A2 XXL, as one write-up solved it (fwd only, ring factors on, summed comms):
    comm_X = M_X·(15/16)·(D·F/Y)·2 B = 8.18e8 B, comm_Y = M_Y·2·(3/4)·B·D·2 B;
    t_comp = 4·B·D·F/(Y·C) ≥ (comm_X + comm_Y)/W  ->  B* = 4.544e-3 / (1.897e-6 − 2.731e-7)
    = 2.80e3 tokens per device: M_X multiplies the bytes of one weight matrix."""
    r = critical_batch(**XXL, choices=Choices("sum", True, "bytes"))
    assert sig3(r.tokens_per_device) == 2800


def test_cs336_xxl_under_each_choice():
    """The same question with M_X multiplying bandwidth (T_X = 2 matrices' bytes / (M_X·W)):
    sum -> 1.40e3, max -> 1.20e3 tokens per device; without ring factors max -> α/M_X = 1.28e3;
    per chip = /Y, global = ·X."""
    got = {ch: critical_batch(**XXL, choices=ch) for ch in (Choices("sum"), Choices("max"), Choices("max", False))}
    assert [sig3(r.tokens_per_device) for r in got.values()] == [1400, 1200, 1280]
    r = got[Choices("max", False)]
    assert math.isclose(r.per_chip, r.tokens_per_device / 4) and math.isclose(r.global_tokens, r.tokens_per_device * 16)
    assert sig3(r.global_tokens) == 20400


def test_memory_term_by_hand():
    """FSDP 2 × TP 2, D 16, F 64, bf16: per token gelu over F/Y = 32 (forward r+w: 64 elements;
    backward r2 w1: 96) and the residual over D = 16 (3 + 3 elements): (64 + 48 + 96 + 48)·2 B;
    fixed: the float32 shard 2·16·64/4 = 512 parameters cast (6 B) and stepped by Adam (40 B).
    T_math gains them over W_hbm, and B* = (c − m) / a with the bigger a and the fixed m."""
    from parity.capacity.bstar import ffn_memory_bytes, step_coefficients

    assert ffn_memory_bytes(16, 64, 2, 2, "fwd") == (512 * 6, (64 + 48) * 2)
    assert ffn_memory_bytes(16, 64, 2, 2, "fwd+bwd") == (512 * 46, (64 + 48 + 96 + 48) * 2)
    hw = Hardware.simple("toy", 1e10, 1e9, hbm=1e11)
    ch = Choices("sum", passes="fwd+bwd", memory=True)
    a0, c0, y0, m0 = step_coefficients(16, 64, 2, 2, 1, 1, hw, Choices("sum", passes="fwd+bwd"))
    a, c, y, m = step_coefficients(16, 64, 2, 2, 1, 1, hw, ch)
    assert m0 == 0 and (c, y) == (c0, y0)
    assert math.isclose(a, a0 + (64 + 48 + 96 + 48) * 2 / 1e11) and math.isclose(m, 512 * 46 / 1e11)
    r = critical_batch(16, 64, 2, 2, 1, 1, hw, ch)
    assert a > y and c > m and math.isclose(r.tokens_per_device, (c - m) / (a - y))
    assert r.tokens_per_device < critical_batch(16, 64, 2, 2, 1, 1, hw, Choices("sum", passes="fwd+bwd")).tokens_per_device
    with pytest.raises(ValueError, match="hbm"):
        critical_batch(16, 64, 2, 2, 1, 1, Hardware.simple("no hbm", 1e12, 1e9), ch)


def test_no_batch_is_enough_when_tp_comm_outgrows_compute():
    """With Y so large that the TP all-reduce per token costs more than the matmuls, B* = inf."""
    assert math.isinf(critical_batch(4096, 4096, 2, 64, 1, 1, TPU, Choices("max")).tokens_per_device)


def test_ring_attention_min_tokens_by_hand():
    """Forward, causal, bf16: t ≥ 2·hk·e·C / (4·h·W·½) = 2·8·2·9.89e14 / (4·32·4.5e11·0.5) = 1.10e3."""
    t = ring_attention_min_tokens(Hardware.load("h100"), heads=32, kv_heads=8, head_dim=128)
    assert sig3(t["fwd"]) == 1100 and t["bwd"] > t["fwd"]


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "fsdp_tp", "zero1"])
def test_training_model_totals_by_hand(strategy):
    """Per-device bytes of one step (2 blocks, D=16, F=64, 32 tokens, bf16) on 4 devices."""
    x, y = {"dp": (4, 1), "fsdp": (4, 1), "tp": (1, 4), "fsdp_tp": (2, 2), "zero1": (4, 1)}[strategy]
    step = FFNStep(strategy, blocks=2, d_model=16, d_ff=64, tokens=32, fsdp=x, tp=y)
    t = ffn_step_traffic(step)
    w = 16 * 64 // y * 2  # one weight matrix shard in bytes
    act = 32 // x * 16 * 2
    expected = {
        "dp": 2 * 2 * 2 * 0.75 * w,  # blocks × matrices × all-reduce 2(n-1)/n
        "fsdp": 2 * 2 * 3 * 0.75 * w,  # AG fwd + AG bwd + RS
        "tp": 2 * 2 * 2 * 0.75 * act,  # fwd + bwd all-reduce
        "fsdp_tp": 2 * 2 * 3 * 0.5 * w + 2 * 2 * 2 * 0.5 * act,
        "zero1": 2 * 2 * 2 * 0.75 * w,  # RS + AG of params
    }[strategy]
    assert float(t.bytes()) == expected
    assert ffn_step_flops(step)["bwd"] == 2 * ffn_step_flops(step)["fwd"] == 2 * 2 * 4 * (32 // x) * 16 * 64 // y
