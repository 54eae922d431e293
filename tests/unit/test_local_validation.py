"""Unit — the per-device entry points check their local shards (validation.validate_local) and
build one frozen, hashable AttentionConfig; environment variables only give the defaults of the
``deterministic`` / ``check_ranks`` keywords."""

from __future__ import annotations

import numpy as np
import pytest

BAD_LOCAL = [  # (q, k, v shapes, dtypes, layout, error, message)
    (((1, 3, 2, 8), (1, 3, 2, 8), (1, 3, 2, 8)), "float32", "zigzag", ValueError, r"local seq % 2 must be 0"),
    (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "float32", "zigzag", ValueError, r"heads % kv_heads must be 0"),
    (((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 4)), "float32", "zigzag", ValueError, r"k and v must have the same shape"),
    (((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8)), "float32", "zigzag", ValueError, r"q and k must agree"),
    (((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "float32", "spiral", ValueError, r"layout must be one of"),
    (((4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "float32", "zigzag", ValueError, r"local q must be rank-4"),
]


@pytest.mark.parametrize("shapes,dtype,layout,error,message", BAD_LOCAL)
@pytest.mark.parametrize("entry", ["ring_attention", "allgather_attention", "double_ring_attention"])
def test_torch_entry_points_refuse_bad_local_shards(entry, shapes, dtype, layout, error, message):
    torch = pytest.importorskip("torch")
    import torch_impl

    q, k, v = (torch.zeros(s, dtype=getattr(torch, dtype)) for s in shapes)
    with pytest.raises(error, match=message):
        getattr(torch_impl, entry)(q, k, v, None, causal=True, layout=layout)


def test_torch_dtypes_and_ulysses_heads_are_checked():
    torch = pytest.importorskip("torch")
    import torch_impl

    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k and v must share one dtype, q's or float32"):
        torch_impl.ring_attention(q, q.half(), q.half(), None)
    with pytest.raises(TypeError, match="dtype must be one of"):
        torch_impl.ring_attention(q.double(), q.double(), q.double(), None)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        torch_impl.usp_attention(q, q, q, None, None, scale=-1.0)
    o, lse = torch_impl.ring_attention(q, q.float(), q.float(), None, causal=True)  # Ulysses' float32 K/V
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_jax_entry_points_refuse_bad_local_shards(jax_devices):
    """Inside shard_map, at trace time: no collective is ever emitted for a refused call."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_impl

    mesh = jax.make_mesh((2, 2), ("ring", "ulysses"))
    spec = P(None, ("ring", "ulysses"), None, None)

    def call(fn, *qkv):
        qkv = (jax.device_put(x, NamedSharding(mesh, spec)) for x in qkv)
        return jax.jit(jax.shard_map(lambda q, k, v: fn(q, k, v)[0], mesh=mesh, in_specs=(spec,) * 3,
                                     out_specs=spec))(*qkv)

    odd = jnp.zeros((1, 12, 4, 8), jnp.float32)  # 3 tokens per device
    with pytest.raises(ValueError, match=r"local seq % 2 must be 0 for layout 'zigzag'"):
        call(lambda q, k, v: jax_impl.ring_attention(q, k, v, ("ring", "ulysses"), layout="zigzag"), odd, odd, odd)
    three = jnp.zeros((1, 16, 3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"heads % 'ulysses' mesh size must be 0"):
        call(lambda q, k, v: jax_impl.usp_attention(q, k, v, "ring", "ulysses"), three, three, three)
    q = jnp.zeros((1, 16, 4, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="k and v must share one dtype"):
        call(lambda q, k, v: jax_impl.allgather_attention(q, k, v, ("ring", "ulysses")), q, q.astype(jnp.float16), q)


@pytest.mark.parametrize("framework", ["jax_impl", "torch_impl"])
def test_config_is_frozen_hashable_and_checked(framework):
    config_module = pytest.importorskip(f"{framework}.config")
    make = config_module.AttentionConfig
    a, b = make(True, "zigzag", 0.25), make(True, "zigzag", 0.25)
    assert a == b and hash(a) == hash(b) and a.block_backend == "auto" and not a.deterministic
    with pytest.raises(AttributeError):
        a.causal = False  # frozen
    with pytest.raises(ValueError, match="layout must be one of"):
        make(True, "spiral", 0.25)
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
        make(True, "zigzag", float("nan"))
    q = np.zeros((1, 4, 2, 16))
    assert config_module.make_config(q, causal=False, layout="stripe", scale=None, block_backend="auto",
                                     deterministic=True).scale == 0.25


def test_check_ranks_default_comes_from_the_environment_only_at_the_boundary(monkeypatch):
    from seqplan import config as config_module

    monkeypatch.setenv("RINGBRIDGE_CHECK_RANKS", "1")
    assert config_module.default_check_ranks(None) and not config_module.default_check_ranks(False)
    monkeypatch.setenv("RINGBRIDGE_CHECK_RANKS", "0")
    assert not config_module.default_check_ranks(None) and config_module.default_check_ranks(True)


def test_block_modules_read_no_environment():
    """Library behaviour is switched by keywords; os.environ is read in a config.py only (torch's
    deterministic default is torch's own switch, not the environment)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for package in ("seqplan", "jax_impl", "torch_impl"):
        readers = sorted(p.name for p in (root / package).glob("*.py") if "os.environ" in p.read_text())
        assert readers in ([], ["config.py"]), (package, readers)
    assert "os.environ" in (root / "seqplan" / "config.py").read_text()  # the probe works
