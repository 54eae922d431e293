"""The float64 truth computed by torch on a device: the oracle for sizes the NumPy oracle
(``parity.core.reference``) cannot afford on a host (a GPU-sized case: 8192 tokens, 8 heads, d 128
is a 4 GB float64 score matrix per tensor; on an H100 this takes well under a second).

Same mathematics as ``parity.core.reference`` — dense scores (soft-capped when asked), a mask,
attention sinks, the textbook analytic backward with the lse cotangent — in float64, one query head at a time (memory:
one [b, t, s] float64 matrix and its temporaries). A row with no visible key (the first row of a
strict block) gets o = 0, lse = −inf (with sinks: its sink) and no gradient, as the block kernels
define it.

    q, do: [b, t, h, d]; k, v: [b, s, hk, d]; dlse: [b, h, t] or None; visible: [t, s] or [b, t, s] bool or None;
    sinks: [h] or None; softcap: a float or None
    -> {"o": [b, t, h, d], "lse": [b, h, t], "dq", "dk", "dv"(, "dsinks": [h])} float64 tensors on the inputs' device
"""

from __future__ import annotations

import numpy as np

from ..core.cases import Case
from ..core.inputs import Inputs

__all__ = ["dense_truth", "case_truth"]


def dense_truth(q, k, v, do, dlse=None, *, visible=None, scale: float | None = None, sinks=None,
                softcap: float | None = None) -> dict:
    """float64 attention and its gradients for the cotangents (do, dlse) (module docstring). With
    ``sinks``, lse includes exp(sinks[h]) and dsinks[h] = −Σ_rows P_sink·(D − dlse). With
    ``softcap``, every scaled logit x is softcap·tanh(x / softcap) and dS gains its slope."""
    import torch

    f64 = torch.float64
    q, k, v, do = (x.to(f64) for x in (q, k, v, do))
    b, t, h, d = q.shape
    hk = k.shape[2]
    if h % hk:
        raise ValueError(f"heads % kv_heads must be 0, got heads={h}, kv_heads={hk}")
    scale = d**-0.5 if scale is None else float(scale)
    group = h // hk
    out = {"o": torch.zeros_like(q), "lse": torch.empty(b, h, t, dtype=f64, device=q.device),
           "dq": torch.zeros_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v)}
    empty = None if visible is None else ~visible.any(-1)  # [t] or [b, t]
    if sinks is not None:
        out["dsinks"] = torch.zeros(h, dtype=f64, device=q.device)
    for head in range(h):
        kh, vh, qh, doh = k[:, :, head // group], v[:, :, head // group], q[:, :, head], do[:, :, head]
        scores, slope = torch.einsum("btd,bsd->bts", qh, kh) * scale, 1.0
        if softcap is not None:
            tanh = torch.tanh(scores / softcap)
            scores, slope = tanh * softcap, 1.0 - tanh * tanh
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty[..., None], 0.0)
        lse = torch.logsumexp(scores, dim=-1)  # [b, t]
        p = torch.exp(scores - lse[..., None])
        if visible is not None:
            p = p.masked_fill(~visible, 0.0).masked_fill(empty[..., None], 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        if sinks is not None:  # one more logit per row, no value vector: rescale the keys' probabilities
            lse_f = torch.logaddexp(lse, sinks[head].to(f64))
            p, lse = p * torch.exp(lse - lse_f)[..., None], lse_f
        o = torch.einsum("bts,bsd->btd", p, vh)
        delta = (doh * o).sum(-1) - (0.0 if dlse is None else dlse[:, head].to(f64))  # [b, t]
        if sinks is not None:
            out["dsinks"][head] = -(torch.exp(sinks[head].to(f64) - lse) * delta).sum()
        ds = p * (torch.einsum("btd,bsd->bts", doh, vh) - delta[..., None]) * slope
        out["o"][:, :, head], out["lse"][:, head] = o, lse
        out["dq"][:, :, head] = torch.einsum("bts,bsd->btd", ds, kh) * scale
        out["dk"][:, :, head // group] += torch.einsum("bts,btd->bsd", ds, qh) * scale
        out["dv"][:, :, head // group] += torch.einsum("bts,btd->bsd", p, doh)
        del scores, p, ds, slope
    return out


def case_truth(case: Case, x: Inputs, device: str) -> dict[str, np.ndarray]:
    """The oracle's answer for a parity case (inputs in original order, causal by position, packed
    documents by their ids, the window by position, the sinks, the soft-cap), computed by :func:`dense_truth`
    on ``device``; float64 NumPy arrays like ``inputs.oracle``."""
    import torch

    q, k, v, do, dlse = (torch.tensor(a, dtype=torch.float64, device=device) for a in (x.q, x.k, x.v, x.do, x.dlse))
    visible = torch.ones(case.seq, case.seq, dtype=torch.bool, device=device).tril() if case.causal else None
    if x.segment_ids is not None:
        ids = torch.tensor(x.segment_ids, device=device)
        same = ids[:, :, None] == ids[:, None, :]  # [b, t, s]
        visible = same if visible is None else same & visible
    if case.window is not None:
        pos = torch.arange(case.seq, device=device)
        offset = pos[None, :] - pos[:, None]  # [t, s]: key minus query position
        inside = (offset >= -case.window[0]) & (offset <= case.window[1])
        visible = inside if visible is None else visible & inside
    sinks = None if x.sinks is None else torch.tensor(x.sinks, dtype=torch.float64, device=device)
    out = dense_truth(q, k, v, do, dlse, visible=visible, scale=case.scale, sinks=sinks, softcap=case.softcap)
    return {n: t.cpu().numpy() for n, t in out.items()}
