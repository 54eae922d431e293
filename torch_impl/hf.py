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
- logit soft-capping (``softcap``: Gemma 2's ``attn_logit_softcapping``, which Hugging Face applies
  to the scaled logits, softcap · tanh(x / softcap), as ringbridge defines it) -> ``softcap``
  (None: no cap; under ``block_backend="auto"`` capped blocks run on the portable kernel);
- packed documents, from whichever the batch carries (first match): ``segment_ids`` (a keyword
  of the model call, this rank's shard); ``seq_idx`` (``DataCollatorWithFlattening(return_seq_idx=True)``:
  this rank's shard, or the global row, which is sharded here); ``cu_seq_lens_q`` (``return_flash_attn_kwargs=True``:
  offsets of the global, original-order row; ``cu_seq_lens_k`` must equal it); ``position_ids``
  that restart (the collator's default): a document is a run over which original position minus
  position id stays constant — Hugging Face's own rule (positions step by one inside a
  document), computed per token, so it is exact on any layout's shard;
- refused: attention dropout > 0, a padding ``attention_mask`` with any zero (pack documents
  instead), a sliding window on a non-causal layer, and any keyword not in :data:`MAPPED` or
  :data:`HARMLESS`. Train with ``use_cache=False`` (generation is not sequence-parallel).
This module is torch_impl's only import of transformers; torch_impl itself never imports it.
"""

from __future__ import annotations

import torch

from seqplan.axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from seqplan.layouts import layout_permutation

from .api import sequence_parallel_attention

# Keywords the attention function reads (see the module docstring).
MAPPED = ("scaling", "dropout", "sliding_window", "s_aux", "softcap", "segment_ids", "seq_idx", "cu_seq_lens_q",
          "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")
# Keywords that reach the attention interface and change nothing ringbridge computes in training.
HARMLESS = {
    "output_attentions": "ringbridge returns no attention weights (None), as every fused implementation does",
    "use_cache": "read by the model around the attention; a cache that reaches it is refused",
    "cache_position": "cache bookkeeping; positions that matter arrive as position_ids",
    "past_key_values": "None in training; a cache is refused (check_keywords)",
    "position_embeddings": "RoPE is applied to q and k before the attention is called",
    "is_causal": "the layer's own module.is_causal is what decides",
    "output_router_logits": "a mixture-of-experts output flag (gpt-oss) that travels with the layer's keywords",
}


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
        check_keywords(kwargs)
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
        segment_ids = packed_segment_ids(kwargs, mesh, layout, query.shape[0], query.shape[2], query.device)
        o = sequence_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh, causal=causal, layout=layout,
            scale=scaling, kv_exchange=kv_exchange, block_backend=block_backend,
            segment_ids=segment_ids, window=window, sinks=kwargs.get("s_aux"), softcap=kwargs.get("softcap"))
        return o, None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def check_keywords(kwargs: dict) -> None:
    """ValueError for a keyword ringbridge would otherwise drop silently: not in MAPPED or
    HARMLESS, or a key/value cache."""
    unknown = sorted(set(kwargs) - set(MAPPED) - set(HARMLESS))
    if unknown:
        raise ValueError(f"ringbridge attention got keyword(s) {unknown} that it does not map; they would be ignored. "
                         "Drop them from the model call, or map them in torch_impl/hf.py (MAPPED / HARMLESS)")
    if kwargs.get("past_key_values") is not None:
        raise ValueError("ringbridge attention is for training: call the model with use_cache=False (a key/value "
                         "cache would append past tokens to this rank's shard)")


def _mesh_sizes(mesh) -> dict:
    return {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names or ())}


def _sequence_shards(mesh) -> int:
    sizes = _mesh_sizes(mesh)
    return sizes.get(RING, 1) * sizes.get(RING_OUTER, 1) * sizes.get(RING_INNER, 1) * sizes.get(ULYSSES, 1)


def _original_positions(mesh, layout: str, b: int, t: int, device):
    """[b, t] int64: the original position of every token of this rank's shard of length t."""
    row = torch.arange(t * _sequence_shards(mesh), device=device).expand(b * _mesh_sizes(mesh).get(DATA, 1), -1)
    return local_shard(row, mesh, layout)


def packed_segment_ids(kwargs: dict, mesh, layout: str, b: int, t: int, device):
    """This rank's ``segment_ids`` [b, t] from what the batch carries (module docstring), or None
    for one document per row."""
    if kwargs.get("segment_ids") is not None:
        return kwargs["segment_ids"]
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        return seq_idx if seq_idx.shape[1] == t else local_shard(seq_idx, mesh, layout)
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k, cu_q):
            raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q: ringbridge maps packed self-attention only "
                             "(pass segment_ids instead)")
        total = int(cu_q[-1])
        if b != 1 or _mesh_sizes(mesh).get(DATA, 1) != 1 or total != t * _sequence_shards(mesh):
            raise ValueError(f"cu_seq_lens_q describes one flattened row of {total} tokens; this rank holds {b} row(s) "
                             f"of {t} of a {t * _sequence_shards(mesh)}-token sequence: pass segment_ids for this "
                             "shard instead")
        ids = torch.searchsorted(cu_q.to(device)[1:], torch.arange(total, device=device), right=True)
        return local_shard(ids[None], mesh, layout)
    positions = kwargs.get("position_ids")
    if positions is not None:
        start = _original_positions(mesh, layout, b, t, positions.device) - positions.expand(b, -1)
        return None if bool(torch.all(start == start[:, :1])) else start
    return None


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
