"""The whole model on ONE GPU (torch): every strategy's attention replayed inside the bf16 model,
checked against the float64 step, and one step of a GPU-sized model timed next to its compute
prediction.

``python -m parity.training.llama_gpu check --out DIR``: the tiny Llama in bf16 with the fused
block kernels, its attention in every layer run through a strategy's replay (``torch_impl.replay``:
every virtual device's blocks, merges and accumulators in turn on the one GPU, as an autograd
function), the rest of the step the non-parallel model on the layout-ordered batch. The loss and
every first-step gradient against the float64 step on the same bf16-rounded weights, under the
low-precision policy (``parity.core.numerics``: ≤ 2 × the same model's error with plain dense
bf16 attention + the floor).

``python -m parity.training.llama_gpu time --out DIR``: one training step (forward, backward,
Adam) of a model sized to fill the GPU at 32k tokens, the attention the replay of one device
(the fused kernel), timed; next to the prediction T = matmul FLOPs / C + attention FLOPs / C_attn,
C a bf16 n×n×n matmul's rate and C_attn the fused causal kernel's, both measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..core.mesh import MeshShape
from ..core.numerics import check_tensor
from .llama import LlamaConfig, ModelCase, TokenBatch, next_in_document, step_flops

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


def replay_attention_fn(mesh: MeshShape, layout: str, block_backend: str = "auto"):
    """An attention callable for ``torch_impl.layers`` (``mesh=None``) that runs ``mesh``'s
    strategy by replay on the inputs' device, forward and backward (an autograd function)."""
    import torch

    from torch_impl import replay

    strategy = replay.Strategy(ring=mesh.ring, ulysses=mesh.ulysses, outer=mesh.ring_outer,
                               kv_exchange=mesh.kv_exchange)

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, segment_ids, window, causal):
            kw = dict(strategy=strategy, causal=causal, layout=layout, block_backend=block_backend,
                      segment_ids=segment_ids, window=window, sinks=sinks)
            o, lse = replay.replay_attention(q, k, v, **kw)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.kw = kw
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            grads = replay.replay_attention_grads(q, k, v, o, lse, do.contiguous(), **ctx.kw)
            dsinks = grads[3] if len(grads) > 3 else None
            return grads[0], grads[1], grads[2], dsinks, None, None, None

    def attention(q, k, v, *, causal, segment_ids, window, sinks):
        return Replayed.apply(q, k, v, sinks, segment_ids, window, causal)

    return attention


def _bf16_rounded(weights: dict) -> dict:
    import torch

    return {n: torch.from_numpy(w).to(torch.bfloat16).double().numpy() for n, w in weights.items()}


def one_document(batch: TokenBatch) -> TokenBatch:
    """``batch``'s tokens as one document per row (no packing: every block runs the fused kernels)."""
    ids = np.zeros_like(batch.segment_ids)
    positions = np.broadcast_to(np.arange(batch.tokens.shape[1], dtype=np.int32), batch.tokens.shape).copy()
    return TokenBatch(batch.tokens, next_in_document(batch.tokens, ids), positions, ids)


def _loss_and_grads(case: ModelCase, weights: dict, dtype, attention=None, layout_order: bool = False,
                    packed: bool = True):
    """(loss, {name: grad}) of one step of the non-parallel model on the GPU."""
    import torch

    from .llama import IGNORE
    from .llama_torch import build_model, export, loss_sum

    _, batch = case.inputs()
    batch = batch if packed else one_document(batch)
    if layout_order:
        batch = batch.permuted(case.permutation())
    model = build_model(case.model, weights, dtype=dtype, attention=attention, device="cuda")
    arrays = [torch.as_tensor(a, device="cuda") for a in (batch.tokens, batch.labels, batch.positions,
                                                          batch.segment_ids)]
    tokens, labels, positions, ids = arrays
    loss = loss_sum(model(tokens, positions, ids), labels) / int((labels != IGNORE).sum())
    loss.backward()
    grads = export({n: p.grad for n, p in model.named_parameters()}, case.model)
    return loss.item(), grads


def check(strategies: list[str], seq: int, config: LlamaConfig, backend: str, packed: bool) -> list[dict]:
    """One row per strategy: the worst tensor's error / tolerance, loss error, verdict. ``packed``:
    the packed corpus (document-masked blocks run the portable kernel: no fused kernel takes a
    document mask) or one document per row (every block on the fused kernels)."""
    import torch

    rows = []
    for name in strategies:
        mesh, layout = STRATEGIES[name]
        case = ModelCase(config, mesh, layout=layout, batch=2, seq=seq, fsdp=False)
        weights = _bf16_rounded(case.inputs()[0])
        ref_loss, ref = _loss_and_grads(case, weights, torch.float64, packed=packed)
        ctl_loss, ctl = _loss_and_grads(case, weights, torch.bfloat16, packed=packed)
        got_loss, got = _loss_and_grads(case, weights, torch.bfloat16, replay_attention_fn(mesh, layout, backend),
                                        layout_order=True, packed=packed)
        checks = [check_tensor("loss", [got_loss], [ref_loss], "bfloat16", control=[ctl_loss])]
        checks += [check_tensor(n, got[n], ref[n], "bfloat16", control=ctl[n]) for n in ref]
        worst = max(checks, key=lambda c: c.error / c.tolerance)
        rows.append({"strategy": name, "layout": layout, "mesh": mesh.name, "seq": seq, "backend": backend,
                     "packed": packed,
                     "passed": all(c.ok for c in checks), "tensors": len(checks), "worst": worst.name,
                     "worst_ratio": worst.error / worst.tolerance, "loss": got_loss, "loss_ref": ref_loss,
                     "loss_error": abs(got_loss - ref_loss), "loss_tolerance": checks[0].tolerance})
        print(f"{name}: {'passed' if rows[-1]['passed'] else 'FAILED'} worst {worst}", flush=True)
    return rows


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


def time_step(config: LlamaConfig, seq: int, backend: str, warmup: int = 2, iters: int = 5) -> dict:
    """One bf16 training step of ``config`` on ``seq`` tokens, timed, with its compute prediction."""
    import torch

    from .llama import IGNORE
    from .llama_torch import build_model, loss_sum

    case = ModelCase(config, MeshShape(ring=1), layout="contiguous", batch=1, seq=seq, fsdp=False)
    batch = one_document(case.inputs()[1])
    model = build_model(config, None, dtype=torch.bfloat16, attention=replay_attention_fn(case.mesh, "contiguous",
                                                                                          backend), device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens, labels, positions, ids = (torch.as_tensor(a, device="cuda") for a in
                                      (batch.tokens, batch.labels, batch.positions, batch.segment_ids))
    count = int((labels != IGNORE).sum())

    def step():
        opt.zero_grad(set_to_none=True)
        loss_sum(model(tokens, positions, ids), labels).div(count).backward()
        opt.step()

    step_ms = _median_ms(step, warmup, iters)
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated()
    breakdown = _gpu_time_by_kind(step)
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c_matmul = 2 * n**3 / (_median_ms(lambda: a @ b, 3, 10) * 1e-3)
    name, c_attention = attention_rate(backend, seq, config.heads, config.head_dim)
    flops = step_flops(config, batch)
    matmul, attention = flops["matmul_fwd"] + flops["matmul_bwd"], flops["attention_fwd"] + flops["attention_bwd"]
    predicted_ms = 1e3 * (matmul / c_matmul + attention / c_attention)
    return {"config": asdict(config), "seq": seq, "backend": backend, "step_ms": step_ms, "peak_gib": peak / 2**30,
            "matmul_flops": matmul, "attention_flops": attention, "C_matmul_tflops": c_matmul / 1e12,
            "C_attention_tflops": c_attention / 1e12, "predicted_ms": predicted_ms,
            "measured_over_predicted": step_ms / predicted_ms, "attention_kernel": name,
            "profile_ms": breakdown,
            "matmul_tflops_in_step": matmul / (breakdown["matmul"] * 1e-3) / 1e12 if breakdown["matmul"] else None,
            "attention_tflops_in_step": attention / (breakdown["attention"] * 1e-3) / 1e12
            if breakdown["attention"] else None}


def attention_rate(backend: str, seq: int, heads: int, head_dim: int, device: str = "cuda",
                   dtype: str = "bfloat16") -> tuple[str, float]:
    """(kernel, FLOP/s) of the block kernel ``backend`` resolves to for one causal block of
    ``seq`` tokens in ``dtype`` on ``device`` ("cuda" or "cpu"), forward + backward
    (4·h·s²·d/2 × 3.5 FLOPs), timed alone."""
    import torch

    from seqplan.schedule import BlockMask
    from torch_impl.block import get_backend, resolve_backend

    name = resolve_backend(backend, device_kind=device, dtype=dtype, mask="causal")
    kernel, mask, scale = get_backend(name), BlockMask("causal"), head_dim**-0.5
    q, k, v, do = (torch.randn(1, seq, heads, head_dim, device=device, dtype=getattr(torch, dtype)) for _ in range(4))

    def block():
        with torch.no_grad():
            o, lse = kernel.fwd(q, k, v, mask, scale)
            kernel.bwd(do, q, k, v, o, lse, mask, scale, None)

    return name, 3.5 * 4 * heads * seq * seq * head_dim / 2 / (_median_ms(block, 2, 5, device) * 1e-3)


def _gpu_time_by_kind(step) -> dict[str, float]:
    """GPU kernel time (ms) of one ``step`` under torch.profiler, by kind of kernel name: matmul
    (GEMM kernels), attention (cuDNN / flash attention kernels), the rest (norms, RoPE, SwiGLU,
    softmax and cross-entropy of the logits, the replay's merges and casts, Adam) — the part the
    compute prediction leaves out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        name = event.key.lower()
        if any(k in name for k in ("fmha", "flash", "attention", "cudnn", "sdpa")):
            kinds["attention"] += total / 1e3
        elif any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "sm90")):
            kinds["matmul"] += total / 1e3
        else:
            kinds["other"] += total / 1e3
    return kinds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parity.training.llama_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("check", "time"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seq", type=int, default=None, help="check: 2048; time: 32768")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--one-document", action="store_true", help="check: one document per row (fused kernels only)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    import torch

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.what == "check":
        rows = check([s for s in a.strategies.split(",") if s], a.seq or 2048, CHECK_MODEL, a.backend,
                     not a.one_document)
        name = f"llama-bf16-check{'-one-document' if a.one_document else ''}.json"
        (a.out / name).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        print(f"{sum(r['passed'] for r in rows)} of {len(rows)} strategies passed")
    else:
        row = time_step(GPU_MODEL, a.seq or 32768, a.backend)
        (a.out / "llama-step-time.json").write_text(json.dumps({"env": env, "row": row}, indent=1))
        print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
