"""GPU: torch_impl over NCCL on 2 and 4 GPUs at 16k tokens, bf16, causal, against a float32
single-GPU reference, with the bf16 single-GPU SDPA as the low-precision control (the contract's (docs/contract.md)
policy: max error ≤ 2 × the control's + a quarter-ulp floor). Each mesh runs on as many GPUs as it
has devices (a world of that size) and is skipped with "needs N GPUs" on fewer; the same strategies'
per-device work on one GPU is tests/gpu/test_one_gpu_replay.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_tasks import bf16_case_task, needs_gpus

SEQ, HEADS, KV_HEADS, HEAD_DIM = 16384, 8, 2, 128
MESHES = {
    "ring2-zigzag": ((("ring", 2),), "zigzag"),
    "ring2-stripe": ((("ring", 2),), "stripe"),
    "ring2-contiguous": ((("ring", 2),), "contiguous"),
    "ulysses2": ((("ulysses", 2),), "zigzag"),
    "ring4-zigzag": ((("ring", 4),), "zigzag"),
    "ring4-stripe": ((("ring", 4),), "stripe"),
    "ring4-contiguous": ((("ring", 4),), "contiguous"),
    "ulysses4": ((("ulysses", 4),), "zigzag"),
    "usp-r2xu2": ((("ring", 2), ("ulysses", 2)), "zigzag"),
    "double-ring-2x2": ((("ring_outer", 2), ("ring_inner", 2)), "zigzag"),
}


def _devices(name: str) -> int:
    size = 1
    for _, n in MESHES[name][0]:
        size *= n
    return size


@pytest.fixture(scope="module")
def nccl_world():
    """A getter, not a world: a failed case closes its world, and the next case gets a new one
    (``get_world`` keeps one world per size)."""
    from parity.runners.torch_world import close_worlds, get_world

    yield lambda size: get_world(size, "nccl")
    close_worlds()


@pytest.mark.parametrize("backend", ["aten_flash", "aten_cudnn", "reference"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_gpus(_devices(n))) for n in MESHES])
def test_bf16_causal_16k_matches_fp32_reference(name, backend, nccl_world, seed):
    axes, layout = MESHES[name]
    results = nccl_world(_devices(name)).run(bf16_case_task, SEQ, HEADS, KV_HEADS, HEAD_DIM, axes, layout, backend, seed)
    lines = [f"rank {r} {t}: err {e:.3e} tol {tol:.3e}" for r, res in enumerate(results) for t, (e, tol) in res.items()]
    print(f"\n{name} {backend}:\n" + "\n".join(lines))
    assert all(e <= tol for res in results for e, tol in res.values()), "\n".join(lines)
