"""Tier 1 — jax_impl's pure pieces: layouts, the causal step plan, the block kernel, the merge.
These are cheap and pin down each piece before the multi-device tests combine them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("jax")
import jax.numpy as jnp

from jax_impl import layout_permutation, merge_partials
from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
from parity.core import reference
from seqplan.layouts import LAYOUTS
from seqplan.schedule import BLOCK_MASKS, CAUSAL_MASK, FULL_MASK, STRICT_MASK, Part, step_plan


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ring,ulysses", [(1, 1), (2, 1), (3, 1), (4, 2), (8, 1), (2, 4)])
def test_layout_permutation_matches_oracle(layout, ring, ulysses):
    """jax_impl's vectorised layouts equal the token-by-token oracle (and are permutations)."""
    n = 2 * ring * ulysses * 3
    got = layout_permutation(n, layout, ring, ulysses)
    np.testing.assert_array_equal(got, reference.layout_permutation(n, layout, ring, ulysses))
    np.testing.assert_array_equal(np.sort(got), np.arange(n))


def _visible_by_plan(layout: str, causal: bool, ring: int, shard: int) -> np.ndarray:
    """[seq, seq] count of how often each (query, key) pair of layout positions is computed,
    following the step plan on every device at every step."""
    plan = step_plan(layout, causal)
    computed = np.zeros((ring * shard, ring * shard), dtype=int)
    for r, step in itertools.product(range(ring), range(ring)):
        src = (r - step) % ring
        block = plan.local if step == 0 else plan.from_earlier if step <= r else plan.from_later
        if block is None:
            continue
        q_lo, q_hi = block.q_part.bounds(shard)
        k_lo, k_hi = block.kv_part.bounds(shard)
        rows, cols = np.meshgrid(np.arange(q_lo, q_hi), np.arange(k_lo, k_hi), indexing="ij")
        keep = {FULL_MASK: np.ones_like(rows, bool), CAUSAL_MASK: cols - k_lo <= rows - q_lo,
                STRICT_MASK: cols - k_lo < rows - q_lo}[block.mask]
        computed[r * shard + rows[keep], src * shard + cols[keep]] += 1
    return computed


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
def test_step_plan_computes_each_visible_pair_exactly_once(layout, causal, ring):
    """The plan's blocks, over all devices and steps, cover every (query, key) pair the causal
    mask allows exactly once and no other pair: nothing is lost, nothing counted twice."""
    shard = 4
    perm = reference.layout_permutation(ring * shard, layout, ring)
    want = np.ones((ring * shard,) * 2, int)
    if causal:
        want = (perm[None, :] <= perm[:, None]).astype(int)
    np.testing.assert_array_equal(_visible_by_plan(layout, causal, ring, shard), want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_plan_never_computes_fully_masked_block(layout):
    """Every block the causal plan computes has at least one visible pair, and zigzag/stripe
    off-diagonal blocks are half-size (zigzag) or strictly-lower (stripe): the balance claims."""
    plan = step_plan(layout, causal=True)
    blocks = [b for b in (plan.from_earlier, plan.from_later) if b is not None]
    if layout == "contiguous":
        assert plan.from_later is None and plan.from_earlier.mask == FULL_MASK
    if layout == "zigzag":
        assert all((b.q_part is Part.ALL) != (b.kv_part is Part.ALL) for b in blocks)
    if layout == "stripe":
        assert {b.mask for b in blocks} == {CAUSAL_MASK, STRICT_MASK}


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("mask", list(BLOCK_MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_block_kernel_matches_oracle(mask, heads, kv_heads, seed):
    """The portable block kernel's o, lse and gradients (given the block's own o/lse as global)
    equal the oracle with the equivalent position mask; strict-causal row 0 is empty (lse=-inf)."""
    rng = np.random.default_rng(seed)
    b, t, d, scale = 2, 8, 16, 0.3
    q, do = _rand(rng, b, t, heads, d), _rand(rng, b, t, heads, d)
    k, v = _rand(rng, b, t, kv_heads, d), _rand(rng, b, t, kv_heads, d)
    o, lse = reference_block_fwd(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale)
    if mask == STRICT_MASK:  # row 0 sees nothing; the oracle (which needs a key per row) gets rows 1..
        assert np.all(np.asarray(lse)[:, :, 0] == -np.inf) and np.all(np.asarray(o)[:, 0] == 0)
        q_pos, rows = np.arange(t) - 0.5, slice(1, None)  # query i sees keys j <= i - 0.5
    else:
        q_pos, rows = np.arange(t), slice(None)
    fwd = reference.attention_forward(q[:, rows], k, v, causal=mask != FULL_MASK, scale=scale,
                                      q_pos=q_pos[rows], k_pos=np.arange(t))
    np.testing.assert_allclose(np.asarray(o)[:, rows], fwd.o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse)[:, :, rows], fwd.lse, rtol=2e-5, atol=2e-6)
    if mask == STRICT_MASK:
        return
    dq, dk, dv = reference_block_bwd(jnp.asarray(do), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     o, lse, mask, scale)
    want = reference.attention_backward(fwd, q, k, v, do, scale=scale)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5, err_msg=name)


def test_merge_of_two_key_halves_equals_whole(seed):
    """Attention over keys [A; B] is the LSE merge of attention over A and over B; merging an
    empty partial (lse = -inf) changes nothing."""
    rng = np.random.default_rng(seed)
    q, k, v = _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 10, 2, 8), _rand(rng, 1, 10, 2, 8)
    whole = reference.attention_forward(q, k, v)
    o_a, lse_a = reference_block_fwd(jnp.asarray(q), jnp.asarray(k[:, :4]), jnp.asarray(v[:, :4]), FULL_MASK, 8**-0.5)
    o_b, lse_b = reference_block_fwd(jnp.asarray(q), jnp.asarray(k[:, 4:]), jnp.asarray(v[:, 4:]), FULL_MASK, 8**-0.5)
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(np.asarray(o), whole.o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), whole.lse, rtol=1e-6)
    o2, lse2 = merge_partials(o, lse, jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf))
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_deterministic_xla_flag_sets_the_default(monkeypatch):
    """With --xla_gpu_deterministic_ops=true, deterministic= defaults to True (read at the API
    boundary only); no backend is refused in that mode — cudnn is made deterministic by the flag,
    fa3 and fa3_varlen ask for FA3's deterministic backward (tests/unit/test_fa3_varlen_emulated.py
    checks the attribute they emit). An explicit deterministic= wins."""
    from jax_impl.block import NONDETERMINISTIC_WHEN_REQUESTED, get_backend
    from jax_impl.config import default_deterministic

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true")
    assert default_deterministic(None) and not default_deterministic(False)
    assert not NONDETERMINISTIC_WHEN_REQUESTED
    for name in ("fa3", "fa3_varlen", "cudnn", "reference"):
        assert get_backend(name, deterministic=default_deterministic(None)).name == name
    assert get_backend("auto", deterministic=True).name == "reference"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not default_deterministic(None) and default_deterministic(True)
    assert get_backend("fa3", deterministic=default_deterministic(None)).name == "fa3"


def test_deterministic_on_a_gpu_needs_xla_started_deterministic(monkeypatch):
    """``deterministic=True`` where a call resolves its kernels for a GPU (the default device, the
    rule "auto" follows) without XLA's deterministic ops on is refused by name at trace time — by
    the API and by the per-device entries alike (XLA reads the flag only at start-up; without it
    cuDNN's backward, the kernel deterministic mode routes to, is run-to-run different). The flag's
    last occurrence in XLA_FLAGS wins; on the CPU or with ``deterministic=False`` nothing is asked."""
    import jax
    from jax.sharding import Mesh

    import jax_impl
    from jax_impl import config
    from jax_impl.config import check_deterministic_ready

    flags = "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setattr(config, "_default_platform", lambda: "gpu")  # a GPU host, stood in
    with pytest.raises(ValueError, match="xla_gpu_deterministic_ops"):
        check_deterministic_ready(True)
    mesh = Mesh(np.array(jax.devices()[:2]), ("ring",))
    q = jnp.ones((1, 8, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match="xla_gpu_deterministic_ops"):  # the API refuses as the entries would
        jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, deterministic=True)
    check_deterministic_ready(False)
    for on in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops", "--xla_gpu_deterministic_ops=false "
               "--xla_gpu_deterministic_ops=1"):
        monkeypatch.setenv("XLA_FLAGS", f"{flags} {on}")
        check_deterministic_ready(True)
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
    with pytest.raises(ValueError):
        check_deterministic_ready(True)
    assert not config.default_deterministic(None)
    monkeypatch.setattr(config, "_default_platform", lambda: "cpu")
    check_deterministic_ready(True)
    o = jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, deterministic=True)
    assert o.shape == q.shape


def test_a_devices_only_block_is_never_widened_to_float32():
    """A kernel's o, dq, dK and dV stay in the inputs' dtype when the block is the device's only
    one (one device on the ring, Ulysses): the loops cast inside each block variant — here the
    document mask's ``lax.switch`` between a plain and a document-masked block — so the compiled
    program holds no float32 copy of o / dq / dK / dV, while two blocks do merge in float32 (the
    check can fail). The kernel passes its inputs through, bf16 in, bf16 out, for every mask."""
    import jax
    import jax.numpy as jnp

    from jax_impl import replay
    from jax_impl.block import BlockBackend, register_backend

    b, t, h, hk, d = 1, 64, 4, 2, 8
    lse_of = lambda q: jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    register_backend(BlockBackend("passthrough_cpu", lambda q, k, v, mask, scale, **_: (q, lse_of(q)),
                                  lambda do, q, k, v, o, lse, mask, scale, dlse=None, **_: (do, k, v)))
    q, kv = jnp.ones((b, t, h, d), jnp.bfloat16), jnp.ones((b, t, hk, d), jnp.bfloat16)
    ids = jnp.asarray(np.repeat([0, 1], t // 2)[None], jnp.int32)

    def float32_copies(ring: int, heads: int) -> int:
        strategy = replay.Strategy(ring=ring)
        kw = {"strategy": strategy, "causal": True, "layout": "zigzag", "block_backend": "passthrough_cpu"}
        fwd = jax.jit(lambda q, k, v, ids: replay.device_forward(0, q, k, v, segment_ids=ids, **kw))
        bwd = jax.jit(lambda q, k, v, o, lse, do, ids: replay.device_backward(0, q, k, v, o, lse, do, segment_ids=ids,
                                                                               **kw)[:2])
        o, lse = fwd(q, kv, kv, ids)
        shape = f"f32[{b},{t // ring},{heads},{d}]"
        return sum(fn.lower(*args).compile().as_text().count(shape)
                   for fn, args in ((fwd, (q, kv, kv, ids)), (bwd, (q, kv, kv, o, lse, q, ids))))

    for heads in (h, hk):  # o / dq, then dK / dV
        assert float32_copies(1, heads) == 0
        assert float32_copies(2, heads) > 0


def test_a_replayed_backward_reads_only_its_own_rows_of_o_and_lse():
    """The one-GPU benchmark gives each timed device's backward its own forward's rows placed into
    zeros instead of the whole replayed forward (one program of every device, too slow to compile
    at R 8 over 128k): exact only if device_backward reads o and lse of its own shard and heads
    alone — checked here against the true global o, lse on a USP 2 × 2 replay."""
    import jax.numpy as jnp

    from jax_impl import replay

    rng = np.random.default_rng(0)
    b, t, h, hk, d = 1, 32, 4, 2, 8
    q, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, hk, d)), jnp.float32) for _ in range(2))
    strategy = replay.Strategy(ring=2, ulysses=2)
    kw = {"strategy": strategy, "causal": True, "layout": "zigzag"}
    o, lse = replay.replay_attention(q, k, v, **kw)
    for device in range(strategy.devices):
        r, u = divmod(device, strategy.ulysses)
        heads, rows = strategy.head_groups(h, hk, u)[0], slice(r * t // 2, (r + 1) * t // 2)
        o_d, lse_d = replay.device_forward(device, q, k, v, **kw)
        own_o = jnp.zeros_like(o).at[:, rows, heads].set(o_d)
        own_lse = jnp.zeros_like(lse).at[:, heads, rows].set(lse_d)
        want = replay.device_backward(device, q, k, v, o, lse, do, **kw)
        got = replay.device_backward(device, q, k, v, own_o, own_lse, do, **kw)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        for src in want[1]:
            for g, w in zip(got[1][src], want[1][src]):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
