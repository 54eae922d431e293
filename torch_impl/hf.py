"""Hugging Face transformers (5.x) models, sequence-parallel through torch_impl: ``register`` adds
ringbridge as an attention implementation (``transformers.AttentionInterface``) bound to a
``DeviceMesh``; ``local_shard`` cuts each rank's part of a [batch, seq] tensor in layout order.

    name = register(mesh, layout="zigzag")             # once per process
    model.set_attn_implementation(name)                # any decoder that calls the attention interface
    logits = model(input_ids=local_shard(ids, mesh, "zigzag"),
                   position_ids=local_shard(positions, mesh, "zigzag")).logits

Each rank runs the model on its local shard; ``position_ids`` must be the tokens' ORIGINAL positions
(RoPE then never sees the layout). Labels must be shifted in original order before sharding — the
model's own ``labels=`` shifts inside the local shard, which is wrong at every shard edge — and the
loss divided by the labelled count of the whole global batch, gradients summed over ranks.

What maps, and what is refused (a ValueError before any collective, never a silent guess):
- causal decoders (``module.is_causal``); ``scaling``; GQA;
- ``sliding_window`` w (Mistral, Gemma, gpt-oss: a key is seen when q - w < k <= q) -> ``window=(w - 1, 0)``;
- attention sinks (gpt-oss's ``s_aux``) -> ``sinks``;
- packed documents: pass ``segment_ids=local_shard(ids, ...)`` as a keyword of the model call;
- refused: attention dropout > 0, a padding ``attention_mask`` with any zero (pack documents
  instead), a sliding window on a non-causal layer. Train with ``use_cache=False`` (generation is
  not sequence-parallel).
This module is torch_impl's only import of transformers; torch_impl itself never imports it.
"""

from __future__ import annotations

import torch

from seqplan.axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from seqplan.layouts import layout_permutation

from .api import sequence_parallel_attention


def hf_window(sliding_window: int | None) -> tuple[int, int] | None:
    """ringbridge's ``window`` for Hugging Face's ``sliding_window`` w (query q sees keys
    q - w < k <= q): ``(w - 1, 0)``; None stays None."""
    return None if sliding_window is None else (int(sliding_window) - 1, 0)


def _no_mask(*args, attention_mask=None, **kwargs):
    """The mask builder of the registered implementation: ringbridge builds its masks from
    ``causal``, ``window`` and ``segment_ids`` itself; a padding mask cannot be honoured."""
    if attention_mask is not None and not bool(torch.all(attention_mask.bool())):
        raise ValueError("ringbridge attention takes no padding mask (attention_mask has zeros): pack documents "
                         "and pass segment_ids instead")
    return None


def register(mesh, *, layout: str = "zigzag", name: str = "ringbridge", kv_exchange: str = "ring",
             block_backend: str = "auto") -> str:
    """Register ringbridge attention over ``mesh`` under ``name`` (and a mask builder that builds
    none); returns ``name`` for ``model.set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query: [b, h, t, d], key, value: [b, hk, t, d] (local shards) -> ([b, t, h, d], None)."""
        if dropout:
            raise ValueError(f"ringbridge attention has no dropout, got dropout={dropout}")
        if attention_mask is not None:
            raise ValueError("ringbridge attention builds its own masks; got an attention_mask tensor (register() "
                             "installs a mask builder that returns none: was the model's mask built elsewhere?)")
        causal = bool(getattr(module, "is_causal", True))
        sliding = kwargs.get("sliding_window")
        if sliding is not None and not causal:
            raise ValueError("a sliding window is mapped for causal layers only (Hugging Face's overlay is causal)")
        window = hf_window(sliding)
        o = sequence_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh, causal=causal, layout=layout,
            scale=scaling, kv_exchange=kv_exchange, block_backend=block_backend,
            segment_ids=kwargs.get("segment_ids"), window=window, sinks=kwargs.get("s_aux"))
        return o, None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def local_shard(x, mesh, layout: str = "zigzag"):
    """This rank's part of a global [b, T, ...] tensor in original order: permuted into ``layout``
    over the mesh's ring × Ulysses split, then its data rows and sequence block r·U + u."""
    names = mesh.mesh_dim_names or ()
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    coords = dict(zip(names, mesh.get_coordinate()))
    inner = sizes.get(RING_INNER, 1)
    ring_size = sizes.get(RING, 1) * sizes.get(RING_OUTER, 1) * inner
    r = coords.get(RING, 0) + coords.get(RING_OUTER, 0) * inner + coords.get(RING_INNER, 0)
    uly = sizes.get(ULYSSES, 1)
    block = r * uly + coords.get(ULYSSES, 0)
    b, seq = x.shape[0] // sizes.get(DATA, 1), x.shape[1] // (ring_size * uly)
    perm = torch.as_tensor(layout_permutation(x.shape[1], layout, ring_size, uly), device=x.device)
    d = coords.get(DATA, 0)
    return x[d * b:(d + 1) * b].index_select(1, perm)[:, block * seq:(block + 1) * seq]
