"""Worker tasks of tests/multidevice/test_hf.py (importable by spawned gloo workers): a tiny
Hugging Face decoder trained sequence-parallel through torch_impl.hf, and the same model without
sequence parallelism, from the same seed."""

from __future__ import annotations

IGNORE = -100


def tiny_model(kind: str, seed: int = 0):
    """A tiny random LlamaForCausalLM or MistralForCausalLM (sliding window 5), float32, no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(seed)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=5, **sizes))
    return LlamaForCausalLM(LlamaConfig(**sizes))


def batch(seed: int = 1, b: int = 2, t: int = 32):
    """(input_ids, position_ids, labels) [b, t] in original order; labels shifted in original order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (b, t), generator=gen)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return ids, torch.arange(t).expand(b, t), labels


def loss_sum(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def train(model, steps: int, run):
    """``steps`` Adam steps; ``run(model) -> (loss, count)``; (losses, first-step grads by name)."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run(model)
        loss.backward()
        sync_grads(model)
        losses.append(loss.detach())
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, first


def sync_grads(model):
    import torch.distributed as dist

    if dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad)


def plain_task(kind: str, steps: int):
    """The same model without sequence parallelism (eager attention, whole sequence)."""
    model = tiny_model(kind)
    model.set_attn_implementation("eager")
    ids, pos, labels = batch()
    count = int((labels != IGNORE).sum())
    losses, grads = train(model, steps, lambda m: loss_sum(m(input_ids=ids, position_ids=pos, use_cache=False).logits,
                                                           labels) / count)
    return [float(x) for x in losses], {n: g.double().numpy() for n, g in grads.items()}


def sequence_parallel_task(kind: str, axes: tuple, layout: str, steps: int):
    """Runs on every rank: the model on this rank's shard, ringbridge attention over ``axes``."""
    import torch
    import torch.distributed as dist

    from parity.runners.torch_world import make_mesh
    from torch_impl.hf import local_shard, register

    mesh = make_mesh("cpu", axes)
    model = tiny_model(kind)
    model.set_attn_implementation(register(mesh, layout=layout))
    ids, pos, labels = (local_shard(x, mesh, layout) for x in batch())
    count = torch.tensor([float((labels != IGNORE).sum())])
    dist.all_reduce(count)

    def run(m):
        share = loss_sum(m(input_ids=ids, position_ids=pos, use_cache=False).logits, labels) / count[0]
        return share

    shares, grads = train(model, steps, run)
    losses = []
    for share in shares:
        total = share.clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses, {n: g.double().numpy() for n, g in grads.items()}


def padding_refused_task(axes: tuple):
    """A padding mask is refused with a ValueError naming the constraint."""
    import torch

    from parity.runners.torch_world import make_mesh
    from torch_impl.hf import local_shard, register

    mesh = make_mesh("cpu", axes)
    model = tiny_model("llama")
    model.set_attn_implementation(register(mesh))
    ids, pos, _ = (local_shard(x, mesh) for x in batch())
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    try:
        model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
    except ValueError as err:
        return str(err)
    return "no error"
