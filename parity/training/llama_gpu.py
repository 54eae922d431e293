"""The whole model on ONE GPU, both frameworks: every strategy's attention replayed inside the
bf16 torch model and checked against the float64 step; the JAX and torch steps timed next to the
step-time model (``parity.training.step_model``).

``python -m parity.training.llama_gpu check --out DIR``: the tiny Llama in bf16 with the fused
block kernels, its attention in every layer run through a strategy's replay (``torch_impl.replay``:
every virtual device's blocks, merges and accumulators in turn on the one GPU, as an autograd
function), the rest of the step the non-parallel model on the layout-ordered batch. The loss and
every first-step gradient against the float64 step on the same bf16-rounded weights, under the
low-precision policy (``parity.core.numerics``: ≤ 2 × the same model's error with plain dense
bf16 attention + the floor).

``python -m parity.training.llama_gpu time --frameworks torch|jax --out DIR [--sizes 1024,2048,4096]
[--seqs 8192,32768] [--smoke]``: per framework (one process each), first the bf16 check of the
path it times (torch: the replay of one device, one document per row, as ``check``; JAX:
``check_jax``), then the rates measured by that framework's own kernels — C (bf16 8192³ matmul),
W_hbm (a 2 GiB elementwise copy: bytes read + written per second), C_attn (the causal block
kernel alone, per length and head shape) — then one training step (forward, backward, Adam) per
model size × length, one document per row, timed (median of 5 after 2), each row with the
model's prediction and its terms (matmul FLOPs / C + attention FLOPs / C_attn + memory bytes /
W_hbm, summed), and the program's own count beside the model: for torch the profiler's kernel
time by class and the aten ops' bytes (``accounting.torch_cost``), for JAX the optimized HLO's
FLOPs and bytes (``accounting.hlo_cost``) and the prediction from those bytes. Rows carry
``framework``, ``measured_s`` and ``predicted_s``; written to ``stepmodel-<framework>.json``
after every row. ``report`` merges them into ``stepmodel-DATE.json`` and ``.md`` (``time``
ends with it too). ``--smoke`` runs all of it on the CPU with tiny models (its times mean
nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..core.mesh import MeshShape
from ..core.numerics import check_tensor, step_verdict
from .llama import LlamaConfig, ModelCase, TokenBatch, next_in_document

STRATEGIES = {  # name -> (mesh, layout); ring-r1: one device, the path the timed step runs
    "ring-r1": (MeshShape(ring=1), "contiguous"),
    "zigzag-r2": (MeshShape(ring=2), "zigzag"), "zigzag-r4": (MeshShape(ring=4), "zigzag"),
    "zigzag-r8": (MeshShape(ring=8), "zigzag"), "stripe-r4": (MeshShape(ring=4), "stripe"),
    "contiguous-r4": (MeshShape(ring=4), "contiguous"),
    "allgather-r4": (MeshShape(ring=4, kv_exchange="allgather"), "zigzag"),
    "double-ring-2x2": (MeshShape(ring=4, ring_outer=2), "zigzag"), "ulysses-u4": (MeshShape(ulysses=4), "zigzag"),
    "usp-r2xu2": (MeshShape(ring=2, ulysses=2), "zigzag"),
}
CHECK_MODEL = LlamaConfig(vocab=256, d_model=256, layers=2, heads=4, kv_heads=2, head_dim=64, d_ff=512)
GPU_MODEL = LlamaConfig(vocab=32000, d_model=2048, layers=4, heads=16, kv_heads=8, head_dim=128, d_ff=5632)  # the timed step's


def replay_attention_fn(mesh: MeshShape, layout: str, block_backend: str = "auto", region=None):
    """An attention callable for ``torch_impl.layers`` (``mesh=None``) that runs ``mesh``'s
    strategy by replay on the inputs' device, forward and backward (an autograd function).
    ``region``: a context manager factory entered around its forward and its backward (the op
    counter's ``TorchCost.region("attention")`` names their ops)."""
    import contextlib

    import torch

    from torch_impl import replay

    strategy = replay.Strategy(ring=mesh.ring, ulysses=mesh.ulysses, outer=mesh.ring_outer,
                               kv_exchange=mesh.kv_exchange)

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, segment_ids, window, causal):
            kw = dict(strategy=strategy, causal=causal, layout=layout, block_backend=block_backend,
                      segment_ids=segment_ids, window=window, sinks=sinks)
            with region() if region else contextlib.nullcontext():
                o, lse = replay.replay_attention(q, k, v, **kw)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.kw = kw
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            with region() if region else contextlib.nullcontext():
                grads = replay.replay_attention_grads(q, k, v, o, lse, do.contiguous(), **ctx.kw)
            dsinks = grads[3] if len(grads) > 3 else None
            return grads[0], grads[1], grads[2], dsinks, None, None, None

    def attention(q, k, v, *, causal, segment_ids, window, sinks):
        return Replayed.apply(q, k, v, sinks, segment_ids, window, causal)

    return attention


def rounded(weights: dict, dtype: str = "bfloat16") -> dict:
    """``weights`` rounded to ``dtype`` and held in float64: the weights a ``dtype`` model computes
    with, for a float64 reference of it."""
    import torch

    return {n: torch.from_numpy(w).to(getattr(torch, dtype)).double().numpy() for n, w in weights.items()}


def one_document(batch: TokenBatch) -> TokenBatch:
    """``batch``'s tokens as one document per row (no packing: every block runs the fused kernels)."""
    ids = np.zeros_like(batch.segment_ids)
    positions = np.broadcast_to(np.arange(batch.tokens.shape[1], dtype=np.int32), batch.tokens.shape).copy()
    return TokenBatch(batch.tokens, next_in_document(batch.tokens, ids), positions, ids)


def loss_and_grads(case: ModelCase, weights: dict, dtype, attention=None, layout_order: bool = False,
                   packed: bool = True, device: str = "cuda", batch: TokenBatch | None = None):
    """(loss, {name: grad}) of one step of the non-parallel torch model on ``device``; ``batch``
    (original order; default the case's corpus, as one document per row unless ``packed``)."""
    import torch

    from .llama import IGNORE
    from .llama_torch import build_model, export, loss_sum

    if batch is None:
        batch = case.inputs()[1]
        batch = batch if packed else one_document(batch)
    if layout_order:
        batch = batch.permuted(case.permutation())
    model = build_model(case.model, weights, dtype=dtype, attention=attention, device=device)
    arrays = [torch.as_tensor(a, device=device) for a in (batch.tokens, batch.labels, batch.positions,
                                                          batch.segment_ids)]
    tokens, labels, positions, ids = arrays
    # one document per row: no ids, the causal mask alone — the path the timed steps run
    loss = loss_sum(model(tokens, positions, ids if packed else None), labels) / int((labels != IGNORE).sum())
    loss.backward()
    grads = export({n: p.grad for n, p in model.named_parameters()}, case.model)
    return loss.item(), grads


def check(strategies: list[str], seq: int, config: LlamaConfig, backend: str, packed: bool,
          device: str = "cuda") -> list[dict]:
    """One row per strategy: the worst tensor's error / tolerance, loss error, verdict. ``packed``:
    the packed corpus (document-masked blocks run the portable kernel: no fused kernel takes a
    document mask) or one document per row (every block on the fused kernels)."""
    import torch

    on = {"device": device}
    rows = []
    for name in strategies:
        mesh, layout = STRATEGIES[name]
        case = ModelCase(config, mesh, layout=layout, batch=2, seq=seq, fsdp=False)
        weights = rounded(case.inputs()[0])
        ref_loss, ref = loss_and_grads(case, weights, torch.float64, packed=packed, **on)
        ctl_loss, ctl = loss_and_grads(case, weights, torch.bfloat16, packed=packed, **on)
        got_loss, got = loss_and_grads(case, weights, torch.bfloat16, replay_attention_fn(mesh, layout, backend),
                                        layout_order=True, packed=packed, **on)
        checks = [check_tensor("loss", [got_loss], [ref_loss], "bfloat16", control=[ctl_loss])]
        checks += [check_tensor(n, got[n], ref[n], "bfloat16", control=ctl[n]) for n in ref]
        rows.append({"strategy": name, "layout": layout, "mesh": mesh.name, "seq": seq, "backend": backend,
                     "packed": packed, **step_verdict(checks), "loss": got_loss, "loss_ref": ref_loss,
                     "loss_error": abs(got_loss - ref_loss), "loss_tolerance": checks[0].tolerance})
        print(f"{name}: {'passed' if rows[-1]['passed'] else 'FAILED'} worst {rows[-1]['worst']} "
              f"({rows[-1]['worst_ratio']:.2f} of its tolerance)", flush=True)
    return rows


def check_jax(seq: int, config: LlamaConfig, backend: str) -> dict:
    """The JAX step llama_gpu times (``llama_jax.Step`` on a one-device mesh, bf16 activations,
    float32 weights, ``backend``'s block kernel), one document per row, against the float64 torch
    step on the same bf16-rounded weights (on the CPU), under the low-precision policy with the
    same JAX model on plain dense bf16 attention as the control: loss and every gradient."""
    import jax
    import jax.numpy as jnp

    from .llama import IGNORE
    from .llama_jax import Llama, Step, from_params, loss_sum, make_mesh, to_params

    case = ModelCase(config, MeshShape(ring=1), layout="contiguous", batch=2, seq=seq, fsdp=False)
    weights = rounded(case.inputs()[0])
    import torch

    ref_loss, ref = loss_and_grads(case, weights, torch.float64, packed=False, device="cpu")
    batch = one_document(case.inputs()[1])
    # one document per row: no segment ids, the causal mask alone — the path ``time`` runs
    arrays = (*(jnp.asarray(a) for a in (batch.tokens, batch.labels, batch.positions)), None)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), to_params(weights, config))
    count = float((batch.labels != IGNORE).sum())

    dense = Llama(config, "contiguous", None, False, jnp.bfloat16)

    def control(p):
        tokens, labels, positions, ids = arrays
        return loss_sum(dense.apply({"params": p}, tokens, positions, ids), labels) / count

    ctl_loss, ctl_grads = jax.jit(jax.value_and_grad(control))(params)
    step = Step(case, make_mesh(case), dtype=jnp.bfloat16, block_backend=backend)
    opt_state = step.opt.init(params)
    _, grads_fn, _ = step.programs(params, opt_state)
    loss, grads = grads_fn(params, *arrays)
    got, ctl = from_params(grads, config), from_params(ctl_grads, config)
    got_loss = float(np.sum(np.asarray(loss, np.float64)))
    checks = [check_tensor("loss", [got_loss], [ref_loss], "bfloat16", control=[float(ctl_loss)])]
    checks += [check_tensor(n, got[n], ref[n], "bfloat16", control=ctl[n]) for n in ref]
    row = {"framework": "jax", "strategy": "ring-r1", "seq": seq, "backend": backend, "packed": False,
           **step_verdict(checks), "loss": got_loss, "loss_ref": ref_loss}
    print(f"jax ring-r1: {'passed' if row['passed'] else 'FAILED'} worst {row['worst']} "
          f"({row['worst_ratio']:.2f} of its tolerance)", flush=True)
    return row


# ---- timing ----------------------------------------------------------------------------------------

# The step-time sweep (issue 39): d_model -> model, layers chosen so that both frameworks' step at
# 32k tokens fits one 80 GB H100 (bf16; JAX keeps float32 weights and Adam states).
SIZES = {
    1024: LlamaConfig(vocab=32000, d_model=1024, layers=8, heads=8, kv_heads=4, head_dim=128, d_ff=2816),
    2048: GPU_MODEL,
    4096: LlamaConfig(vocab=32000, d_model=4096, layers=4, heads=32, kv_heads=8, head_dim=128, d_ff=11008),
}
SEQS = (8192, 32768)
# --smoke: the whole command on the CPU in seconds
SMOKE_SIZES = {
    64: LlamaConfig(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, d_ff=160),
    96: LlamaConfig(vocab=384, d_model=96, layers=1, heads=6, kv_heads=6, head_dim=16, d_ff=256),
}
SMOKE_SEQS = (128, 256)


@dataclass(frozen=True)
class Timing:
    """How long to measure: steps not timed and timed; calibration sizes (n of the n³ matmul, MiB
    of the copied buffer)."""

    warmup: int = 2
    iters: int = 5
    matmul: int = 8192
    copy_mib: int = 2048
    ladder_kib: tuple[int, ...] = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)  # the copy ladder's sizes


SMOKE_TIMING = Timing(warmup=1, iters=2, matmul=256, copy_mib=8, ladder_kib=(64, 256, 1024))


def _median_ms(fn, warmup: int, iters: int, device: str = "cuda") -> float:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def jax_median_ms(fn, warmup: int, iters: int, repeat: int = 1) -> float:
    """Median ms of one ``fn()``; ``repeat``: calls dispatched back to back per timing (the time
    over ``repeat``), so a kernel's rate excludes the ~0.2 ms of dispatch and sync one call adds
    (a bf16 8192³ matmul timed one call at a time read 629 TFLOP/s on an H100 where torch read 731)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = [fn() for _ in range(repeat)]
        jax.block_until_ready(out)
        times.append(1e3 * (time.perf_counter() - start) / repeat)
    return statistics.median(times)


def matmul_rate(n: int, device: str = "cuda") -> float:
    """C: FLOP/s of a bf16 n×n×n matmul (torch)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (_median_ms(lambda: a @ b, 3, 10, device) * 1e-3)


def hbm_bandwidth(mib: int, device: str = "cuda") -> float:
    """W_hbm: bytes read + written per second by a large elementwise copy (torch ``copy_`` of a
    ``mib`` MiB bf16 buffer into another: 2 × mib MiB moved per copy)."""
    import torch

    n = mib * 2**20 // 2
    src, dst = torch.randn(n, device=device, dtype=torch.bfloat16), torch.empty(n, device=device, dtype=torch.bfloat16)
    return 2 * n * 2 / (_median_ms(lambda: dst.copy_(src), 3, 10, device) * 1e-3)


def copy_ladder(kib: tuple[int, ...], device: str = "cuda", kernels: int = 50) -> tuple[tuple[float, float], ...]:
    """``Rates.hbm_curve`` by torch: ((bytes one copy kernel moves, bytes/s), ...) of ``copy_``
    between bf16 buffers of each size in ``kib``, ``kernels`` copies issued back to back per timing
    (eager, one op each — so a small copy's rate includes what the step's small ops pay to be
    issued)."""
    import torch

    curve = []
    for size in kib:
        n = size * 1024 // 2
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)

        def copies(src=src, dst=dst):
            for _ in range(kernels):
                dst.copy_(src)

        seconds = _median_ms(copies, 1, 5, device) * 1e-3 / kernels
        curve.append((4.0 * n, 4.0 * n / seconds))
    return tuple(curve)


def jax_matmul_rate(n: int) -> float:
    """C as XLA compiles it: FLOP/s of a jitted bf16 n×n×n matmul."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / (jax_median_ms(lambda: mm(a, b), 3, 10, repeat=10) * 1e-3)


def jax_hbm_bandwidth(mib: int) -> float:
    """W_hbm as XLA compiles it: a jitted elementwise x·2 over a ``mib`` MiB bf16 buffer (reads it,
    writes a new one)."""
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    scale = jax.jit(lambda v: v * 2)
    return 2 * n * 2 / (jax_median_ms(lambda: scale(x), 3, 10, repeat=10) * 1e-3)


def attention_rate(backend: str, seq: int, heads: int, head_dim: int, device: str = "cuda",
                   dtype: str = "bfloat16", batch: int = 1) -> tuple[str, float]:
    """(kernel, FLOP/s) of the block kernel ``backend`` resolves to for one causal block of
    ``batch`` rows of ``seq`` tokens in ``dtype`` on ``device`` ("cuda" or "cpu"), forward +
    backward (4·h·s²·d/2 × 3.5 FLOPs a row), timed alone. (Short rows run far below the kernel's
    peak — 2.4 TFLOP/s for one row of 256 tokens on an H200 — and gain with the batch.)"""
    import torch

    from seqplan.schedule import BlockMask
    from torch_impl.block import get_backend, resolve_backend

    name = resolve_backend(backend, device_kind=device, dtype=dtype, mask="causal")
    kernel, mask, scale = get_backend(name), BlockMask("causal"), head_dim**-0.5
    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (torch.randn(shape, device=device, dtype=getattr(torch, dtype)) for _ in range(4))

    def block():
        with torch.no_grad():
            o, lse = kernel.fwd(q, k, v, mask, scale)
            kernel.bwd(do, q, k, v, o, lse, mask, scale, None)

    return name, batch * 3.5 * 4 * heads * seq * seq * head_dim / 2 / (_median_ms(block, 2, 5, device) * 1e-3)


def jax_attention_rate(backend: str, seq: int, heads: int, head_dim: int, batch: int = 1,
                       dtype: str = "bfloat16") -> tuple[str, float]:
    """(kernel, FLOP/s) of jax_impl's block kernel ``backend`` resolves to for one causal block
    of ``batch`` rows of ``seq`` tokens in ``dtype``, forward + backward (4·h·s²·d/2 × 3.5 FLOPs a
    row), jitted and timed alone — the mirror of :func:`attention_rate`."""
    import jax

    from jax_impl.block import device_kind_of, get_backend, resolve_backend
    from seqplan.schedule import BlockMask

    mask, scale = BlockMask("causal"), head_dim**-0.5
    q, k, v, do = (jax.random.normal(jax.random.key(i), (batch, seq, heads, head_dim), dtype) for i in range(4))
    name = resolve_backend(backend, device_kind=device_kind_of(q), dtype=q.dtype, mask=mask)
    kernel = get_backend(name)

    @jax.jit
    def block(q, k, v, do):
        o, lse = kernel.fwd(q, k, v, mask, scale)
        return kernel.bwd(do, q, k, v, o, lse, mask, scale)

    return name, batch * 3.5 * 4 * heads * seq * seq * head_dim / 2 / (
        jax_median_ms(lambda: block(q, k, v, do), 2, 5, repeat=5) * 1e-3)


HOST_FLOOR_SEQ = 256  # tokens of the host-floor step (torch): its GPU work is a few ms, its Python the step's


def _batch(config: LlamaConfig, seq: int) -> TokenBatch:
    case = ModelCase(config, MeshShape(ring=1), layout="contiguous", batch=1, seq=seq, fsdp=False)
    return one_document(case.inputs()[1])


# The timed rows hold one document per row, so both frameworks' steps pass no segment ids: the
# causal mask alone, the path C_attn is measured on. (With ids of one document the attention is
# the same, but takes the document path: JAX's run dispatch — the portable kernel at 8k — and
# torch's host copy of the ids, a device sync per layer and pass.)


def torch_step(config: LlamaConfig, seq: int, backend: str, device: str = "cuda", region=None):
    """``step()``: one bf16 training step (forward, backward, ``torch.optim.Adam`` with foreach —
    the CUDA default, named so the CPU runs it too) of ``config`` on one row of ``seq`` tokens
    (one document, no segment ids), the attention the replay of one device. ``region``: as
    :func:`replay_attention_fn`; the optimizer runs under ``region`` too when given (``region``
    is then called with "attention" or "optimizer")."""
    import contextlib

    import torch

    from .llama import IGNORE
    from .llama_torch import build_model, loss_sum

    batch = _batch(config, seq)
    attention = replay_attention_fn(MeshShape(ring=1), "contiguous", backend,
                                    region=(lambda: region("attention")) if region else None)
    model = build_model(config, None, dtype=torch.bfloat16, attention=attention, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    tokens, labels, positions = (torch.as_tensor(a, device=device) for a in
                                 (batch.tokens, batch.labels, batch.positions))
    count = int((labels != IGNORE).sum())

    def step():
        opt.zero_grad(set_to_none=True)
        loss_sum(model(tokens, positions, None), labels).div(count).backward()
        with region("optimizer") if region else contextlib.nullcontext():
            opt.step()

    return step


def _profile_by_class(step, device: str) -> dict[str, float]:
    """Kernel time (s) of one ``step`` under torch.profiler, by class of kernel name: matmul (GEMM
    kernels), attention (cuDNN / flash attention kernels), optimizer (the foreach kernels Adam
    runs: multi_tensor_apply), memory (every other kernel: norms, RoPE, SwiGLU, the casts, the
    softmax and cross-entropy of the logits, the replay's glue — the memory term's kernels). On
    the CPU (``--smoke``) the same classes of the aten ops' own CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    kinds = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "memory": 0.0}
    for event in prof.key_averages():
        if device == "cuda":
            total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        else:
            total = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        name = event.key.lower()
        if not total:
            continue
        if any(k in name for k in ("fmha", "flash", "attention", "cudnn", "sdpa")):
            kinds["attention"] += total / 1e6
        elif any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "sm90", "aten::mm", "aten::addmm",
                                     "aten::bmm")):
            kinds["matmul"] += total / 1e6
        elif any(k in name for k in ("multi_tensor", "foreach")):
            kinds["optimizer"] += total / 1e6
        else:
            kinds["memory"] += total / 1e6
    return kinds


def trace_torch_step(config: LlamaConfig, seq: int, backend: str, device: str = "cuda"):
    """The aten ops of one step (after one untraced step), counted (``TorchCost``): FLOPs and bytes
    by class — attention kernels (``_scaled_dot_product_*`` ops and the portable kernel's)
    apart from the attention's glue."""
    from ..accounting.torch_cost import TorchCost

    cost = TorchCost(log=[])
    step = torch_step(config, seq, backend, device, region=cost.region)
    step()
    with cost:
        step()
    glue = sum(b for cls, op, b, _ in cost.log if cls == "attention" and not op.startswith("_scaled_dot_product")
               and op not in ("bmm", "mm"))
    return cost, glue


def _model_name(config: LlamaConfig) -> str:
    return f"d{config.d_model}-L{config.layers}"


def time_torch(config: LlamaConfig, seq: int, backend: str, timing: Timing, rates: dict,
               device: str = "cuda") -> dict:
    """One row: the torch step timed (median), its prediction (``step_model``) with the terms, the
    profile by class, the aten-op count of the same step against the model's bytes."""
    import torch

    from . import step_model as sm

    # the host's floor: the same step (same kernels, same Python) on a row too short to keep the GPU busy
    floor_step = torch_step(config, HOST_FLOOR_SEQ, backend, device)
    host_s = _median_ms(floor_step, timing.warmup, timing.iters, device) * 1e-3
    del floor_step
    _free("torch")
    step = torch_step(config, seq, backend, device)
    measured = _median_ms(step, timing.warmup, timing.iters, device) * 1e-3
    peak = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() / 2**30
    profile = _profile_by_class(step, device)
    del step
    kernel_name, c_attention = rates["attention"][seq]
    r = sm.Rates(rates["matmul"], c_attention, rates["hbm"], hbm_curve=rates["hbm_curve"])
    pred = sm.predict_step(config, seq, seq * (seq + 1) / 2, "torch", "bfloat16", r, host_s=host_s)
    model_bytes = pred.memory_bytes["total"]
    memory_s = profile["memory"] + profile["optimizer"]
    extra = {"profile_s": profile, "profile_memory_s": memory_s, "profile_total_s": sum(profile.values()),
             "gpu_idle_s": measured - sum(profile.values()),
             "achieved_hbm_in_step": model_bytes / memory_s if memory_s else None}
    try:  # the aten ops of the same step, counted (a failure here keeps the timed row)
        cost, glue = trace_torch_step(config, seq, backend, device)
        traced = cost.bytes.get("other", 0.0) + cost.bytes.get("optimizer", 0.0) + glue
        extra |= {"traced_bytes": traced, "traced_over_model": traced / model_bytes,
                  "traced_matmul_flops": cost.flops.get("matmul", 0.0),
                  "traced_matmul_over_model": cost.flops.get("matmul", 0.0) / pred.matmul_flops}
    except Exception as err:  # noqa: BLE001 — recorded in the row
        extra["trace_error"] = f"{type(err).__name__}: {err}"
    return _row("torch", config, seq, measured, pred, r, kernel_name, peak, extra)


def _row(framework, config, seq, measured, pred, rates, kernel_name, peak, extra) -> dict:
    from . import step_model as sm

    d = pred.as_dict()
    return {"framework": framework, "model": _model_name(config), "config": asdict(config), "seq": seq,
            "measured_s": measured, "predicted_s": d["predicted_s"], "measured_over_predicted": measured / d["predicted_s"],
            "terms": {k: d[k] for k in ("matmul_s", "attention_s", "memory_s", "compute_only_s", "combine", "gpu_s",
                                        "host_s")},
            "predicted_max_s": max(d["matmul_s"], d["attention_s"], d["memory_s"]),
            "memory_at_peak_copy_s": d["memory_bytes"]["total"] / rates.hbm,  # every byte at the 2 GiB copy's rate
            "memory_bytes": d["memory_bytes"],
            "memory_bytes_by_dtype": sm.bytes_by_dtype(sm.memory_passes(config, seq, framework, "bfloat16")),
            "matmul_flops": d["matmul_flops"], "attention_flops": d["attention_flops"],
            "rates": {"matmul_tflops": rates.matmul / 1e12, "attention_tflops": rates.attention / 1e12,
                      "hbm_gbps": rates.hbm / 1e9, "attention_kernel": kernel_name},
            "peak_gib": peak, **extra}


def jax_step(config: LlamaConfig, seq: int, backend: str):
    """(run, texts): ``run()`` one jitted bf16 training step of llama_jax's model (one-device mesh,
    float32 weights and Adam states, parameters and states donated and fed back), and the
    optimized HLO of that step program."""
    import jax.numpy as jnp

    from .llama_jax import Step, make_mesh, to_params

    case = ModelCase(config, MeshShape(ring=1), layout="contiguous", batch=1, seq=seq, fsdp=False)
    step = Step(case, make_mesh(case), dtype=jnp.bfloat16, block_backend=backend)
    batch = _batch(config, seq)
    import jax
    from jax.sharding import NamedSharding

    put = lambda a, spec: jax.device_put(a, NamedSharding(step.mesh, spec))
    params = jax.tree.map(lambda a: put(jnp.asarray(a), step.weight_spec), to_params(
        {n: w for n, w in case.inputs()[0].items()}, config))
    opt_state = step.opt.init(params)
    arrays = tuple(put(jnp.asarray(a), step.tokens_spec) for a in (batch.tokens, batch.labels, batch.positions))
    arrays += (None,)  # one document per row: no segment ids
    fn = step.programs(params, opt_state, donate=True)[2]
    compiled = fn.lower(params, opt_state, *arrays).compile()
    state = {"params": params, "opt": opt_state}

    def run():
        _, _, state["params"], state["opt"] = compiled(state["params"], state["opt"], *arrays)
        return state["params"]

    return run, compiled.as_text()


def time_jax(config: LlamaConfig, seq: int, backend: str, timing: Timing, rates: dict,
             out: Path | None = None) -> dict:
    """One row: the JAX step timed (median), its prediction with the terms, and the compiled
    program's own count (``hlo_cost``: FLOPs and bytes by class) against the model — and the
    prediction from the program's bytes. ``out``: where the optimized HLO is kept
    (``hlo-<model>-<seq>.txt.gz``), so the GPU's fusion can be read on the CPU afterwards."""
    import gzip

    from ..accounting.hlo_cost import count_cost
    from . import step_model as sm

    start = time.perf_counter()
    run, text = jax_step(config, seq, backend)
    compile_s = time.perf_counter() - start
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hlo-{_model_name(config)}-{seq}.txt.gz").write_bytes(gzip.compress(text.encode()))
    measured = jax_median_ms(run, timing.warmup, timing.iters) * 1e-3
    kernel_name, c_attention = rates["attention"][seq]
    r = sm.Rates(rates["matmul"], c_attention, rates["hbm"], hbm_curve=rates["hbm_curve"])
    pred = sm.predict_step(config, seq, seq * (seq + 1) / 2, "jax", "bfloat16", r)
    extra = {"compile_s": compile_s}
    try:  # the compiled program's own count (a failure here keeps the timed row)
        hlo = count_cost(text)
        hlo_memory = sum(hlo.bytes.get(c, 0.0) for c in ("other", "loss", "optimizer"))
        extra |= {"hlo_flops": dict(hlo.flops), "hlo_bytes": dict(hlo.bytes), "hlo_memory_bytes": hlo_memory,
                  "hlo_over_model": hlo_memory / pred.memory_bytes["total"],
                  "hlo_matmul_over_model": hlo.flops.get("matmul", 0.0) / pred.matmul_flops,
                  "attention_custom_calls": hlo.attention_calls,
                  "predicted_from_hlo_s": hlo.flops.get("matmul", 0.0) / r.matmul + pred.attention_s
                  + hlo_memory / r.hbm}
    except Exception as err:  # noqa: BLE001 — recorded in the row
        extra["hlo_error"] = f"{type(err).__name__}: {err}"
    peak = None
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use", 0) / 2**30 or None  # the process's peak so far
    except Exception:  # noqa: BLE001 — not every backend reports memory
        pass
    return _row("jax", config, seq, measured, pred, r, kernel_name, peak, extra)


def calibrate_rates(framework: str, timing: Timing, configs, seqs, backend: str, device: str) -> dict:
    """C, W_hbm and C_attn (per sequence length and head shape) measured by ``framework``'s own
    kernels in this process: {"matmul", "hbm", "attention": {(seq, heads, head_dim): (kernel, rate)}}."""
    shapes = sorted({(c.heads, c.head_dim) for c in configs})
    if framework == "torch":
        rates = {"matmul": matmul_rate(timing.matmul, device), "hbm": hbm_bandwidth(timing.copy_mib, device),
                 "hbm_curve": copy_ladder(timing.ladder_kib, device)}
        att = {(s, h, d): attention_rate(backend, s, h, d, device) for s in seqs for h, d in shapes}
    else:
        # no copy ladder for JAX: a copy timed call by call is JAX's dispatch at small sizes (75 µs a
        # call on an H100), which kernels inside one compiled program do not pay; its passes are
        # charged at the large copy's rate
        rates = {"matmul": jax_matmul_rate(timing.matmul), "hbm": jax_hbm_bandwidth(timing.copy_mib), "hbm_curve": ()}
        att = {(s, h, d): jax_attention_rate(backend, s, h, d) for s in seqs for h, d in shapes}
    rates["attention"] = att
    print(f"{framework}: C {rates['matmul'] / 1e12:.1f} TFLOP/s, W_hbm {rates['hbm'] / 1e9:.0f} GB/s, C_attn "
          + ", ".join(f"{s}/{h}x{d} {k} {r / 1e12:.1f}" for (s, h, d), (k, r) in att.items())
          + "; copy ladder " + ", ".join(f"{b / 2**20:.2f} MiB {w / 1e9:.0f} GB/s" for b, w in rates["hbm_curve"]),
          flush=True)
    return rates


def run_time(framework: str, sizes: dict, seqs, backend: str, timing: Timing, device: str, out: Path,
             smoke: bool = False) -> dict:
    """``time``: the framework's bf16 correctness check, its rates, then every size × length row
    (a row that fails records its error and the sweep goes on). Writes ``stepmodel-<fw>.json``."""
    configs = list(sizes.values())
    check_seq = 256 if smoke else 2048
    try:
        if framework == "torch":
            checked = check(["ring-r1"], check_seq, CHECK_MODEL, backend, packed=False, device=device)[0]
            checked["framework"] = "torch"
        else:
            checked = check_jax(check_seq, CHECK_MODEL, backend)
    except Exception as err:  # noqa: BLE001 — recorded; the timed rows then say they are unchecked
        checked = {"framework": framework, "passed": False, "error": f"{type(err).__name__}: {err}"}
        traceback.print_exc()
    rates = calibrate_rates(framework, timing, configs, seqs, backend, device)
    rows = []
    for config in configs:
        for seq in seqs:
            per_seq = {**rates, "attention": {seq: rates["attention"][(seq, config.heads, config.head_dim)]}}
            try:
                row = (time_torch(config, seq, backend, timing, per_seq, device) if framework == "torch"
                       else time_jax(config, seq, backend, timing, per_seq, out))
                row["verified"] = bool(checked.get("passed"))
            except Exception as err:  # noqa: BLE001 — a failing row is a row (out of memory, a compile error)
                row = {"framework": framework, "model": _model_name(config), "seq": seq,
                       "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
                traceback.print_exc()
            rows.append(row)
            print(_row_line(row), flush=True)
            _free(framework)
            result = {"env": _env(framework), "check": checked, "timing": asdict(timing),
                      "rates": {"matmul_tflops": rates["matmul"] / 1e12, "hbm_gbps": rates["hbm"] / 1e9,
                                "copy_ladder": [{"kernel_mib": b / 2**20, "gbps": w / 1e9} for b, w in rates["hbm_curve"]],
                                "attention": {f"{s}/{h}x{d}": {"kernel": k, "tflops": r / 1e12}
                                              for (s, h, d), (k, r) in rates["attention"].items()}},
                      "rows": rows}
            out.mkdir(parents=True, exist_ok=True)  # written after every row: a run cut short keeps its rows
            (out / f"stepmodel-{framework}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def _free(framework: str) -> None:
    import gc

    gc.collect()
    if framework == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _env(framework: str) -> dict:
    import platform

    env = {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    if framework == "torch":
        import torch

        env |= {"torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"}
    else:
        import jax

        env |= {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                "xla_flags": __import__("os").environ.get("XLA_FLAGS", "")}
    return env


def _row_line(row: dict) -> str:
    if "error" in row:
        return f"{row['framework']:5s} {row['model']:10s} T={row['seq']:6d}  ERROR {row['error']}"
    t = row["terms"]
    return (f"{row['framework']:5s} {row['model']:10s} T={row['seq']:6d}  measured {row['measured_s'] * 1e3:8.1f} ms  "
            f"predicted {row['predicted_s'] * 1e3:8.1f} ms (matmul {t['matmul_s'] * 1e3:.1f} + attention "
            f"{t['attention_s'] * 1e3:.1f} + memory {t['memory_s'] * 1e3:.1f}; host floor {t['host_s'] * 1e3:.1f})  "
            f"ratio {row['measured_over_predicted']:.3f}")


def report(out: Path) -> str:
    """``report``: every ``stepmodel-<framework>.json`` in ``out`` merged into ``stepmodel-DATE.json``
    and ``.md``; returns the markdown."""
    parts = [json.loads(p.read_text()) for p in sorted(out.glob("stepmodel-*.json"))
             if p.stem.split("-", 1)[1] in ("jax", "torch")]
    if not parts:
        raise ValueError(f"no stepmodel-jax.json or stepmodel-torch.json in {out}")
    date = parts[0]["env"]["date"]
    merged = {"date": date, "frameworks": {p["rows"][0]["framework"] if p["rows"] else p["check"]["framework"]: p
                                           for p in parts}}
    (out / f"stepmodel-{date}.json").write_text(json.dumps(merged, indent=1, default=str) + "\n")
    lines = [f"# Step-time model vs the measured step — {date}", ""]
    for p in parts:
        r = p["rates"]
        lines.append(f"- {p['env']}: check {'passed' if p['check'].get('passed') else 'FAILED'} "
                     f"(worst {p['check'].get('worst_ratio', float('nan')):.2f} of the tolerance); C "
                     f"{r['matmul_tflops']:.1f} TFLOP/s, W_hbm {r['hbm_gbps']:.0f} GB/s, C_attn "
                     + ", ".join(f"{k} {v['kernel']} {v['tflops']:.1f}" for k, v in r["attention"].items()))
    lines += ["", "| framework | model | T | measured ms | predicted ms | matmul | attention | memory (at the "
              "2 GiB copy's rate) | host floor | measured / predicted | compute-only ratio | memory GB | profile mm / attn / mem "
              "ms, GPU idle (torch) | program bytes / model |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in parts:
        for row in p["rows"]:
            if "error" in row:
                lines.append(f"| {row['framework']} | {row['model']} | {row['seq']} | {row['error']} |"
                             + " |" * 10)
                continue
            t, ms = row["terms"], lambda x: f"{x * 1e3:.1f}"
            prof = row.get("profile_s")
            prof_text = "—" if not prof else (f"{ms(prof['matmul'])} / {ms(prof['attention'])} / "
                                              f"{ms(prof['memory'] + prof['optimizer'])}, {ms(row.get('gpu_idle_s', 0.0))}")
            flat = row.get("memory_at_peak_copy_s")
            ratio = row.get("traced_over_model", row.get("hlo_over_model", float("nan")))
            lines.append(f"| {row['framework']} | {row['model']} | {row['seq']} | {ms(row['measured_s'])} "
                         f"| {ms(row['predicted_s'])} | {ms(t['matmul_s'])} | {ms(t['attention_s'])} "
                         f"| {ms(t['memory_s'])} ({ms(flat) if flat else '—'}) | {ms(t.get('host_s', 0.0))} "
                         f"| {row['measured_over_predicted']:.3f} "
                         f"| {row['measured_s'] / t['compute_only_s']:.3f} | {row['memory_bytes']['total'] / 1e9:.1f} "
                         f"| {prof_text} | {ratio:.3f} |")
    text = "\n".join(lines) + "\n"
    (out / f"stepmodel-{date}.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.training.llama_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("check", "time", "report"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seq", type=int, default=None, help="check: tokens per row (2048)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--one-document", action="store_true", help="check: one document per row (fused kernels only)")
    ap.add_argument("--frameworks", default="torch", help="time: comma-separated of jax,torch (one process each "
                    "is cleaner: each framework's caching allocator keeps what it took)")
    ap.add_argument("--sizes", default=None, help=f"time: comma-separated d_model of {sorted(SIZES)}")
    ap.add_argument("--seqs", default=None, help=f"time: comma-separated tokens per row (default {SEQS})")
    ap.add_argument("--smoke", action="store_true", help="time: tiny models and rates on the CPU (the whole command "
                    "in seconds)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.what == "report":
        print(report(a.out))
        return 0
    if a.what == "check":
        import torch

        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        rows = check([s for s in a.strategies.split(",") if s], a.seq or 2048, CHECK_MODEL, a.backend,
                     not a.one_document)
        name = f"llama-bf16-check{'-one-document' if a.one_document else ''}.json"
        (a.out / name).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        print(f"{sum(r['passed'] for r in rows)} of {len(rows)} strategies passed")
        return 0 if all(r["passed"] for r in rows) else 1
    frameworks = [f for f in a.frameworks.split(",") if f]
    if not frameworks or set(frameworks) - {"jax", "torch"}:
        ap.error(f"--frameworks must be a subset of jax,torch, got {a.frameworks!r}")
    table = SMOKE_SIZES if a.smoke else SIZES
    try:
        wanted = [int(x) for x in a.sizes.split(",")] if a.sizes else list(table)
        seqs = tuple(int(x) for x in a.seqs.split(",")) if a.seqs else (SMOKE_SEQS if a.smoke else SEQS)
    except ValueError:
        ap.error("--sizes and --seqs take comma-separated integers")
    if set(wanted) - set(table):
        ap.error(f"--sizes must be of {sorted(table)}, got {a.sizes!r}")
    if "jax" in frameworks:
        from ..core.devices import configure_jax_devices

        # timed GEMMs must be tuned ones: XLA's untuned default ran a bf16 8192³ matmul at 10 TFLOP/s
        # on an H100 (2026-11-25), 1/70 of the tuned rate
        configure_jax_devices("cpu" if a.smoke else "gpu", autotune=a.what == "time")
    device = "cpu" if a.smoke else "cuda"
    timing = SMOKE_TIMING if a.smoke else Timing()
    for framework in frameworks:
        # on the CPU torch's "auto" is the portable kernel (many ops); aten_cpu is one op inside the
        # same adapter aten_cudnn uses, so the smoke run's op count separates kernel and glue as the GPU's does
        backend = "aten_cpu" if a.smoke and framework == "torch" and a.backend == "auto" else a.backend
        run_time(framework, {d: table[d] for d in wanted}, seqs, backend, timing, device, a.out, a.smoke)
    print(report(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
