"""Multi-device — torch_impl's one-device replay (``torch_impl/replay.py``) equals jax_impl's on
the same float32 inputs, for every strategy family and layout (and so, through
tests/multidevice/test_replay_jax.py, the float64 oracle and the real JAX sharded run)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp

from jax_impl import replay as jax_replay
from seqplan.layouts import LAYOUTS, layout_permutation
from torch_impl import replay as torch_replay

TENSORS = ("o", "lse", "dq", "dk", "dv")
RTOL = 1e-5  # two frameworks' float32 einsums: the float32 policy's bound, relative L2

RINGS = [dict(ring=4), dict(ring=2, kv_exchange="allgather"), dict(ring=4, outer=2), dict(ring=2, ulysses=2),
         dict(ring=2, ulysses=4)]
# Every ring-bearing strategy × layout causal, and non-causal zigzag; Ulysses alone has no layout.
CASES = ([(f, layout, True) for f in RINGS for layout in LAYOUTS] + [(f, "zigzag", False) for f in RINGS]
         + [(dict(ulysses=4), "contiguous", c) for c in (True, False)])


@pytest.mark.parametrize("fields,layout,causal", CASES,
                         ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_torch_replay_equals_jax_replay(fields, layout, causal, seed):
    js, ts = jax_replay.Strategy(**fields), torch_replay.Strategy(**fields)
    assert js.mesh_sizes() == ts.mesh_sizes()
    seq, kv_heads = 8 * js.devices, 1 if js.ulysses >= 4 else 2
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((1, seq, 8, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, seq, kv_heads, 8)).astype(np.float32) for _ in range(2))
    perm = layout_permutation(seq, layout, js.ring, js.ulysses)
    q, k, v, do = (x[:, perm] for x in (q, k, v, do))
    kw = dict(causal=causal, layout=layout)
    jq, jk, jv, jdo = (jnp.asarray(x) for x in (q, k, v, do))
    o, lse = jax_replay.replay_attention(jq, jk, jv, strategy=js, **kw)
    got_jax = (o, lse, *jax_replay.replay_attention_grads(jq, jk, jv, o, lse, jdo, strategy=js, **kw))
    tq, tk, tv, tdo = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v, do))
    o, lse = torch_replay.replay_attention(tq, tk, tv, strategy=ts, **kw)
    got_torch = (o, lse, *torch_replay.replay_attention_grads(tq, tk, tv, o, lse, tdo, strategy=ts, **kw))
    for name, a, b in zip(TENSORS, got_jax, got_torch):
        a, b = np.asarray(a, np.float64), b.double().numpy()
        assert a.shape == b.shape, name
        rel = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert rel <= RTOL, f"{js} {layout} causal={causal} {name}: torch vs JAX rel L2 {rel:.2e}"
