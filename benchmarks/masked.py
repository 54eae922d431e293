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


def block_checks(device: str, heads=32, kv_heads=8, d=128, t=4096) -> list[dict]:
    """Each case: the backend under test vs the portable kernel (float32) on the same inputs."""
    import torch

    from seqplan.documents import document_runs
    from torch_impl.block import get_backend

    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen).bfloat16()
    # packed documents over 2t tokens with length-1 documents, one spanning the block edge at t
    lengths = [1, 2047, 1, 1, 1500, 2000, 500, 1, 2141]
    lengths[-1] += 2 * t - sum(lengths)
    ids = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]).to(device)
    ref, fast = get_backend("reference"), get_backend("aten_varlen")
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


def _cuda_ms(fn, iters: int, warmup: int) -> float:
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


def anchor(seq: int, heads=32, kv_heads=8, d=128, iters=5, warmup=2) -> dict:
    """FA2 varlen on the whole sequence's documents (the anchor the replay rows compare to)."""
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
        fwd_ms = _cuda_ms(lambda: varlen_block_fwd(q, k, v, mask, d**-0.5, segments=seg), iters, warmup)
        return fwd_ms, _cuda_ms(step, iters, warmup)

    small = torch.from_numpy(_ids(4096)).to(device)
    q, k, v, do, (o, lse, grads) = run(4096, small, False)
    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    o_r, lse_r = reference_block_fwd(q, k, v, mask, d**-0.5, segments=(small, small))
    g_r = reference_block_bwd(do, q, k, v, o_r.bfloat16(), lse_r, mask, d**-0.5, segments=(small, small))
    errors = {"o": _rel(o.float(), o_r), "dq": _rel(grads[0].float(), g_r[0])}
    verified = all(e <= 2e-2 for e in errors.values())
    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents="mix")
    fwd_ms, step_ms = run(seq, torch.from_numpy(problem.segment_ids()).to(device), True)
    return {"kernel": "FA2 varlen (aten._flash_attention_forward/_backward)", "seq": seq, "verified_at_4096": errors,
            "verified": verified, "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms,
            "tflops_fwd": problem.flops(True) / fwd_ms / 1e9, "tflops_fwd_bwd": problem.flops(False) / step_ms / 1e9}


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


def markdown(result: dict) -> str:
    lines = [f"# Masked blocks on one GPU — {result['date']}", "", f"Machine: {result['device']}; "
             f"versions: {result['versions']}", "", "## Block checks (aten_varlen vs the portable kernel, float32)", "",
             "| case | mask | empty rows | exact empty rows | o | lse (abs) | dq | dk | dv | verified |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("block_checks", []):
        e = r["errors"]
        lines.append(f"| {r['case']} | {r['mask']} | {r['empty_rows']} | {r['empty_rows_exact']} | {e['o']:.2e} | "
                     f"{e['lse']:.2e} | {e['dq']:.2e} | {e['dk']:.2e} | {e['dv']:.2e} | {r['verified']} |")
    if "anchor" in result:
        a = result["anchor"]
        lines += ["", "## Anchor: FA2 varlen on the whole sequence's documents", "",
                  f"{a['seq']} tokens, mix ids: fwd {a['fwd_ms']:.2f} ms ({a['tflops_fwd']:.0f} TFLOP/s), fwd+bwd "
                  f"{a['fwd_bwd_ms']:.2f} ms ({a['tflops_fwd_bwd']:.0f} TFLOP/s); checked at 4096 tokens: "
                  f"{a['verified_at_4096']} verified={a['verified']}"]
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
    a = ap.parse_args(argv)
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "versions": {"torch": torch.__version__},
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if a.smoke or not torch.cuda.is_available():
        # the CPU has no varlen kernel: check the block-check plumbing on the portable kernel alone
        from torch_impl.kernels.reference import reference_block_fwd

        ids = torch.from_numpy(_ids(256))
        q = torch.randn(1, 256, 4, 16)
        o, lse = reference_block_fwd(q, q[:, :, :2], q[:, :, :2], BlockMask(MaskKind.CAUSAL, documents=True), 0.25,
                                     segments=(ids, ids), chunk=64)
        print("smoke: portable kernel ran on mix ids,", tuple(o.shape), "lse finite:", bool(lse.isfinite().all()))
        return result
    result["block_checks"] = block_checks("cuda")
    result["anchor"] = anchor(a.seq)
    print("anchor", result["anchor"], flush=True)
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
