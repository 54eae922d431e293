"""Masked blocks on one GPU (issue 35): the document kernels checked block by block, the anchor
kernel on the same ids, and the portable kernel's memory on a real-length masked block.

    python -m benchmarks.masked [--seq 32768] [--out DIR]     (a GPU; writes masked.json / .md)
    python -m benchmarks.masked --smoke                         (CPU: tiny sizes, what can run there)

1. **Block checks** — ``aten_varlen`` (torch_impl/kernels/varlen.py) against the portable kernel in
   float32 on the same bf16 inputs, through the block interface, for the edge cases: a causal
   diagonal block of packed documents (length-1 documents included), a full block whose queries
   and keys come from different places of the sequence (documents spanning the block edge, a
   query document with no key in the block: o = 0, lse = -inf), GQA 32 / 8. Pass: o, dq, dk, dv
   within the low-precision bound (2e-2 relative to each tensor's max), lse within 1e-2 abs,
   empty rows exactly o = 0, lse = -inf.
2. **Anchor** — FA2 varlen itself (``aten._flash_attention_forward`` / ``_backward``, what
   ``varlen_attn`` calls) on the whole sequence's documents: checked at 4096 tokens against the
   portable kernel, then timed fwd+bwd at ``--seq`` (TFLOP/s on the visible pairs).
3. **Portable memory** — torch's CUDA peak of the portable kernel's fwd + bwd on one
   document-masked causal block of 16384 tokens, 8 heads, d 64, against the block's float32 scores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from seqplan.schedule import BlockMask, MaskKind


def _ids(seq: int, seed: int = 0) -> np.ndarray:
    from parity.core.documents import draw_segment_ids

    return draw_segment_ids("mix", 1, seq, np.random.default_rng(seed)).astype(np.int32)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    finite = b.isfinite()
    return float((a[finite] - b[finite]).abs().max() / b[finite].abs().max().clamp_min(1e-30))


def _anchor_result(kernel: str, problem, errors: dict, fwd_ms: float, step_ms: float, verified: bool | None = None,
                   **extra) -> dict:
    """An anchor's result: its kernel, its 4096-token check (``errors``; ``verified``: every error
    within 2e-2 unless given), the forward and forward + backward times at ``problem.seq`` and their
    TFLOP/s on the problem's visible pairs."""
    return {"kernel": kernel, "seq": problem.seq, **extra, "verified_at_4096": errors,
            "verified": all(e <= 2e-2 for e in errors.values()) if verified is None else verified,
            "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms, "tflops_fwd": problem.flops(True) / fwd_ms / 1e9,
            "tflops_fwd_bwd": problem.flops(False) / step_ms / 1e9}


def block_checks(device: str, heads=32, kv_heads=8, d=128, t=4096, backend="aten_varlen") -> list[dict]:
    """Each case: the backend under test vs the portable kernel (float32) on the same inputs."""
    import torch

    from seqplan.documents import document_runs
    from torch_impl.block import get_backend

    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen).bfloat16()
    # packed documents over 2t tokens with length-1 documents, one spanning the block edge at t
    ids = torch.from_numpy(np.repeat(np.arange(9, dtype=np.int32), _doc_lengths(t))[None]).to(device)
    ref, fast = get_backend("reference"), get_backend(backend)
    half_absent = torch.cat([ids[:, :t // 2], ids[:, t // 2:t] + 77777], 1)
    cases = [("causal diagonal, packed (length-1 documents)", MaskKind.CAUSAL, ids[:, :t], ids[:, :t]),
             ("full, later queries vs earlier keys (one document spans the edge)", MaskKind.FULL, ids[:, t:],
              ids[:, :t]),
             ("full, half the query documents absent from the keys", MaskKind.FULL, half_absent, ids[:, :t])]
    rows = []
    for name, kind, q_ids, kv_ids in cases:
        q, do = rnd(1, t, heads, d), rnd(1, t, heads, d)
        k, v = rnd(1, t, kv_heads, d), rnd(1, t, kv_heads, d)
        mask, scale, seg = BlockMask(kind, documents=True), d**-0.5, (q_ids, kv_ids)
        o_r, lse_r = ref.fwd(q, k, v, mask, scale, segments=seg)
        o_f, lse_f = fast.fwd(q, k, v, mask, scale, segments=seg)
        o = o_r.bfloat16()
        g_r = ref.bwd(do, q, k, v, o, lse_r, mask, scale, segments=seg)
        g_f = fast.bwd(do, q, k, v, o, lse_r, mask, scale, segments=seg)
        empty = ~lse_r.isfinite()
        errors = {"o": _rel(o_f.float(), o_r), "lse": float((lse_f - lse_r)[~empty].abs().max()) if (~empty).any()
                  else 0.0, "dq": _rel(g_f[0].float(), g_r[0]), "dk": _rel(g_f[1].float(), g_r[1]),
                  "dv": _rel(g_f[2].float(), g_r[2])}
        empty_ok = bool((lse_f[empty] == float("-inf")).all() and (o_f.float().transpose(1, 2)[empty] == 0).all())
        ok = empty_ok and errors["lse"] <= 1e-2 and all(errors[n] <= 2e-2 for n in ("o", "dq", "dk", "dv"))
        runs = document_runs(q_ids.cpu().numpy(), kv_ids.cpu().numpy(), kind is MaskKind.CAUSAL)
        ok = ok and runs is not None  # the varlen path ran, not the portable fallback
        rows.append({"case": name, "mask": kind.value, "runs": None if runs is None else len(runs.cu_q) - 1,
                     "empty_rows": int(empty.sum()), "empty_rows_exact": empty_ok,
                     "errors": errors, "verified": ok})
        print(f"block check {name}: {errors} empty rows {int(empty.sum())} exact={empty_ok} verified={ok}", flush=True)
    return rows


def window_checks(heads=32, kv_heads=8, d=128, t=4096, backend: str = "aten_window") -> list[dict]:
    """``backend``'s windowed blocks (torch: ``aten_window`` on FA2's window, or ``fa4`` on FA4's)
    vs the portable kernel: a causal diagonal block, an off-diagonal block the window crosses, one
    the window reaches only at its corner (the crop leaves most rows empty), and positions that are
    not contiguous (must take the portable path)."""
    import torch

    from torch_impl.block import get_backend
    from torch_impl.kernels.window import block_band

    gen = torch.Generator(device="cuda").manual_seed(2)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()
    ref, fast = get_backend("reference"), get_backend(backend)
    span = lambda start: torch.arange(start, start + t, device="cuda", dtype=torch.int32)
    cases = _window_cases(t, span, torch.cat)
    rows = []
    for name, kind, window, q_pos, kv_pos in cases:
        q, do = rnd(1, t, heads, d), rnd(1, t, heads, d)
        k, v = rnd(1, t, kv_heads, d), rnd(1, t, kv_heads, d)
        mask, scale, pos = BlockMask(kind, window=window), d**-0.5, (q_pos, kv_pos)
        o_r, lse_r = ref.fwd(q, k, v, mask, scale, positions=pos)
        o_f, lse_f = fast.fwd(q, k, v, mask, scale, positions=pos)
        o = o_r.bfloat16()
        g_r = ref.bwd(do, q, k, v, o, lse_r, mask, scale, positions=pos)
        g_f = fast.bwd(do, q, k, v, o, lse_r, mask, scale, positions=pos)
        empty = ~lse_r.isfinite()
        errors = {"o": _rel(o_f.float(), o_r), "lse": float((lse_f - lse_r)[~empty].abs().max()) if (~empty).any()
                  else 0.0, "dq": _rel(g_f[0].float(), g_r[0]), "dk": _rel(g_f[1].float(), g_r[1]),
                  "dv": _rel(g_f[2].float(), g_r[2])}
        empty_ok = bool((lse_f[empty] == float("-inf")).all() and (o_f.float().transpose(1, 2)[empty] == 0).all())
        fused = block_band(mask, t, t, pos) != "portable"
        ok = empty_ok and errors["lse"] <= 1e-2 and all(errors[n] <= 2e-2 for n in ("o", "dq", "dk", "dv"))
        rows.append({"backend": backend, "case": name, "mask": kind.value, "window": list(window), "fused_path": fused,
                     "empty_rows": int(empty.sum()), "empty_rows_exact": empty_ok, "errors": errors, "verified": ok})
        print(f"window check {backend} {name}: {errors} fused={fused} empty rows {int(empty.sum())} exact={empty_ok} "
              f"verified={ok}", flush=True)
    return rows


WINDOW_CHECK = 1000  # the window every window anchor is checked with at 4096 tokens


def _torch_window_errors(q, k, v, do, o, dq, window: int) -> dict:
    """o and dq of a causal ``window`` over [1, t, ...] inputs against the portable kernel's."""
    import torch

    from seqplan.schedule import UNBOUNDED
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    d = q.shape[-1]
    pos = torch.arange(q.shape[1], device=q.device, dtype=torch.int32)
    mask = BlockMask(MaskKind.CAUSAL, window=(window, UNBOUNDED))
    o_r, lse_r = reference_block_fwd(q, k, v, mask, d**-0.5, positions=(pos, pos))
    g_r = reference_block_bwd(do, q, k, v, o_r.bfloat16(), lse_r, mask, d**-0.5, positions=(pos, pos))
    return {"o": _rel(o.float(), o_r), "dq": _rel(dq.float(), g_r[0])}


def window_anchor(seq: int, window: int = 4096, heads=32, kv_heads=8, d=128, iters=5, warmup=2) -> dict:
    """FA2's own sliding window (``aten._flash_attention_forward`` / ``_backward``, window
    (w - 1, 0) — Hugging Face's w) on the whole sequence: torch_impl's ``aten_window`` path, checked
    at 4096 tokens (window :data:`WINDOW_CHECK`) against the portable kernel, then timed."""
    import torch

    from benchmarks.common import Problem
    from seqplan.schedule import UNBOUNDED
    from torch_impl.kernels.window import block_band, window_block_bwd, window_block_fwd

    gen = torch.Generator(device="cuda").manual_seed(3)

    def inputs(t):
        q, do = (torch.randn(1, t, heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, t, kv_heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        return q, k, v, do, torch.arange(t, device="cuda", dtype=torch.int32)

    band = lambda w: BlockMask(MaskKind.CAUSAL, window=(w, UNBOUNDED))

    def calls(q, k, v, do, pos, w):
        mask = band(w)
        fwd = lambda: window_block_fwd(q, k, v, mask, d**-0.5, positions=(pos, pos))

        def step():
            o, lse = fwd()
            return o, window_block_bwd(do, q, k, v, o, lse, mask, d**-0.5, positions=(pos, pos))

        return fwd, step

    q, k, v, do, pos = inputs(4096)
    o, grads = calls(q, k, v, do, pos, WINDOW_CHECK)[1]()
    errors = _torch_window_errors(q, k, v, do, o, grads[0], WINDOW_CHECK)
    timed = inputs(seq)
    # the fused band, not the portable fallback, at both sizes: else the check compares the portable
    # kernel with itself and the anchor times it
    fused = all(block_band(band(w), t, t, (p, p)) != "portable"
                for w, t, p in ((WINDOW_CHECK, 4096, pos), (window, seq, timed[-1])))
    fwd, step = calls(*timed, window)
    fwd_ms, step_ms = cuda_ms(fwd, iters, warmup), cuda_ms(step, iters, warmup)
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, window=(window, 0))
    return _anchor_result("FA2 sliding window (aten._flash_attention_*, through aten_window on the whole sequence)",
                          problem, {**errors, "fused": fused}, fwd_ms, step_ms,
                          fwd_bwd_queued_ms=cuda_queued_ms(step, iters),
                          verified=fused and all(e <= 2e-2 for e in errors.values()), window=window)


def fa4_window_anchor(seq: int, window: int = 4096, heads=32, kv_heads=8, d=128, iters=5, warmup=2) -> dict:
    """FlashAttention-4's own sliding window (``flash_attn_varlen_func(window_size=(w, 0))`` over one
    run, through its own autograd) on the whole sequence, checked at 4096 tokens (window
    :data:`WINDOW_CHECK`) against the portable kernel, then timed. Raises ImportError where it is
    not installed."""
    import torch
    from flash_attn.cute.interface import flash_attn_varlen_func

    from benchmarks.common import Problem

    gen = torch.Generator(device="cuda").manual_seed(5)

    def inputs(t):
        q, do = (torch.randn(t, heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        k, v = (torch.randn(t, kv_heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        return [x.requires_grad_() for x in (q, k, v)], do

    def call(qkv, w):
        cu = torch.tensor([0, qkv[0].shape[0]], device="cuda", dtype=torch.int32)
        t = qkv[0].shape[0]
        return lambda: flash_attn_varlen_func(*qkv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t, max_seqlen_k=t,
                                              softmax_scale=d**-0.5, causal=True, window_size=(w, 0))[0]

    (q, k, v), do = inputs(4096)
    o = call((q, k, v), WINDOW_CHECK)()
    dq = torch.autograd.grad(o, q, do)[0]
    errors = _torch_window_errors(q[None].detach(), k[None].detach(), v[None].detach(), do[None], o[None], dq[None],
                                  WINDOW_CHECK)
    qkv, do = inputs(seq)
    fwd = call(qkv, window)
    fwd_ms, step_ms, queued_ms = _autograd_ms(fwd, qkv, do, iters, warmup)
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, window=(window, 0))
    return _anchor_result(f"FlashAttention-4 sliding window (flash_attn.cute, window_size=({window}, 0))", problem,
                          errors, fwd_ms, step_ms, window=window, fwd_bwd_queued_ms=queued_ms)


def _autograd_ms(fwd, qkv, do, iters: int, warmup: int) -> tuple[float, float, float]:
    """(forward ms, forward + backward ms, the latter queued: :func:`cuda_queued_ms`) of ``fwd()``
    over the leaf tensors ``qkv``, through autograd with cotangent ``do`` (a kernel library's own
    backward)."""
    import torch

    def step():
        for x in qkv:
            x.grad = None
        fwd().backward(do)

    with torch.no_grad():
        fwd_ms = cuda_ms(fwd, iters, warmup)
    return fwd_ms, cuda_ms(step, iters, warmup), cuda_queued_ms(step, iters)


def cuda_queued_ms(fn, steps: int) -> float:
    """ms a call of ``fn`` with ``steps`` calls issued back to back between two CUDA events (the
    host running ahead, as in training); ``fn`` already warm."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def cuda_ms(fn, iters: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def anchor(seq: int, heads=32, kv_heads=8, d=128, iters=5, warmup=2, problem=None) -> dict:
    """FA2 varlen on the whole sequence's documents (the anchor the replay rows compare to):
    ``problem``'s ids (a ``benchmarks.common.Problem``; default: the harness's ``mix`` at ``seq``)."""
    import torch

    from benchmarks.common import Problem
    from torch_impl.kernels.varlen import varlen_block_bwd, varlen_block_fwd

    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(1)
    mask = BlockMask(MaskKind.CAUSAL, documents=True)

    def run(t, ids, time_it):
        q, do = (torch.randn(1, t, heads, d, device=device, generator=gen).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, t, kv_heads, d, device=device, generator=gen).bfloat16() for _ in range(2))
        seg = (ids, ids)

        def step():
            o, lse = varlen_block_fwd(q, k, v, mask, d**-0.5, segments=seg)
            return o, lse, varlen_block_bwd(do, q, k, v, o, lse, mask, d**-0.5, segments=seg)

        if not time_it:
            return q, k, v, do, step()
        fwd_ms = cuda_ms(lambda: varlen_block_fwd(q, k, v, mask, d**-0.5, segments=seg), iters, warmup)
        return fwd_ms, cuda_ms(step, iters, warmup), cuda_queued_ms(step, iters)

    small = torch.from_numpy(_ids(4096)).to(device)
    q, k, v, do, (o, lse, grads) = run(4096, small, False)
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    o_r, lse_r = reference_block_fwd(q, k, v, mask, d**-0.5, segments=(small, small))
    g_r = reference_block_bwd(do, q, k, v, o_r.bfloat16(), lse_r, mask, d**-0.5, segments=(small, small))
    errors = {"o": _rel(o.float(), o_r), "dq": _rel(grads[0].float(), g_r[0])}
    problem = problem or Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents="mix")
    fwd_ms, step_ms, queued_ms = run(seq, torch.from_numpy(problem.segment_ids()).to(device), True)
    return _anchor_result("FA2 varlen (aten._flash_attention_forward/_backward)", problem, errors, fwd_ms, step_ms,
                          fwd_bwd_queued_ms=queued_ms)


FA4_KERNEL = "FlashAttention-4 varlen (flash_attn.cute flash_attn_varlen_func)"


def fa4_anchor(seq: int, heads=32, kv_heads=8, d=128, iters=5, warmup=2, problem=None) -> dict:
    """FlashAttention-4's varlen kernel (pip ``flash-attn-4``: ``flash_attn.cute.interface``) on
    the whole sequence's documents, causal, through its own autograd: checked at 4096 tokens
    against the portable kernel (as :func:`anchor`), then timed on ``problem``'s ids. Raises
    ImportError where it is not installed. Its kernels JIT-compile per variant (seconds, in the
    warmup)."""
    import torch
    from flash_attn.cute.interface import flash_attn_varlen_func

    from benchmarks.common import Problem
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(1)

    def tensors(t):
        q, do = (torch.randn(t, heads, d, device=device, generator=gen).bfloat16() for _ in range(2))
        k, v = (torch.randn(t, kv_heads, d, device=device, generator=gen).bfloat16() for _ in range(2))
        return [x.requires_grad_() for x in (q, k, v)], do

    def call(qkv, ids):
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        bounds = np.r_[starts, len(ids)]
        cu = torch.as_tensor(bounds.astype(np.int32), device=device)
        longest = int(np.diff(bounds).max())
        return lambda: flash_attn_varlen_func(*qkv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                              max_seqlen_k=longest, softmax_scale=d**-0.5, causal=True)[0]

    small = _ids(4096)[0]
    (q, k, v), do = tensors(4096)
    o = call((q, k, v), small)()
    dq = torch.autograd.grad(o, q, do)[0]
    seg = (torch.from_numpy(small[None]).to(device),) * 2
    mask = BlockMask(MaskKind.CAUSAL, documents=True)
    o_r, lse_r = reference_block_fwd(q[None].detach(), k[None].detach(), v[None].detach(), mask, d**-0.5, segments=seg)
    g_r = reference_block_bwd(do[None], q[None].detach(), k[None].detach(), v[None].detach(), o_r.bfloat16(), lse_r,
                              mask, d**-0.5, segments=seg)
    errors = {"o": _rel(o[None].float(), o_r), "dq": _rel(dq[None].float(), g_r[0])}
    problem = problem or Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents="mix")
    qkv, do = tensors(seq)
    fwd = call(qkv, problem.segment_ids()[0])
    fwd_ms, step_ms, queued_ms = _autograd_ms(fwd, qkv, do, iters, warmup)
    return _anchor_result(FA4_KERNEL, problem, errors, fwd_ms, step_ms, fwd_bwd_queued_ms=queued_ms)


FA4_DENSE_KERNEL = "FlashAttention-4 (flash_attn.cute flash_attn_func, causal)"


def fa4_dense_anchor(seq: int, heads=32, kv_heads=8, d=128, iters=5, warmup=2) -> dict:
    """FlashAttention-4's dense causal kernel (``flash_attn_func`` on [1, t, h, d], GQA K/V as they
    are, through its own autograd) — torch's unmasked ceiling when flash-attn-4 is installed:
    checked at 4096 tokens against the portable kernel (o and dq), then timed at ``seq``. Raises
    ImportError where it is not installed. Its kernels JIT-compile per variant (in the warmup)."""
    import torch
    from flash_attn.cute.interface import flash_attn_func

    from benchmarks.common import Problem
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    gen = torch.Generator(device="cuda").manual_seed(7)

    def tensors(t):
        q, do = (torch.randn(1, t, heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, t, kv_heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
        return [x.requires_grad_() for x in (q, k, v)], do

    def call(qkv):  # (out, lse) in flash-attn-4 4.0 betas; out alone would also do
        def fwd():
            result = flash_attn_func(*qkv, softmax_scale=d**-0.5, causal=True)
            return result[0] if isinstance(result, tuple) else result
        return fwd

    (q, k, v), do = tensors(4096)
    o = call((q, k, v))()
    dq = torch.autograd.grad(o, q, do)[0]
    mask = BlockMask(MaskKind.CAUSAL)
    o_r, lse_r = reference_block_fwd(q.detach(), k.detach(), v.detach(), mask, d**-0.5)
    g_r = reference_block_bwd(do, q.detach(), k.detach(), v.detach(), o_r.bfloat16(), lse_r, mask, d**-0.5)
    errors = {"o": _rel(o.float(), o_r), "dq": _rel(dq.float(), g_r[0])}
    qkv, do = tensors(seq)
    fwd_ms, step_ms, queued_ms = _autograd_ms(call(qkv), qkv, do, iters, warmup)
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d)
    return _anchor_result(FA4_DENSE_KERNEL, problem, errors, fwd_ms, step_ms, fwd_bwd_queued_ms=queued_ms)


def portable_peak(device: str, t=16384, heads=8, d=64) -> dict:
    """torch's peak allocation of the portable kernel's fwd + bwd on one masked block."""
    import torch

    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    ids = torch.from_numpy(_ids(t)).to(device)
    q, k, v, do = (torch.randn(1, t, heads, d, device=device).bfloat16() for _ in range(4))
    mask = BlockMask(MaskKind.CAUSAL, documents=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    o, lse = reference_block_fwd(q, k, v, mask, d**-0.5, segments=(ids, ids))
    reference_block_bwd(do, q, k, v, o, lse, mask, d**-0.5, segments=(ids, ids))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    scores = heads * t * t * 4
    return {"t": t, "heads": heads, "head_dim": d, "peak_beyond_inputs_mib": peak / 2**20,
            "scores_f32_mib": scores / 2**20, "fraction_of_scores": peak / scores,
            "seconds": time.perf_counter() - start}


def _doc_lengths(t: int) -> list[int]:
    """Packed documents over 2t tokens: length-1 documents, one spanning the block edge at t."""
    lengths = [1, 2047, 1, 1, 1500, 2000, 500, 1, 2141]
    lengths[-1] += 2 * t - sum(lengths)
    return lengths


def jax_block_checks(heads=32, kv_heads=8, d=128, t=4096, backend="cudnn_varlen") -> list[dict]:
    """``cudnn_varlen`` (jax_impl/kernels/packed.py) vs the portable kernel, as ``block_checks``."""
    import jax
    import jax.numpy as jnp

    from jax_impl.block import get_backend
    from jax_impl.kernels.runs import packed_segments

    ids = jnp.asarray(np.repeat(np.arange(9, dtype=np.int32), _doc_lengths(t))[None])
    half_absent = jnp.concatenate([ids[:, :t // 2], ids[:, t // 2:t] + 77777], 1)
    cases = [("causal diagonal, packed (length-1 documents)", MaskKind.CAUSAL, ids[:, :t], ids[:, :t]),
             ("full, later queries vs earlier keys (one document spans the edge)", MaskKind.FULL, ids[:, t:],
              ids[:, :t]),
             ("full, half the query documents absent from the keys", MaskKind.FULL, half_absent, ids[:, :t])]
    ref, fast = get_backend("reference"), get_backend(backend)
    scale = d**-0.5
    keys = iter(jax.random.split(jax.random.key(0), 64))
    rnd = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(jnp.bfloat16)
    rows = []
    for name, kind, q_ids, kv_ids in cases:
        q, do, k, v = rnd(1, t, heads, d), rnd(1, t, heads, d), rnd(1, t, kv_heads, d), rnd(1, t, kv_heads, d)
        mask, seg = BlockMask(kind, documents=True), (q_ids, kv_ids)
        o_r, lse_r = jax.jit(lambda q, k, v, m=mask, s=seg: ref.fwd(q, k, v, m, scale, segments=s))(q, k, v)
        o_f, lse_f = jax.jit(lambda q, k, v, m=mask, s=seg: fast.fwd(q, k, v, m, scale, segments=s))(q, k, v)
        o = o_r.astype(jnp.bfloat16)
        g_r = jax.jit(lambda *a, m=mask, s=seg: ref.bwd(*a, m, scale, segments=s))(do, q, k, v, o, lse_r)
        g_f = jax.jit(lambda *a, m=mask, s=seg: fast.bwd(*a, m, scale, segments=s))(do, q, k, v, o, lse_r)
        ran_packed = bool(packed_segments(q_ids, kv_ids, kind is MaskKind.CAUSAL).ok)
        row = _jax_errors(o_r, lse_r, g_r, o_f, lse_f, g_f)
        ok, errors = ran_packed and row["verified"], row["errors"]
        rows.append({"case": name, "mask": kind.value, "ran_packed": ran_packed, "empty_rows": row["empty_rows"],
                     "empty_rows_exact": row["empty_rows_exact"], "errors": errors, "verified": ok})
        print(f"jax block check {backend} {name}: {errors} packed={ran_packed} empty rows {row['empty_rows']} "
              f"exact={row['empty_rows_exact']} verified={ok}", flush=True)
        if not ok and errors["lse"] > 1e-2:  # say where cuDNN's statistics went
            print("  lse ref [0, 0, :6]", np.asarray(lse_r)[0, 0, :6], "got", np.asarray(lse_f)[0, 0, :6], flush=True)
    return rows


def jax_ms(fn, *args, iters=5, warmup=2) -> float:
    """Median wall ms of a jitted call (host clock around block_until_ready)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def jax_queued_ms(fn, *args, steps=10, repeats=3) -> float:
    """Wall ms per call with ``steps`` calls queued before one wait (the host running ahead of the
    GPU, as a training loop's does), the median of ``repeats`` such runs; ``fn`` already compiled
    and warm (every caller times it waited first). Beside :func:`jax_ms`, whose every call also
    pays the host's launch and the wait's wake-up (for FA3's own varlen fwd+bwd at 32k on an
    H200, up to 0.5 ms of a 5-ms step, 2026-11-29: docs/gpu/host-gaps-2026-11-29-h200.md)."""
    import jax

    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):  # each step's outputs dropped as the next is issued: one step's memory, not steps'
            out = fn(*args)
        jax.block_until_ready(out)  # a device runs its steps in order: the last done, all done
        runs.append((time.perf_counter() - start) * 1e3 / steps)
    return float(np.median(runs))


def jax_anchor(seq: int, heads=32, kv_heads=8, d=128, problem=None) -> dict:
    """flash_attn3_jax's ``flash_mha_varlen`` (its own custom_vjp; causal, so the library's
    backward workspaces suffice: 64-row tiles) on the whole sequence's documents, checked at 4096
    tokens against the portable kernel, then timed."""
    import jax
    import jax.numpy as jnp
    from flash_attn3_jax import flash_mha_varlen

    from benchmarks.common import Problem
    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    mask = BlockMask(MaskKind.CAUSAL, documents=True)

    def inputs(t, ids):
        keys = jax.random.split(jax.random.key(1), 4)
        q, do = (jax.random.normal(kk, (t, heads, d)).astype(jnp.bfloat16) for kk in keys[:2])
        k, v = (jax.random.normal(kk, (t, kv_heads, d)).astype(jnp.bfloat16) for kk in keys[2:])
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        cu = jnp.asarray(np.r_[starts, t].astype(np.int32))
        longest = int(np.diff(np.r_[starts, t]).max())
        return q, k, v, do, cu, longest

    def programs(cu, longest):
        fwd = lambda q, k, v: flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                               softmax_scale=d**-0.5, is_causal=True)

        def step(q, k, v, do):
            o, pull = jax.vjp(fwd, q, k, v)
            return o, pull(do)

        return jax.jit(fwd), jax.jit(step)

    small = _ids(4096)[0]
    q, k, v, do, cu, longest = inputs(4096, small)
    fwd, step = programs(cu, longest)
    o, (dq, _, _) = step(q, k, v, do)
    seg = (jnp.asarray(small[None]), jnp.asarray(small[None]))
    o_r, lse_r = reference_block_fwd(q[None], k[None], v[None], mask, d**-0.5, segments=seg)
    dq_r = reference_block_bwd(do[None], q[None], k[None], v[None], o_r.astype(jnp.bfloat16), lse_r, mask, d**-0.5,
                               segments=seg)[0]
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    errors = {"o": rel(o, o_r[0]), "dq": rel(dq, dq_r[0])}
    problem = problem or Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents="mix")
    q, k, v, do, cu, longest = inputs(seq, problem.segment_ids()[0])
    fwd, step = programs(cu, longest)
    fwd_ms, step_ms = jax_ms(fwd, q, k, v), jax_ms(step, q, k, v, do)
    return _anchor_result("flash_attn3_jax flash_mha_varlen (its own vjp)", problem, errors, fwd_ms, step_ms,
                          fwd_bwd_queued_ms=jax_queued_ms(step, q, k, v, do))


def _window_cases(t: int, span, cat):
    """The windowed blocks both frameworks' checks run: (name, kind, window, q_pos, kv_pos)."""
    from seqplan.schedule import UNBOUNDED

    return [("causal diagonal, window 1000", MaskKind.CAUSAL, (1000, UNBOUNDED), span(0), span(0)),
            ("full, queries one block after the keys, window 5000", MaskKind.FULL, (5000, UNBOUNDED), span(t), span(0)),
            ("full, the window reaches the corner only (100)", MaskKind.FULL, (100, UNBOUNDED), span(t), span(0)),
            ("full, two-sided window (700, 300), keys after the queries", MaskKind.FULL, (700, 300), span(0),
             span(t // 8)),
            ("full, positions not contiguous (zigzag-like): portable", MaskKind.FULL, (3000, UNBOUNDED),
             cat([span(2 * t)[: t // 2], span(6 * t)[: t // 2]]), span(0))]


def jax_window_checks(heads=32, kv_heads=8, d=128, t=4096, backend="fa3") -> list[dict]:
    """JAX ``fa3`` on windowed blocks (FA3's own window on the band, ``kernels/fused.py``) vs the
    portable kernel, the same cases as :func:`window_checks`; each mask carries the parts' static
    offset as the loops give it (None where the positions are not runs: the portable path)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.block import get_backend
    from jax_impl.kernels.fused import is_band
    from seqplan.bands import part_offset

    span = lambda start: jnp.arange(start, start + t, dtype=jnp.int32)
    ref, fast = get_backend("reference"), get_backend(backend)
    keys = iter(jax.random.split(jax.random.key(2), 64))
    rnd = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(jnp.bfloat16)
    scale, rows = d**-0.5, []
    for name, kind, window, q_pos, kv_pos in _window_cases(t, span, jnp.concatenate):
        q, do, k, v = rnd(1, t, heads, d), rnd(1, t, heads, d), rnd(1, t, kv_heads, d), rnd(1, t, kv_heads, d)
        mask, pos = BlockMask(kind, window=window, offset=part_offset(np.asarray(q_pos), np.asarray(kv_pos))), (q_pos, kv_pos)
        o_r, lse_r = jax.jit(lambda q, k, v, m=mask, p=pos: ref.fwd(q, k, v, m, scale, positions=p))(q, k, v)
        o_f, lse_f = jax.jit(lambda q, k, v, m=mask, p=pos: fast.fwd(q, k, v, m, scale, positions=p))(q, k, v)
        o = o_r.astype(jnp.bfloat16)
        g_r = jax.jit(lambda *a, m=mask, p=pos: ref.bwd(*a, m, scale, positions=p))(do, q, k, v, o, lse_r)
        g_f = jax.jit(lambda *a, m=mask, p=pos: fast.bwd(*a, m, scale, positions=p))(do, q, k, v, o, lse_r)
        row = _jax_errors(o_r, lse_r, g_r, o_f, lse_f, g_f)
        row.update({"case": name, "mask": kind.value, "window": list(window), "fused_path": is_band(mask),
                    "backend": backend})
        rows.append(row)
        print(f"jax window check {name}: {row['errors']} fused={row['fused_path']} empty rows {row['empty_rows']} "
              f"exact={row['empty_rows_exact']} verified={row['verified']}", flush=True)
    return rows


def _jax_errors(o_r, lse_r, g_r, o_f, lse_f, g_f) -> dict:
    """The block check's errors (max |Δ| / max |truth|; lse: max |Δ|), exact empty rows, verdict."""
    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        finite = np.isfinite(b)
        return float(np.abs(a - b)[finite].max() / max(1e-30, float(np.abs(b[finite]).max())))

    lse_r_np, lse_f_np = np.asarray(lse_r), np.asarray(lse_f)
    empty = ~np.isfinite(lse_r_np)
    errors = {"o": rel(o_f, o_r), "lse": float(np.abs(lse_f_np[~empty] - lse_r_np[~empty]).max()) if (~empty).any()
              else 0.0, "dq": rel(g_f[0], g_r[0]), "dk": rel(g_f[1], g_r[1]), "dv": rel(g_f[2], g_r[2])}
    o_np = np.asarray(o_f, np.float32).transpose(0, 2, 1, 3)
    empty_ok = bool(np.all(lse_f_np[empty] == -np.inf) and np.all(o_np[empty] == 0))
    ok = empty_ok and errors["lse"] <= 1e-2 and all(errors[n] <= 2e-2 for n in ("o", "dq", "dk", "dv"))
    return {"errors": errors, "empty_rows": int(empty.sum()), "empty_rows_exact": empty_ok, "verified": ok}


def jax_window_anchor(seq: int, window: int = 4096, heads=32, kv_heads=8, d=128) -> dict:
    """flash_attn3_jax's ``flash_mha`` with its own sliding window ``(window, 0)`` and its own vjp
    on the whole sequence (causal windows: 64-row tiles, the library's workspaces suffice),
    checked at 4096 tokens (window :data:`WINDOW_CHECK`) against the portable kernel, then timed."""
    import jax
    import jax.numpy as jnp
    from flash_attn3_jax import flash_mha

    from benchmarks.common import Problem
    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
    from seqplan.schedule import UNBOUNDED

    def inputs(t):
        keys = jax.random.split(jax.random.key(4), 4)
        q, do = (jax.random.normal(kk, (1, t, heads, d)).astype(jnp.bfloat16) for kk in keys[:2])
        k, v = (jax.random.normal(kk, (1, t, kv_heads, d)).astype(jnp.bfloat16) for kk in keys[2:])
        return q, k, v, do

    def programs(w):
        fwd = lambda q, k, v: flash_mha(q, k, v, softmax_scale=d**-0.5, is_causal=True, window_size=(w, 0))

        def step(q, k, v, do):
            o, pull = jax.vjp(fwd, q, k, v)
            return o, pull(do)

        return jax.jit(fwd), jax.jit(step)

    q, k, v, do = inputs(4096)
    _, step = programs(WINDOW_CHECK)
    o, (dq, _, _) = step(q, k, v, do)
    pos = jnp.arange(4096, dtype=jnp.int32)
    mask = BlockMask(MaskKind.CAUSAL, window=(WINDOW_CHECK, UNBOUNDED))
    o_r, lse_r = reference_block_fwd(q, k, v, mask, d**-0.5, positions=(pos, pos))
    dq_r = reference_block_bwd(do, q, k, v, o_r.astype(jnp.bfloat16), lse_r, mask, d**-0.5, positions=(pos, pos))[0]
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    errors = {"o": rel(o, o_r), "dq": rel(dq, dq_r)}
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, window=(window, 0))
    q, k, v, do = inputs(seq)
    fwd, step = programs(window)
    fwd_ms, step_ms = jax_ms(fwd, q, k, v), jax_ms(step, q, k, v, do)
    return _anchor_result(f"flash_attn3_jax flash_mha(window_size=({window}, 0)) (its own vjp)", problem, errors,
                          fwd_ms, step_ms, window=window, fwd_bwd_queued_ms=jax_queued_ms(step, q, k, v, do))


def markdown(result: dict) -> str:
    lines = [f"# Masked blocks on one GPU — {result['date']}", "", f"Machine: {result['device']}; "
             f"versions: {result['versions']}", "", "## Block checks (aten_varlen vs the portable kernel, float32)", "",
             "| case | mask | empty rows | exact empty rows | o | lse (abs) | dq | dk | dv | verified |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("block_checks", []):
        e = r["errors"]
        lines.append(f"| {r['case']} | {r['mask']} | {r['empty_rows']} | {r['empty_rows_exact']} | {e['o']:.2e} | "
                     f"{e['lse']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | {r['verified']} |")
    if result.get("jax_block_checks"):
        lines += ["", "## JAX block checks (fa3_varlen, cudnn_varlen vs the portable kernel, float32)", "",
                  "| backend | case | mask | runs path ran | empty rows | exact empty rows | o | lse (abs) | dq | dk | dv "
                  "| verified |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["jax_block_checks"]:
            e = r["errors"]
            lines.append(f"| {r['backend']} | {r['case']} | {r['mask']} | {r['ran_packed']} | {r['empty_rows']} "
                         f"| {r['empty_rows_exact']} "
                         f"| {e['o']:.2e} | {e['lse']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | {r['verified']} |")
    if "jax_anchor" in result:
        a = result["jax_anchor"]
        lines += ["", f"## JAX anchor: {a['kernel']}", "",
                  f"{a['seq']} tokens, mix ids: fwd {a['fwd_ms']:.2f} ms ({a['tflops_fwd']:.0f} TFLOP/s), fwd+bwd "
                  f"{a['fwd_bwd_ms']:.2f} ms ({a['tflops_fwd_bwd']:.0f} TFLOP/s); checked at 4096 tokens: "
                  f"{a['verified_at_4096']} verified={a['verified']}"]
    if "anchor" in result:
        a = result["anchor"]
        lines += ["", "## Anchor: FA2 varlen on the whole sequence's documents", "",
                  f"{a['seq']} tokens, mix ids: fwd {a['fwd_ms']:.2f} ms ({a['tflops_fwd']:.0f} TFLOP/s), fwd+bwd "
                  f"{a['fwd_bwd_ms']:.2f} ms ({a['tflops_fwd_bwd']:.0f} TFLOP/s); checked at 4096 tokens: "
                  f"{a['verified_at_4096']} verified={a['verified']}"]
    for key, title in (("window_checks", "torch aten_window"), ("jax_window_checks", "JAX fa3 (FA3's window on the band)")):
        if result.get(key):
            lines += ["", f"## Window block checks: {title} vs the portable kernel (float32)", "",
                      "| case | mask | window | fused path | empty rows | exact | o | lse (abs) | dq | dk | dv | verified |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in result[key]:
                e = r["errors"]
                lines.append(f"| {r['case']} | {r['mask']} | {tuple(r['window'])} | {r['fused_path']} | {r['empty_rows']} "
                             f"| {r['empty_rows_exact']} | {e['o']:.2e} | {e['lse']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} "
                             f"| {e['dv']:.2e} | {r['verified']} |")
    for key in ("window_anchor", "jax_window_anchor"):
        if key in result:
            a = result[key]
            lines += ["", f"## Window anchor: {a['kernel']}", "",
                      f"{a['seq']} tokens: fwd {a['fwd_ms']:.2f} ms ({a['tflops_fwd']:.0f} TFLOP/s), fwd+bwd "
                      f"{a['fwd_bwd_ms']:.2f} ms ({a['tflops_fwd_bwd']:.0f} TFLOP/s)"
                      + (f"; checked at 4096 tokens: {a['verified_at_4096']} verified={a['verified']}"
                         if "verified" in a else "")]
    if "portable_peak" in result:
        p = result["portable_peak"]
        lines += ["", "## Portable kernel memory (one document-masked causal block, fwd + bwd)", "",
                  f"t = s = {p['t']}, {p['heads']} heads, d {p['head_dim']}: peak beyond the inputs "
                  f"{p['peak_beyond_inputs_mib']:.0f} MiB = {p['fraction_of_scores']:.3f} of the block's float32 scores "
                  f"({p['scores_f32_mib']:.0f} MiB); {p['seconds']:.1f} s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.masked", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU: only the parts that run without CUDA, tiny sizes")
    ap.add_argument("--parts", default="torch,jax,peak",
                    help="comma-separated of torch, jax, peak, window, jaxwindow; anchors (the four anchors alone)")
    ap.add_argument("--window", type=int, default=4096, help="the window anchors' left extent")
    a = ap.parse_args(argv)
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "versions": {"torch": torch.__version__},
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if a.smoke or not torch.cuda.is_available():
        # the CPU has no varlen kernel: run every check's code on the portable kernel against itself
        block_checks("cpu", heads=4, kv_heads=2, d=16, backend="reference")
        jax_block_checks(heads=4, kv_heads=2, d=16, backend="reference")
        jax_window_checks(heads=4, kv_heads=2, d=16, t=256, backend="reference")
        return result
    parts = a.parts.split(",")
    if "torch" in parts:
        result["block_checks"] = block_checks("cuda")
        result["anchor"] = anchor(a.seq)
        print("anchor", result["anchor"], flush=True)
    if "jax" in parts:
        import jax

        result["versions"]["jax"] = jax.__version__
        result["jax_block_checks"] = [{**row, "backend": name} for name in ("fa3_varlen", "cudnn_varlen")
                                      for row in jax_block_checks(backend=name)]
        try:
            result["jax_anchor"] = jax_anchor(a.seq)
            print("jax anchor", result["jax_anchor"], flush=True)
        except ImportError as err:  # flash_attn3_jax is optional: say so in the report
            result["jax_anchor_missing"] = str(err)
    if "window" in parts:
        result["window_checks"] = window_checks()
        result["window_anchor"] = window_anchor(a.seq, a.window)
        print("window anchor", result["window_anchor"], flush=True)
    if "jaxwindow" in parts:
        import jax

        result["versions"]["jax"] = jax.__version__
        result["jax_window_checks"] = jax_window_checks()
        result["jax_window_anchor"] = jax_window_anchor(a.seq, a.window)
        print("jax window anchor", result["jax_window_anchor"], flush=True)
    if "anchors" in parts:  # the same-run anchors at --seq, without the block checks
        import jax

        result["versions"]["jax"] = jax.__version__
        for key, fn in (("anchor", anchor), ("jax_anchor", jax_anchor), ("window_anchor", window_anchor),
                        ("jax_window_anchor", jax_window_anchor)):
            try:
                result[key] = fn(a.seq) if "window" not in key else fn(a.seq, a.window)
            except Exception as err:  # noqa: BLE001  (one anchor failing, e.g. out of memory, must not lose the others)
                result[key + "_failed"] = f"{type(err).__name__}: {err}"
            print(key, result.get(key, result.get(key + "_failed")), flush=True)
    if "peak" in parts:
        result["portable_peak"] = portable_peak("cuda")
        print("portable peak", result["portable_peak"], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "masked.json").write_text(json.dumps(result, indent=1))
    (out / "masked.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
