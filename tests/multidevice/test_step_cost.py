"""The step-time model's FLOPs and bytes against what each framework's step executes, on the
CPU: JAX's compiled program (parity.accounting.hlo_cost: optimized HLO, trip counts) and torch's
dispatched aten ops (parity.accounting.torch_cost) — as `python -m parity accounting` checks
them — and planted miscounts that the check must catch."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")

from parity.checks import step_cost
from parity.training import step_model as sm
from parity.training.llama import LlamaConfig


@pytest.fixture(scope="module")
def texts(jax_devices):
    from parity.training import llama_jax

    return llama_jax.compiled_texts(step_cost.STEP_COST_CONFIGS[0], which=(2,))  # the step program alone


def test_jax_step_flops_and_bytes_equal_the_model(texts):
    """One device, float32: matmul and executed attention FLOPs equal (exactly: 0 difference;
    per pass in `python -m parity accounting` and the multi-device configurations of
    test_llama.py), the memory-bound kernels' bytes within 10 % (measured 0.2 %)."""
    verdict = step_cost.llama_cost_verdict(step_cost.STEP_COST_CONFIGS[0], texts, check_bytes=True)
    assert not verdict.problems(), verdict.problems()
    assert verdict.worst_flops() == 0.0
    model, hlo = verdict.bytes
    assert abs(hlo / model - 1) < 0.02


def test_planted_miscounts_fail_the_check(texts, monkeypatch):
    """A matmul count 2 % high, attention's backward counted 2× the forward instead of 2.5×, and a
    memory model without Adam each fail."""
    case = step_cost.STEP_COST_CONFIGS[0]
    with monkeypatch.context() as m:
        real = sm.matmul_flops
        m.setattr(sm, "matmul_flops", lambda config, tokens: 1.02 * real(config, tokens))
        assert step_cost.llama_cost_verdict(case, texts).problems()
    with monkeypatch.context() as m:
        real = sm.executed_attention_flops
        m.setattr(sm, "executed_attention_flops", lambda *a: real(*a) * 12 / 14)
        assert any("attention" in p for p in step_cost.llama_cost_verdict(case, texts).problems())
    with monkeypatch.context() as m:
        real = sm.memory_passes
        m.setattr(sm, "memory_passes", lambda *a, **k: [p for p in real(*a, **k) if p.group != "optimizer"])
        assert any("memory bytes" in p for p in step_cost.llama_cost_verdict(case, texts, check_bytes=True).problems())


TORCH_MODEL = LlamaConfig(vocab=120, d_model=48, layers=2, heads=4, kv_heads=2, head_dim=12, d_ff=96)


def test_torch_step_bytes_equal_the_model(monkeypatch):
    """The bf16 torch step (aten_cpu: the GPU's attention adapter) op by op: matmul FLOPs equal,
    the memory term within 10 % (measured 0.1 %: the CPU op's lse copy); without the RMSNorm
    backward's passes the model falls short and the check fails."""
    from parity.training.llama_gpu import trace_torch_step

    traced = trace_torch_step(TORCH_MODEL, 128, "aten_cpu", "cpu")
    verdict = step_cost.torch_cost_verdict(TORCH_MODEL, 128, traced=traced)
    assert not verdict.problems(), verdict.problems()
    model_bytes, traced_bytes = verdict.bytes
    assert abs(traced_bytes / model_bytes - 1) < 0.01
    real = sm.memory_passes
    monkeypatch.setattr(sm, "memory_passes", lambda *a, **k: [p for p in real(*a, **k)
                                                               if not p.name.startswith("rmsnorm bwd")])
    assert step_cost.torch_cost_verdict(TORCH_MODEL, 128, traced=traced).problems()
