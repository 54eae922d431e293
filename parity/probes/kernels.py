"""Block kernels on one device — ringbridge's backends through the block interface the strategies
call, and the single-GPU kernels a user could pick instead ("peers", each through its own public
API) — verified against a float64 truth and then timed (issue 24, items 1, 5 and 7).

    python -m parity peers --devices gpu --out DIR                         (one GPU, ~3 minutes)
    python -m parity peers --devices cpu --out DIR                         (CPU: portable kernels and
                                                                             the peers that run there)
    python -m benchmarks.kernel_table --out DIR [...]                       (the same, all options)

Verification: for each subject × block mask (full, causal, strict) × heads (MHA 8/8, GQA 8/2, MQA
8/1) × head_dim (64, 128) × dtype (bf16, fp16) × block shape (square ``--tokens``, and the two
rectangular full blocks of a zigzag ring, t/2 × t and t × t/2). A ringbridge backend runs
``fwd(q, k, v, mask, scale) -> (o, lse)``, then ``bwd(do, q, k, v, o, lse, mask, scale, None) ->
(dq, dk, dv)`` with the block's own o and lse. A peer runs its public attention function forward
and its framework's autodiff backward for the cotangent ``do`` (lse only where its API returns
it). Each tensor is compared with a float64 truth on the same rounded inputs (dense attention,
autograd), under the contract's (docs/contract.md) low-precision policy: max |x − truth| ≤ LOWP_FACTOR × max |control −
truth| + LOWP_ABS_FLOOR × max |truth|, where the control is plain dense attention in the same dtype
by the same framework. A subject that raises (not installed, a mask its API has no form for) is
reported as skipped with the reason, never passed.

Timing (METHOD.md): every subject × mask whose verification passed in every case is timed at
``--bench-tokens`` (b 1, 32 heads, d 128, bf16): forward and forward+backward, on fresh random
inputs, after warm-up, median of ``--repeats`` synchronised runs. FLOPs: 4·b·h·t·s·d forward
(halved for causal and strict blocks), ×3.5 forward+backward.

Writes ``kernel_table.json`` and ``kernel_table.md`` under ``--out`` and prints the summary.
jax and torch are imported with this module: callers import it lazily, after
``parity.core.devices.configure_jax_devices``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
# XLA's GEMM autotuning cost ~13 s per new shape of the dense control and the portable kernel
# (H100, 2026-11-23); neither is timed, and the timed kernels are custom calls it does not tune.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_impl.block
import torch_impl.block
from parity.core.numerics import LOWP_ABS_FLOOR, LOWP_FACTOR
from seqplan.schedule import BlockMask
from seqplan.schedule import MaskKind as Mask

TENSORS = ("o", "lse", "dq", "dk", "dv")
MASKS = (Mask.FULL, Mask.CAUSAL, Mask.STRICT)
HEADS = ((8, 8), (8, 2), (8, 1))  # (query heads, key/value heads): MHA, GQA, MQA
BACKENDS = {"jax": ("reference", "cudnn", "fa3"), "torch": ("reference", "aten_flash", "aten_cudnn")}
# Backends timed at --bench-tokens only when verified; the portable kernels materialise the
# [b, h, t, s] float32 scores (137 GB at 32k tokens, 32 heads) and are not timed there.
UNTIMED = {"reference": "materialises the [b, h, t, s] float32 scores",
           "sdpa[math]": "materialises the [b, h, t, s] scores",
           "jax.nn.dot_product_attention[xla]": "materialises the [b, h, t, s] scores"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the portable kernels


@dataclass(frozen=True)
class Case:
    """One verification case: a block of ``tq`` queries against ``tk`` keys, batch 1."""

    framework: str  # "jax" or "torch"
    backend: str
    mask: str  # a schedule.MaskKind value
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16" or "float16"
    tq: int
    tk: int

    @property
    def inputs_key(self) -> tuple:
        """Cases with equal keys share inputs, truth and (per framework) control."""
        return (self.mask, self.heads, self.kv_heads, self.head_dim, self.dtype, self.tq, self.tk)


@dataclass
class TensorResult:
    """One tensor of one case, in the contract's (docs/contract.md) metric and in relative L2."""

    max_abs: float
    tolerance: float
    control_max_abs: float
    ratio_to_control: float  # max_abs / control_max_abs
    rel_l2: float
    control_rel_l2: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_abs) and self.max_abs <= self.tolerance)


@dataclass
class CaseResult:
    case: Case
    status: str  # "pass", "FAIL", or "skipped: <reason>"
    tensors: dict[str, TensorResult] = field(default_factory=dict)
    seconds: float = 0.0

    def worst(self) -> tuple[str, float]:
        """The tensor with the largest error ratio to the control, and that ratio."""
        if not self.tensors:
            return "", float("nan")
        name = max(self.tensors, key=lambda n: self.tensors[n].ratio_to_control)
        return name, self.tensors[name].ratio_to_control


# ---- inputs, truth and controls -------------------------------------------------------------------

def _visible(mask: str, tq: int, tk: int, device) -> torch.Tensor | None:
    """[tq, tk] bool of visible pairs in local indices (None: every key visible)."""
    if mask == Mask.FULL.value:
        return None
    if tq != tk:
        raise ValueError(f"a {mask} block is square, got {tq}x{tk}")
    return torch.ones((tq, tk), dtype=torch.bool, device=device).tril(0 if mask == Mask.CAUSAL.value else -1)


def make_inputs(key: tuple, seed: int) -> dict[str, torch.Tensor]:
    """q, do: [1, tq, h, d]; k, v: [1, tk, hk, d]; float32 CUDA tensors holding values already
    rounded to the case's dtype (fresh standard-normal draws; never zeros)."""
    _, h, hk, d, dtype, tq, tk = key
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    low = getattr(torch, dtype)
    shapes = {"q": (1, tq, h, d), "k": (1, tk, hk, d), "v": (1, tk, hk, d), "do": (1, tq, h, d)}
    return {n: torch.randn(s, generator=gen, device=DEVICE).to(low).float() for n, s in shapes.items()}


def _masked_attention(q, k, v, visible, scale, score_dtype, prob_dtype):
    """Dense attention with explicit rounding points; a row with no visible key gets o = 0 and
    lse = -inf (its scores are replaced by zeros before the logsumexp, so autograd sees no NaN).
    q: [b, t, h, d], k, v: [b, s, hk, d] -> (o [b, t, h, d], lse [b, h, t] float32-or-wider)."""
    h, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    scores = (torch.einsum("bthd,bshd->bhts", q, k) * scale).to(score_dtype)
    wide = scores.to(torch.float64 if score_dtype == torch.float64 else torch.float32)
    if visible is None:
        lse = torch.logsumexp(wide, dim=-1)
        probs = torch.exp(wide - lse.unsqueeze(-1))
    else:
        empty = ~visible.any(-1)  # [t]
        safe = wide.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
        lse_safe = torch.logsumexp(safe, dim=-1)
        probs = torch.exp(safe - lse_safe.unsqueeze(-1)).masked_fill(~visible, 0.0)
        lse = lse_safe.masked_fill(empty, float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", probs.to(prob_dtype), v)
    return o, lse


def torch_dense(x: dict, mask: str, scale: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense attention in ``dtype`` and its autograd gradients for the cotangent ``do``: with
    float64 this is the truth; in the inputs' dtype it is torch's control (the rounding of
    torch_impl.dense_attention: scores and probabilities rounded to the dtype)."""
    q, k, v = (x[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    visible = _visible(mask, q.shape[1], k.shape[1], q.device)
    o, lse = _masked_attention(q, k, v, visible, scale, dtype, dtype)
    o.backward(x["do"].to(dtype))
    out = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: t.detach() for n, t in out.items()}


def jax_dense(x: dict, mask: str, scale: float, dtype: str) -> dict[str, torch.Tensor]:
    """JAX's control: dense attention in ``dtype`` with jax_impl.dense_attention's rounding
    points, a general block mask, and jax.vjp gradients (returned as torch tensors)."""
    tq, tk = x["q"].shape[1], x["k"].shape[1]
    if mask != Mask.FULL.value and tq != tk:
        raise ValueError(f"a {mask} block is square, got {tq}x{tk}")
    low = jnp.dtype(dtype)

    def attention(q, k, v):
        visible = None if mask == Mask.FULL.value else jnp.tril(jnp.ones((tq, tk), bool), 0 if mask == Mask.CAUSAL.value else -1)
        h, hk = q.shape[2], k.shape[2]
        k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
        scores = (jnp.einsum("bthd,bshd->bhts", q, k) * jnp.asarray(scale, low)).astype(low).astype(jnp.float32)
        if visible is None:
            lse = jax.nn.logsumexp(scores, axis=-1)
            probs = jnp.exp(scores - lse[..., None])
        else:
            empty = ~visible.any(-1)
            safe = jnp.where(empty[:, None], 0.0, jnp.where(visible, scores, -jnp.inf))
            lse_safe = jax.nn.logsumexp(safe, axis=-1)
            probs = jnp.where(visible, jnp.exp(safe - lse_safe[..., None]), 0.0)
            lse = jnp.where(empty, -jnp.inf, lse_safe)
        return jnp.einsum("bhts,bshd->bthd", probs.astype(low), v), lse

    @jax.jit
    def forward_backward(q, k, v, do):
        (o, lse), vjp = jax.vjp(attention, q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    out = forward_backward(*(to_jax(x[n], dtype) for n in ("q", "k", "v", "do")))
    return dict(zip(TENSORS, (to_torch(t) for t in out)))


def to_jax(x: torch.Tensor, dtype: str) -> jax.Array:
    """A rounded float32 torch tensor as a JAX array of ``dtype`` (host cast: no per-shape program)."""
    return jax.device_put(x.cpu().numpy().astype(jnp.dtype(dtype)))


def to_torch(x: jax.Array) -> torch.Tensor:
    """A JAX array as a CUDA torch tensor (zero-copy through DLPack where possible)."""
    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001  (a dtype or device DLPack does not carry: go through the host)
        return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(DEVICE)


def check(got: torch.Tensor, ref: torch.Tensor, control: torch.Tensor, dtype: str) -> TensorResult:
    """the contract's (docs/contract.md) low-precision metric; -inf entries of the truth (empty rows) must match exactly."""
    got, ref, control = (t.to(torch.float64).reshape(ref.shape) for t in (got, ref, control))
    empty = torch.isneginf(ref)

    def error(x):
        if bool((torch.isneginf(x) != empty).any()) or not bool(torch.isfinite(x[~empty]).all()):
            return float("inf"), float("inf")
        diff = (x - ref)[~empty]
        return float(diff.abs().max()), float(diff.norm() / ref[~empty].norm().clamp_min(1e-300))

    max_abs, rel = error(got)
    control_max, control_rel = error(control)
    tolerance = LOWP_FACTOR * control_max + LOWP_ABS_FLOOR[dtype] * float(ref[~empty].abs().max())
    return TensorResult(max_abs, tolerance, control_max, max_abs / max(control_max, 1e-300), rel, control_rel)


# ---- the backends under test -----------------------------------------------------------------------

def get_backend(framework: str, name: str):
    """A ringbridge block backend by framework and name (fa3: its backward mended in
    jax_impl/kernels/fa3.py)."""
    return jax_impl.block.get_backend(name) if framework == "jax" else torch_impl.block.get_backend(name)


def jax_block_program(backend, mask: Mask, scale: float, backward: bool = True) -> Callable:
    """One jitted program: the block forward, then (optionally) its backward with the block's own
    o and lse, as a training step compiles them."""
    mask = BlockMask(mask.value)

    def program(q, k, v, do):
        o, lse = backend.fwd(q, k, v, mask, scale)
        if not backward:
            return o, lse
        return (o, lse, *backend.bwd(do, q, k, v, o, lse, mask, scale, None))

    return jax.jit(program)


def torch_block_program(backend, mask: Mask, scale: float, backward: bool = True) -> Callable:
    mask = BlockMask(mask.value)

    def program(q, k, v, do):
        with torch.no_grad():
            o, lse = backend.fwd(q, k, v, mask, scale)
            if not backward:
                return o, lse
            return (o, lse, *backend.bwd(do, q, k, v, o, lse, mask, scale, None))

    return program


# ---- peers: the single-GPU kernels a user could call instead, each through its public API ---------

def _no_mask_form(name: str, mask: Mask, allowed: tuple[Mask, ...]) -> None:
    if mask not in allowed:
        raise NotImplementedError(f"{name}'s public API has no {mask.value} block mask "
                                  f"(takes {'/'.join(m.value for m in allowed)})")


def _jax_peer(name: str, attention: Callable, masks: tuple[Mask, ...]):
    """A JAX peer ``attention(q, k, v, causal, scale) -> o`` ([b, t, h, d] in and out):
    forward, and ``jax.vjp`` for the cotangent do; no lse."""
    def make(mask: Mask, scale: float, backward: bool = True) -> Callable:
        _no_mask_form(name, mask, masks)

        def fn(q, k, v):
            return attention(q, k, v, mask is Mask.CAUSAL, scale)

        def program(q, k, v, do):
            if not backward:
                return fn(q, k, v), None
            o, vjp = jax.vjp(fn, q, k, v)
            return (o, None, *vjp(do))

        return jax.jit(program)

    return make


def _flash_mha(q, k, v, causal, scale):
    from flash_attn3_jax import flash_mha  # flash_attn3_jax's README: flash_mha(q, k, v, softmax_scale, is_causal)

    return flash_mha(q, k, v, softmax_scale=scale, is_causal=causal)


def _dot_product_attention(implementation: str):
    def attention(q, k, v, causal, scale):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=implementation)

    return attention


def _tokamax(implementation: str):
    def attention(q, k, v, causal, scale):
        import tokamax  # tokamax's README: tokamax.dot_product_attention(q, k, v, ..., implementation=...)

        return tokamax.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=implementation)

    return attention


def _torch_peer(name: str, attention: Callable, masks: tuple[Mask, ...]):
    """A torch peer ``attention(q, k, v, mask, scale) -> (o, lse or None)`` ([b, t, h, d]):
    forward, and autograd for the cotangent do."""
    def make(mask: Mask, scale: float, backward: bool = True) -> Callable:
        _no_mask_form(name, mask, masks)

        def program(q, k, v, do):
            if not backward:
                with torch.no_grad():
                    return attention(q, k, v, mask, scale)
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            with torch.enable_grad():
                o, lse = attention(*leaves, mask, scale)
                o.backward(do)
            return (o.detach(), lse, *(x.grad for x in leaves))

        return program

    return make


def _sdpa(backend_name: str):
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend (torch's
    ``sdpa_kernel`` context), GQA by ``enable_gqa``; layout [b, h, t, d] as its docs require."""
    def attention(q, k, v, mask, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=mask is Mask.CAUSAL, scale=scale, enable_gqa=True)
        return o.transpose(1, 2), None

    return attention


_FLEX = {}


def _flex_attention(q, k, v, mask, scale):
    """torch's flex_attention (compiled on CUDA, as its docs advise) with a block mask for causal
    (kv <= q) or strict (kv < q) blocks; returns its lse (``return_lse=True``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if q.is_cuda and "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention)
    flex = _FLEX["compiled"] if q.is_cuda else flex_attention
    block_mask = None
    if mask is not Mask.FULL:
        strict = mask is Mask.STRICT

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < q_idx) if strict else (kv_idx <= q_idx)

        block_mask = create_block_mask(mask_mod, None, None, q.shape[1], k.shape[1], device=q.device)
    o, lse = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, scale=scale,
                  enable_gqa=True, return_lse=True)
    return o.transpose(1, 2), lse.detach()


SQUARE = (Mask.FULL, Mask.CAUSAL)
PEERS: dict[str, dict[str, Callable]] = {
    "jax": {"flash_attn3_jax.flash_mha": _jax_peer("flash_attn3_jax.flash_mha", _flash_mha, SQUARE),
            "jax.nn.dot_product_attention[cudnn]": _jax_peer("jax.nn.dot_product_attention[cudnn]",
                                                             _dot_product_attention("cudnn"), SQUARE),
            "jax.nn.dot_product_attention[xla]": _jax_peer("jax.nn.dot_product_attention[xla]",
                                                           _dot_product_attention("xla"), SQUARE),
            "tokamax[mosaic]": _jax_peer("tokamax[mosaic]", _tokamax("mosaic"), SQUARE),
            "tokamax[triton]": _jax_peer("tokamax[triton]", _tokamax("triton"), SQUARE)},
    "torch": {f"sdpa[{b.lower()}]": _torch_peer(f"sdpa[{b.lower()}]", _sdpa(b), SQUARE)
              for b in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")}
    | {"flex_attention": _torch_peer("flex_attention", _flex_attention, MASKS)},
}
# Peers that run on the CPU (the CPU smoke run of ``python -m parity peers``).
CPU_PEERS = {"jax": ("jax.nn.dot_product_attention[xla]",), "torch": ("sdpa[math]", "flex_attention")}


def program_for(framework: str, name: str, mask: Mask, scale: float, backward: bool = True) -> Callable:
    """The program a subject runs for one block: ``(q, k, v, do) -> (o, lse, dq, dk, dv)`` (lse
    None for peers whose API does not return it), or ``(o, lse)`` without ``backward``."""
    if name in PEERS[framework]:
        return PEERS[framework][name](mask, scale, backward)
    make = jax_block_program if framework == "jax" else torch_block_program
    return make(get_backend(framework, name), mask, scale, backward)


def run_backend(case: Case, x: dict, scale: float) -> dict[str, torch.Tensor | None]:
    program = program_for(case.framework, case.backend, Mask(case.mask), scale)
    if case.framework == "jax":
        out = program(*(to_jax(x[n], case.dtype) for n in ("q", "k", "v", "do")))
        return {n: None if t is None else to_torch(t) for n, t in zip(TENSORS, out)}
    low = getattr(torch, case.dtype)
    return dict(zip(TENSORS, program(*(x[n].to(low) for n in ("q", "k", "v", "do")))))


def cases(tokens: int, backends: dict[str, tuple[str, ...]], dtypes, head_dims) -> list[Case]:
    """The verification matrix (see the module docstring); rectangular blocks are full-mask."""
    shapes = [(tokens, tokens, m) for m in MASKS] + [(tokens // 2, tokens, Mask.FULL), (tokens, tokens // 2, Mask.FULL)]
    return [Case(fw, be, m.value, h, hk, d, dt, tq, tk)
            for dt in dtypes for d in head_dims for h, hk in HEADS for tq, tk, m in shapes
            for fw, names in backends.items() for be in names]


def verify(all_cases: list[Case], seed: int, log: Callable[[str], None]) -> list[CaseResult]:
    results = []
    groups: dict[tuple, list[Case]] = {}
    for c in all_cases:
        groups.setdefault(c.inputs_key, []).append(c)
    for index, (key, group) in enumerate(groups.items()):
        mask, _, _, d, dtype, _, _ = key
        scale = d**-0.5
        x = make_inputs(key, seed + index)
        truth = torch_dense(x, mask, scale, torch.float64)
        controls = {}
        for c in group:
            start = time.perf_counter()
            try:
                if c.framework not in controls:
                    controls[c.framework] = (jax_dense(x, mask, scale, dtype) if c.framework == "jax"
                                             else torch_dense(x, mask, scale, getattr(torch, dtype)))
                got = run_backend(c, x, scale)
                tensors = {n: check(got[n], truth[n], controls[c.framework][n], dtype)
                           for n in TENSORS if got[n] is not None}  # a peer without lse: four tensors
                status = "pass" if all(t.ok for t in tensors.values()) else "FAIL"
                result = CaseResult(c, status, tensors)
            except Exception as err:  # noqa: BLE001  (a backend that cannot run the case: skipped, with why)
                result = CaseResult(c, f"skipped: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
            result.seconds = time.perf_counter() - start
            results.append(result)
            worst, ratio = result.worst()
            log(f"{c.framework:5} {c.backend:13} {c.mask:6} {c.heads}/{c.kv_heads} d{c.head_dim:<3} {c.dtype:8} "
                f"{c.tq}x{c.tk}  {result.status[:60]:60} worst {worst or '-':3} {ratio:8.3g}  ({result.seconds:.1f}s)")
        del x, truth, controls
        torch.cuda.empty_cache()
    return results


# ---- timing ------------------------------------------------------------------------------------------

def block_flops(t: int, heads: int, d: int, mask: Mask, backward: bool) -> float:
    fwd = 4 * heads * t * t * d / (1 if mask is Mask.FULL else 2)
    return 3.5 * fwd if backward else fwd


def _run_jax(program, inputs) -> None:
    jax.block_until_ready(program(*inputs))


def _run_torch(program, inputs) -> None:
    with torch.no_grad():
        program(*inputs)


def time_block(framework: str, name: str, mask: Mask, tokens: int, heads: int, d: int, dtype: str,
               repeats: int, seed: int) -> dict:
    """Median milliseconds and TFLOP/s of forward and forward+backward at one size (fresh inputs)."""
    scale = d**-0.5
    row = {"framework": framework, "backend": name, "mask": mask.value, "tokens": tokens, "heads": heads,
           "head_dim": d, "dtype": dtype}
    shape = (1, tokens, heads, d)
    for backward in (False, True):
        label = "fwd_bwd" if backward else "fwd"
        if framework == "jax":
            keys = jax.random.split(jax.random.PRNGKey(seed), 4)
            inputs = [jax.random.normal(k_, shape, jnp.dtype(dtype)) for k_ in keys]
            program = program_for(framework, name, mask, scale, backward)
            run = functools.partial(_run_jax, program, inputs)
        else:
            gen = torch.Generator(device=DEVICE).manual_seed(seed)
            inputs = [torch.randn(shape, generator=gen, device=DEVICE, dtype=getattr(torch, dtype)) for _ in range(4)]
            program = program_for(framework, name, mask, scale, backward)
            run = functools.partial(_run_torch, program, inputs)
        for _ in range(2):  # warm-up: compilation, handles, autotuning
            run()
        times = []
        for _ in range(repeats):
            if framework == "torch":
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                run()
                times.append(1e3 * (time.perf_counter() - start))
        ms = statistics.median(times)
        row[f"{label}_ms"] = ms
        row[f"{label}_spread_ms"] = max(times) - min(times)
        row[f"{label}_tflops"] = block_flops(tokens, heads, d, mask, backward) / (ms * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return row


def verified_pairs(results: list[CaseResult]) -> dict[tuple, bool]:
    """(framework, backend, mask) -> whether every case of it passed (skips and failures: False)."""
    verdict: dict[tuple, bool] = {}
    for r in results:
        k = (r.case.framework, r.case.backend, r.case.mask)
        verdict[k] = verdict.get(k, True) and r.status == "pass"
    return verdict


# ---- report ------------------------------------------------------------------------------------------

def environment() -> dict:
    def command(*args):
        try:
            return subprocess.run(args, check=False, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            return f"unavailable ({err})"

    versions = {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "torch_cudnn": torch.backends.cudnn.version()}
    for package in ("jaxlib", "flash_attn3_jax", "tokamax"):
        try:
            from importlib.metadata import version

            versions[package] = version(package.replace("_", "-")) if package != "jaxlib" else version("jaxlib")
        except ImportError:  # importlib.metadata.PackageNotFoundError is an ImportError
            versions[package] = "not installed"
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "gpu": command("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
            "jax_devices": [str(d) for d in jax.devices()], **versions}


def summarise(results: list[CaseResult]) -> list[dict]:
    """Per (framework, backend, mask): passes, skips, failures, the worst ratio to the control and
    where it occurred, the worst relative L2 and the worst control relative L2."""
    rows: dict[tuple, dict] = {}
    for r in results:
        k = (r.case.framework, r.case.backend, r.case.mask)
        row = rows.setdefault(k, {"framework": k[0], "backend": k[1], "mask": k[2], "cases": 0, "passed": 0,
                                  "failed": 0, "skipped": 0, "worst_ratio": 0.0, "worst_at": "",
                                  "worst_rel_l2": 0.0, "worst_control_rel_l2": 0.0, "skip_reasons": set()})
        row["cases"] += 1
        if r.status.startswith("skipped"):
            row["skipped"] += 1
            row["skip_reasons"].add(r.status[len("skipped: "):])
            continue
        row["passed" if r.status == "pass" else "failed"] += 1
        name, ratio = r.worst()
        if not ratio <= row["worst_ratio"]:
            c = r.case
            row["worst_ratio"] = ratio
            row["worst_at"] = f"{name} {c.heads}/{c.kv_heads} d{c.head_dim} {c.dtype} {c.tq}x{c.tk}"
        row["worst_rel_l2"] = max(row["worst_rel_l2"], max(t.rel_l2 for t in r.tensors.values()))
        row["worst_control_rel_l2"] = max(row["worst_control_rel_l2"], max(t.control_rel_l2 for t in r.tensors.values()))
    for row in rows.values():
        row["skip_reasons"] = sorted(row["skip_reasons"])
    return list(rows.values())


def markdown(env: dict, args: dict, summary: list[dict], results: list[CaseResult], timings: list[dict]) -> str:
    lines = [f"# Block kernels on one GPU: verification and speed ({env['date'][:10]})", "",
             f"Machine: {env['gpu']}; JAX devices {env['jax_devices']}.",
             (f"Versions: python {env['python']}, jax {env['jax']} (jaxlib {env['jaxlib']}), torch {env['torch']} "
              f"(CUDA {env['torch_cuda']}, cuDNN {env['torch_cudnn']}), flash_attn3_jax {env['flash_attn3_jax']}, "
              f"tokamax {env['tokamax']}."),
             f"Command: `python -m parity peers {args['argv']}` (seed {args['seed']}).", "",
             "## Verification (block interface, float64 truth, the contract's (docs/contract.md) low-precision metric)", "",
             ("Ratio = max |x − truth| / max |dense same-dtype control − truth| (the policy allows "
              f"{LOWP_FACTOR:g} plus a floor of {LOWP_ABS_FLOOR['bfloat16']:g}·max|truth| (bf16) / "
              f"{LOWP_ABS_FLOOR['float16']:g}·max|truth| (fp16)); worst over o, lse, dq, dk, dv and every case of the "
              f"row (heads 8/8, 8/2, 8/1; d 64, 128; bf16, fp16; {args['tokens']}² blocks, and for full masks also "
              f"{args['tokens'] // 2}×{args['tokens']} and {args['tokens']}×{args['tokens'] // 2})."), "",
             "| framework | backend | mask | passed | failed | skipped | worst ratio | at | worst rel L2 "
             "| control's worst rel L2 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        ratio = f"{s['worst_ratio']:.3g}" if s["passed"] + s["failed"] else "–"
        lines.append(f"| {s['framework']} | {s['backend']} | {s['mask']} | {s['passed']}/{s['cases']} | {s['failed']} | "
                     f"{s['skipped']} | {ratio} | {s['worst_at']} | {s['worst_rel_l2']:.2e} | {s['worst_control_rel_l2']:.2e} |")
    reasons = [(s, r) for s in summary for r in s["skip_reasons"]]
    if reasons:
        lines += ["", "Skip reasons:", ""] + [f"- {s['framework']} {s['backend']} {s['mask']}: {r}" for s, r in reasons]
    lines += ["", (f"## Speed ({args['bench_tokens']} tokens, b 1, 32 heads, d 128, bf16; causal and strict FLOPs "
                   f"halved; median of {args['repeats']} after 2 warm-ups)"), "",
              "| framework | backend | mask | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
              "|---|---|---|---|---|---|---|---|"]
    for t in timings:
        if "fwd_ms" in t:
            lines.append(f"| {t['framework']} | {t['backend']} | {t['mask']} | {t['fwd_ms']:.2f} | {t['fwd_tflops']:.0f} | "
                         f"{t['fwd_bwd_ms']:.2f} | {t['fwd_bwd_tflops']:.0f} | "
                         f"{'' if t.get('verified') else 'not verified by this invocation (--time-only)'} |")
        else:
            lines.append(f"| {t['framework']} | {t['backend']} | {t['mask']} | – | – | – | – | {t['note']} |")
    lines += ["", "## Every case", "",
              "| framework | backend | mask | heads | d | dtype | block | status | worst tensor | ratio | rel L2 (dq) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.case
        name, ratio = r.worst()
        dq = f"{r.tensors['dq'].rel_l2:.2e}" if "dq" in r.tensors else "–"
        lines.append(f"| {c.framework} | {c.backend} | {c.mask} | {c.heads}/{c.kv_heads} | {c.head_dim} | {c.dtype} | "
                     f"{c.tq}×{c.tk} | {r.status} | {name or '–'} | {ratio:.3g} | {dq} |")
    return "\n".join(lines) + "\n"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096, help="square block size of the verification")
    parser.add_argument("--bench-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--backends", nargs="+", default=None,
                        help="framework:name or name (both frameworks' backend of that name); default: all")
    parser.add_argument("--peers", choices=("all", "cpu", "none"), default="all",
                        help="peer kernels beside ringbridge's backends: all, those that run on a CPU, or none")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--time-only", nargs="+", default=None, metavar="FRAMEWORK:BACKEND:MASK",
                        help="skip verification and time these pairs (rows marked verified=false: use only for "
                             "pairs a separate run verified)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv``, verify and time (see the module docstring); 1 when a case failed."""
    args = build_parser(prog).parse_args(argv)
    if args.tokens % 2:
        raise ValueError(f"--tokens must be even (the rectangular blocks are half of it), got {args.tokens}")
    peers = {"all": {f: tuple(p) for f, p in PEERS.items()}, "cpu": CPU_PEERS,
             "none": {f: () for f in PEERS}}[args.peers]
    backends = BACKENDS
    if args.backends:
        backends = {fw: tuple(n for n in names if n in args.backends or f"{fw}:{n}" in args.backends)
                    for fw, names in BACKENDS.items()}
    subjects = {fw: backends[fw] + peers[fw] for fw in BACKENDS}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "kernel_table.log", "w") as log_file:
        results = run_all(args, subjects, argv, log_file)
    return 1 if any(r.status == "FAIL" for r in results) else 0


def run_all(args, backends: dict, argv, log_file) -> list[CaseResult]:
    """Verify, time, write the JSON and markdown, print the short tables (``main``'s body)."""

    def log(message: str) -> None:
        print(message, flush=True)
        log_file.write(message + "\n")
        log_file.flush()

    env = environment()
    log(json.dumps(env))
    if args.time_only:
        results, verdict = [], {tuple(p.split(":")): None for p in args.time_only}
    else:
        results = verify(cases(args.tokens, backends, args.dtypes, args.head_dims), args.seed, log)
        verdict = verified_pairs(results)
    timings = []
    if not args.no_timing:
        for (framework, name, mask), ok in verdict.items():
            row = {"framework": framework, "backend": name, "mask": mask}
            if name in UNTIMED and ok is not None:
                timings.append({**row, "note": f"not timed: {UNTIMED[name]}"})
            elif ok is False:
                timings.append({**row, "note": "not timed: not verified (a case failed or was skipped)"})
            else:
                try:
                    timings.append({**time_block(framework, name, Mask(mask), args.bench_tokens, 32, 128, "bfloat16",
                                                 args.repeats, args.seed), "verified": ok is True})
                except Exception as err:  # noqa: BLE001 — a kernel that fails to time is a row note, the table goes on
                    timings.append({**row, "note": f"timing failed: {type(err).__name__}: {str(err)[:160]}"})
                log(json.dumps(timings[-1]))
    summary = summarise(results)
    report_args = {"argv": " ".join(sys.argv[1:] if argv is None else argv), "seed": args.seed,
                   "tokens": args.tokens, "bench_tokens": args.bench_tokens, "repeats": args.repeats}
    payload = {"environment": env, "arguments": report_args, "summary": summary, "timing": timings,
               "cases": [{**asdict(r.case), "status": r.status, "seconds": r.seconds,
                          "tensors": {n: {**asdict(t), "ok": t.ok} for n, t in r.tensors.items()}} for r in results]}
    (args.out / "kernel_table.json").write_text(json.dumps(payload, indent=1, default=str))
    text = markdown(env, report_args, summary, results, timings)
    (args.out / "kernel_table.md").write_text(text)
    # The short tables last (the device tool returns the end of the output).
    log("\n".join(line for line in text.split("## Every case")[0].splitlines() if line.startswith("|")))
    return results
