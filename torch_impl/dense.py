"""Plain dense attention in the inputs' own dtype: the low-precision *control* of the contract's (docs/contract.md)
numerics policy (what "attention run in the same dtype" means), differentiated by autograd.

Deliberately naive: scores, softmax and the weighted sum are each rounded to the input dtype, as a
framework's textbook attention would be. Not sequence-parallel and not for speed.
"""

from __future__ import annotations

import torch


def dense_attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """q: [b, t, h, d], k, v: [b, s, hk, d] in original token order -> (o [b, t, h, d], lse [b, h, t])."""
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        visible = torch.ones((t, k.shape[1]), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.exp(scores.float() - lse.unsqueeze(-1)).to(q.dtype)
    return torch.einsum("bhts,bshd->bthd", probs, v), lse
