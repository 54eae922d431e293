"""The oracle itself. Everything else is judged against parity.core.reference, so it is
checked against an independent derivation: torch float64 autograd of the textbook formula."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core import reference
from parity.core.inputs import round_to_dtype

torch = pytest.importorskip("torch")


def _autograd(q, k, v, do, dlse, *, causal, scale, q_pos, k_pos):
    """(o, lse, dq, dk, dv) by torch autograd, float64, KV heads expanded by repeat_interleave."""
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, ke) * scale
    if causal:
        allowed = torch.tensor(k_pos)[None, :] <= torch.tensor(q_pos)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), ve)
    (o * torch.tensor(do)).sum().add((lse * torch.tensor(dlse)).sum()).backward()
    return [t.detach().numpy() for t in (o, lse, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_oracle_matches_float64_autograd(heads, kv_heads, causal, layout, seed):
    """o, lse and the analytic dq, dk, dv (with an lse cotangent) equal autograd in float64, for
    inputs in layout order masked by original positions and a non-default scale."""
    rng = np.random.default_rng(seed)
    b, t, d, scale = 2, 24, 8, 0.37
    q, do = rng.standard_normal((2, b, t, heads, d))
    k, v = rng.standard_normal((2, b, t, kv_heads, d))
    dlse = rng.standard_normal((b, heads, t))
    pos = reference.layout_permutation(t, layout, ring_size=3)
    fwd = reference.attention_forward(q, k, v, causal=causal, scale=scale, q_pos=pos, k_pos=pos)
    got = [fwd.o, fwd.lse, *reference.attention_backward(fwd, q, k, v, do, dlse, scale=scale)]
    want = _autograd(q, k, v, do, dlse, causal=causal, scale=scale, q_pos=pos, k_pos=pos)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("softcap", [0.7, 4.0])
def test_oracle_softcap_matches_float64_autograd(softcap, seed):
    """Soft-capped (every scaled logit x -> softcap·tanh(x / softcap), before the mask), with GQA, a
    causal window in layout order and sinks that stay uncapped: o, lse, dq, dk, dv and dsinks of
    the analytic oracle equal torch float64 autograd of that formula; the cap changes every one
    of them (it is not a no-op at these logits)."""
    rng = np.random.default_rng(seed)
    b, t, h, hk, d, scale, window = 2, 24, 4, 2, 8, 0.6, (5, 0)
    q, do = rng.standard_normal((2, b, t, h, d))
    k, v = rng.standard_normal((2, b, t, hk, d))
    dlse, sinks = rng.standard_normal((b, h, t)), rng.standard_normal(h)
    pos = reference.layout_permutation(t, "zigzag", ring_size=3)
    kw = dict(causal=True, scale=scale, q_pos=pos, k_pos=pos, window=window, sinks=sinks)
    fwd = reference.attention_forward(q, k, v, softcap=softcap, **kw)
    got = [fwd.o, fwd.lse, *reference.attention_backward(fwd, q, k, v, do, dlse, scale=scale),
           reference.sinks_backward(fwd, do, dlse)]

    tq, tk, tv, ts = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, sinks))
    group = h // hk
    logits = torch.einsum("bthd,bshd->bhts", tq, tk.repeat_interleave(group, 2)) * scale
    logits = softcap * torch.tanh(logits / softcap)
    offset = torch.tensor(pos)[None, :] - torch.tensor(pos)[:, None]  # key minus query, original positions
    logits = logits.masked_fill(~((offset <= 0) & (offset >= -window[0])), float("-inf"))
    full = torch.cat([logits, ts[None, :, None, None].expand(b, h, t, 1)], dim=-1)  # the sink: uncapped
    lse = torch.logsumexp(full, dim=-1)
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(full, dim=-1)[..., :t], tv.repeat_interleave(group, 2))
    (o * torch.tensor(do)).sum().add((lse * torch.tensor(dlse)).sum()).backward()
    want = [x.detach().numpy() for x in (o, lse, tq.grad, tk.grad, tv.grad, ts.grad)]
    plain = reference.attention_forward(q, k, v, **kw)
    plain = [plain.o, plain.lse, *reference.attention_backward(plain, q, k, v, do, dlse, scale=scale),
             reference.sinks_backward(plain, do, dlse)]
    for name, g, w, p in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want, plain):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)
        assert np.abs(g - p).max() > 1e-3 * np.abs(p).max(), name
    with pytest.raises(ValueError, match="softcap must be"):
        reference.attention_forward(q, k, v, softcap=0.0)


def test_oracle_causal_in_layout_order_equals_permuted_original(seed):
    """Masking by original positions makes the oracle layout-equivariant: attention of permuted
    inputs is the permuted attention of the original ones."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 1, 16, 2, 4))
    perm = reference.layout_permutation(16, "zigzag", ring_size=4)
    plain = reference.attention_forward(q, k, v, causal=True)
    permuted = reference.attention_forward(q[:, perm], k[:, perm], v[:, perm], causal=True, q_pos=perm, k_pos=perm)
    # atol: an output near zero (seed 1567483538: 7.6e-5) differs by float64 summation order alone (9e-17)
    np.testing.assert_allclose(permuted.o, plain.o[:, perm], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(permuted.lse, plain.lse[:, :, perm], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "layout,ring,expected",
    [
        ("contiguous", 2, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("zigzag", 2, [0, 1, 6, 7, 2, 3, 4, 5]),
        ("zigzag", 4, [0, 7, 1, 6, 2, 5, 3, 4]),
        ("stripe", 2, [0, 2, 4, 6, 1, 3, 5, 7]),
        ("stripe", 4, [0, 4, 1, 5, 2, 6, 3, 7]),
    ],
)
def test_layout_oracle_hand_examples(layout, ring, expected):
    """the contract's (docs/contract.md) definitions worked by hand on 8 tokens."""
    assert reference.layout_permutation(8, layout, ring).tolist() == expected


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_layout_oracle_rejects_indivisible_seq(layout):
    """zigzag needs seq % (2·R·U) == 0, the others seq % (R·U) == 0."""
    bad = 2 * 3 * 2 + 3 if layout == "zigzag" else 2 * 3 + 1
    with pytest.raises(ValueError, match="divisible"):
        reference.layout_permutation(bad, layout, ring_size=2, ulysses_size=3)


def test_round_to_bfloat16_matches_torch(seed):
    """The NumPy bf16 rounding used for inputs is torch's round-to-nearest-even."""
    x = np.random.default_rng(seed).standard_normal(4096) * 10.0
    want = torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).to(torch.float64).numpy()
    np.testing.assert_array_equal(round_to_dtype(x, "bfloat16"), want)
