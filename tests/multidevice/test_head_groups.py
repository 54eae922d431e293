"""Ulysses in head groups (``head_groups``): the heads split into G consecutive groups whose
all-to-alls overlap each other's attention (torch: issued asynchronously, waited for where read,
forward and backward; JAX: separate all-to-alls for XLA's scheduler). Why these tests exist: the
split moves which rank computes which head and how each group's sinks and GQA K/V heads are
sliced, so a wrong slice or concatenation order gives a wrong answer that G = 1 never exercises.

Every case runs against the float64 dense truth (o, lse, dq, dk, dv, dsinks) and against the same
call with G = 1 (the same arithmetic head for head, so within float32 round-off); on gloo worlds
of 2, 4 and 8 ranks (torch) and on 8 simulated CPU devices (JAX). Bad values are refused on
every rank before any collective."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl
from seqplan.validation import check_head_groups
from test_torch_windows import (
    RTOL,
    T,
    assert_close_to,
    from_layout,
    make_inputs,
    ring_and_ulysses,
    stitch,
    to_layout,
    truth,
)
from torch_tasks import bad_input_task, documents_task, head_groups_order_task

# (id, mesh axes, kv_exchange, layout, causal, kv_heads, window, sinks?, ids?, head_groups). HEADS = 4:
# kv 4 splits without replication inside each group (the overlapped K/V path); kv 2 leaves each
# group of 2 one K/V head for U = 2, replicated (the synchronous K/V path).
CASES = [
    ("ulysses2-g2-kv4-causal-w5-sinks-ids", (("ulysses", 2),), "ring", "contiguous", True, 4, (5, 0), True, True, 2),
    ("ulysses2-g2-kv2-full", (("ulysses", 2),), "ring", "contiguous", False, 2, None, False, False, 2),
    ("usp2x2-g2-kv4-zigzag-causal-w7-sinks", (("ring", 2), ("ulysses", 2)), "ring", "zigzag", True, 4, 7, True,
     False, 2),
    ("usp2x2-g2-kv2-allgather-contiguous-causal-ids", (("ring", 2), ("ulysses", 2)), "allgather", "contiguous", True,
     2, None, False, True, 2),
    ("double2x2x2-usp-g2-kv4-zigzag-causal-w6-sinks", (("ring_outer", 2), ("ring_inner", 2), ("ulysses", 2)), "ring",
     "zigzag", True, 4, (6, 0), True, False, 2),
]


def _run(worlds, axes, exchange, layout, causal, window, x_layout, head_groups) -> list[dict]:
    devices = int(np.prod([n for _, n in axes]))
    kwargs = dict(causal=causal, layout=layout, kv_exchange=exchange, window=window, head_groups=head_groups)
    return worlds(devices).run(documents_task, axes, x_layout, kwargs, False)


@pytest.mark.parametrize("name,axes,exchange,layout,causal,kv_heads,window,sinks,ids,groups", CASES,
                         ids=[c[0] for c in CASES])
def test_torch_head_groups_match_the_truth_and_one_group(name, axes, exchange, layout, causal, kv_heads, window,
                                                         sinks, ids, groups, seed, worlds):
    x = make_inputs(seed, 2, kv_heads, sinks=sinks, ids=ids)
    ring, ulysses = ring_and_ulysses(axes)
    perm = torch_impl.layout_permutation(T, layout, ring, ulysses)
    got = {}
    for g in (groups, 1):
        shards = _run(worlds, axes, exchange, layout, causal, window, to_layout(x, perm), g)
        got[g] = from_layout(stitch(shards, 1), perm)
    assert_close_to(got[groups], truth(x, causal, window), f"{name} (seed {seed})")
    for key, want in got[1].items():  # the same heads on the same kernel: round-off apart at most
        torch.testing.assert_close(got[groups][key], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=f"{name}: {key} vs G=1")


def test_torch_head_groups_overlap_by_construction(seed, worlds):
    """The overlap is in the order of issue, which gloo can show (not its timing): with G = 2 on
    Ulysses 2 every group's q / k / v all-to-all is issued, asynchronously, before the first block
    kernel; group 0's o all-to-all before group 1 attends; and in the backward, the gradients of
    group 1's inputs are issued before group 0's attention backward runs. G = 1 stays synchronous."""
    x = make_inputs(seed, 1, 4, sinks=False, ids=False)
    events = {g: worlds(2).run(head_groups_order_task, (("ulysses", 2),), x, {"causal": True, "head_groups": g})
              for g in (2, 1)}
    for rank_events in events[2]:
        forward, backward = rank_events[:rank_events.index("backward")], rank_events[rank_events.index("backward"):]
        first_fwd = forward.index("fwd")
        assert forward[:first_fwd] == ["a2a"] * 6, forward  # q, k, v of both groups in flight
        second_fwd = forward.index("fwd", first_fwd + 1)
        assert "a2a" in forward[first_fwd:second_fwd], forward  # group 0's o leaves while group 1 attends
        bwd_calls = [i for i, e in enumerate(backward) if e == "bwd"]
        assert len(bwd_calls) == 2 and "a2a" in backward[bwd_calls[0]:bwd_calls[1]], backward
        assert "a2a-sync" not in rank_events, rank_events
    for rank_events in events[1]:
        assert "a2a" not in rank_events and "a2a-sync" in rank_events, rank_events


@pytest.mark.parametrize("axes,kv_heads,head_groups,needle", [
    ((("ulysses", 2),), 4, 3, "head_groups must divide heads and kv_heads"),
    ((("ulysses", 2),), 1, 2, "head_groups must divide heads and kv_heads"),
    ((("ring", 2),), 2, 2, "needs a 'ulysses' mesh axis"),
    ((("ulysses", 2),), 2, 0, "head_groups must be a positive int"),
    ((("ulysses", 4),), 4, 2, "Ulysses head split on its own"),
])
def test_torch_bad_head_groups_refused_before_any_collective(axes, kv_heads, head_groups, needle, worlds):
    devices = int(np.prod([n for _, n in axes]))
    results = worlds(devices).run(bad_input_task, (2, T, 4, 8), (2, T, kv_heads, 8), (2, T, kv_heads, 8),
                                  ("float32",) * 3, axes, {"head_groups": head_groups})
    for kind, message in results:
        assert kind == "ValueError" and needle in message, (kind, message)


def test_check_head_groups_rules():
    assert check_head_groups(1, 4, 1, 1) == 1 and check_head_groups(4, 32, 8, 2) == 4
    assert check_head_groups(2, 8, 2, 2) == 2  # one kv head a group, replicated for U = 2
    for bad in (True, 1.0, "2", -1):
        with pytest.raises(ValueError, match="positive int"):
            check_head_groups(bad, 4, 4, 2)


# ---- JAX --------------------------------------------------------------------------------------

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import jax_impl
from parity.core import reference

B, H, HK, D = 2, 8, 4, 16


@pytest.mark.parametrize("shape,names,kv_heads,groups,window", [
    ((2, 2), ("ring", "ulysses"), HK, 2, (6, 0)),
    ((4,), ("ulysses",), HK, 2, None),
    ((2, 2), ("ring", "ulysses"), 2, 2, None),  # one kv head a group: replicated for U = 2
])
def test_jax_head_groups_match_the_truth_and_one_group(shape, names, kv_heads, groups, window, seed, jax_devices):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, T, kv_heads, D)).astype(np.float32)
    sinks = (1.0 + rng.standard_normal(H)).astype(np.float32)
    ring = dict(zip(names, shape)).get("ring", 1)
    ulysses = dict(zip(names, shape))["ulysses"]
    perm = reference.layout_permutation(T, "zigzag", ring, ulysses)
    mesh = jax.make_mesh(shape, names, devices=jax_devices[:int(np.prod(shape))])
    want = torch_impl.dense_attention(*(torch.from_numpy(a).double() for a in (q, k, v)), causal=True, window=window,
                                      sinks=torch.from_numpy(sinks).double())[0].numpy()[:, perm]

    def loss_and_grads(g):
        def loss(q, k, v, s):
            o, lse = jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="zigzag", window=window,
                                                          sinks=s, return_lse=True, head_groups=g)
            return jnp.sum(o * o) + jnp.sum(jnp.sin(lse)), o
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            *(jnp.asarray(a) for a in (q[:, perm], k[:, perm], v[:, perm], sinks)))
        return np.asarray(o), [np.asarray(x) for x in grads]

    o_g, grads_g = loss_and_grads(groups)
    o_1, grads_1 = loss_and_grads(1)
    rel = np.linalg.norm(o_g - want) / np.linalg.norm(want)
    assert rel <= RTOL, f"o: relative L2 error {rel:.2e} against the float64 truth"
    # the same heads on the same kernel, but XLA may fuse and order a group's float32 sums differently:
    # round-off apart, measured against each tensor's scale (1.3e-6 on a dq element of scale 2 seen)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), (o_g, *grads_g), (o_1, *grads_1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=f"{name}: G={groups} vs G=1")


def test_jax_bad_head_groups_refused(jax_devices):
    mesh = jax.make_mesh((2, 2), ("ring", "ulysses"), devices=jax_devices[:4])
    q = jnp.zeros((B, T, H, D))
    kv = jnp.zeros((B, T, HK, D))
    with pytest.raises(ValueError, match="head_groups must divide"):
        jax_impl.sequence_parallel_attention(q, kv, kv, mesh, head_groups=3)
    ring_only = jax.make_mesh((4,), ("ring",), devices=jax_devices[:4])
    with pytest.raises(ValueError, match="needs a 'ulysses' mesh axis"):
        jax_impl.sequence_parallel_attention(q, kv, kv, ring_only, head_groups=2)


def test_environment_default_applies_to_ulysses_meshes_only(monkeypatch, jax_devices):
    """``RINGBRIDGE_HEAD_GROUPS`` is the default where there is a Ulysses axis (the driver times a
    whole run under one setting, its checks included) and is ignored by the rings: here 2 reaches
    an MQA call on a Ulysses mesh (one kv head cannot be split in two groups: refused) and not the
    same call on a ring."""
    from seqplan.config import HEAD_GROUPS_ENV, default_head_groups

    monkeypatch.setenv(HEAD_GROUPS_ENV, "2")
    assert default_head_groups(None, 2) == 2 and default_head_groups(None, 1) == 1 and default_head_groups(4, 2) == 4
    q, kv = jnp.zeros((B, T, H, D)), jnp.zeros((B, T, 1, D))
    usp = jax.make_mesh((2, 2), ("ring", "ulysses"), devices=jax_devices[:4])
    with pytest.raises(ValueError, match="head_groups must divide heads and kv_heads"):
        jax_impl.sequence_parallel_attention(q, kv, kv, usp)
    ring = jax.make_mesh((4,), ("ring",), devices=jax_devices[:4])
    assert jax_impl.sequence_parallel_attention(q, kv, kv, ring).shape == q.shape
    monkeypatch.setenv(HEAD_GROUPS_ENV, "two")
    with pytest.raises(ValueError, match="RINGBRIDGE_HEAD_GROUPS must be a positive int"):
        default_head_groups(None, 2)
