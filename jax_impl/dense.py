"""Plain dense attention in the inputs' own dtype: the low-precision *control* of the contract's (docs/contract.md)
numerics policy (what "attention run in the same dtype" means), differentiated by autodiff.

Deliberately naive: scores, softmax and the weighted sum are each rounded to the input dtype, as a
framework's textbook attention would be. Not sequence-parallel and not for speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqplan.validation import check_window


def dense_attention(q, k, v, *, causal: bool = False, scale: float | None = None, segment_ids=None, window=None,
                    sinks=None, softcap=None):
    """q: [b, t, h, d], k, v: [b, s, hk, d] in original token order -> (o [b, t, h, d], lse [b, h, t]).
    ``segment_ids`` [b, t] (self-attention, original order): a query sees only keys of its id.
    ``window`` (None, w or (left, right)): query i sees keys i - left..i + right. ``sinks`` [h]:
    each row's softmax gains a logit sinks[h] with no value (lse includes it). ``softcap``: every
    scaled logit x becomes softcap · tanh(x / softcap), in the inputs' dtype (the sinks are not capped)."""
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    group = h // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = (jnp.einsum("bthd,bshd->bhts", q, k) * jnp.asarray(scale, q.dtype)).astype(q.dtype)
    if softcap is not None:
        cap = jnp.asarray(softcap, q.dtype)
        scores = (cap * jnp.tanh(scores / cap)).astype(q.dtype)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), dtype=bool)), scores, -jnp.inf)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, t, s]
        scores = jnp.where(same[:, None], scores, -jnp.inf)
    window = check_window(window)
    if window is not None:
        i, j = jnp.arange(t)[:, None], jnp.arange(k.shape[1])[None, :]
        scores = jnp.where((j >= i - window[0]) & (j <= i + window[1]), scores, -jnp.inf)
    logits = scores.astype(jnp.float32)
    if sinks is not None:  # one more column per row, with no value vector
        sink = jnp.broadcast_to(sinks.astype(q.dtype).astype(jnp.float32)[None, :, None, None], (b, h, t, 1))
        logits = jnp.concatenate([logits, sink], axis=-1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])[..., :k.shape[1]].astype(q.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v), lse
