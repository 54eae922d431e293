"""The step-time model (parity.training.step_model) and the compiled program's counter
(parity.accounting.hlo_cost) on inputs worked by hand — no compiler, no device."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest

from parity.accounting.hlo_cost import count_cost, scopes
from parity.checks.step_cost import CostVerdict
from parity.core.mesh import MeshShape
from parity.training import step_model as sm
from parity.training.llama import LlamaConfig

HLO = """HloModule m

%fused_dot (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_exp (p0: f32[4,16]) -> f32[4,16] {
  %p0 = f32[4,16]{1,0} parameter(0)
  ROOT %e = f32[4,16]{1,0} exponential(%p0)
}

%fused_dus (p0: f32[64,16], p1: f32[4,16], p2: s32[]) -> f32[64,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = f32[4,16]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[64,16]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

%fused_slice (p0: f32[64,16], p1: s32[]) -> f32[4,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[4,16]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={4,16}
}

%body (p: (s32[], f32[4,8], f32[8,16], f32[64,16])) -> (s32[], f32[4,8], f32[8,16], f32[64,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[64,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %acc = f32[64,16]{1,0} get-tuple-element(%p), index=3
  %y = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/layers_0/dot_general"}
  %old = f32[4,16]{1,0} fusion(%acc, %i), kind=kLoop, calls=%fused_slice
  %new = f32[64,16]{1,0} fusion(%acc, %y, %i), kind=kLoop, calls=%fused_dus
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[64,16]{1,0}) tuple(%i, %x, %w, %new)
}

%cond (p: (s32[], f32[4,8], f32[8,16], f32[64,16])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[64,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%big (a: f32[4,8], b: f32[8,16]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %d1 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = f32[4,16]{1,0} fusion(%d1), kind=kLoop, calls=%fused_exp
}

%small (a: f32[4,8], b: f32[8,16]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  ROOT %z = f32[4,16]{1,0} broadcast(%b), dimensions={}
}

ENTRY %main (x: f32[4,8], w: f32[8,16], acc: f32[64,16], k: s32[]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,16]{1,0} parameter(1)
  %acc = f32[64,16]{1,0} parameter(2)
  %k = s32[] parameter(3)
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[64,16]{1,0}) tuple(%k, %x, %w, %acc)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[64,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %att = f32[4,16]{1,0} conditional(%k, %x, %w), branch_computations={%small, %big}, metadata={op_name="jit(f)/layers_0/attn/core_attention/cond"}
  %opt = f32[4,16]{1,0} fusion(%att), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(f)/optimizer/exp"}
  ROOT %l = f32[4,16]{1,0} fusion(%opt), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(f)/transpose(jvp(loss))/exp"}
}
"""


def test_hlo_cost_counts_loops_branches_fusions_and_classes_by_hand():
    """A while body × its trip count (4 dots of 2·4·16·8 = 1024 FLOPs, inside fusions); a
    conditional's largest branch (1024 FLOPs; smallest 0) under the core_attention scope, so its
    dot is attention, not matmul; bytes per kernel: the dot fusion 128 + 512 + 256 B, the
    dynamic-slice fusion reads what it takes (256 B, writes 256 B), the in-place update writes
    and reads only its update (256 + 256 B, not the 4 KiB buffer); classes by scope
    (optimizer, loss — through jvp/transpose wrappers)."""
    cost = count_cost(HLO)
    assert cost.flops == {"matmul": 4 * 1024, "attention": 1024}
    assert cost.flops_min["matmul"] == 4 * 1024 and cost.flops_min.get("attention", 0) == 0
    assert cost.bytes["matmul"] == 4 * (128 + 512 + 256)
    # 4 × (slice 256 + 256, update 256 + 256, each + its s32 index 4); the condition's compare × 5 (4 + 4 + 1)
    assert cost.bytes["other"] == 4 * (512 + 512 + 4 + 4) + 5 * (4 + 4 + 1)
    assert cost.bytes["attention"] == (128 + 512 + 256) + (256 + 256)  # the largest branch's dot and exp
    assert cost.bytes["optimizer"] == cost.bytes["loss"] == 512
    assert cost.kernels["matmul"] == 4


def test_hlo_cost_refuses_a_loop_without_trip_count():
    with pytest.raises(ValueError, match="known_trip_count"):
        count_cost(HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""))
    with pytest.raises(ValueError, match="ENTRY"):
        count_cost("HloModule m\n")


def test_scopes_unwrap_transformations():
    assert scopes("jit(step)/transpose(jvp(loss))/jit(log_softmax)/exp") == ["step", "loss", "log_softmax", "exp"]


TINY = LlamaConfig(vocab=50, d_model=16, layers=2, heads=4, kv_heads=2, head_dim=4, d_ff=24)


def test_memory_passes_by_hand():
    """torch's Adam: 19 elements per parameter in the model's dtype (lerp 3, mul 2, addcmul 4,
    sqrt 2, div 2, add 2, addcdiv 4); torch's
    float32 model dispatches no casts, bf16 does; the loss's log_softmax reads and writes [N, V]
    float32 in both dtypes. JAX on XLA:CPU: optax's 10 float32 elements (m 3, v 3, p 4)."""
    params = sm.parameter_count(TINY)
    assert params == 50 * 16 * 2 + 2 * (2 * 16 + 16 * 16 * 2 + 2 * 16 * 8 + 3 * 16 * 24) + 16
    for dtype, e in (("bfloat16", 2), ("float32", 4)):
        torch_opt = sm.memory_bytes(sm.memory_passes(TINY, 64, "torch", dtype))["optimizer"]
        assert torch_opt == 19 * e * params
        assert sm.memory_bytes(sm.memory_passes(TINY, 64, "jax", dtype, backend="cpu"))["optimizer"] == 40 * params
    # XLA:GPU: one Adam kernel a parameter (p, m, v and the gradient read — the embedding's float32,
    # the others bf16; p, m, v and the float32 gradient written: 30 bytes, 28 for the embedding)
    # and two float32 layout copies of every parameter (16 bytes)
    embed = 50 * 16
    assert sm.memory_bytes(sm.memory_passes(TINY, 64, "jax", "bfloat16"))["optimizer"] == 46 * params - 2 * embed
    casts = lambda dtype: [p for p in sm.memory_passes(TINY, 64, "torch", dtype) if "x to float32" in p.name]
    assert casts("bfloat16") and not casts("float32")
    lsm = next(p for p in sm.memory_passes(TINY, 64, "torch", "bfloat16") if p.name == "log_softmax")
    assert lsm.bytes == 2 * 4 * 64 * 50
    shard = sm.memory_bytes(sm.memory_passes(TINY, 64, "torch", "bfloat16", shards=4))
    assert shard["optimizer"] == 19 * 2 * params / 4


def test_executed_attention_flops_by_hand():
    """The portable kernel executes whole blocks: one device, T = 64: the whole 64 × 64 causal
    block (not its 2080 visible pairs); zigzag ring 2: its own 32 × 32 block and one 32 × 16 half
    block; contiguous ring 4: the busiest device computes a 16 × 16 block at every step."""
    per_pair = 14 * TINY.layers * TINY.head_dim * TINY.heads
    assert sm.executed_attention_flops(TINY, MeshShape(ring=1), "contiguous", 1, 64) == per_pair * 64 * 64
    assert sm.executed_attention_flops(TINY, MeshShape(ring=2), "zigzag", 1, 64) == per_pair * (32 * 32 + 32 * 16)
    assert sm.executed_attention_flops(TINY, MeshShape(ring=4), "contiguous", 2, 64) == per_pair * 2 * 4 * 16 * 16
    assert sm.executed_attention_flops(TINY, MeshShape(ulysses=2), "zigzag", 1, 64) == per_pair / 2 * 64 * 64
    assert sm.attention_flops(TINY, 2080) == per_pair / 14 * 3.5 * 4 * 2080


def test_prediction_terms_combine_and_batch_coefficients():
    rates = sm.Rates(1e12, 5e11, 1e11)
    pred = sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", rates)
    assert math.isclose(pred.predicted_s, pred.matmul_s + pred.attention_s + pred.memory_s)
    assert math.isclose(pred.matmul_s, sm.matmul_flops(TINY, 128) / 1e12)
    assert math.isclose(pred.memory_s, pred.memory_bytes["total"] / 1e11)
    top = sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", rates, combine="max")
    assert top.predicted_s == max(pred.matmul_s, pred.attention_s, pred.memory_s)
    # the host's floor counts only where it is longer than the GPU's work
    low, high = (sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", rates, host_s=h)
                 for h in (pred.gpu_s / 2, pred.gpu_s * 3))
    assert low.predicted_s == pred.predicted_s and high.predicted_s == pred.gpu_s * 3
    for framework in sm.FRAMEWORKS:  # T(B) = m + a·B exactly; m > 0: Adam does not grow with B
        m, a = sm.batch_coefficients(TINY, 32, framework, "bfloat16", rates, devices=2, shards=2)
        assert m > 0 and a > 0
        for rows in (3, 5):
            t = sm.predict_step(TINY, rows * 16, rows * 32 * 33 / 4, framework, "bfloat16", rates, shards=2)
            assert math.isclose(t.predicted_s, m + a * rows, rel_tol=1e-9)


XLA_GPU_HLO = Path(__file__).resolve().parents[2] / "docs" / "gpu" / "stepmodel-2026-11-25-h100" / "xla-gpu-hlo"


@pytest.mark.parametrize("name", ["d1024-L8-8192", "d2048-L4-32768", "d4096-L4-8192"])
def test_jax_gpu_passes_equal_the_xla_gpu_program(name):
    """The JAX step's memory passes on the GPU against the optimized HLO XLA:GPU compiled for the
    timed step (jax 0.11.2, H100, kept by ``llama_gpu time``): the bytes of every kernel that is
    neither a GEMM nor attention, within 5 % (measured: 0.965–0.998 over six programs)."""
    from parity.training.llama_gpu import SIZES

    d_model, layers, seq = (int(x.lstrip("dL")) for x in name.split("-"))
    config = SIZES[d_model]
    assert config.layers == layers
    cost = count_cost(gzip.decompress((XLA_GPU_HLO / f"hlo-{name}.txt.gz").read_bytes()).decode())
    program = sum(cost.bytes.get(c, 0.0) for c in ("other", "loss", "optimizer"))
    model = sm.memory_bytes(sm.memory_passes(config, seq, "jax", "bfloat16"))["total"]
    assert 0.95 < program / model < 1.05, (program / 1e9, model / 1e9)
    # the loss reads the bf16 logits in its reductions: 30 bytes a logit in the model; the program
    # names two of its kernels outside the "loss" scope (the picked logit's read, 2 bytes, and the
    # logits gradient's cast, 8) — equal at 8k tokens, 7 % more in the program at 32k
    logits = seq * config.vocab
    assert 0.99 < (cost.bytes["loss"] + 10 * logits) / (30 * logits) < 1.08, cost.bytes["loss"] / logits
    assert sm.memory_bytes(sm.memory_passes(config, seq, "jax", "bfloat16"))["loss"] == 30 * logits + 20 * seq


def test_copy_ladder_charges_each_pass_at_its_own_size():
    """With a measured copy ladder the memory term charges every kernel at the rate a copy of its
    size reached (log-log between sizes, clamped at the ends); a flat ladder is W_hbm."""
    curve = ((1e3, 1e9), (1e6, 1e11), (1e9, 1e12))
    rates = sm.Rates(1e12, 5e11, 2e12, hbm_curve=curve)
    assert rates.hbm_at(10) == 1e9 and rates.hbm_at(1e12) == 1e12  # clamped
    assert math.isclose(rates.hbm_at(1e6), 1e11) and math.isclose(rates.hbm_at(10**4.5), 1e10)  # log-log midpoint
    passes = sm.memory_passes(TINY, 128, "torch")
    pred = sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", rates)
    by_hand = sum(p.count * (p.bytes / p.count) / rates.hbm_at(p.bytes / p.count) for p in passes)
    assert math.isclose(pred.memory_s, by_hand) and pred.memory_s > pred.memory_bytes["total"] / 1e9 / 1e3
    flat = sm.Rates(1e12, 5e11, 2e12, hbm_curve=((1e3, 2e12), (1e9, 2e12)))
    plain = sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", sm.Rates(1e12, 5e11, 2e12))
    assert math.isclose(sm.predict_step(TINY, 128, 128 * 129 / 2, "torch", "bfloat16", flat).memory_s, plain.memory_s)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="framework"):
        sm.memory_passes(TINY, 64, "mxnet")
    with pytest.raises(ValueError, match="dtype"):
        sm.memory_passes(TINY, 64, "jax", "int8")
    with pytest.raises(ValueError, match="tokens"):
        sm.memory_passes(TINY, 0, "jax")
    with pytest.raises(TypeError, match="LlamaConfig"):
        sm.memory_passes({"d_model": 16}, 64, "jax")
    with pytest.raises(ValueError, match="sinks"):
        sm.memory_passes(LlamaConfig(sinks=True), 64, "jax")
    with pytest.raises(ValueError, match="hbm"):
        sm.Rates(1e12, 1e12, 0)
    with pytest.raises(ValueError, match="hbm_curve"):
        sm.Rates(1, 1, 1, hbm_curve=((2e6, 1e9), (1e6, 1e9)))  # not ascending
    with pytest.raises(ValueError, match="combine"):
        sm.predict_step(TINY, 64, 10, "jax", "bfloat16", sm.Rates(1, 1, 1), combine="mean")
    with pytest.raises(TypeError, match="Rates"):
        sm.predict_step(TINY, 64, 10, "jax", "bfloat16", {"matmul": 1})
    with pytest.raises(ValueError, match="seq % devices"):
        sm.batch_coefficients(TINY, 33, "jax", "bfloat16", sm.Rates(1, 1, 1), devices=2)


def test_cost_verdict_tolerances():
    """FLOPs must agree within 1 %, memory bytes within 10 %: a count 2 % off fails."""
    ok = CostVerdict("x", {("fwd", "matmul"): (100.0, 100.5)}, (1000.0, 1090.0))
    assert not ok.problems()
    assert CostVerdict("x", {("fwd", "matmul"): (100.0, 102.0)}).problems()
    assert CostVerdict("x", {}, (1000.0, 1110.0)).problems()
