"""The reference FFN training steps (parity.training.jax_step: shard_map + flax + optax;
parity.training.torch_step: FSDP2 + DTensor TP on gloo) against the float64 oracle of the unsharded
step, and their communication against the analytical model, byte for byte and call for call.

Why: the accounting model and the B* calculator built on it are only worth something if real
FSDP / TP / DP / ZeRO-1 implementations in both frameworks move exactly what the model says —
and compute the same step as no parallelism at all."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

from parity.checks.traffic import TRAINING_CONFIGS
from parity.core.numerics import check_tensor
from parity.training import jax_step as train_jax
from parity.training.reference import TrainCase, make_train_inputs, reference_step
from parity.training.traffic_model import ffn_step_traffic

KEYS = ("loss", "dx", "dw1", "dw2", "new_w1", "new_w2")
LOW_PRECISION_KEYS = ("loss", "dx", "dw1", "dw2")  # Adam's first step is ≈ lr·sign(g): a bf16
# rounding of a tiny gradient entry flips it, so updated weights are compared in float32 only.


def _torch_step(case, inputs):
    from parity.training import torch_step

    return torch_step.run_step(case, inputs)


@pytest.mark.parametrize("case", TRAINING_CONFIGS, ids=lambda c: c.name)
def test_step_traffic_model_equals_xla_hlo_and_torch_trace(case, jax_devices, worlds):
    """Three-way equality per pass (fwd / bwd / optimizer step) and kind, float32 on the wire."""
    from parity.training import torch_step as train_torch

    model = ffn_step_traffic(case.model_step())
    jax_measured = train_jax.measure_traffic(case)
    torch_measured = train_torch.measure_traffic(case, make_train_inputs(case))
    assert model == jax_measured, "\n" + model.diff(jax_measured, ("model", "jax HLO"))
    assert model == torch_measured, "\n" + model.diff(torch_measured, ("model", "torch trace"))
    assert model.bytes() > 0


@pytest.mark.parametrize("case", [TrainCase("fsdp_tp", fsdp=2, tp=2, dtype="bfloat16"),
                                  TrainCase("zero1", fsdp=4, dtype="bfloat16"), TrainCase("dp", fsdp=2, dtype="bfloat16")],
                         ids=lambda c: c.name)
def test_bf16_step_torch_moves_bf16_and_xla_cpu_moves_float32(case, jax_devices, worlds):
    """torch's FSDP2 / DTensor / explicit collectives move bf16 as modelled (2 bytes); XLA:CPU
    widens the same bf16 program's collectives to float32 — exactly the 4-byte model."""
    from parity.training import torch_step as train_torch

    assert ffn_step_traffic(case.model_step()) == train_torch.measure_traffic(case, make_train_inputs(case))
    assert ffn_step_traffic(case.model_step(comm_bytes=4)) == train_jax.measure_traffic(case)


@pytest.mark.parametrize("case", TRAINING_CONFIGS, ids=lambda c: c.name)
def test_float32_step_equals_the_unsharded_oracle(case, jax_devices, worlds):
    """Loss, input gradient, weight gradients and Adam-updated weights of the sharded float32
    step, both frameworks, within the float32 policy (relative 1e-5) of the float64 oracle."""
    inputs = make_train_inputs(case)
    ref = reference_step(case, inputs)
    for framework, got in (("jax", train_jax.run_step(case, inputs)), ("torch", _torch_step(case, inputs))):
        bad = [str(c) for c in (check_tensor(k, got[k], ref[k], "float32") for k in KEYS) if not c.ok]
        assert not bad, f"{framework}: {bad}"


@pytest.mark.parametrize("case", [TrainCase("fsdp_tp", fsdp=2, tp=2, dtype="bfloat16"),
                                  TrainCase("fsdp", fsdp=4, dtype="bfloat16"), TrainCase("tp", tp=4, dtype="bfloat16"),
                                  TrainCase("zero1", fsdp=2, dtype="bfloat16")], ids=lambda c: c.name)
def test_bf16_step_is_as_accurate_as_the_unsharded_bf16_step(case, jax_devices, worlds):
    """bf16 activations and communication: within the low-precision policy (2× the error of the
    same framework's unsharded bf16 step, plus a 2⁻¹⁰·max floor) of the float64 oracle."""
    inputs = make_train_inputs(case)
    ref = reference_step(case, inputs)
    control_case = TrainCase(case.strategy, dtype=case.dtype)  # one device, same code and dtype
    for framework, run in (("jax", train_jax.run_step), ("torch", _torch_step)):
        got, control = run(case, inputs), run(control_case, inputs)
        checks = [check_tensor(k, got[k], ref[k], case.dtype, control[k]) for k in LOW_PRECISION_KEYS]
        assert not [str(c) for c in checks if not c.ok], f"{framework}: {[str(c) for c in checks]}"


def test_invalid_training_cases_are_refused():
    """Strategy / mesh mismatches and indivisible shapes fail at construction, naming the rule."""
    with pytest.raises(ValueError, match="tp must be 1"):
        TrainCase("fsdp", fsdp=2, tp=2)
    with pytest.raises(ValueError, match="fsdp must be 1"):
        TrainCase("tp", fsdp=2, tp=2)
    with pytest.raises(ValueError, match="multiples of fsdp"):
        TrainCase("fsdp", fsdp=3)
    with pytest.raises(ValueError, match="strategy"):
        TrainCase("ddp")


def test_calibrate_measures_a_loadable_profile_and_predicts(tmp_path, worlds):
    """`python -m parity calibrate` machinery on a gloo world with tiny sizes: a profile with
    positive C and W for every collective kind that the B* calculator loads, and finite
    predicted / measured times for the FSDP+TP step and USP attention. (The numbers mean
    nothing on CPU; the GPU run is in docs/accounting.md.)"""
    import json

    from parity.accounting.model import KINDS
    from parity.capacity import calibrate
    from parity.capacity.bstar import Hardware

    result = worlds(2).run(calibrate.profile_task, calibrate.SMALL, "cpu")[0]
    assert result["flops"] > 0 and set(result["bandwidth"]) == set(KINDS)
    assert all(w > 0 for w in result["bandwidth"].values())
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "p", "source": "test", "flops": result["flops"],
                                "bandwidth": result["bandwidth"]}))
    assert Hardware.load(str(path)).flops == result["flops"]
    rows = calibrate.predict(calibrate.SMALL, result, "gloo", "cpu")
    assert len(rows) == 3
    for r in rows:
        assert r["measured_s"] > 0 and r["t_math_s"] > 0 and r["t_comm_s"] > 0
