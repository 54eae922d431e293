"""Worker tasks of tests/multidevice/test_hf.py (importable by spawned gloo workers): a tiny
Hugging Face decoder trained sequence-parallel through torch_impl.hf, and the same model without
sequence parallelism, from the same seed."""

from __future__ import annotations

IGNORE = -100


SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0, head_dim=8)


def tiny_config(kind: str, **overrides):
    """A tiny random config of a model family the keyword census covers (no download)."""
    import transformers

    make = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig,
            "gpt_oss": transformers.GptOssConfig}[kind]
    extra = {"mistral": {"sliding_window": 5}, "gpt_oss": {"num_local_experts": 2, "num_experts_per_tok": 1}}
    return make(**{**SIZES, **extra.get(kind, {}), **overrides})


def tiny_model(kind: str, seed: int = 0, overrides: dict | None = None):
    """A tiny random causal LM of ``kind`` (llama, mistral with sliding window 5, ...), float32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **(overrides or {})))


DOCUMENTS = (11, 5, 16)  # a packed row: three documents (lengths), crossing shard edges


def batch(seed: int = 1, b: int = 2, t: int = 32, packed: bool = False):
    """(input_ids, position_ids, labels, segment_ids) [b, t] in original order; labels shifted in
    original order, inside each document; positions restart at each document when ``packed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (b, t), generator=gen)
    lengths = DOCUMENTS if packed else (t,)
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(b, t)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(b, t)
    labels = torch.full_like(ids, IGNORE)
    same = segments[:, 1:] == segments[:, :-1]
    labels[:, :-1] = torch.where(same, ids[:, 1:], IGNORE)
    return ids, positions, labels, segments


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


def plain_task(kind: str, steps: int, packed: bool = False, overrides: dict | None = None, b: int = 2):
    """The same model without sequence parallelism (eager attention, whole sequence; packed
    documents through Hugging Face's own packed-sequence mask, read from the restarting positions;
    ``overrides``: of the model's config; ``b`` batch rows)."""
    model = tiny_model(kind, overrides=overrides)
    model.set_attn_implementation("eager")
    ids, pos, labels, _ = batch(packed=packed, b=b)
    count = int((labels != IGNORE).sum())
    losses, grads = train(model, steps, lambda m: loss_sum(m(input_ids=ids, position_ids=pos, use_cache=False).logits,
                                                           labels) / count)
    return [float(x) for x in losses], {n: g.double().numpy() for n, g in grads.items()}


def sequence_parallel_task(kind: str, axes: tuple, layout: str, steps: int, packed: bool = False,
                           mode: str = "segment_ids", overrides: dict | None = None, b: int = 2):
    """Runs on every rank: the model on this rank's shard, ringbridge attention over ``axes``
    (packed documents through the ``segment_ids`` keyword, or as DataCollatorWithFlattening marks
    them: ``mode="positions"`` only through the restarting ``position_ids`` (its default),
    ``"cu_seq_lens"`` with its flash-attention keywords of the global row
    (``return_flash_attn_kwargs=True``, one row: ``b=1``), ``"seq_idx"`` with the global row's
    document index (``return_seq_idx=True``); ``overrides``: of the model's config)."""
    import torch
    import torch.distributed as dist

    from parity.runners.torch_world import make_mesh
    from torch_impl.hf import local_shard, register

    mesh = make_mesh("cpu", axes)
    model = tiny_model(kind, overrides=overrides)
    model.set_attn_implementation(register(mesh, layout=layout))
    whole = batch(packed=packed, b=b)
    ids, pos, labels, segments = (local_shard(x, mesh, layout) for x in whole)
    count = torch.tensor([float((labels != IGNORE).sum())])
    dist.all_reduce(count)
    lengths = torch.tensor(DOCUMENTS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    extra = {"segment_ids": {"segment_ids": segments.contiguous()}, "positions": {},
             "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
                             "max_length_k": int(lengths.max())},
             "seq_idx": {"seq_idx": whole[3].contiguous()}}[mode] if packed else {}

    def run(m):
        share = loss_sum(m(input_ids=ids, position_ids=pos, use_cache=False, **extra).logits, labels) / count[0]
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
    ids, pos, _, _ = (local_shard(x, mesh) for x in batch())
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    try:
        model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
    except ValueError as err:
        return str(err)
    return "no error"


def segment_ids_task(axes: tuple, layout: str):
    """Every way a packed batch can reach torch_impl.hf, on this rank's shard: (mode, derived ids,
    the true ids sharded) — for each mode of DataCollatorWithFlattening and an explicit keyword."""
    import torch

    from parity.runners.torch_world import make_mesh
    from torch_impl.hf import local_shard, packed_segment_ids

    mesh = make_mesh("cpu", axes)
    _, positions, _, segments = batch(b=1, packed=True)
    t = local_shard(segments, mesh, layout).shape[1]
    lengths = torch.tensor(DOCUMENTS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    modes = {"positions": {"position_ids": local_shard(positions, mesh, layout)},
             "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
                             "max_length_k": int(lengths.max())},
             "seq_idx (global)": {"seq_idx": segments},
             "seq_idx (shard)": {"seq_idx": local_shard(segments, mesh, layout)},
             "unpacked positions": {"position_ids": local_shard(torch.arange(32)[None], mesh, layout)}}
    want = local_shard(segments, mesh, layout)
    out = []
    for mode, kwargs in modes.items():
        got = packed_segment_ids(kwargs, mesh, layout, 1, t, torch.device("cpu"))
        out.append((mode, None if got is None else got.numpy(), want.numpy()))
    return out


def refused_task(kind: str, overrides: dict, call: dict):
    """The message of the ValueError a model call raises (or "no error")."""
    from parity.runners.torch_world import make_mesh
    from torch_impl.hf import local_shard, register

    mesh = make_mesh("cpu", (("ring", 2),))
    model = tiny_model(kind, overrides=overrides)
    model.set_attn_implementation(register(mesh))
    ids, pos, _, _ = (local_shard(x, mesh) for x in batch())
    try:
        model(input_ids=ids, position_ids=pos, **{"use_cache": False, **call})
    except ValueError as err:
        return str(err)
    return "no error"
