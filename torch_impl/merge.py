"""The stable LSE merge of two attention partials, written once for every algorithm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_partials(o, lse, o_b, lse_b):
    """Fold partial ``(o_b, lse_b)`` into ``(o, lse)``, in float32.

        o   ← o − σ(lse_b − lse)·(o − o_b)
        lse ← lse − log σ(lse − lse_b)

    o, o_b: [b, t, h, d]; lse, lse_b: [b, h, t]. An empty partial (lse_b = −inf) leaves (o, lse)
    unchanged; (o, lse) itself must be non-empty (the local diagonal block always is).
    """
    o, lse = o.float().clone(), lse.float().clone()
    merge_partials_into(o, lse, o_b, lse_b)
    return o, lse


def merge_partials_into(o, lse, o_b, lse_b) -> None:
    """``merge_partials`` in place: ``o`` and ``lse`` (float32) are overwritten, and the only
    temporary the size of ``o`` is ``o_b`` widened to float32 (none when it is float32 already) —
    the ring's forward merges R−1 times into the same accumulator, so this is what bounds its
    memory. ``o_b`` may be in the input dtype."""
    lse_b = lse_b.float()
    weight = torch.sigmoid(lse_b - lse)  # [b, h, t], from the old lse
    lse.sub_(F.logsigmoid(lse - lse_b))
    # o + σ·(o_b − o), the same update as o − σ·(o − o_b), in one pass over o: lerp reads o, o_b and
    # the row weights and writes o (its end in o's dtype: one widening copy of o_b first) — 18 bytes
    # an element of float32 traffic where a difference, a product and a subtraction moved 30.
    o.lerp_(o_b.to(o.dtype), weight.to(o.dtype).transpose(1, 2).unsqueeze(-1))  # lerp_ takes no mixed dtypes
