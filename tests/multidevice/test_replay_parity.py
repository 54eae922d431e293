"""The one-device replay of a strategy (``jax_impl.replay`` / ``torch_impl.replay``) through the
parity pipeline, on the CPU with the portable kernel: cases replayed through ``check_case`` pass
the oracle, agree with the real mesh run, and ``check_case`` turns to the replay by itself when a
case needs more devices than the runner has (what ``python -m parity --devices gpu`` does on one
GPU). The GPU-sized backend sweep runs here at tiny sizes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")

from helpers import assert_passed, jax_runner, torch_runner
from parity.core.cases import Case
from parity.core.inputs import make_inputs, oracle
from parity.runners.jax_runner import JaxRunner
from parity.runners.pipeline import check_case, cross_check

CASES = [
    Case(ring=2, ulysses=2, layout="stripe", causal=True, dtype="bfloat16"),
    Case(ring=4, ring_outer=2, layout="contiguous", causal=False, kv_heads=1),
    Case(ring=4, layout="zigzag", causal=False, kv_heads=2, kv_exchange="allgather", dtype="bfloat16"),
    # packed documents: the replay runners pass the global layout-order ids, the mesh runs their shards
    Case(ring=2, ulysses=2, layout="stripe", causal=True, kv_heads=2, batch=2, documents="mix"),
    # windows and sinks: the replays pass window= and the float32 sinks; their grads end with dsinks, summed over
    # the virtual devices (the mesh: JAX's cotangent, torch's ranks' sinks.grad summed by the runner)
    Case(ring=4, ring_outer=2, layout="contiguous", causal=True, kv_heads=2, window=(20, 9), sinks=True),
    # logit soft-capping: the replays pass softcap= (their configs' kernels cap every block)
    Case(ring=2, layout="zigzag", causal=True, kv_heads=2, softcap=1.5),
    # explicit token indices: the per-document zigzag (per-row layout); the replays pass the global token_index
    Case(ring=2, layout="contiguous", causal=True, kv_heads=2, batch=2, documents="mix", token_index=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_replay_passes_and_matches_the_mesh(case, seed, jax_devices, worlds):
    """Each framework's replay passes the oracle and equals its own mesh run (same kernels, same
    summation order: float32 cases to rounding, bf16 within one bf16 ulp of the tensor's scale);
    JAX-vs-torch holds between the replays."""
    x = make_inputs(case, seed)
    ref = oracle(case, x)
    replays = {}
    for name, runner in (("jax", jax_runner()), ("torch", torch_runner())):
        mesh = check_case(case, runner, x=x, ref=ref)
        replay = check_case(case, runner.replay("cpu"), x=x, ref=ref)
        assert mesh.mode == "mesh" and replay.mode == "replay"
        assert_passed(mesh, case, f"{name} mesh", seed)
        assert_passed(replay, case, f"{name} replay", seed)
        for t, got in replay.results.items():
            scale = np.abs(mesh.results[t]).max()
            tol = 1e-5 * scale if case.dtype == "float32" else 2.0**-7 * scale
            np.testing.assert_allclose(got, mesh.results[t], atol=tol, rtol=0, err_msg=f"{name} {t}")
        replays[name] = replay
    assert_passed(cross_check(case, replays["jax"], replays["torch"]), case, "jax-vs-torch replay", seed)


class _OneDevice(JaxRunner):
    """A JAX runner that reports one device, as on a one-GPU machine."""

    def device_count(self, devices="cpu") -> int:
        return 1


def test_check_case_replays_when_the_mesh_needs_more_devices(seed, jax_devices):
    case = Case(ring=2, ulysses=2, layout="zigzag", causal=True, kv_heads=2)
    side = check_case(case, _OneDevice(), seed=seed)
    assert side.mode == "replay"
    assert_passed(side, case, "jax replay on one device", seed)


def test_a_wrong_kernel_fails_the_replay(seed, jax_devices):
    """The replay really runs the kernels: a forward whose full-mask blocks are wrong fails it."""
    import jax_impl.block
    from seqplan.schedule import MaskKind

    good = jax_impl.block.get_backend("reference")

    def fwd(q, k, v, mask, scale):
        o, lse = good.fwd(q, k, v, mask, scale)
        return (o * 1.01, lse) if mask.kind is MaskKind.FULL else (o, lse)

    jax_impl.block.register_backend(jax_impl.block.BlockBackend("planted", fwd, good.bwd))
    case = Case(ring=2, layout="zigzag", causal=True)
    side = check_case(case, JaxRunner("planted").replay("cpu"), seed=seed)
    assert side.status == "failed" and "o:" in side.detail, side.detail


def test_backend_sweep_at_tiny_sizes(seed, jax_devices, tmp_path):
    """The sweep's pipeline (inputs, truth, per-framework control, replay, JAX-vs-torch, report)
    at 64 tokens with the portable kernel and ``auto``."""
    from parity.probes.backend_sweep import run_sweep, sweep_cases, sweep_markdown

    cases = sweep_cases(seq=64, heads=4, kv_heads=2, head_dim=16, dtypes=("bfloat16",))
    rows, crosses = run_sweep(cases, {"jax": ("reference", "auto"), "torch": ("reference", "auto")}, "cpu", seed,
                              replay=True, log=lambda *_: None)
    assert len(rows) == 3 * 4 and len(crosses) == 3 * 2
    bad = [(r.case.name, r.framework, r.backend, r.side.detail) for r in rows if r.side.status != "passed"]
    assert not bad, bad
    assert all(s.status == "passed" for *_, s in crosses), [s.detail for *_, s in crosses]
    assert {r.side.mode for r in rows} == {"replay"}
    assert {m for r in rows for m in r.resolved} == {"full", "causal", "strict"}
    assert all(0 < r.worst()[1] < float("inf") for r in rows)
    text = sweep_markdown(rows, crosses)
    assert text.count("| replay | passed |") == len(rows)
