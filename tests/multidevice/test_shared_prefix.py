"""Tier 2 — all-gather KV's shared prefix (``shared_tokens``, seqplan.shared) through both public
APIs on 4 devices (torch: gloo ranks; JAX: simulated devices): packed documents on the
per-document hybrid, where only each shard's leading shared tokens travel, against the float64
oracle in original order — forward and gradients, at the smallest value the ids allow, a larger
one, the whole shard and none shared (0 on ids whose documents all stay home); a value the ids
break refused on every rank; and the one-call kernel path (the varlen ops emulated in 16-bit)
equal to the truth. Why: the split computes each query's keys in one of two parts with no merge,
and gathers and reduce-scatters only the prefixes — an off-by-one there is a wrong gradient, not
a crash. JAX also: USP 2×2 (the ring shard after the all-to-all), and under ``jax.jit`` with the
ids as program arguments a broken promise turns the outputs NaN (the ids are tracers: no
ValueError is possible there)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import hybrid_layout, pad_documents
from seqplan.shared import ring_shards, shared_extent
from torch_tasks import documents_task

RING = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
NAMES = ("o", "lse", "dq", "dk", "dv")
# Two rows of 128 tokens: one document long enough to be split over the ring (40 and 32 tokens)
# among short ones kept whole.
LENGTHS = ([5, 4, 2, 5, 2, 4, 4, 2, 1, 6, 6, 4, 4, 1, 4, 6, 6, 40, 5, 4, 2, 1, 1, 4, 5],
           [1, 2, 5, 1, 5, 5, 4, 2, 4, 6, 4, 3, 3, 3, 6, 4, 32, 3, 5, 6, 5, 2, 3, 3, 6, 5])
DOCUMENTS = np.stack([np.repeat(np.arange(len(n)) + 100 * i, n) for i, n in enumerate(LENGTHS)])


def _problem(seed: int, ids=DOCUMENTS, split_at: int = 20):
    padded, _ = pad_documents(ids, RING)
    layout = hybrid_layout(padded, RING, split_at=split_at)
    rng = np.random.default_rng(seed)
    b, seq = padded.shape
    x = {n: rng.standard_normal((b, seq, h, DIM)) for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS),
                                                                 ("do", HEADS))}
    x["dlse"] = rng.standard_normal((b, HEADS, seq))
    return padded, layout, x


def _laid(x, perm, seq_axis=1):
    index = np.expand_dims(perm, tuple(range(2, x.ndim))) if seq_axis == 1 else perm[:, None, :]
    return np.take_along_axis(x, index, seq_axis)


def _laid_inputs(x, ids, layout) -> dict:
    """The problem's float32 tensors, ids and token indices in the layout's order (torch)."""
    torch = pytest.importorskip("torch")
    laid = {n: torch.from_numpy(_laid(a, layout.perm, 2 if n == "dlse" else 1).astype(np.float32))
            for n, a in x.items()}
    laid["segment_ids"] = torch.from_numpy(_laid(ids, layout.perm).astype(np.int32))
    laid["token_index"] = torch.from_numpy(np.ascontiguousarray(layout.token_index))
    return laid


def _run(worlds, x, ids, layout, **kwargs):
    torch = pytest.importorskip("torch")
    laid = _laid_inputs(x, ids, layout)
    shards = worlds(RING).run(documents_task, (("ring", RING),), laid,
                              dict(causal=True, layout="contiguous", kv_exchange="allgather") | kwargs)
    if any("error" in s for s in shards if isinstance(s, dict)):
        return shards
    inverse = np.argsort(layout.perm, axis=1)
    out = {}
    for name in NAMES:
        seq_axis = 2 if name == "lse" else 1
        whole = torch.cat([s[name] for s in sorted(shards, key=lambda s: s["block"])], dim=seq_axis)
        out[name] = _laid(whole.double().numpy(), inverse, seq_axis)
    return out


def _truth(x, ids):
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, segment_ids=ids)
    return dict(zip(NAMES, (fwd.o, fwd.lse, *attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], x["dlse"]))))


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_torch_shared_prefix_matches_float64_truth(worlds):
    ids, layout, x = _problem(seed=0)
    laid_ids = _laid(ids, layout.perm)
    extent = shared_extent(ring_shards(laid_ids, RING))
    t = ids.shape[1] // RING
    assert 0 < extent < t, "the case must have shared and whole documents"
    truth = _truth(x, ids)
    for shared_tokens in (extent, extent + 3, t):
        got = _run(worlds, x, ids, layout, shared_tokens=shared_tokens)
        for name in NAMES:
            assert _rel(got[name], truth[name]) < 1e-5, (shared_tokens, name, _rel(got[name], truth[name]))


def test_torch_nothing_shared_gathers_nothing(worlds):
    """Documents short enough to stay whole: ``shared_tokens=0``, no part gathered, still exact."""
    ids = np.repeat(np.arange(16), 4)[None]  # 16 documents of 4 tokens, 16 a shard
    ids, layout, x = _problem(seed=1, ids=ids, split_at=64)
    assert shared_extent(ring_shards(_laid(ids, layout.perm), RING)) == 0
    got, truth = _run(worlds, x, ids, layout, shared_tokens=0), _truth(x, ids)
    for name in NAMES:
        assert _rel(got[name], truth[name]) < 1e-5, (name, _rel(got[name], truth[name]))


def test_torch_the_prefixes_travel_while_the_host_plans(worlds):
    """The prefixes' all-gather needs only ``shared_tokens`` (static): it is issued before the
    call's plan is made, so on a GPU it runs while the host plans (the 4x H200 profile's short mix
    left the GPU idle 1.8–2.2 ms before it). Every rank: the K and V prefixes' gathers, then the plan."""
    from torch_tasks import shared_prefix_order_task

    ids, layout, x = _problem(seed=0)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    laid = _laid_inputs(x, ids, layout)
    kwargs = dict(causal=True, layout="contiguous", kv_exchange="allgather", shared_tokens=extent)
    for events in worlds(RING).run(shared_prefix_order_task, (("ring", RING),), laid, kwargs):
        prefixes = [i for i, e in enumerate(events) if e[0] == "gather" and e[1][1] == extent]
        plans = [i for i, e in enumerate(events) if e[0] == "plan"]
        assert len(prefixes) == 2 and len(plans) == 1 and max(prefixes) < plans[0], events


def test_torch_a_broken_promise_is_refused_on_every_rank(worlds):
    ids, layout, x = _problem(seed=2)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    with pytest.raises(Exception, match=f"these ids need shared_tokens >= {extent}"):
        _run(worlds, x, ids, layout, shared_tokens=extent - 1)


def test_torch_the_one_call_kernel_path_equals_the_portable_one(worlds):
    """bfloat16 on ``aten_varlen`` with FA2's varlen ops emulated: each part one varlen call, forward
    and backward (4 ranks x 2 parts each way), equal to the float64 truth at bfloat16's level."""
    torch = pytest.importorskip("torch")
    ids, layout, x = _problem(seed=3)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    laid = _laid_inputs(x, ids, layout)
    shards = worlds(RING).run(documents_task, (("ring", RING),), laid,
                              dict(causal=True, layout="contiguous", kv_exchange="allgather", shared_tokens=extent),
                              False, True)  # count=False, emulate_varlen=True
    t = ids.shape[1] // RING
    for s in shards:  # each part one call (query rows: b·P, then b·(t - P)); a one-row forward probes the rng state
        parts = [c for c in s["calls"] if c[1] > 1]
        want = [(op, rows) for op in ("flash_forward", "flash_backward") for rows in (2 * (t - extent), 2 * extent)]
        assert sorted(parts) == sorted(want), s["calls"]
    inverse = np.argsort(layout.perm, axis=1)
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, segment_ids=ids)
    grads = attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], np.zeros_like(x["dlse"]))
    for name, want in zip(("o", "dq", "dk", "dv"), (fwd.o, *grads)):
        whole = torch.cat([s[name] for s in sorted(shards, key=lambda s: s["block"])], dim=1)
        got = _laid(whole.double().numpy(), inverse)
        assert _rel(got, want) < 2e-2, (name, _rel(got, want))


# ---- JAX --------------------------------------------------------------------------------------

def _jax_run(mesh, x, ids, layout, *, traced_ids: bool = False, block_backend: str = "auto", dtype="float32",
             **kwargs):
    """o, lse, dq, dk, dv (cotangent ``do`` on o alone) of jax_impl's public API (one jitted
    program), read back to original order; ``traced_ids``: the ids and token indices enter as program arguments."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_impl

    perm = layout.perm
    laid = [jnp.asarray(_laid(x[n], perm), dtype) for n in ("q", "k", "v", "do")]
    masks = (jnp.asarray(_laid(ids, perm).astype(np.int32)), jnp.asarray(layout.token_index.astype(np.int32)))

    def outputs(q, k, v, do, seg, index):
        def attention(q, k, v):
            return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="contiguous",
                                                        return_lse=True, kv_exchange="allgather", segment_ids=seg,
                                                        token_index=index, block_backend=block_backend, **kwargs)
        o, pullback = jax.vjp(lambda *a: attention(*a)[0], q, k, v)  # no lse cotangent: the varlen backward's case
        return (o, attention(q, k, v)[1], *pullback(do))

    if traced_ids:
        got = jax.jit(outputs)(*laid, *masks)
    else:
        got = jax.jit(lambda *a: outputs(*a, *masks))(*laid)
    inverse = np.argsort(perm, axis=1)
    return {name: (np.take_along_axis(np.asarray(g, np.float64), inverse[:, None, :], 2) if name == "lse"
                   else _laid(np.asarray(g, np.float64), inverse)) for name, g in zip(NAMES, got)}


def _zero_dlse_truth(x, ids):
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, segment_ids=ids)
    grads = attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], np.zeros_like(x["dlse"]))
    return dict(zip(NAMES, (fwd.o, fwd.lse, *grads)))


@pytest.mark.parametrize("axes", [{"ring": 4}, {"ring": 2, "ulysses": 2}], ids=["ring4", "usp2x2"])
def test_jax_shared_prefix_matches_float64_truth(axes, jax_devices):
    jax = pytest.importorskip("jax")
    ring = axes["ring"]
    padded, _ = pad_documents(DOCUMENTS, ring, multiple=2 * ring * axes.get("ulysses", 1))
    layout = hybrid_layout(padded, ring, split_at=20)
    rng = np.random.default_rng(4)
    x = {n: rng.standard_normal((2, padded.shape[1], h, DIM)) for n, h in
         (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("do", HEADS))}
    x["dlse"] = np.zeros((2, HEADS, padded.shape[1]))
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    t = padded.shape[1] // ring
    extent = shared_extent(ring_shards(_laid(padded, layout.perm), ring))
    assert 0 < extent < t
    truth = _zero_dlse_truth(x, padded)
    for shared_tokens, traced in ((extent, True), (extent + 3, False), (t, False)):
        got = _jax_run(mesh, x, padded, layout, traced_ids=traced, shared_tokens=shared_tokens)
        for name in NAMES:
            assert _rel(got[name], truth[name]) < 1e-5, (shared_tokens, name, _rel(got[name], truth[name]))


def test_jax_a_broken_promise_raises_or_shows(jax_devices):
    """Concrete ids: the ValueError before any collective; ids as program arguments (tracers):
    the outputs and gradients NaN."""
    jax = pytest.importorskip("jax")
    ids, layout, x = _problem(seed=5)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    mesh = jax.make_mesh((RING,), ("ring",))
    with pytest.raises(ValueError, match=f"these ids need shared_tokens >= {extent}"):
        _jax_run(mesh, x, ids, layout, shared_tokens=extent - 1)
    got = _jax_run(mesh, x, ids, layout, traced_ids=True, shared_tokens=extent - 1)
    for name in ("o", "dq", "dk", "dv"):
        assert np.isnan(got[name]).all(), name
    assert np.isfinite(_jax_run(mesh, x, ids, layout, traced_ids=True, shared_tokens=extent)["o"]).all()


def _float16_one_call(seed: int):
    """(got, truth): the JAX shared-prefix call in float16 on ``fa3_varlen`` (its kernels emulated
    by the caller) at the smallest ``shared_tokens`` the ids allow, and the float64 truth."""
    import jax

    ids, layout, x = _problem(seed=seed)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    got = _jax_run(jax.make_mesh((RING,), ("ring",)), x, ids, layout, traced_ids=True, block_backend="fa3_varlen",
                   dtype="float16", shared_tokens=extent)
    return got, _zero_dlse_truth(x, ids)


def test_jax_the_one_call_kernel_path_equals_the_truth(jax_devices, monkeypatch):
    """float16 on ``fa3_varlen`` with FA3's varlen ops emulated: each part one varlen call forward
    and backward — the shared part on its ranked plans, the local part on the shard's own keys in
    place (``runs.own_key_plans``) — the portable kernel the parts would fall back to planted with
    NaNs, so a part that fell back would show; equal to the float64 truth at float16's level."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import fa3_ops
    from jax_impl import allgather
    from jax_impl.kernels import runs

    fa3_ops.emulate(monkeypatch)
    monkeypatch.setattr(runs, "PREFIX_SLOTS", (32,))
    monkeypatch.setattr(runs, "prefix_length_ladder", lambda n: (n,))
    nan = lambda *xs: tuple(jnp.full(s.shape, jnp.nan, jnp.float32) for s in xs)
    monkeypatch.setattr(allgather, "reference_block_fwd", lambda q, k, v, *a, **kw: nan(
        q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]))))
    monkeypatch.setattr(allgather, "reference_block_bwd", lambda do, q, k, v, *a, **kw: nan(q, k, v))
    got, truth = _float16_one_call(seed=6)
    for name in ("o", "dq", "dk", "dv"):
        assert np.isfinite(got[name]).all(), f"{name}: a part fell back to the portable kernel (NaN planted there)"
        assert _rel(got[name], truth[name]) < 2e-2, (name, _rel(got[name], truth[name]))


def test_jax_a_local_part_its_own_keys_cannot_hold_falls_back_to_the_portable_kernel(jax_devices, monkeypatch):
    """Where the shard's documents are not runs with increasing indices the local part's own-key
    plans refuse (``runs.own_key_runs``' ``ok``; refused here on the hybrid's ids, which hold) and
    it runs on the portable kernel — the one call planted with NaNs for the local part's runs,
    forward and backward, so a refusal not taken would show — still equal to the truth."""
    import dataclasses

    pytest.importorskip("jax")
    import jax.numpy as jnp

    import fa3_ops
    from jax_impl import allgather
    from jax_impl.kernels import fa3_varlen

    fa3_ops.emulate(monkeypatch)
    own = allgather.own_key_plans
    monkeypatch.setattr(allgather, "own_key_plans",
                        lambda *a: [dataclasses.replace(plan, ok=jnp.zeros((), bool)) for plan in own(*a)])
    real_fwd, real_bwd = fa3_varlen.varlen_fwd, fa3_varlen._bwd_call
    planted = lambda q, k, v, causal, scale, runs, *a: (  # the own-key runs are the only identity runs here
        (jnp.full(q.shape, jnp.nan, q.dtype), jnp.full((q.shape[0], q.shape[2], q.shape[1]), jnp.nan))
        if runs.identity else real_fwd(q, k, v, causal, scale, runs, *a))
    planted_bwd = lambda do, q, k_p, v_p, o, lse, causal, scale, runs, t, s: (  # ... and a backward taken anyway
        tuple(jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k_p, v_p)) if runs.identity
        else real_bwd(do, q, k_p, v_p, o, lse, causal, scale, runs, t, s))
    monkeypatch.setattr(fa3_varlen, "varlen_fwd", planted)
    monkeypatch.setattr(fa3_varlen, "_bwd_call", planted_bwd)
    got, truth = _float16_one_call(seed=8)
    for name in ("o", "dq", "dk", "dv"):
        assert _rel(got[name], truth[name]) < 2e-2, (name, _rel(got[name], truth[name]))


def test_jax_every_phase_of_the_call_is_named_for_the_profile(jax_devices, monkeypatch):
    """The shared-prefix call's phases carry their ``jax.named_scope`` (``allgather.SCOPES``) into
    the traced program, forward and backward: the 4-GPU profile sums XLA's fusion time by them.
    On the GPU's path (``fa3_varlen``, emulated here), where the plans are built on the device."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fa3_ops
    import jax_impl
    from jax_impl.allgather import SCOPES

    fa3_ops.emulate(monkeypatch)

    ids, layout, x = _problem(seed=7)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    mesh = jax.make_mesh((RING,), ("ring",))
    q, k, v, do = (jnp.asarray(_laid(x[n], layout.perm), jnp.float16) for n in ("q", "k", "v", "do"))
    seg, index = jnp.asarray(_laid(ids, layout.perm).astype(np.int32)), jnp.asarray(layout.token_index.astype(np.int32))

    def step(q, k, v, do, seg, index):
        attention = lambda q, k, v: jax_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=True, layout="contiguous", kv_exchange="allgather", segment_ids=seg,
            token_index=index, shared_tokens=extent, block_backend="fa3_varlen")
        o, pullback = jax.vjp(attention, q, k, v)
        return o, pullback(do)

    stacks = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            stacks.add(str(eqn.source_info.name_stack))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(step)(q, k, v, do, seg, index).jaxpr)
    named = " ".join(stacks)
    missing = [s for s in vars(SCOPES).values() if s not in named]
    assert not missing, missing
