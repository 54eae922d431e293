"""Communication accounting: the analytical model (parity.accounting.model) equals, byte for
byte and call for call, what XLA's compiled HLO moves (parity.accounting.hlo) and what torch_impl
issues through torch.distributed (parity.accounting.torch_trace), per device and per pass.

One measured exception, pinned by its own test: XLA:CPU widens bfloat16 collectives to float32
(its CPU collectives have no bf16 path), so on CPU a bf16 JAX program moves float32-sized
buffers; torch's gloo moves bf16. The equality tests therefore compare JAX in float32 and torch
in both dtypes. With attention sinks the model is per framework (JAX all-reduces their cotangent,
torch moves nothing for them)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from dataclasses import replace

from helpers import FULL
from parity.accounting.model import attention_traffic
from parity.checks.traffic import ATTENTION_CONFIGS, one_per_path
from parity.core.cases import Case
from parity.runners import jax_runner, torch_runner


def _masked(case) -> bool:
    return case.documents != "none" or case.window is not None or case.sinks or case.token_index


# Shared with `python -m parity accounting`: by default the first configuration of each model path
# (`one_per_path`: 13 of the 25 plain ones, every branch of the model — what `python -m parity` closes
# with) and the ring of 8 (contiguous, non-causal: the largest ring), the rest with --full; of the
# packed-document, window, sink and token-index ones likewise the first of each path (token indices
# alone on a ring and with ids under USP by default, the double ring with --full). Until 2026-11-28
# every plain configuration ran by default but the causal zigzag ring of 8 (36.6 s); the tier took
# 208 s of the suite's 1,846 worker-seconds then, the most of any file.
RING8 = "ring-r8-contiguous-full-h8kv1-d16-b1-t64-float32"
PLAIN = [c for c in ATTENTION_CONFIGS if not _masked(c)]
assert any(c.name == RING8 for c in PLAIN), RING8
CONFIGS = (PLAIN if FULL else one_per_path(PLAIN, [])[0] + [c for c in PLAIN if c.name == RING8]) + (
    [c for c in ATTENTION_CONFIGS if _masked(c)] if FULL
    else one_per_path([c for c in ATTENTION_CONFIGS if _masked(c)], [])[0])


# The loss without lse (o only): by default on the first plain configuration of every model path
# and on every masked one above, all of them with --full. Whether lse is returned changes only the
# Ulysses all-to-alls in the model (its one use of return_lse), and each path — the ring, Ulysses
# with and without replicated KV heads, USP, a data axis, all-gather KV, the double rings — keeps
# its o-only case; the other plain configurations of a path run with lse (≈ 11 s of compiling).
O_ONLY = {c.name for c in (CONFIGS if FULL else [*one_per_path([c for c in CONFIGS if not _masked(c)], [])[0],
                                                  *(c for c in CONFIGS if _masked(c))])}
PARAMS = [pytest.param(c, lse, id=f"{c.name}-{'with-lse' if lse else 'o-only'}")
          for c in CONFIGS for lse in (True, False) if lse or c.name in O_ONLY]


@pytest.mark.parametrize("case,return_lse", PARAMS)
def test_model_equals_xla_hlo_and_torch_trace(case, return_lse, jax_devices, worlds):
    """Three-way equality, bytes and calls, forward and backward (float32)."""
    jax_model, torch_model = (attention_traffic(case, return_lse=return_lse, framework=f) for f in ("jax", "torch"))
    jax_measured = jax_runner.measure_attention_traffic(case, return_lse=return_lse)
    torch_measured = torch_runner.measure_attention_traffic(case, return_lse=return_lse)
    assert jax_model == jax_measured, "\n" + jax_model.diff(jax_measured, ("model", "jax HLO"))
    assert torch_model == torch_measured, "\n" + torch_model.diff(torch_measured, ("model", "torch trace"))
    assert (jax_model == torch_model) == (not case.sinks or case.data * case.ring * case.ulysses == 1)
    if case.window is not None and case.window[0] == 0 and case.layout == "contiguous" and case.ulysses == 1:
        assert jax_model.bytes() == 0  # a ring truncated to reach 0: each device needs only its own shard
    elif case.devices > 1 and case.ring * case.ulysses > 1:
        assert jax_model.bytes("fwd") > 0 and jax_model.bytes("bwd") > 0


@pytest.mark.parametrize("case", [Case(ring=4, dtype="bfloat16", kv_heads=2), Case(ring=2, ulysses=2, dtype="bfloat16"),
                                  Case(ring=2, ulysses=4, dtype="bfloat16", kv_heads=2)],
                         ids=lambda c: c.name)
def test_bfloat16_torch_moves_bf16_and_xla_cpu_moves_float32(case, jax_devices, worlds):
    """torch moves bf16 buffers as modelled (and float32 dK/dV of replicated KV heads back through
    Ulysses' all-to-all); XLA:CPU widens them to float32 — the same traffic as the float32
    model, exactly (a CPU-backend fact, not the algorithm's)."""
    assert attention_traffic(case) == torch_runner.measure_attention_traffic(case)
    f32 = replace(case, dtype="float32")
    assert attention_traffic(f32) == jax_runner.measure_attention_traffic(case)


def test_a_model_without_the_token_index_gather_fails_the_three_way_check(monkeypatch, jax_devices, worlds):
    """Planted miscount: the model as it was before it counted the token indices (their int32
    all-gathers left out) against USP r2×u2 with ids and token indices — the harness's check
    (``parity.checks.traffic.check_attention``) reports both frameworks off by exactly those
    gathers: the forward all-gathers, 2 calls and 384 B short of the 4 calls / 768 B measured."""
    from parity.checks import traffic

    case = next(c for c in ATTENTION_CONFIGS if c.token_index and c.ulysses > 1 and c.documents != "none")
    counted = traffic.attention_traffic

    def without_the_gather(config, **kwargs):
        return counted(replace(config, token_index=False), **kwargs)

    monkeypatch.setattr(traffic, "attention_traffic", without_the_gather)
    verdict = traffic.check_attention(case, ("jax", "torch"))
    assert verdict.problems() == [f"{framework}:\nfwd all-gather: model 2 calls / 384 B, {framework} 4 calls / 768 B"
                                  for framework in ("jax", "torch")]
