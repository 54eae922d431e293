"""The FFN training step in JAX: ``shard_map`` over the mesh ("fsdp", "tp"), flax for the model,
optax Adam — DP, FSDP, TP, FSDP+TP and ZeRO-1, each written the way the accounting model
(``parity.training.traffic_model``) describes it, so the compiled HLO can be counted against it.

Inside the per-device function every collective is explicit or the transpose of one:
- FSDP: ``all_gather`` of the weight shard (under ``jax.checkpoint``, so the backward gathers it
  again instead of keeping the full weight); its transpose is the gradient reduce-scatter.
- TP: W1 column- and W2 row-parallel; ``psum`` over "tp" of the block output; the input's
  implicit broadcast to the tp-varying matmul transposes to the backward all-reduce.
- DP: replicated weights meet fsdp-sharded tokens; the implicit broadcast transposes to the
  gradient all-reduce.
- ZeRO-1: replicated compute weights, explicitly marked varying so the backward leaves local
  gradients; ``psum_scatter`` them, Adam on this device's float32 shard, ``all_gather`` the update.
Master weights and Adam state are float32; the weights are cast to ``case.dtype`` before they
are gathered, so everything on the wire is in ``case.dtype``.
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

from .reference import TrainCase, TrainInputs, make_train_inputs

FSDP, TP = "fsdp", "tp"


def _all_gather_invariant(x, axis_name, axis):
    """all_gather whose result is typed replicated (its transpose is a slice, not a reduce-scatter):
    ZeRO-1's gathered update is the same on every device. Public in newer JAX as lax.all_gather_invariant."""
    fn = getattr(lax, "all_gather_invariant", None)
    if fn is None:
        from jax._src.lax.parallel import all_gather_invariant as fn
    return fn(x, axis_name, axis=axis, tiled=True)


GATHERED = "fsdp_gathered_weight"
# FSDP keeps only the shard between forward and backward and gathers again in the backward: the
# block is rematerialized, saving every intermediate except the gathered weights (so the TP
# all-reduce of the forward is not repeated, but the FSDP all-gather is).
def fsdp_remat_policy(prim, *avals, **params) -> bool:
    """Saveable: everything but the gathered weights — neither the all_gather's output nor its
    named alias."""
    return prim is not lax.all_gather_p and params.get("name") != GATHERED


# remat marks the backward's re-gather with a CSE barrier; XLA expands CSE barriers after layout
# assignment and its next CSE then merges the re-gather into the forward's gather — keeping every
# full weight alive from forward to backward, which is what FSDP exists to avoid. The reference
# step keeps the barriers (measured on XLA:CPU, jax 0.10: 1 gather per weight without this, 2 with).
# CPU only: XLA:GPU cannot execute an unexpanded opt-barrier (and keeps the re-gather by itself).
# On GPUs, XLA's all-reduce combiner concatenates DP's per-matrix gradient all-reduces into one
# buffer (same bytes, one call; measured jax 0.11.2, H200): the reference step turns it off so it
# issues the calls the model (and torch's explicit DP) counts.
GPU_COMPILER_OPTIONS = {"xla_gpu_all_reduce_combine_threshold_bytes": 0}
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options(mesh) -> dict:
    """The reference steps' compiler options on ``mesh``'s platform (above: the CPU's, or the GPUs')."""
    return COMPILER_OPTIONS if mesh.devices.flat[0].platform == "cpu" else GPU_COMPILER_OPTIONS


def _gather_weight(w, axis):
    return checkpoint_name(lax.all_gather(w, FSDP, axis=axis, tiled=True), GATHERED)


class FFNBlock(nn.Module):
    """x ← x + gelu(x·W1)·W2 on this device's shards. x: [T/X, D]; w1: [D/X?, F/Y]; w2: [F/Y, D/X?]
    (the D dimension is sharded over "fsdp" only when ``fsdp_sharded``)."""

    w1_shape: tuple
    w2_shape: tuple
    fsdp_sharded: bool
    tensor_parallel: bool

    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.initializers.zeros, self.w1_shape, x.dtype)
        w2 = self.param("w2", nn.initializers.zeros, self.w2_shape, x.dtype)
        if self.fsdp_sharded:
            w1, w2 = _gather_weight(w1, 0), _gather_weight(w2, 1)
        h = nn.gelu(x @ w1, approximate=True)  # [T/X, F/Y]
        out = h @ w2
        return x + (lax.psum(out, TP) if self.tensor_parallel else out)  # row-parallel W2: partial sums


class FFNStack(nn.Module):
    blocks: int
    w1_shape: tuple
    w2_shape: tuple
    fsdp_sharded: bool
    tensor_parallel: bool

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            block = nn.remat(FFNBlock, policy=fsdp_remat_policy) if self.fsdp_sharded else FFNBlock
            x = block(self.w1_shape, self.w2_shape, self.fsdp_sharded, self.tensor_parallel, name=f"block_{i}")(x)
        return x


def _specs(case: TrainCase):
    """PartitionSpecs of one block's W1 [D, F] and W2 [F, D] as stored (float32 master) and as
    computed with. An axis a strategy does not use is not named (naming it, even with size 1,
    would type the weights as varying over it)."""
    fsdp = FSDP if case.strategy in ("fsdp", "fsdp_tp") else None
    tp = TP if case.strategy in ("tp", "fsdp_tp") else None
    if case.strategy == "zero1":  # master shards over "fsdp" on dim 0; compute weights replicated
        return {"w1": P(FSDP, None), "w2": P(FSDP, None)}, {"w1": P(), "w2": P()}
    spec = {"w1": P(fsdp, tp), "w2": P(tp, fsdp)}
    return spec, spec


class Step:
    """The jitted per-pass programs of one case on ``mesh``: ``loss``, ``grads``, ``step``
    (each also usable for counting its compiled collectives)."""

    def __init__(self, case: TrainCase, mesh):
        self.case, self.mesh = case, mesh
        self.dtype = jnp.dtype(case.dtype)
        self.opt = optax.adam(case.lr)
        x, y = case.fsdp, case.tp
        shard_d = case.strategy in ("fsdp", "fsdp_tp")
        w1_local = (case.d_model // x if shard_d else case.d_model, case.d_ff // y)
        w2_local = (case.d_ff // y, case.d_model // x if shard_d else case.d_model)
        self.model = FFNStack(case.blocks, w1_local, w2_local, shard_d, case.strategy in ("tp", "fsdp_tp"))
        master, compute = _specs(case)
        self.master_specs = {f"block_{i}": master for i in range(case.blocks)}
        self.compute_specs = {f"block_{i}": compute for i in range(case.blocks)}

    # ---- per-device pieces -------------------------------------------------------------
    def _local_loss(self, params, x, y):
        """This device's share of ½Σ(out − y)²/T (its tokens; TP ranks hold the same value)."""
        out = self.model.apply({"params": params}, x)
        return 0.5 * jnp.sum(jnp.square(out.astype(jnp.float32) - y)) / self.case.tokens

    def _loss_and_grads(self, params, x, y):
        if self.case.strategy == "zero1":  # keep per-device gradients: reduce-scattered below
            params = jax.tree.map(lambda w: lax.pcast(w, FSDP, to="varying"), params)
        loss, (g, dx) = jax.value_and_grad(self._local_loss, argnums=(0, 1))(params, x, y)
        if self.case.strategy == "zero1":
            g = jax.tree.map(lambda w: lax.psum_scatter(w, FSDP, scatter_dimension=0, tiled=True), g)
        return loss[None], g, dx

    def _cast(self, tree):
        return jax.tree.map(lambda w: w.astype(self.dtype), tree)

    def _update(self, master, opt_state, grads):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = self.opt.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    # ---- the three programs ------------------------------------------------------------
    def _shard_map(self, fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs),
                       compiler_options=compiler_options(self.mesh))

    def _opt_specs(self, opt_state):
        return optax.tree_map_params(self.opt, lambda _, spec: spec, opt_state, self.master_specs,
                                     transform_non_params=lambda _: P(), is_leaf=lambda s: isinstance(s, P))

    def programs(self, opt_state):
        """(loss, grads, step) jitted functions. Inputs: weights, x [T, D], y [T, D] (+ state)."""
        tok = P(FSDP, None)
        zero1 = self.case.strategy == "zero1"
        loss_out, grad_specs = P(FSDP), (self.master_specs if zero1 else self.compute_specs)

        def compute_weights(w):  # ZeRO-1 computes with replicated low-precision weights it is given
            return w if zero1 else self._cast(w)

        def loss(w, x, y):
            return self._local_loss(compute_weights(w), x.astype(self.dtype), y)[None]

        def grads(w, x, y):
            return self._loss_and_grads(compute_weights(w), x.astype(self.dtype), y)

        def step(w, master, opt_state, x, y):
            loss_share, g, dx = self._loss_and_grads(compute_weights(w if zero1 else master), x.astype(self.dtype), y)
            master, opt_state = self._update(master, opt_state, g)
            if zero1:
                w = jax.tree.map(lambda m: _all_gather_invariant(m.astype(self.dtype), FSDP, 0), master)
            return loss_share, dx, w, master, opt_state

        w_in = self.compute_specs if zero1 else self.master_specs
        opt_specs = self._opt_specs(opt_state)
        return (self._shard_map(loss, (w_in, tok, tok), loss_out),
                self._shard_map(grads, (w_in, tok, tok), (loss_out, grad_specs, tok)),
                self._shard_map(step, (w_in, self.master_specs, opt_specs, tok, tok),
                                (loss_out, tok, w_in, self.master_specs, opt_specs)))

    # ---- host side ---------------------------------------------------------------------
    def arguments(self, inputs: TrainInputs):
        """(weights, master, opt_state, x, y) as sharded global arrays."""
        put = lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec))
        # host arrays put sharded, Adam's zeros made from the shards: no whole copy on one device
        master = jax.tree.map(put, {f"block_{i}": {"w1": inputs.w1[i], "w2": inputs.w2[i]}
                                    for i in range(self.case.blocks)}, self.master_specs)
        opt_state = self.opt.init(master)
        opt_state = jax.tree.map(put, opt_state, self._opt_specs(opt_state))
        weights = master
        if self.case.strategy == "zero1":
            weights = jax.tree.map(put, self._cast(master), self.compute_specs)
        x, y = (put(a, P(FSDP, None)) for a in (inputs.x, inputs.y))
        return weights, master, opt_state, x, y


def make_mesh(case: TrainCase, devices=None):
    devices = jax.devices()[: case.devices] if devices is None else devices
    if len(devices) < case.devices:
        raise ValueError(f"{case.name} needs {case.devices} devices, JAX has {len(devices)}")
    return jax.sharding.Mesh(np.array(devices).reshape(case.fsdp, case.tp), (FSDP, TP))


def _stack(tree, key):
    return np.stack([np.asarray(tree[f"block_{i}"][key], np.float64) for i in range(len(tree))])


def run_step(case: TrainCase, inputs: TrainInputs) -> dict[str, np.ndarray]:
    """One training step; the same keys as ``parity.training.reference.reference_step``."""
    step = Step(case, make_mesh(case))
    weights, master, opt_state, x, y = step.arguments(inputs)
    _, grads_fn, step_fn = step.programs(opt_state)
    loss, g, dx = grads_fn(weights, x, y)
    _, _, _, new_master, _ = step_fn(weights, master, opt_state, x, y)
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    g = jax.tree.map(f64, g)
    return {"loss": np.sum(f64(loss)), "dx": f64(dx), "dw1": _stack(g, "w1"), "dw2": _stack(g, "w2"),
            "new_w1": _stack(new_master, "w1"), "new_w2": _stack(new_master, "w2")}


def compiled_texts(case: TrainCase) -> list[str]:
    """The optimized HLO of the compiled loss, loss+grads and full-step programs of ``case``."""
    step = Step(case, make_mesh(case))
    weights, master, opt_state, x, y = step.arguments(make_train_inputs(case))
    loss_fn, grads_fn, step_fn = step.programs(opt_state)
    return [loss_fn.lower(weights, x, y).compile().as_text(), grads_fn.lower(weights, x, y).compile().as_text(),
            step_fn.lower(weights, master, opt_state, x, y).compile().as_text()]


def measure_traffic(case: TrainCase, texts: list[str] | None = None):
    """Per-device collectives of the compiled loss, loss+grads and full-step programs, split
    into fwd / bwd / step passes (``Traffic``); ``texts``: those programs, already compiled."""
    from ..accounting.hlo import split_passes

    return split_passes(*(texts or compiled_texts(case)))
