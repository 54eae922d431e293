"""One GPU: every strategy's per-device work replayed on the GPU (``parity.runners.replay_runner``
through ``check_case``: same inputs, oracle and policy as the mesh runs), in bf16 with the ``auto``
backend — the fused kernels the strategies resolve to — and the GPU-sized backend sweep's cases
(8192 tokens, 4096-token local blocks, bf16 and fp16, every mask kind) with every backend."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gpu_tasks import jax_on_gpu, needs_gpus
from helpers import assert_passed, jax_runner, torch_runner
from parity.core.cases import Case
from parity.core.inputs import make_inputs
from parity.runners.pipeline import check_case
from parity.runners.torch_truth import case_truth

pytestmark = [needs_gpus(1)]

STRATEGIES = [
    Case(ring=2, layout="zigzag"), Case(ring=4, layout="zigzag"), Case(ring=8, layout="zigzag"),
    Case(ring=4, layout="stripe"), Case(ring=4, layout="contiguous"), Case(ring=4, kv_exchange="allgather"),
    Case(ring=4, ring_outer=2), Case(ulysses=4), Case(ring=2, ulysses=2), Case(ring=4, ring_outer=2, ulysses=2),
]


def _gpu_case(c: Case, dtype: str) -> Case:
    return Case(ring=c.ring, ulysses=c.ulysses, ring_outer=c.ring_outer, kv_exchange=c.kv_exchange, layout=c.layout,
                causal=True, seq=4096, heads=8, kv_heads=2, head_dim=128, dtype=dtype)


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda c: f"{c.mesh.name}-{c.layout}")
def test_strategy_replayed_on_one_gpu(strategy, framework, seed):
    if framework == "jax" and not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    case = _gpu_case(strategy, "bfloat16")
    runner = jax_runner() if framework == "jax" else torch_runner()
    x = make_inputs(case, seed)
    ref = case_truth(case, x, "cuda")  # the float64 oracle, on the GPU (the NumPy one takes ~10 s here)
    side = check_case(case, runner.replay("gpu"), x=x, ref=ref, devices="gpu")
    assert side.mode == "replay"
    assert_passed(side, case, f"{framework} replay", seed)


def test_backend_sweep_on_one_gpu(seed):
    """Every backend × mask kind × dtype at 4096-token blocks, replayed; JAX vs torch."""
    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    from parity.probes.backend_sweep import SWEEP_BACKENDS, run_sweep, sweep_cases, sweep_markdown

    rows, crosses = run_sweep(sweep_cases(), SWEEP_BACKENDS, "gpu", seed, replay=True)
    print(sweep_markdown(rows, crosses))
    failed = [(r.case.name, r.framework, r.backend, r.side.detail[:300]) for r in rows if r.side.status == "failed"]
    assert not failed, failed
    skipped = [(r.framework, r.backend, r.side.detail) for r in rows if r.side.status == "skipped"]
    assert all(b == "fa3" and ("flash_attn3_jax" in why or "not available" in why) for _, b, why in skipped), skipped
    assert all(s.status == "passed" for *_, s in crosses), [(c.name, b, s.detail) for c, b, s in crosses]
