"""The tiny Llama decoder in torch (``torch_impl.layers`` for attention) and its sequence-parallel
training over a torch.distributed world — gloo on CPU, NCCL on GPUs.

Each rank feeds its shard of the case's batch in layout order (data shard, sequence block r·U + u)
and runs the same model; attention is ``torch_impl.sequence_parallel_attention`` over the case's
mesh. Weights are either
- FSDP (``case.fsdp``): FSDP2 ``fully_shard`` over a 1-D mesh of every rank (the data and sequence
  ranks together, as torchtitan shards over data × context-parallel ranks), one unit per
  weight-holding module — each Linear, norm, embedding, and the attention layer for its sinks — so
  one all-gather (forward), one again (backward) and one reduce-scatter per weight; or
- replicated, with one all-reduce per gradient after the backward.
The loss is Σ cross-entropy over this rank's labelled tokens / the labelled count of the whole
global batch (one all-reduce of the local counts), so the gradients' sum over ranks is the
gradient of the global mean. Adam from ``torch.optim`` on the float32 weights (or their shards).

Weight names: ``parity.training.llama`` (canonical, math orientation); here nn.Linear holds Wᵀ.
"""

from __future__ import annotations

import numpy as np

from ..runners.torch_world import get_world, make_mesh
from .llama import IGNORE, LlamaConfig, ModelCase, TokenBatch, TrainResult


def _modules():
    """The model's classes, defined on first use (this module imports without torch)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from torch_impl.layers import AttentionLayerConfig, SequenceParallelAttention

    class RMSNorm(nn.Module):
        """x · rsqrt(mean(x²) + eps) · weight, in float32 (float64 for float64 x)."""

        def __init__(self, width: int, eps: float, dtype):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(width, dtype=dtype))

        def forward(self, x):
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            normed = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps)
            return (normed * self.weight).to(x.dtype)

    class DecoderLayer(nn.Module):
        def __init__(self, config: LlamaConfig, layout: str, kv_exchange: str, mesh, attention, dtype):
            super().__init__()
            c = config
            attn_config = AttentionLayerConfig(c.d_model, c.heads, c.kv_heads, c.head_dim, rope_theta=c.rope_theta,
                                               causal=True, layout=layout, window=c.window, sinks=c.sinks,
                                               kv_exchange=kv_exchange)
            self.attn_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
            self.attn = SequenceParallelAttention(attn_config, mesh, attention=attention, dtype=dtype)
            self.mlp_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
            self.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False, dtype=dtype)
            self.w_up = nn.Linear(c.d_model, c.d_ff, bias=False, dtype=dtype)
            self.w_down = nn.Linear(c.d_ff, c.d_model, bias=False, dtype=dtype)

        def forward(self, x, positions, segment_ids):
            h = x + self.attn(self.attn_norm(x), positions, segment_ids)
            m = self.mlp_norm(h)
            return h + self.w_down(F.silu(self.w_gate(m)) * self.w_up(m))

    class Llama(nn.Module):
        """tokens, positions, segment_ids: [b, t] -> logits [b, t, V] (float32 or wider)."""

        def __init__(self, config: LlamaConfig, layout: str = "zigzag", kv_exchange: str = "ring", mesh=None,
                     attention=None, dtype=torch.float32):
            super().__init__()
            c = self.config = config
            self.embed = nn.Embedding(c.vocab, c.d_model, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(c, layout, kv_exchange, mesh, attention, dtype) for _ in range(c.layers))
            self.final_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
            self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab, bias=False, dtype=dtype)

        def forward(self, tokens, positions, segment_ids):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, positions, segment_ids)
            x = self.final_norm(x)
            logits = x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)
            return logits.to(torch.promote_types(logits.dtype, torch.float32))

    return Llama


def build_model(config: LlamaConfig, weights: dict[str, np.ndarray] | None = None, *, layout: str = "zigzag",
                kv_exchange: str = "ring", mesh=None, attention=None, dtype=None, device=None):
    """The model (``mesh=None``: not parallel, whole sequence in original order), with ``weights``
    (canonical names) loaded when given."""
    import torch

    model = _modules()(config, layout, kv_exchange, mesh, attention, dtype or torch.float32)
    if weights is not None:
        load_weights(model, weights)
    return model.to(device) if device is not None else model


def _parameter_name(name: str) -> tuple[str, bool]:
    """(torch parameter path, transposed) of a canonical weight name."""
    leaf = name.rsplit(".", 1)[-1]
    prefix = name[: -len(leaf)]
    if leaf in ("wq", "wk", "wv", "wo"):
        return f"{prefix}attn.{leaf}.weight", True
    if leaf == "sinks":
        return f"{prefix}attn.sinks", False
    if leaf in ("w_gate", "w_up", "w_down", "lm_head"):
        return f"{prefix}{leaf}.weight", True
    return f"{name}.weight", False  # embed, norms


def load_weights(model, weights: dict[str, np.ndarray]) -> None:
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            path, transposed = _parameter_name(name)
            p = params[path]
            p.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transposed else value)).to(p.dtype))


def export(tensors: dict[str, object], config: LlamaConfig) -> dict[str, np.ndarray]:
    """Canonical float64 arrays from torch parameter paths -> full tensors (or their grads)."""
    from .llama import weight_shapes

    out = {}
    for name in weight_shapes(config):
        path, transposed = _parameter_name(name)
        a = tensors[path].detach().double().cpu().numpy()
        out[name] = a.T.copy() if transposed else a
    return out


def loss_sum(logits, labels):
    """Σ cross-entropy over the labelled tokens (float32 or wider)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), ignore_index=IGNORE,
                           reduction="sum")


def local_batch(case: ModelCase, batch: TokenBatch, coords: dict) -> TokenBatch:
    """This rank's shard of the layout-ordered ``batch``: its data rows and sequence block r·U + u."""
    from ..core.mesh import sequence_block

    block = sequence_block(coords, case.mesh.axes)
    rows = case.batch // case.mesh.data
    t = case.seq // (case.mesh.ring * case.mesh.ulysses)
    d = coords.get("data", 0)
    take = lambda a: a[d * rows:(d + 1) * rows, block * t:(block + 1) * t]
    return TokenBatch(take(batch.tokens), take(batch.labels), take(batch.positions), take(batch.segment_ids),
                      batch.order[block * t:(block + 1) * t])


class Rig:
    """One rank's model, optimizer and inputs."""

    def __init__(self, case: ModelCase, device_type: str, dtype: str = "float32", batch: TokenBatch | None = None):
        """``dtype``: the model's (weights, activations, gradients, Adam state); ``batch``: the
        global batch in original order (default: the case's packed corpus)."""
        import torch

        self.case = case
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        self.mesh = make_mesh(device_type, tuple(case.mesh.axes.items()))
        self.coords = dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))
        weights, corpus = case.inputs()
        batch = corpus if batch is None else batch
        case.check_batch(batch)
        self.batch = local_batch(case, batch.permuted(case.permutation()), self.coords)
        model = build_model(case.model, weights, layout=case.layout, kv_exchange=case.mesh.kv_exchange, mesh=self.mesh,
                            device=self.device, dtype=getattr(torch, dtype))
        if case.fsdp:
            from torch.distributed.fsdp import fully_shard

            flat = make_mesh(device_type, (("fsdp", case.mesh.devices),))  # every rank, built once per process
            for unit in fsdp_modules(model, case):
                fully_shard(unit, mesh=flat)
            fully_shard(model, mesh=flat)
            for module in model.modules():  # each unit reduces its own gradients: sum, not mean
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self.model = model
        # on the GPU Adam's list form: per parameter, each of its ops on FSDP's DTensors is a
        # host-side dispatch of its own (the CPU checks keep the per-parameter loop they were built on)
        self.opt = torch.optim.Adam(model.parameters(), lr=case.lr, foreach=device_type == "cuda")
        as_tensor = lambda a: torch.as_tensor(a, device=self.device)
        b = self.batch  # on the device once: every step feeds the same batch
        self._tensors = (as_tensor(b.tokens), as_tensor(b.labels), as_tensor(b.positions),
                         as_tensor(b.segment_ids) if case.segment_ids else None)
        self._labelled = float((b.labels != IGNORE).sum())  # from the host copy: no device sync a step

    def tensors(self):
        return self._tensors

    def step(self, tracer, keep_grads: bool = True):
        """One training step, each pass under ``tracer.phase``; (this rank's loss share, grads by
        path — or None without ``keep_grads``, as a timed step runs)."""
        import torch
        import torch.distributed as dist

        tokens, labels, positions, ids = self.tensors()
        self.opt.zero_grad(set_to_none=True)
        with tracer.phase("fwd"):
            count = torch.tensor([self._labelled], device=self.device)
            dist.all_reduce(count)  # the global batch's labelled tokens: the loss's denominator
            loss = loss_sum(self.model(tokens, positions, ids), labels) / count[0]
        with tracer.phase("bwd"):
            loss.backward()
            if not self.case.fsdp:
                for p in self.model.parameters():
                    dist.all_reduce(p.grad)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()} if keep_grads else None
        with tracer.phase("step"):
            self.opt.step()
        return loss.item(), grads


def fsdp_modules(model, case: ModelCase) -> list:
    """The modules wrapped as FSDP2 units before the root, children before parents (a parent's
    unit then holds only what no child unit holds), as ``llama.fsdp_groups`` lists their weights:
    ``"weight"`` — every module holding weights of its own (the attention layer: its sinks);
    ``"block"`` — each decoder block and the embedding. A tied embedding stays with the root unit,
    which holds it gathered from the lookup to the logits."""
    tied = case.model.tie_embeddings
    if case.fsdp_units == "block":
        return ([] if tied else [model.embed]) + list(model.layers)
    units = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))
             and not (tied and m is model.embed)]
    return units[::-1]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_grads(grads: dict, config) -> dict[str, np.ndarray]:
    """A rank's gradients by parameter path (FSDP's shards gathered: a collective, every rank
    calls it) as the exported full arrays by weight name."""
    return export({n: _full(g) for n, g in grads.items()}, config)


def train_task(case: ModelCase, steps: int, device_type: str) -> dict:
    """Runs on every rank: ``steps`` traced training steps. Returns the loss shares and the first
    step's traffic; rank 0 also the first step's full gradients and the final full weights."""
    import torch.distributed as dist

    from ..accounting.torch_trace import CommTracer

    rig = Rig(case, device_type)
    losses, first_grads, traffic = [], None, None
    for i in range(steps):
        if i == 0:
            with CommTracer() as tracer:
                loss, grads = rig.step(tracer)
            traffic, first_grads = tracer.traffic.rows(), full_grads(grads, case.model)
        else:
            loss, _ = rig.step(CommTracer())  # never entered: its phases only label
        losses.append(loss)
    weights = {n: _full(p) for n, p in rig.model.named_parameters()}
    out = {"losses": losses, "traffic": traffic}
    if dist.get_rank() == 0:
        out["grads"], out["weights"] = first_grads, export(weights, case.model)
    return out


def _run(case: ModelCase, steps: int, devices: str) -> list[dict]:
    backend, device_type = ("nccl", "cuda") if devices == "gpu" else ("gloo", "cpu")
    return get_world(case.mesh.devices, backend).run(train_task, case, steps, device_type)


def train(case: ModelCase, steps: int | None = None, *, devices: str = "cpu") -> TrainResult:
    """``steps`` (default ``case.steps``) sequence-parallel training steps of ``case``."""
    ranks = _run(case, steps or case.steps, devices)
    root = next(r for r in ranks if "grads" in r)
    losses = [float(sum(r["losses"][i] for r in ranks)) for i in range(len(root["losses"]))]
    return TrainResult(losses, root["grads"], root["weights"])


def measure_traffic(case: ModelCase, *, devices: str = "cpu"):
    """Per-device ``Traffic`` of one training step (fwd / bwd / step); every rank must agree."""
    from ..accounting.torch_trace import same_on_every_rank

    return same_on_every_rank([r["traffic"] for r in _run(case, 1, devices)])
