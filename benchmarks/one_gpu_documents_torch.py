"""torch_impl's side of ``benchmarks.one_gpu_documents``: the same check and the same timed row on
one GPU (``torch_impl.ring_attention`` with no group — one rank, the whole sequence one causal
block, ids as a tensor), beside the faster of FlashAttention-4's and FA2's varlen kernels on the
same ids (``benchmarks.masked.fa4_anchor`` / ``anchor``: issue 46's torch anchor) — and the FA4
compile stream.

**The compile stream** (issue 46, item 3): FlashAttention-4 JIT-compiles a kernel variant per
compile key (seconds each). Packed training changes the longest document every batch, so
``torch_impl.kernels.fa4`` buckets ``max_seqlen`` to powers of two (``fa4.seqlen_bucket``). The
stream runs ``batches`` fwd+bwd steps, each on new ids (the balance mixes in turn, a new seed each
batch), and records per batch its wall time and how many entries FA4's compile caches gained
(``fa4_variants``). It then runs a few more batches with the bucketing switched off (the raw
longest run as ``max_seqlen``), to show whether the bucketing is what keeps compiles bounded on
this FA4 version or whether its compile key ignores the bound.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import numpy as np

from benchmarks.one_gpu_documents import PASS


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _calls(backend: str):
    """(step, forward): torch_impl on one rank, causal, documents; step returns (o, dq, dk, dv)."""
    import torch

    import torch_impl

    def forward(q, k, v, ids):
        return torch_impl.ring_attention(q, k, v, causal=True, layout="contiguous", segment_ids=ids,
                                         block_backend=backend)[0]

    def step(q, k, v, do, ids):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = forward(*leaves, ids)
        return (o, *torch.autograd.grad(o, leaves, do))

    return step, forward


def random_inputs(seq: int, heads: int, kv_heads: int, d: int, dtype, seed: int = 0):
    import torch

    gen = torch.Generator(device=device_name()).manual_seed(seed)
    q, do = (torch.randn(1, seq, heads, d, device=device_name(), generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, d, device=device_name(), generator=gen).to(dtype) for _ in range(2))
    return q, k, v, do


def _ids_tensor(ids):
    import torch

    return torch.as_tensor(np.asarray(ids, np.int32), device=device_name())


def check_ids(mix: str, ids, backend: str, heads=8, kv_heads=2, d=128) -> dict:
    """torch_impl with ``backend`` in bf16 against the portable kernel in float32 on the same
    (upcast) inputs and ``ids`` [1, seq]: relative max error of o, dq, dk, dv."""
    import torch

    ids_t = _ids_tensor(ids)
    low = random_inputs(ids_t.shape[1], heads, kv_heads, d, torch.bfloat16, seed=1)
    got = _calls(backend)[0](*low, ids_t)
    want = _calls("reference")[0](*(x.float() for x in low), ids_t)
    errors = {name: float((g.detach().float() - w.detach()).abs().max() / w.detach().abs().max())
              for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    passed = all(np.isfinite(e) and e <= PASS for e in errors.values())
    return {"kind": "check", "framework": "torch", "mix": mix, "seq": ids_t.shape[1], "backend": backend,
            "errors": errors, "passed": passed}


def timed(mix: str, seq: int, backend: str, iters: int, warmup: int, heads=32, kv_heads=8, d=128) -> dict:
    """torch_impl's fwd+bwd and fwd at ``seq`` on ``mix`` beside FA4's and FA2's varlen kernels on the
    same ids (the faster is the anchor; both are recorded)."""
    import torch

    from benchmarks.common import Problem
    from benchmarks.masked import anchor, cuda_ms, fa4_anchor
    from seqplan.schedule import BlockMask, MaskKind
    from torch_impl.block import device_kind_of, resolve_backend

    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents=mix)
    ids_np = problem.segment_ids()
    ids = _ids_tensor(ids_np)
    q, k, v, do = random_inputs(seq, heads, kv_heads, d, torch.bfloat16)
    step, forward = _calls(backend)
    began = time.perf_counter()
    step(q, k, v, do, ids)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - began
    step_ms = cuda_ms(lambda: step(q, k, v, do, ids), iters, warmup)
    with torch.no_grad():
        fwd_ms = cuda_ms(lambda: forward(q, k, v, ids), iters, warmup)
    anchors = [anchor(seq, heads, kv_heads, d, iters, warmup, problem=problem)]
    with contextlib.suppress(ImportError):  # FA4 is an optional extra: FA2 alone is then the anchor
        anchors.append(fa4_anchor(seq, heads, kv_heads, d, iters, warmup, problem=problem))
    best = min(anchors, key=lambda a: a["fwd_bwd_ms"])
    kernel = resolve_backend(backend, device_kind=device_kind_of(q), dtype=q.dtype,
                             mask=BlockMask(MaskKind.CAUSAL, documents=True))
    documents = int(1 + np.sum(ids_np[0, 1:] != ids_np[0, :-1]))
    return {"kind": "time", "framework": "torch", "mix": mix, "seq": seq, "documents": documents,
            "backend": backend, "kernel": kernel, "compile_s": round(compile_s, 1), "impl_ms": step_ms,
            "impl_fwd_ms": fwd_ms, "impl_tflops": problem.flops(False) / step_ms / 1e9,
            "anchor_kernel": best["kernel"], "anchor_ms": best["fwd_bwd_ms"], "anchor_fwd_ms": best["fwd_ms"],
            "anchor_tflops": best["tflops_fwd_bwd"], "anchor_verified": best["verified"],
            "anchors": {a["kernel"]: {"fwd_bwd_ms": a["fwd_bwd_ms"], "verified": a["verified"]} for a in anchors},
            "ratio": best["fwd_bwd_ms"] / step_ms, "fwd_ratio": best["fwd_ms"] / fwd_ms}


# ---- the FA4 compile stream ---------------------------------------------------------------------

def fa4_variants() -> int | None:
    """Entries in FlashAttention-4's in-memory compile caches (every ``compile_cache`` of its
    interface module: forward, backward, their pre- and post-processing), or None without FA4."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return None
    caches = (getattr(fn, "compile_cache", None) for fn in vars(interface).values())
    return sum(len(c.cache) for c in caches if isinstance(getattr(c, "cache", None), dict))


@contextlib.contextmanager
def _raw_bounds():
    """``max_seqlen`` passed as the longest run itself (FA4's bucketing off) inside the block."""
    from torch_impl.kernels import fa4

    bucket = fa4.seqlen_bucket
    fa4.seqlen_bucket = lambda n, cap: max(1, int(n))
    try:
        yield
    finally:
        fa4.seqlen_bucket = bucket


def _longest_run(ids: np.ndarray) -> int:
    bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1], True])
    return int(np.diff(bounds).max())


def stream(seq: int, batches: int, backend: str, bucketed: bool, seed0: int, heads=32, kv_heads=8, d=128):
    """Yield one row per batch: ``batches`` fwd+bwd steps of torch_impl, each on new ids (the
    balance mixes in turn, seed ``seed0 + i``), with its wall ms and FA4's compile-cache growth —
    after a check row of the same path (bucketed or not) on the first batch's mix at ``min(seq,
    8192)`` tokens; a path that fails its check streams nothing."""
    import torch

    from benchmarks.common import Problem
    from parity.probes.balance import MIXES
    from torch_impl.kernels.fa4 import seqlen_bucket

    mode = contextlib.nullcontext if bucketed else _raw_bounds
    first = replace(MIXES[0], seed=seed0)
    with mode():
        checked = check_ids(first.name, Problem(seq=min(seq, 8192), documents=first.name).segment_ids(), backend)
    yield {**checked, "kind": "stream check", "bucketed": bucketed}
    if not checked["passed"]:
        return

    q, k, v, do = random_inputs(seq, heads, kv_heads, d, torch.bfloat16 if device_name() == "cuda" else torch.float32)
    step = _calls(backend)[0]
    for i in range(batches):
        mix = replace(MIXES[i % len(MIXES)], seed=seed0 + i)
        ids = mix.segment_ids(seq).astype(np.int32)
        longest = _longest_run(ids)
        before = fa4_variants()
        began = time.perf_counter()
        with mode():
            step(q, k, v, do, _ids_tensor(ids[None]))
        if device_name() == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - began) * 1e3
        after = fa4_variants()
        yield {"kind": "stream", "framework": "torch", "bucketed": bucketed, "batch": i, "mix": mix.name,
               "seed": mix.seed, "seq": seq, "longest": longest,
               "max_seqlen": seqlen_bucket(longest, seq) if bucketed else longest, "ms": round(ms, 2),
               "fa4_variants": after, "new_variants": None if after is None else after - before}
