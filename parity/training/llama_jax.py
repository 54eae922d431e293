"""The tiny Llama decoder in flax linen (``jax_impl.layers`` for attention) and its sequence-parallel
training step: one explicit ``jax.shard_map`` per program over the case's mesh, optax Adam.

Inside the per-device function every collective is explicit or the transpose of one, so the
compiled HLO can be counted against the traffic model (``parity.training.llama_traffic``):
- attention: ``jax_impl.local_attention`` over the mesh's sequence axes (ring / Ulysses / both /
  double ring), the layer in ``per_device`` mode on this device's shards;
- FSDP (``case.fsdp``): every weight sharded on dim 0 over ALL mesh axes (data and sequence
  devices together, as torch_impl's FSDP2 shards over every rank), ``all_gather``-ed before use
  under ``jax.checkpoint`` so the backward gathers again instead of keeping the full weights; the
  gather's transpose is the gradient reduce-scatter;
- replicated weights: the implicit broadcast of a replicated weight to the device-varying loss
  transposes to one gradient all-reduce per weight;
- the loss: Σ cross-entropy over this device's labelled tokens / ``psum`` of every device's
  labelled count (one all-reduce in the forward). Each device returns its share; the shares sum
  to the global mean.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.block import get_backend
from jax_impl.layers import AttentionLayerConfig, SequenceParallelAttention

from .jax_step import GATHERED, compiler_options, fsdp_remat_policy
from .llama import IGNORE, LlamaConfig, ModelCase, TokenBatch, TrainResult, weight_shapes


def rms_norm(x, weight, eps: float):
    """x · rsqrt(mean(x²) + eps) · weight, in float32 (float64 for float64 x), returned in x's dtype."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    normed = wide * lax.rsqrt(jnp.mean(jnp.square(wide), axis=-1, keepdims=True) + eps)
    return (normed * weight_view(weight.reshape((1,) * (x.ndim - 1) + (-1,)))).astype(x.dtype)


def weight_view(w):
    """A reshaped or transposed weight, named like the gathered weight it views: under FSDP's
    remat policy it is recomputed from the re-gathered weight, never kept from the forward (which
    would keep a full copy of a sharded weight alive until the backward)."""
    return checkpoint_name(w, GATHERED)


class DecoderLayer(nn.Module):
    config: LlamaConfig
    layout: str
    mesh: jax.sharding.Mesh | None
    per_device: bool
    block_backend: str = "auto"
    attention: object = None
    kv_exchange: str = "ring"

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        c = self.config
        ones, init = nn.initializers.ones, nn.initializers.lecun_normal()
        attn_config = AttentionLayerConfig(c.d_model, c.heads, c.kv_heads, c.head_dim, rope_theta=c.rope_theta,
                                           causal=True, layout=self.layout, window=c.window, sinks=c.sinks,
                                           block_backend=self.block_backend, kv_exchange=self.kv_exchange)
        attn_norm = self.param("attn_norm", ones, (c.d_model,))
        h = x + SequenceParallelAttention(attn_config, self.mesh, self.per_device, self.attention, name="attn")(
            rms_norm(x, attn_norm, c.norm_eps), positions, segment_ids)
        m = rms_norm(h, self.param("mlp_norm", ones, (c.d_model,)), c.norm_eps)
        w_gate, w_up = (self.param(n, init, (c.d_model, c.d_ff)).astype(x.dtype) for n in ("w_gate", "w_up"))
        w_down = self.param("w_down", init, (c.d_ff, c.d_model)).astype(x.dtype)
        return h + (nn.silu(m @ w_gate) * (m @ w_up)) @ w_down


class Llama(nn.Module):
    """tokens, positions, segment_ids: [b, t] -> logits [b, t, V] float32 (float64 in float64).

    mesh / per_device: as ``jax_impl.layers.SequenceParallelAttention`` (mesh None: not parallel).
    dtype: the activations' dtype (weights are cast to it where they are used)."""

    config: LlamaConfig
    layout: str = "zigzag"
    mesh: jax.sharding.Mesh | None = None
    per_device: bool = False
    dtype: jnp.dtype = jnp.float32
    block_backend: str = "auto"
    attention: object = None
    kv_exchange: str = "ring"

    @nn.compact
    def __call__(self, tokens, positions, segment_ids):
        c = self.config
        embed = self.param("embed", nn.initializers.normal(1.0), (c.vocab, c.d_model))
        x = embed[tokens].astype(self.dtype)
        for i in range(c.layers):
            x = DecoderLayer(c, self.layout, self.mesh, self.per_device, self.block_backend, self.attention,
                             self.kv_exchange, name=f"layers_{i}")(x, positions, segment_ids)
        x = rms_norm(x, self.param("final_norm", nn.initializers.ones, (c.d_model,)), c.norm_eps)
        head = weight_view(embed.T) if c.tie_embeddings else self.param("lm_head", nn.initializers.lecun_normal(),
                                                               (c.d_model, c.vocab))
        logits = x @ head.astype(x.dtype)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def _path(name: str) -> tuple[str, ...]:
    """The flax parameter path of a canonical weight name."""
    parts = name.split(".")
    if parts[0] != "layers":
        return (name,)
    leaf = parts[2]
    return (f"layers_{parts[1]}", "attn", leaf) if leaf in ("wq", "wk", "wv", "wo", "sinks") else \
        (f"layers_{parts[1]}", leaf)


def to_params(weights: dict, config: LlamaConfig) -> dict:
    """The flax parameter tree of canonical ``weights`` (arrays of any kind)."""
    tree: dict = {}
    for name in weight_shapes(config):
        node = tree
        *parents, leaf = _path(name)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = weights[name]
    return tree


def from_params(tree: dict, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Canonical float64 NumPy arrays of a flax parameter tree."""
    out = {}
    for name in weight_shapes(config):
        node = tree
        for p in _path(name):
            node = node[p]
        out[name] = np.asarray(jnp.asarray(node, jnp.float32), np.float64)
    return out


def loss_sum(logits, labels):
    """Σ cross-entropy over the labelled tokens."""
    labelled = labels != IGNORE
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(labelled, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(labelled, picked, 0.0))


def make_mesh(case: ModelCase, devices=None) -> jax.sharding.Mesh:
    axes = case.mesh.axes
    devices = jax.devices()[: case.mesh.devices] if devices is None else devices
    if len(devices) < case.mesh.devices:
        raise ValueError(f"{case.name} needs {case.mesh.devices} devices, JAX has {len(devices)}")
    return jax.sharding.Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes))


class Step:
    """The jitted per-pass programs of one case on ``mesh``: ``loss``, ``grads``, ``step``."""

    def __init__(self, case: ModelCase, mesh, *, dtype=jnp.float32, block_backend: str = "auto"):
        self.case, self.mesh = case, mesh
        self.axes = tuple(mesh.axis_names)
        self.dtype = jnp.dtype(dtype)
        self.model = Llama(case.model, case.layout, mesh, True, dtype, block_backend,
                           kv_exchange=case.mesh.kv_exchange)
        self.opt = optax.adam(case.lr)
        self.typed = get_backend(block_backend).typed_for_shard_map
        from jax_impl.api import partition_specs

        self.tokens_spec = P(*partition_specs(mesh)[0][:2])
        self.weight_spec = P(self.axes) if case.fsdp else P()

    def _gather(self, params):
        # cast before the gather (as FSDP2's param_dtype): the wire and the model see self.dtype
        gather = lambda w: checkpoint_name(lax.all_gather(w.astype(self.dtype), self.axes, axis=0, tiled=True),
                                           GATHERED)
        return jax.tree.map(gather, params) if self.case.fsdp else params

    def _local_loss(self, params, tokens, labels, positions, ids):
        """This device's share of the global mean cross-entropy."""
        count = lax.psum(jnp.sum(labels != IGNORE).astype(jnp.float32), self.axes)
        logits = self.model.apply({"params": self._gather(params)}, tokens, positions, ids)
        with jax.named_scope("loss"):  # the step-time model's classes (parity.accounting.hlo_cost)
            return loss_sum(logits, labels) / count

    def _loss_and_grads(self, params, *batch):
        # FSDP: keep every intermediate but the gathered weights; the backward gathers them again.
        loss_fn = jax.checkpoint(self._local_loss, policy=fsdp_remat_policy) if self.case.fsdp else self._local_loss
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        if not self.case.fsdp and not self.typed:  # untyped kernels: no implicit all-reduce of replicated grads
            grads = lax.psum(grads, self.axes)
        return loss[None], grads

    def _shard_map(self, fn, in_specs, out_specs, donate=()):
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=self.typed),
                       compiler_options=compiler_options(self.mesh), donate_argnums=donate)

    def programs(self, params, opt_state, donate: bool = False):
        """(loss, grads, step) jitted functions of (params, [opt_state,] tokens, labels, positions, ids);
        ``donate``: the step takes its params and opt_state buffers (a timed loop feeds them back)."""
        w = jax.tree.map(lambda _: self.weight_spec, params)
        o = optax.tree_map_params(self.opt, lambda _, s: s, opt_state, w, transform_non_params=lambda _: P(),
                                  is_leaf=lambda s: isinstance(s, P))
        batch, share = (self.tokens_spec,) * 4, P(self.axes)

        def step(params, opt_state, *b):
            loss, grads = self._loss_and_grads(params, *b)
            with jax.named_scope("optimizer"):
                updates, opt_state = self.opt.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
            return loss, grads, params, opt_state

        return (self._shard_map(lambda p, *b: self._local_loss(p, *b)[None], (w, *batch), share),
                self._shard_map(self._loss_and_grads, (w, *batch), (share, w)),
                self._shard_map(step, (w, o, *batch), (share, w, w, o), donate=(0, 1) if donate else ()))

    def arguments(self, batch: TokenBatch | None = None, abstract: bool = False):
        """(params, opt_state, tokens, labels, positions, ids) as sharded global arrays (ids None
        without ``case.segment_ids``); ``batch`` in original order (default the case's corpus).
        ``abstract``: their shapes, dtypes and shardings only (``jax.ShapeDtypeStruct``), nothing
        placed on the mesh and nothing run — enough to lower and compile the programs for devices
        this process cannot run on (a mocked GPU topology: ``jax_mock_gpu_topology``)."""
        weights, corpus = self.case.inputs()
        batch = corpus if batch is None else batch
        self.case.check_batch(batch)
        batch = batch.permuted(self.case.permutation())
        if abstract:
            put = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, spec))
        else:
            put = lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec))
        # placed from host arrays: a host array is sliced on the host, where one already on a
        # device is spread by a small program compiled per shape (``_multi_slice``)
        host = lambda a: np.asarray(a, jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
        params = jax.tree.map(lambda a: put(host(a), self.weight_spec), to_params(weights, self.case.model))
        if abstract:  # Adam's moments sharded as their parameters; the step count uncommitted, as init leaves it
            opt_state = optax.tree_map_params(self.opt, lambda a: put(a, self.weight_spec),
                                              jax.eval_shape(self.opt.init, params))
        else:
            opt_state = self.opt.init(params)
        arrays = (batch.tokens, batch.labels, batch.positions)
        ids = put(host(batch.segment_ids), self.tokens_spec) if self.case.segment_ids else None
        return (params, opt_state, *(put(host(a), self.tokens_spec) for a in arrays), ids)


def train(case: ModelCase, steps: int | None = None) -> TrainResult:
    """``steps`` (default ``case.steps``) sequence-parallel training steps of ``case``."""
    step = Step(case, make_mesh(case))
    params, opt_state, *batch = step.arguments()
    *_, step_fn = step.programs(params, opt_state)
    losses, first = [], None
    for _ in range(steps or case.steps):
        loss, grads, params, opt_state = step_fn(params, opt_state, *batch)
        losses.append(float(np.sum(np.asarray(loss, np.float64))))
        first = first if first is not None else from_params(grads, case.model)
    return TrainResult(losses, first, from_params(params, case.model))


def compiled_texts(case: ModelCase, dtype=jnp.float32, which: tuple[int, ...] = (0, 1, 2)) -> list[str]:
    """The optimized HLO of the compiled loss, loss+grads and full-step programs of ``case`` (the
    ``which`` of them, in that order)."""
    step = Step(case, make_mesh(case), dtype=dtype)
    params, opt_state, *batch = step.arguments()
    programs = step.programs(params, opt_state)
    args = ((params, *batch), (params, *batch), (params, opt_state, *batch))
    return [programs[i].lower(*args[i]).compile().as_text() for i in which]


def measure_traffic(case: ModelCase, texts: list[str] | None = None):
    """Per-device collectives of the compiled loss, loss+grads and full-step programs, split into
    fwd / bwd / step passes (``Traffic``); ``texts``: those programs, already compiled."""
    from ..accounting.hlo import split_passes

    return split_passes(*(texts or compiled_texts(case)))
