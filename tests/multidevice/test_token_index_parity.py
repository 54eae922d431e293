"""Token-index parity cases (``Case.token_index``: packed documents in the per-document zigzag,
passed as explicit token indices and segment ids) through the harness's one pipeline: JAX and
torch agree with the float64 oracle (in original order) and with each other, forward and
gradients; and a run given the wrong token indices fails — the cases can fail. The default
matrix tier (test_jax_parity.py, test_torch_parity.py) runs the two sampled token-index cases
per framework; the replays run one in test_replay_parity.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")

from helpers import assert_passed, jax_runner, torch_runner
from parity.core.cases import token_index_cases
from parity.core.inputs import make_inputs, oracle, permutation
from parity.runners.pipeline import check_case, run_case_everywhere


def test_jax_and_torch_agree_on_a_token_index_case(seed, jax_devices, worlds):
    """The first sampled case (a causal ring of 4, float32, long-tailed documents) through both
    frameworks on one set of inputs: each within 1e-5 of the oracle, and JAX vs torch."""
    case = token_index_cases()[0]
    result = run_case_everywhere(case, {"jax": jax_runner(), "torch": torch_runner()}, seed)
    for framework, side in result.sides.items():
        assert_passed(side, case, framework, seed)
    assert result.cross is not None
    assert_passed(result.cross, case, "jax-vs-torch", seed)
    assert set(result.cross.errors) == {"o", "lse", "dq", "dk", "dv"}


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_the_layouts_own_positions_as_token_indices_fail(framework, seed, jax_devices, worlds):
    """Planted: the same laid-out data given token indices 0..t-1 in every row (the positions a
    call without token indices would assume for the static "contiguous" name) — far from the
    oracle, so the harness reports the case failed."""
    case = token_index_cases()[0]
    x = make_inputs(case, seed)
    perm = permutation(case, x)
    wrong = replace(x, token_index=np.argsort(perm, axis=1).astype(np.int32))  # laid out: arange in every row
    side = check_case(case, {"jax": jax_runner(), "torch": torch_runner()}[framework], x=wrong, ref=oracle(case, x))
    assert side.status == "failed", side.detail
    assert side.errors["o"] > 1e-3 and side.errors["dq"] > 1e-3
