"""Tier 2 — the attention LAYERS with explicit token indices, both frameworks: packed documents
laid out by the per-document zigzag (``seqplan.layouts.document_layout``), the layer given the
layout-order input, its RoPE positions (``rope_positions``: restarting at every document), the
segment ids and ``token_index``, over a ring of 4 — read back to original order, it equals the
same layer without a mesh on the original-order sequence (output, input gradient and weight
gradients). Without ``token_index`` the same call is wrong (the layout's static positions would
mask the wrong pairs), so the check can fail."""

from __future__ import annotations

import numpy as np
import pytest

from seqplan.config import AttentionLayerConfig
from seqplan.layouts import document_layout, rope_positions

RING, D_MODEL = 4, 16
CONFIG = dict(d_model=D_MODEL, heads=4, kv_heads=2, head_dim=8, causal=True, layout="contiguous")
# two rows of packed documents, every length a multiple of 2R (the per-document zigzag's rule)
IDS = np.array([[0] * 8 + [1] * 16 + [2] * 8, [5] * 24 + [6] * 8])


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    layout = document_layout(IDS, RING)
    b, t = IDS.shape
    x, dy = (rng.standard_normal((b, t, D_MODEL)).astype(np.float32) for _ in range(2))
    positions = rope_positions(np.broadcast_to(np.arange(t), (b, t)), IDS)  # original order
    return layout, x, dy, positions


def _laid(a, perm):
    return np.take_along_axis(a, perm.reshape(perm.shape + (1,) * (a.ndim - 2)), 1)


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def _jax_outputs(layer, params, x, positions, ids, dy, **kw):
    """y and the gradients of Σ y·dy (parameters, x) of a JAX layer, in one jitted program."""
    import jax
    import jax.numpy as jnp

    def loss(params, x):
        y = layer.apply(params, x, positions, ids, **kw)
        return jnp.sum(y * dy), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def test_jax_layer_with_token_index_equals_the_plain_layer(jax_devices):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.layers import SequenceParallelAttention

    layout, x, dy, positions = _problem()
    config = AttentionLayerConfig(**CONFIG)
    plain = SequenceParallelAttention(config)
    params = plain.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(positions), jnp.asarray(IDS))
    # Auto axes: the weight gradients contract over the sharded sequence (Explicit axes would ask
    # for their sharding)
    mesh = jax.make_mesh((RING,), ("ring",), axis_types=(jax.sharding.AxisType.Auto,))
    parallel = SequenceParallelAttention(config, mesh=mesh)

    y_ref, (dp_ref, dx_ref) = _jax_outputs(plain, params, *(jnp.asarray(a) for a in (x, positions, IDS, dy)))
    perm, inverse = layout.perm, layout.inverse
    laid = [jnp.asarray(_laid(a, perm)) for a in (x, positions, IDS, dy)]
    y, (dp, dx) = _jax_outputs(parallel, params, *laid, token_index=jnp.asarray(layout.token_index))
    assert _rel(_laid(np.asarray(y), inverse), y_ref) < 1e-5
    assert _rel(_laid(np.asarray(dx), inverse), dx_ref) < 1e-5
    for name in ("wq", "wk", "wv", "wo"):
        assert _rel(dp["params"][name], dp_ref["params"][name]) < 1e-5, name
    wrong = jax.jit(parallel.apply)(params, *laid[:3])  # the contiguous layout's positions, not the documents'
    assert _rel(_laid(np.asarray(wrong), inverse), y_ref) > 1e-2
    with pytest.raises(ValueError, match="token_index needs a mesh"):
        plain.apply(params, *laid[:3], token_index=jnp.asarray(layout.token_index))


def test_torch_layer_with_token_index_equals_the_plain_layer(worlds):
    torch = pytest.importorskip("torch")
    from torch_impl.layers import SequenceParallelAttention
    from torch_tasks import layer_task

    layout, x, dy, positions = _problem(seed=1)
    torch.manual_seed(0)
    plain = SequenceParallelAttention(AttentionLayerConfig(**CONFIG))
    weights = {name: getattr(plain, name).weight.detach().numpy().copy() for name in ("wq", "wk", "wv", "wo")}
    xt = torch.from_numpy(x).requires_grad_(True)
    y_ref = plain(xt, torch.from_numpy(positions), torch.from_numpy(IDS))
    (y_ref * torch.from_numpy(dy)).sum().backward()
    perm, inverse = layout.perm, layout.inverse
    laid = {"x": _laid(x, perm), "positions": _laid(positions, perm), "segment_ids": _laid(IDS, perm),
            "dy": _laid(dy, perm)}

    def run(token_index):
        shards = sorted(worlds(RING).run(layer_task, (("ring", RING),), weights, CONFIG,
                                         laid | {"token_index": token_index}), key=lambda r: r["rank"])
        y = np.concatenate([r["y"] for r in shards], 1)
        dx = np.concatenate([r["dx"] for r in shards], 1)
        grads = {n: sum(r["grads"][n] for r in shards) for n in weights}
        return _laid(y, inverse), _laid(dx, inverse), grads

    y, dx, grads = run(layout.token_index)
    assert _rel(y, y_ref.detach().numpy()) < 1e-5
    assert _rel(dx, xt.grad.numpy()) < 1e-5
    for name in weights:
        assert _rel(grads[name], getattr(plain, name).weight.grad.numpy()) < 1e-5, name
    wrong, _, _ = run(None)
    assert _rel(wrong, y_ref.detach().numpy()) > 1e-2
    with pytest.raises(ValueError, match="token_index needs a mesh"):
        plain(xt, torch.from_numpy(positions), torch.from_numpy(IDS), token_index=torch.from_numpy(layout.perm))


# ---- the layout chooser's result, taken by both layers (seqplan.chooser) ----------------------------

def _short_and_one_long(rng, long: int, n: int = 256) -> list[int]:
    """Document lengths of one row: one ``long`` document among short ones (1-6 tokens)."""
    lengths, rest = [long], n - long
    while rest > 0:
        lengths.append(min(rest, int(rng.integers(1, 7))))
        rest -= lengths[-1]
    rng.shuffle(lengths)
    return lengths


# Two rows of 256 tokens, each one long document of odd length (61, 75) among short ones: the
# chooser splits the long ones over the ring and keeps the short ones whole — the shared prefix's
# two parts both run
_RNG = np.random.default_rng(5)
CHOOSER_IDS = np.stack([np.repeat(np.arange(len(n)) + 100 * i, n)
                        for i, n in enumerate(_short_and_one_long(_RNG, long) for long in (61, 75))])


def _chosen_problem(seed: int):
    from seqplan.chooser import choose_layout

    rng = np.random.default_rng(seed)
    b, t = CHOOSER_IDS.shape
    x, dy = (rng.standard_normal((b, t, D_MODEL)).astype(np.float32) for _ in range(2))
    positions = rope_positions(np.broadcast_to(np.arange(t), (b, t)), CHOOSER_IDS)
    choice = choose_layout(CHOOSER_IDS, ring=RING)
    assert choice.padding > 0 and choice.kv_exchange == "allgather"  # the case the test is for
    assert 0 < choice.shared_tokens < choice.segment_ids.shape[1] // RING  # both parts of the shared prefix
    laid = {"x": choice.lay_out(x), "positions": choice.lay_out(positions), "segment_ids": choice.segment_ids,
            "dy": choice.lay_out(dy)}  # padding: dy = 0, no loss weight
    return choice, x, dy, positions, laid


def test_jax_layer_takes_the_layout_chooser_s_choice(jax_devices):
    """The chooser's layer config (per-document hybrid, all-gather KV), its padded layout-order
    arrays and token indices: read back, the layer equals the plain layer on the unpadded original
    order — output, input gradient, weight gradients."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.layers import SequenceParallelAttention

    choice, x, dy, positions, laid = _chosen_problem(seed=2)
    config = AttentionLayerConfig(**CONFIG)
    plain = SequenceParallelAttention(config)
    params = plain.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(positions), jnp.asarray(CHOOSER_IDS))
    mesh = jax.make_mesh((RING,), ("ring",), axis_types=(jax.sharding.AxisType.Auto,))
    parallel = SequenceParallelAttention(choice.layer_config(config), mesh=mesh)

    y_ref, (dp_ref, dx_ref) = _jax_outputs(plain, params,
                                           *(jnp.asarray(a) for a in (x, positions, CHOOSER_IDS, dy)))
    y, (dp, dx) = _jax_outputs(parallel, params, *(jnp.asarray(laid[n]) for n in ("x", "positions", "segment_ids", "dy")),
                               token_index=jnp.asarray(choice.token_index))
    assert _rel(choice.read_back(np.asarray(y)), y_ref) < 1e-5
    assert _rel(choice.read_back(np.asarray(dx)), dx_ref) < 1e-5
    for name in ("wq", "wk", "wv", "wo"):
        assert _rel(dp["params"][name], dp_ref["params"][name]) < 1e-5, name


def test_torch_layer_takes_the_layout_chooser_s_choice(worlds):
    torch = pytest.importorskip("torch")
    from torch_impl.layers import SequenceParallelAttention
    from torch_tasks import layer_task

    choice, x, dy, positions, laid = _chosen_problem(seed=3)
    torch.manual_seed(0)
    plain = SequenceParallelAttention(AttentionLayerConfig(**CONFIG))
    weights = {name: getattr(plain, name).weight.detach().numpy().copy() for name in ("wq", "wk", "wv", "wo")}
    xt = torch.from_numpy(x).requires_grad_(True)
    y_ref = plain(xt, torch.from_numpy(positions), torch.from_numpy(CHOOSER_IDS))
    (y_ref * torch.from_numpy(dy)).sum().backward()
    config = CONFIG | {"layout": choice.layout, "kv_exchange": choice.kv_exchange,
                       "shared_tokens": choice.shared_tokens}  # choice.layer_config's fields
    shards = sorted(worlds(RING).run(layer_task, (("ring", RING),), weights, config,
                                     laid | {"token_index": choice.token_index}), key=lambda r: r["rank"])
    y = choice.read_back(np.concatenate([r["y"] for r in shards], 1))
    dx = choice.read_back(np.concatenate([r["dx"] for r in shards], 1))
    assert _rel(y, y_ref.detach().numpy()) < 1e-5
    assert _rel(dx, xt.grad.numpy()) < 1e-5
    for name in weights:
        assert _rel(sum(r["grads"][name] for r in shards), getattr(plain, name).weight.grad.numpy()) < 1e-5, name
