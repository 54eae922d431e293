"""Plain dense attention in the inputs' own dtype: the low-precision *control* of the contract's (docs/contract.md)
numerics policy (what "attention run in the same dtype" means), differentiated by autograd.

Deliberately naive: scores, softmax and the weighted sum are each rounded to the input dtype, as a
framework's textbook attention would be. Not sequence-parallel and not for speed. In float64 it
is the truth the packed-document, window and sink tests compare with.
"""

from __future__ import annotations

import torch

from seqplan.validation import check_window


def dense_attention(q, k, v, *, causal: bool = False, scale: float | None = None, segment_ids=None, window=None,
                    sinks=None, softcap=None):
    """q: [b, t, h, d], k, v: [b, s, hk, d] in original token order -> (o [b, t, h, d], lse [b, h, t]).

    ``segment_ids``: packed documents, integer [b, t] in original order (self-attention: s = t):
    query i sees key j only if their ids are equal (and, causal, j <= i). ``window``: None, w or
    (left, right): query i sees key j only if i - left <= j <= i + right. ``sinks``: [h] logits
    (or None): each row's denominator gains exp(sinks[h]) with no value vector; lse includes it.
    ``softcap``: every scaled logit x becomes softcap · tanh(x / softcap), in the inputs' dtype
    (the sinks are not capped). The softmax runs in float32, or float64 for float64 inputs."""
    window = check_window(window)
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = None
    if causal:
        visible = torch.ones((t, k.shape[1]), dtype=torch.bool, device=q.device).tril()
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, t) or k.shape[1] != t:
            raise ValueError(f"segment_ids must be [batch, seq] = {(b, t)} with keys as long as queries, got ids "
                             f"{tuple(segment_ids.shape)} and {k.shape[1]} keys")
        same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, t, s]
        visible = same if visible is None else same & visible
    if window is not None:
        offset = torch.arange(k.shape[1], device=q.device)[None, :] - torch.arange(t, device=q.device)[:, None]
        inside = (offset >= -window[0]) & (offset <= window[1])  # [t, s]: key minus query position
        visible = inside if visible is None else visible & inside
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    lse = torch.logsumexp(scores.to(softmax_dtype), dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(softmax_dtype)[None, :, None])
    probs = torch.exp(scores.to(softmax_dtype) - lse.unsqueeze(-1)).to(q.dtype)
    return torch.einsum("bhts,bshd->bthd", probs, v), lse
