"""The whole model's timed multi-device run (``python -m parity.capacity.llama_scale``) on a gloo
world with tiny sizes, and its B* arithmetic.

Why: the multi-GPU run (docs/model.md, "On several GPUs") compares a measured step with the
accounting model's prediction and sweeps the batch to B*; the command must work before GPU time
is spent on it, and its prediction must read bytes that equal what the step moves. The times on
the CPU mean nothing; the traffic equality, the affine model and the B* formula do."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

torch = pytest.importorskip("torch")

from helpers import FULL
from parity.capacity import llama_scale
from parity.capacity.bstar import PRESETS, Hardware, table
from parity.training.llama_traffic import llama_step_traffic

PROFILE = {"flops": 1e12, "hbm": 1e11, "bandwidth": {k: 1e9 for k in ("p2p", "all-to-all", "all-gather",
                                                                       "reduce-scatter", "all-reduce")}}


def test_the_command_times_every_strategy_with_the_models_bytes_equal_to_the_trace(worlds, tmp_path):
    """Every row's whole-step traffic (FSDP gathers and reduce-scatters, the attention's K/V or
    all-to-alls, the loss count) equals the trace of the step it times; the sweep covers every B;
    the markdown names the machine. A model in the wrong wire dtype differs from that trace, so
    the equality can fail."""
    worlds(2)  # the session's gloo world of 2 (measure uses the same one)
    run = llama_scale.SMALL_RUN
    emitted = []
    result = llama_scale.measure(run, "cpu", world=2, emit=emitted.append)
    # every row handed out as it was measured (a killed run keeps them), each strategy's exposure first
    calibration = ("exposure", "host_floor", "verify")
    timed_rows = [r for r in emitted if not {*calibration, "hardware"} & set(r)]
    # each also carries its own step's cProfile (rank 0's), which the CLI writes to a file of its own
    assert all("llama_torch.py" in r.pop("host_profile") for r in timed_rows)
    assert timed_rows == result["rows"] + result["bstar"]["sweep"]
    # first of all the calibrated profile, in the form `python -m parity bstar --hardware FILE` reads
    assert "hardware" in emitted[0] and sum("hardware" in r for r in emitted) == 1
    path = tmp_path / "hardware.json"
    path.write_text(json.dumps(emitted[0]["hardware"]))
    hardware = Hardware.load(str(path))
    assert (hardware.flops, hardware.hbm, hardware.bandwidth) == tuple(result["profile"][k] for k in ("flops", "hbm",
                                                                                                       "bandwidth"))
    assert table(next(iter(PRESETS)), hardware=hardware)  # the B* table runs on it
    for key in calibration:  # each strategy's two calibration steps and its check, each once
        assert [r[key] for r in emitted if key in r] == list(run.strategies)
    for r in emitted:  # the host-floor step's own cProfile (rank 0): where the floor's time goes
        if "host_floor" in r:
            assert "llama_torch.py" in r["host_profile"] and "(step)" in r["host_profile"], r["host_profile"][:500]
            assert len(r["timings_s"]) == 2 and r["seconds"] == min(r["timings_s"])  # the faster of two
    assert [(r["strategy"], r["seq"], r["batch"]) for r in result["rows"]] == [(s, run.seqs[0], 1)
                                                                                 for s in run.strategies]
    assert all(v["passed"] for v in result["verified"].values()), result["verified"]
    for r in result["rows"] + result["bstar"]["sweep"]:
        assert r["traffic_equal"] and r["verified"], r
        assert r["measured_s"] > 0 and r["t_math_s"] > 0 and r["t_comm_s"] > 0 and r["t_memory_s"] > 0
        # gloo blocks the calling thread in every collective: nothing hides, the GPU-side prediction is
        # the serial bound, and the host's floor (a step of host_seq tokens) where that is longer
        assert r["framework"] == "torch" and r["devices"] == 2 and set(r["exposed_fraction"].values()) == {1.0}
        assert r["predicted_s"] == max(r["bound_serial_s"], result["host_floor_s"][r["strategy"]])
        assert r["fixed_s"] is None and r["predicted_exposure_s"] == r["bound_serial_s"]  # torch: the floor is a floor
        assert r["bound_overlap_s"] < r["bound_serial_s"]
    assert result["bstar"]["predicted_bstar"] == max(result["bstar"]["rows_exposed"], result["bstar"]["rows_host"])
    assert [(r["seq"], r["batch"]) for r in result["bstar"]["sweep"]] == [(run.bstar_seq, b) for b in run.batches]
    case = llama_scale.model_case(run, "zigzag", run.seqs[0], 1, 2)
    traced = worlds(2).run(llama_scale.timed_step_task, case, "cpu", "float32", 0, 1)[0]["traffic"]
    assert llama_scale.traffic_equal(llama_step_traffic(case, "torch", "float32").rows(), traced)
    assert not llama_scale.traffic_equal(llama_step_traffic(case, "torch", "bfloat16").rows(), traced)
    assert "2x CPU" in llama_scale.markdown(result)


def test_rows_with_and_without_segment_ids_move_what_the_model_counts_in_both_frameworks(worlds, jax_devices):
    """The command's rows pass no segment ids by default (one document a row: the causal mask
    itself); ``--segment-ids`` passes them (the packed-training program). Each setting's traced
    bytes equal its own model in both frameworks, and the two models differ — by the ids' gathers
    alone — so neither equality holds against the other setting's trace."""
    from parity.capacity import llama_scale_jax

    run = llama_scale.SMALL_RUN
    cases = {ids: llama_scale.model_case(dataclasses.replace(run, segment_ids=ids), "zigzag", 32, 1, 2)
             for ids in (False, True)}
    for framework in ("torch", "jax"):
        model = {ids: llama_step_traffic(case, framework, "float32").rows() for ids, case in cases.items()}
        assert model[True] != model[False]
        gathered = {ids: sum(b for (_, kind), (_, b) in model[ids].items() if kind == "all-gather") for ids in model}
        assert gathered[True] > gathered[False] and all(
            model[True].get(key) == value for key, value in model[False].items() if key[1] != "all-gather")
        for ids, case in cases.items():
            if framework == "torch":
                traced = worlds(2).run(llama_scale.timed_step_task, case, "cpu", "float32", 0, 1)[0]["traffic"]
            else:
                traced = llama_scale_jax.JaxRig(case, "float32", "reference").traffic().rows()
            assert llama_scale.traffic_equal(model[ids], traced), (framework, ids)
            assert not llama_scale.traffic_equal(model[not ids], traced), (framework, ids)


def test_a_batch_of_packed_rows_without_segment_ids_is_refused_before_any_device_work():
    """Without ids a row of several documents would be attended as one: refused by name, in both
    frameworks' step builders (``ModelCase.check_batch``)."""
    from parity.training.llama import packed_corpus

    case = llama_scale.model_case(llama_scale.SMALL_RUN, "zigzag", 32, 1, 2)
    assert not case.segment_ids
    case.check_batch(llama_scale.rows_of_one_document(case))  # one document a row: accepted
    with pytest.raises(ValueError, match="row 0 holds several documents"):
        case.check_batch(packed_corpus(case.model, 1, 32, 1))


def test_the_knee_is_the_smallest_batch_within_ten_percent_of_the_best_time_per_row():
    assert llama_scale.knee([1, 2, 4, 8], [1.0, 1.0, 1.2, 2.3]) == 4  # per row 1, .5, .3, .2875
    assert llama_scale.knee([1, 2, 4], [1.0, 2.0, 4.0]) == 1  # compute-bound from the first row


def test_calibration_steps_are_never_rows_the_run_predicts():
    run = llama_scale.SMALL_RUN
    with pytest.raises(ValueError, match="exposure_seq"):
        llama_scale.calibration_seqs(llama_scale.replace(run, exposure_seq=run.seqs[0]))
    with pytest.raises(ValueError, match="host_seq"):
        llama_scale.calibration_seqs(llama_scale.replace(run, host_seq=run.bstar_seq))


def test_the_step_model_is_affine_in_the_batch_and_bstar_balances_it():
    """T_math = m + a·B and T_comm = c + y·B hold exactly for B = 1..4 of the GPU-sized model
    (FSDP bytes and Adam's traffic fixed, FLOPs, activations' traffic and K/V bytes per row); m
    is Adam over the device's half of the weights plus the embedding's gradient buffer (and the
    norms' weight-sized vectors); at B*
    compute equals communication, and beyond it compute exceeds it; "max" reads only the
    weights' c; the memory term lowers B* (m > 0 covers part of c)."""
    from parity.training import step_model as sm
    from parity.training.llama_gpu import GPU_MODEL

    run = llama_scale.ScaleRun(seqs=(8192,))
    m, a, c, y = llama_scale.affine_in_batch(run, "zigzag", 8192, 2, PROFILE, 5e11, batches=(1, 2, 3, 4))
    assert a > y > 0 and c > 0 and m > 0
    adam = 19 * 2 * sm.parameter_count(GPU_MODEL) / 2  # torch's foreach Adam, bf16, on the device's half
    embedding_grad = 2 * GPU_MODEL.vocab * GPU_MODEL.d_model  # written whole before its reduce-scatter
    # (+ 0.004 %: the norms' weight vectors and their gradients, RoPE's frequencies)
    assert m == pytest.approx((adam + embedding_grad) / PROFILE["hbm"], rel=1e-4)
    b = llama_scale.critical_batch(a, c, y, "sum", m)
    assert math.isclose(m + a * b, c + y * b, rel_tol=1e-12)
    assert b < llama_scale.critical_batch(a, c, y, "sum")
    assert llama_scale.critical_batch(a, c, y, "max", m) == pytest.approx((c - m) / a)
    assert llama_scale.critical_batch(a, c, y, "max") == pytest.approx(c / a)
    assert llama_scale.critical_batch(a, c, y, "sum", m=2 * c) == 0.0  # Adam alone outlasts the weights' traffic
    assert llama_scale.critical_batch(1.0, 1.0, 2.0, "sum") == math.inf  # attention traffic outgrows compute
    with pytest.raises(ValueError, match="overlap"):
        llama_scale.critical_batch(a, c, y, "both")
    with pytest.raises(ValueError, match="hbm"):
        llama_scale.affine_in_batch(run, "zigzag", 8192, 2, {k: v for k, v in PROFILE.items() if k != "hbm"}, 5e11)


def test_bad_strategy_is_refused_by_name():
    with pytest.raises(ValueError, match="strategy must be one of"):
        llama_scale.strategy_mesh("ring-of-rings", 2)


def test_fsdp_units_are_refused_for_the_jax_twin_by_name(tmp_path, capsys):
    """JAX has no FSDP2 units (XLA groups the gathers): the flag would be silently ignored."""
    with pytest.raises(SystemExit):
        llama_scale.main(["--framework", "jax", "--fsdp-units", "weight", "--devices", "cpu", "--small",
                          "--out", str(tmp_path)])
    assert "--framework jax has no units" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def test_xla_gemm_is_refused_for_torch_by_name(tmp_path, capsys):
    """--xla-gemm picks XLA's GEMM kernels: given with torch it would be silently ignored."""
    with pytest.raises(SystemExit):
        llama_scale.main(["--xla-gemm", "cublas", "--devices", "cpu", "--small", "--out", str(tmp_path)])
    assert "--xla-gemm is XLA's" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work
    assert llama_scale.XLA_GEMM["cublas"] == "--xla_gpu_enable_triton_gemm=false"


def test_usp_is_ulysses_two_times_a_ring_and_refused_on_worlds_that_cannot_hold_it():
    assert llama_scale.strategy_mesh("usp", 4) == llama_scale.MeshShape(ring=2, ulysses=2)
    assert llama_scale.strategy_mesh("usp", 8) == llama_scale.MeshShape(ring=4, ulysses=2)
    for world in (2, 5):
        with pytest.raises(ValueError, match="usp needs a multiple of 2 devices, at least 4"):
            llama_scale.strategy_mesh("usp", world)
    with pytest.raises(ValueError, match="usp needs"):  # before any rank starts
        llama_scale.measure(dataclasses.replace(llama_scale.SMALL_RUN, strategies=("zigzag", "usp")), "cpu", world=2)


@pytest.mark.skipif(not FULL, reason="a world of four for one more row (11 s): --full")
@pytest.mark.slow
def test_a_usp_row_moves_the_bytes_the_model_counts(worlds):
    """USP's row on four gloo ranks (Ulysses 2 × ring 2 under FSDP over all four): its traffic —
    the all-to-alls, the ring's hops, FSDP's gathers — equals the step's trace. The default tier
    keeps USP's whole-step traffic against the trace in test_llama.py (its data × ring × Ulysses
    case, FSDP on); this is the command's own row on it."""
    worlds(4)
    run = dataclasses.replace(llama_scale.SMALL_RUN, strategies=("usp",), batches=(1,))
    result = llama_scale.measure(run, "cpu", world=4)
    (row,) = result["rows"]
    assert row["strategy"] == "usp" and row["devices"] == 4 and row["traffic_equal"], row


def test_the_jax_twin_times_the_same_rows_with_the_models_bytes_equal_to_the_compiled_program(jax_devices):
    """``--framework jax`` (``llama_scale_jax``): the same row schema through ``llama_jax.Step`` on
    the simulated devices — every row's bytes equal the compiled HLO's collectives (the equality
    itself fails on a wrong wire dtype: the torch test above), each strategy's calibration steps
    once, the sweep's rows,
    the calibrated profile first. On XLA:CPU nothing is profiled: every fraction is 1 and the
    prediction is the serial bound or the host's floor."""
    from parity.capacity import llama_scale_jax

    # one row and a one-row sweep: the test's cost is JAX's compiles (≈ 2.5 s a step program); the
    # check at the rows' T, so its loss-and-grads program is the one the rows' traffic compiles
    run = dataclasses.replace(llama_scale.SMALL_RUN, strategies=("zigzag",), seqs=(32,), batches=(1,), verify_seq=32)
    emitted = []
    result = llama_scale_jax.measure_jax(run, "cpu", world=2, emit=emitted.append)
    assert "hardware" in emitted[0] and set(emitted[0]["hardware"]["bandwidth"]) == set(PROFILE["bandwidth"])
    for key in ("exposure", "host_floor", "verify"):  # each calibration step and the check, once
        assert [r[key] for r in emitted if key in r] == ["zigzag"], key
    assert result["verified"]["zigzag"]["passed"], result["verified"]
    rows = result["rows"] + result["bstar"]["sweep"]
    assert [(r["seq"], r["batch"]) for r in rows] == [(run.seqs[0], 1)] + [(run.bstar_seq, b) for b in run.batches]
    for r in rows:
        assert "error" not in r, r
        assert r["framework"] == "jax" and r["devices"] == 2 and r["traffic_equal"] and r["verified"], r
        assert r["traffic_unquantized_differences"] == {}, r  # compiled without XLA's collective-quantizer too
        assert set(r["exposed_fraction"].values()) == {1.0}
        # a compiled step's fixed cost adds: the floor step less its own T_math, plus the row's T_math
        floor_case = llama_scale.model_case(run, "zigzag", run.host_seq, 1, 2)
        floor_math = llama_scale.predict(floor_case, run.dtype, result["profile"],
                                         result["attention_kernel"][f"{run.host_seq}x1"]["tflops"] * 1e12,
                                         framework="jax")["t_math_s"]
        assert r["fixed_s"] == pytest.approx(result["host_floor_s"]["zigzag"] - floor_math, rel=1e-9)
        assert r["predicted_s"] == pytest.approx(r["fixed_s"] + r["t_math_s"], rel=1e-12)
        assert r["predicted_exposure_s"] == pytest.approx(r["bound_serial_s"], rel=1e-12)  # every fraction 1
    assert result["bstar"]["predicted_bstar"] == max(result["bstar"]["rows_exposed"], result["bstar"]["rows_host"])
    case = llama_scale.model_case(run, "zigzag", run.seqs[0], 1, 2)  # the bytes it compared are not nothing
    assert rows[0]["comm_bytes_per_device"] == sum(float(b) for _, b in llama_step_traffic(case, "jax", run.dtype)
                                                   .rows().values()) > 0
    assert "jax " in llama_scale.markdown(result) and "2x cpu" in llama_scale.markdown(result)
    # a result written before the rows carried the fixed cost (docs/gpu/ keeps such files) still renders
    older = json.loads(json.dumps(result))
    for r in older["rows"] + older["bstar"]["sweep"]:
        del r["fixed_s"], r["predicted_exposure_s"]
    assert "| measured / (T_math + exposed) |" in llama_scale.markdown(older)


def test_the_gpu_rows_whole_step_count_equals_the_model_per_kind_and_still_fails_wrong_bytes(jax_devices):
    """On GPUs the twin reads a row's bytes from the timed step's program alone (``traffic_scope``
    "whole step": the per-pass split's two extra compiles cost minutes there). That count must
    equal the model per kind, and still fail a model of other bytes (bf16 against a float32 step) —
    else the GPU rows' ``traffic_equal`` could not fail. It cannot see bytes put in the wrong pass:
    the per-pass check, on the CPU, does."""
    from parity.capacity import llama_scale_jax

    case = llama_scale.model_case(llama_scale.SMALL_RUN, "zigzag", 32, 1, 2)
    rig = llama_scale_jax.JaxRig(case, "float32", "reference")
    whole, split = rig.traffic("whole step").rows(), rig.traffic("per pass").rows()
    assert {p for p, _ in whole} == {"step"} and len(whole) >= 3  # gathers, reduce-scatters, the ring's hops
    model = llama_step_traffic(case, "jax", "float32").rows()
    assert llama_scale.traffic_equal(model, whole, "whole step") and llama_scale.traffic_equal(model, split)
    assert not llama_scale.traffic_equal(llama_step_traffic(case, "jax", "bfloat16").rows(), whole, "whole step")
    # what a row records where they differ: each kind's (calls, bytes) on both sides
    wrong = llama_scale.traffic_differences(llama_step_traffic(case, "jax", "bfloat16").rows(), whole, "whole step")
    assert wrong and all(key.startswith("step/") and d["model"] != d["traced"] for key, d in wrong.items()), wrong
    assert all(d["traced"] == [whole[tuple(key.split("/"))][0], whole[tuple(key.split("/"))][1]]
               for key, d in wrong.items())
    assert llama_scale.traffic_differences(model, whole, "whole step") == {}
    assert not llama_scale.traffic_equal(model, whole)  # a whole-step count is no per-pass count
    with pytest.raises(ValueError, match="scope"):
        llama_scale.traffic_equal(model, whole, "per kind")


@pytest.mark.parametrize("strategy", ["zigzag", "ulysses"])
def test_the_twins_step_as_lowered_equals_the_model_in_bf16(strategy, jax_devices):
    """The bf16 step as JAX lowers it (before XLA's passes: ``JaxRig.traffic("lowered")``) moves
    exactly the model's bf16 calls and bytes per kind — K / V and the all-to-alls in bf16, the ring's
    dK / dV trail in float32. The compiled CPU program cannot say this (XLA:CPU widens bf16
    collectives to float32), and on two H200s the compiled GPU program sent fewer p2p bytes than the
    model (docs/gpu/llamajax-2026-11-29-h200x2.md): this tells the program's own bytes from what XLA
    does to them. A float32 model fails it."""
    from parity.capacity import llama_scale_jax

    case = llama_scale.model_case(llama_scale.SMALL_RUN, strategy, 32, 1, 2)
    lowered = llama_scale_jax.JaxRig(case, "bfloat16", "reference").traffic("lowered").rows()
    assert any(kind in ("p2p", "all-to-all") for _, kind in lowered), lowered  # the attention's own, counted
    assert llama_scale.traffic_equal(llama_step_traffic(case, "jax", "bfloat16").rows(), lowered, "whole step")
    assert not llama_scale.traffic_equal(llama_step_traffic(case, "jax", "float32").rows(), lowered, "whole step")


def test_a_row_passes_on_its_trace_or_on_the_step_without_the_quantizer():
    """The command's exit code: a row moved the model's bytes when its trace equals the model, or —
    JAX on GPUs, whose compiled ring hops XLA's collective-quantizer narrows exactly — when the
    same step compiled without that pass does; a row whose unquantized count differs too, or that
    has none (torch), fails on its trace alone."""
    differs = {"step/p2p": {"model": [24, 8.0], "traced": [24, 6.0]}}
    assert llama_scale.bytes_as_modelled({"traffic_equal": True, "traffic_unquantized_differences": None})
    assert llama_scale.bytes_as_modelled({"traffic_equal": False, "traffic_unquantized_differences": {}})
    assert not llama_scale.bytes_as_modelled({"traffic_equal": False, "traffic_unquantized_differences": differs})
    assert not llama_scale.bytes_as_modelled({"traffic_equal": False, "traffic_unquantized_differences": None})


def test_the_twins_step_without_the_quantizer(jax_devices):
    """``JaxRig.traffic("unquantized")`` compiles the step again with XLA's collective-quantizer
    disabled (the pass that, on GPUs, sends an exactly widened or narrowed ring hop in bf16) — the
    count each GPU row holds beside its compiled one (XLA:CPU has no such pass: the twin's CPU
    command test finds it equal to the model in every row). The options keep the passes ``Step``
    disables on the CPU, and an unknown scope is refused before anything compiles."""
    from parity.capacity import llama_scale_jax
    from parity.training.jax_step import COMPILER_OPTIONS, GPU_COMPILER_OPTIONS

    case = llama_scale.model_case(llama_scale.SMALL_RUN, "zigzag", 32, 1, 2)
    rig = llama_scale_jax.JaxRig(case, "float32", "reference")
    assert rig.options == COMPILER_OPTIONS  # the CPU's: the options the rig's programs were compiled with
    options = llama_scale_jax.without_quantizer(rig.options)
    assert options["xla_disable_hlo_passes"].split(",") == ["cse_barrier_expander", llama_scale_jax.QUANTIZER]
    gpu = llama_scale_jax.without_quantizer(GPU_COMPILER_OPTIONS)
    assert gpu["xla_disable_hlo_passes"] == llama_scale_jax.QUANTIZER
    assert gpu["xla_gpu_all_reduce_combine_threshold_bytes"] == 0  # the GPU step's own option kept
    with pytest.raises(ValueError, match="scope"):
        rig.traffic("as compiled")


def test_the_twins_abstract_step_lowers_the_same_program(jax_devices):
    """``JaxRig(..., abstract=True)`` (shapes and shardings only: what compiles a step for a mocked GPU
    topology, where the other devices cannot hold an array) lowers exactly the program text of the
    rig built on real arrays — so what XLA compiles from it, and a byte count read from that, is
    the timed step's. It holds no values: running it is refused by JAX, not faked."""
    from parity.capacity import llama_scale_jax

    case = llama_scale.model_case(llama_scale.SMALL_RUN, "zigzag", 32, 1, 2)
    real = llama_scale_jax.JaxRig(case, "bfloat16", "reference")
    shapes = llama_scale_jax.JaxRig(case, "bfloat16", "reference", abstract=True)
    assert shapes.lowered.as_text() == real.lowered.as_text()
    with pytest.raises((TypeError, ValueError)):
        shapes.run()


def test_the_check_before_timing_fails_a_wrong_gradient():
    """``verdict`` (each strategy's step at ``verify_seq`` against the float64 non-parallel step,
    before its rows are timed) passes the truth itself and fails a 1 % error in one gradient."""
    import torch

    from parity.training.llama_gpu import loss_and_grads, rounded

    run = llama_scale.SMALL_RUN
    case = llama_scale.model_case(run, "zigzag", run.verify_seq, 1, 2)
    loss, grads = loss_and_grads(case, rounded(case.inputs()[0], run.dtype), torch.float64, packed=False,
                                 device="cpu", batch=llama_scale.rows_of_one_document(case))
    assert llama_scale.verdict(case, run.dtype, loss, grads)["passed"]
    name = next(iter(grads))
    wrong = llama_scale.verdict(case, run.dtype, loss, {**grads, name: grads[name] * 1.01})
    assert not wrong["passed"] and wrong["worst"] == name, wrong
