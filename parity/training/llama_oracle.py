"""The whole model's truth: the float64 *non-parallel* training step — the torch model of
``parity.training.llama_torch`` with ``mesh=None`` (dense attention on the whole sequence in
original order), every weight and activation in float64, ``torch.optim.Adam`` (β 0.9/0.999,
ε 1e-8) on the whole batch.

Why autograd in float64 and not hand-written NumPy gradients (as the attention oracle is): what
the whole-model check targets is the parallelisation — sharding, layouts, RoPE by original
position, labels shifted across shard edges, the loss normalised over every shard, FSDP's gathers
and reductions, the optimizer on shards — not autograd, which both frameworks' sequence-parallel
steps also use. The attention inside is the dense path the float64 attention oracle already
checks (``tests/unit/test_window_sinks_oracle.py``), and the JAX model, written separately in
flax, must agree with it too.
"""

from __future__ import annotations

from .llama import IGNORE, ModelCase, TrainResult
from .llama_torch import build_model, export, loss_sum


def train(case: ModelCase, steps: int | None = None) -> TrainResult:
    """``steps`` (default ``case.steps``) float64 steps on one device; the same ``TrainResult``."""
    import torch

    weights, batch = case.inputs()
    model = build_model(case.model, weights, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=case.lr, foreach=False)
    tokens, labels, positions, ids = (torch.as_tensor(a) for a in
                                      (batch.tokens, batch.labels, batch.positions, batch.segment_ids))
    count = int((labels != IGNORE).sum())
    losses, first = [], None
    for _ in range(steps or case.steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_sum(model(tokens, positions, ids), labels) / count
        loss.backward()
        if first is None:
            first = export({n: p.grad for n, p in model.named_parameters()}, case.model)
        losses.append(loss.item())
        opt.step()
    return TrainResult(losses, first, export(dict(model.named_parameters()), case.model))
