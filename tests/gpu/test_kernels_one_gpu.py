"""GPU (one GPU) — every block backend of both frameworks through the block interface the
strategies call, and every strategy's replay, against a truth under DESIGN.md's low-precision
policy (issue 24, items 1 and 2). Run on one CUDA GPU:

    JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \\
        python -m pytest tests/gpu/test_kernels_one_gpu.py -q

(XLA's GEMM autotuning cost ~13 s per new shape of the dense controls on an H100; nothing here is
timed. Without CUDA everything skips with that reason; fa3 skips without flash_attn3_jax 0.2.3.)

**Kernels** (the check of ``benchmarks/kernel_table.py``, as tests): ``fwd(q, k, v, mask, scale)``,
then ``bwd(do, q, k, v, o, lse, mask, scale, None)`` with the block's own o and lse, for full,
causal and strict 4096² blocks and the two rectangular full blocks of a zigzag ring (2048×4096,
4096×2048); every tensor vs a float64 truth on the same rounded inputs: max |x − truth| ≤
LOWP_FACTOR × max |control − truth| + LOWP_ABS_FLOOR × max |truth|, the control being dense
attention in the same dtype by the same framework. Heads (MHA 8/8, GQA 8/2, MQA 8/1) × head_dim
(64, 128) × dtype (bf16, fp16): every pair of the three by default (6 combinations), the full
product with RINGBRIDGE_FULL=1.

**Replay**: ring (contiguous / zigzag / stripe), all-gather KV, double ring, Ulysses and USP at
R (or U) = 2, 4, 8, 8192 tokens, bf16, GQA 8/2, d 128, causal (and a non-causal zigzag ring),
each fused backend of each framework, vs a float32 dense truth in the same metric.
"""

from __future__ import annotations

import functools
import importlib
import os
import zlib

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # effective if JAX has not started
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.gpu

LOWP_FACTOR = 2.0  # DESIGN.md: 2 × the dense same-dtype control's max error ...
LOWP_ABS_FLOOR = {"bfloat16": 2.0**-10, "float16": 2.0**-13}  # ... plus this × max |truth|
TENSORS = ("o", "lse", "dq", "dk", "dv")
BACKENDS = (("jax", "reference"), ("jax", "cudnn"), ("jax", "fa3"),
            ("torch", "reference"), ("torch", "aten_flash"), ("torch", "aten_cudnn"))
TOKENS = 4096
BLOCKS = (("full", TOKENS, TOKENS), ("causal", TOKENS, TOKENS), ("strict", TOKENS, TOKENS),
          ("full", TOKENS // 2, TOKENS), ("full", TOKENS, TOKENS // 2))
HEADS, HEAD_DIMS, DTYPES = ((8, 8), (8, 2), (8, 1)), (64, 128), ("bfloat16", "float16")
# Every pair of (heads, head_dim, dtype) values appears in one of these six combinations.
PAIRWISE = (((8, 8), 64, "bfloat16"), ((8, 8), 128, "float16"), ((8, 2), 64, "float16"),
            ((8, 2), 128, "bfloat16"), ((8, 1), 64, "bfloat16"), ((8, 1), 128, "float16"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: only a smoke run of the helpers
FULL_MATRIX = os.environ.get("RINGBRIDGE_FULL", "") == "1"
COMBOS = [(h, d, dt) for h in HEADS for d in HEAD_DIMS for dt in DTYPES] if FULL_MATRIX else list(PAIRWISE)


def _need_gpu(framework: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch sees none)")
    if framework == "jax" and jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here: run with JAX_PLATFORMS=cuda")


def _need_backend(framework: str, name: str) -> None:
    if framework == "jax" and name == "fa3":
        from jax_impl.kernels import fa3

        if not fa3.verified():
            pytest.skip(f"fa3 needs flash_attn3_jax {fa3.VERIFIED_VERSION}; installed: {fa3.installed_version()}")


# ---- dense attention with a general block mask: the truth and the controls ------------------------

def _visible(mask: str, tq: int, tk: int):
    """[tq, tk] numpy bool of visible pairs in local indices (None: every key)."""
    if mask == "full":
        return None
    return np.tril(np.ones((tq, tk), bool), 0 if mask == "causal" else -1)


def torch_dense(q, k, v, do, visible, scale, dtype):
    """Dense attention and autograd gradients with scores and probabilities rounded to ``dtype``
    (float64: the truth; the inputs' dtype: torch's control). Rows with no visible key: o = 0,
    lse = -inf. Returns float64 host arrays."""
    q, k, v = (x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v))
    h, hk = q.shape[2], k.shape[2]
    ke, ve = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    scores = (torch.einsum("bthd,bshd->bhts", q, ke) * scale).to(dtype)
    wide = scores.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if visible is None:
        lse = torch.logsumexp(wide, dim=-1)
        probs = torch.exp(wide - lse.unsqueeze(-1))
    else:
        vis = torch.as_tensor(visible, device=q.device)
        empty = ~vis.any(-1)
        safe = wide.masked_fill(~vis, float("-inf")).masked_fill(empty[:, None], 0.0)
        lse_safe = torch.logsumexp(safe, dim=-1)
        probs = torch.exp(safe - lse_safe.unsqueeze(-1)).masked_fill(~vis, 0.0)
        lse = lse_safe.masked_fill(empty, float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", probs.to(dtype), ve)
    o.backward(do.to(dtype))
    return [x.detach().double().cpu().numpy() for x in (o, lse, q.grad, k.grad, v.grad)]


def jax_dense(q, k, v, do, visible, scale, dtype: str):
    """JAX's control: the same rounding points in ``dtype``, gradients by jax.vjp."""
    low = jnp.dtype(dtype)
    vis = None if visible is None else jnp.asarray(visible)

    def attention(q, k, v):
        h, hk = q.shape[2], k.shape[2]
        ke, ve = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
        scores = (jnp.einsum("bthd,bshd->bhts", q, ke) * jnp.asarray(scale, low)).astype(low).astype(jnp.float32)
        if vis is None:
            lse = jax.nn.logsumexp(scores, axis=-1)
            probs = jnp.exp(scores - lse[..., None])
        else:
            empty = ~vis.any(-1)
            safe = jnp.where(empty[:, None], 0.0, jnp.where(vis, scores, -jnp.inf))
            lse_safe = jax.nn.logsumexp(safe, axis=-1)
            probs = jnp.where(vis, jnp.exp(safe - lse_safe[..., None]), 0.0)
            lse = jnp.where(empty, -jnp.inf, lse_safe)
        return jnp.einsum("bhts,bshd->bthd", probs.astype(low), ve), lse

    @jax.jit
    def forward_backward(q, k, v, do):
        (o, lse), vjp = jax.vjp(attention, q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    return [np.asarray(x, np.float64) for x in forward_backward(*(_to_jax(x, dtype) for x in (q, k, v, do)))]


def _to_jax(x, dtype: str):
    """A float32 torch tensor (values already rounded to ``dtype``) as a JAX GPU array."""
    return jnp.asarray(x.cpu().numpy().astype(jnp.dtype(dtype)))


def check(name: str, got, truth, control, dtype: str) -> str | None:
    """DESIGN.md's low-precision metric; -inf entries of the truth (empty rows) must match.
    Returns a failure message, or None."""
    got = np.asarray(got, np.float64).reshape(truth.shape)
    empty = np.isneginf(truth)

    def error(x):
        if (np.isneginf(x) != empty).any() or not np.isfinite(x[~empty]).all():
            return np.inf
        return float(np.max(np.abs(x[~empty] - truth[~empty])))

    err, control_err = error(got), error(np.asarray(control, np.float64).reshape(truth.shape))
    tolerance = LOWP_FACTOR * control_err + LOWP_ABS_FLOOR[dtype] * float(np.max(np.abs(truth[~empty])))
    if err <= tolerance:
        return None
    return f"{name}: max error {err:.3e} > tolerance {tolerance:.3e} (control {control_err:.3e})"


# ---- the kernels ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def block_problem(mask: str, tq: int, tk: int, heads: tuple, d: int, dtype: str):
    """Inputs (float32 CUDA tensors holding ``dtype``-rounded values), truth and both controls."""
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(repr((mask, tq, tk, heads, d, dtype)).encode()))
    low = getattr(torch, dtype)
    h, hk = heads
    shapes = {"q": (1, tq, h, d), "k": (1, tk, hk, d), "v": (1, tk, hk, d), "do": (1, tq, h, d)}
    x = {n: torch.randn(s, generator=gen, device=DEVICE).to(low).float() for n, s in shapes.items()}
    visible, scale = _visible(mask, tq, tk), d**-0.5
    args = (x["q"], x["k"], x["v"], x["do"], visible, scale)
    return (x, torch_dense(*args, torch.float64), {"torch": torch_dense(*args, low), "jax": jax_dense(*args, dtype)})


def run_block(framework: str, name: str, x: dict, mask: str, dtype: str, scale: float):
    """fwd then bwd (the block's own o and lse) through ``get_backend(name)``: five host arrays."""
    if framework == "jax":
        from jax_impl.block import get_backend
        from jax_impl.schedule import BlockMask

        backend, block_mask = get_backend(name), BlockMask(mask)

        @jax.jit
        def program(q, k, v, do):
            o, lse = backend.fwd(q, k, v, block_mask, scale)
            return (o, lse, *backend.bwd(do, q, k, v, o, lse, block_mask, scale, None))

        return [np.asarray(t, np.float64) for t in program(*(_to_jax(x[n], dtype) for n in ("q", "k", "v", "do")))]
    from torch_impl.block import get_backend
    from torch_impl.schedule import BlockMask

    backend, block_mask, low = get_backend(name), BlockMask(mask), getattr(torch, dtype)
    q, k, v, do = (x[n].to(low) for n in ("q", "k", "v", "do"))
    with torch.no_grad():
        o, lse = backend.fwd(q, k, v, block_mask, scale)
        out = (o, lse, *backend.bwd(do, q, k, v, o, lse, block_mask, scale, None))
    return [t.double().cpu().numpy() for t in out]


KERNEL_CASES = [(fw, name, block, combo) for combo in COMBOS for block in BLOCKS for fw, name in BACKENDS]


@pytest.mark.parametrize("framework,backend,block,combo", KERNEL_CASES,
                         ids=lambda p: "x".join(map(str, p)) if isinstance(p, tuple) else str(p))
def test_block_kernel_against_float64_truth(framework, backend, block, combo):
    """One backend, one block: o, lse, dq, dk, dv within the low-precision policy."""
    _need_gpu(framework)
    _need_backend(framework, backend)
    (mask, tq, tk), (heads, d, dtype) = block, combo
    x, truth, controls = block_problem(mask, tq, tk, heads, d, dtype)
    got = run_block(framework, backend, x, mask, dtype, d**-0.5)
    failures = [m for n, g, t, c in zip(TENSORS, got, truth, controls[framework]) if (m := check(n, g, t, c, dtype))]
    assert not failures, f"{framework} {backend} {mask} {tq}x{tk} heads {heads} d {d} {dtype}: " + "; ".join(failures)


# ---- the replay of every strategy ------------------------------------------------------------------------

SEQ, REPLAY_HEADS, REPLAY_D, REPLAY_DTYPE = 8192, (8, 2), 128, "bfloat16"
REPLAY_BACKENDS = (("jax", "cudnn"), ("jax", "fa3"), ("jax", "auto"),
                   ("torch", "aten_cudnn"), ("torch", "aten_flash"), ("torch", "auto"))


def _strategies():
    """(fields of replay.Strategy, layout, causal) at R (or U) = 2, 4, 8."""
    out = []
    for n in (2, 4, 8):
        out += [({"ring": n}, layout, True) for layout in ("contiguous", "zigzag", "stripe")]
        out += [({"ring": n, "kv_exchange": "allgather"}, "zigzag", True), ({"ulysses": n}, "contiguous", True)]
        if n > 2:  # the double ring and USP need 2 x n/2
            out += [({"ring": n, "outer": 2}, "stripe", True), ({"ring": n // 2, "ulysses": 2}, "zigzag", True)]
    out.append(({"ring": 4}, "zigzag", False))
    return out


@functools.lru_cache(maxsize=2)
def replay_problem(causal: bool):
    """Original-order bf16-rounded inputs (float32 CUDA tensors), the float32 dense truth and the
    bf16 dense controls of both frameworks (jax_impl / torch_impl.dense_attention), host arrays."""
    import jax_impl
    import torch_impl

    gen = torch.Generator(device=DEVICE).manual_seed(20261124 + causal)
    h, hk = REPLAY_HEADS
    shapes = {"q": (1, SEQ, h, REPLAY_D), "k": (1, SEQ, hk, REPLAY_D), "v": (1, SEQ, hk, REPLAY_D),
              "do": (1, SEQ, h, REPLAY_D)}
    x = {n: torch.randn(s, generator=gen, device=DEVICE).bfloat16().float() for n, s in shapes.items()}

    def torch_run(dtype):
        q, k, v = (x[n].detach().to(dtype).clone().requires_grad_() for n in ("q", "k", "v"))
        o, lse = torch_impl.dense_attention(q, k, v, causal=causal)
        o.backward(x["do"].to(dtype))
        return [t.detach().double().cpu().numpy() for t in (o, lse, q.grad, k.grad, v.grad)]

    @jax.jit
    def jax_run(q, k, v, do):
        (o, lse), vjp = jax.vjp(lambda q, k, v: jax_impl.dense_attention(q, k, v, causal=causal), q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    jax_control = [np.asarray(t, np.float64)
                   for t in jax_run(*(_to_jax(x[n], REPLAY_DTYPE) for n in ("q", "k", "v", "do")))]
    return x, torch_run(torch.float32), {"torch": torch_run(torch.bfloat16), "jax": jax_control}


@pytest.mark.parametrize("framework,backend", REPLAY_BACKENDS, ids=lambda p: str(p))
def test_replay_of_every_strategy_against_float32_truth(framework, backend):
    """Every strategy's per-device work, replayed on this GPU with ``backend``, vs the truth."""
    _need_gpu(framework)
    _need_backend(framework, backend)
    from jax_impl.layouts import layout_permutation

    failures = []
    for fields, layout, causal in _strategies():
        x, truth, controls = replay_problem(causal)
        replay = importlib.import_module(f"{framework}_impl.replay")
        strategy = replay.Strategy(**fields)
        perm = layout_permutation(SEQ, layout, strategy.ring, strategy.ulysses)
        if framework == "jax":
            q, k, v, do = (_to_jax(x[n][:, perm], REPLAY_DTYPE) for n in ("q", "k", "v", "do"))
        else:
            q, k, v, do = (x[n][:, perm].bfloat16().contiguous() for n in ("q", "k", "v", "do"))
        kw = {"strategy": strategy, "causal": causal, "layout": layout, "block_backend": backend}
        o, lse = replay.replay_attention(q, k, v, **kw)
        grads = replay.replay_attention_grads(q, k, v, o, lse, do, **kw)
        got = [np.asarray(t, np.float64) if framework == "jax" else t.double().cpu().numpy() for t in (o, lse, *grads)]
        for name, g, t, c in zip(TENSORS, got, truth, controls[framework]):
            index = (slice(None), slice(None), perm) if name == "lse" else (slice(None), perm)
            if message := check(name, g, t[index], c[index], REPLAY_DTYPE):
                failures.append(f"{strategy.name} {layout} causal={causal} {message}")
    assert not failures, f"{framework} {backend}:\n" + "\n".join(failures)
