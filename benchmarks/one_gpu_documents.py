"""Issue 46's one-GPU target: jax_impl on packed documents against FlashAttention-3's own varlen
call on the same ids, same run (the whole sequence is one causal block on one device — what each
Ulysses device runs, and where the per-call cost around the kernel shows most). ``--frameworks
torch`` runs torch_impl the same way against the faster of FA4's and FA2's varlen kernels, and
``--stream N`` FA4's compile stream (``benchmarks.one_gpu_documents_torch``).

1. **Check** — for every mix, jax_impl on a one-device mesh (``block_backend`` as given, default
   ``auto``: ``fa3_varlen`` on Hopper) at ``--check-seq`` tokens, 8 / 2 heads, bf16, against the
   portable kernel in float32 on the same (upcast) inputs and ids: relative max error of o, dq,
   dk, dv (≤ 2e-2 passes). A mix whose check fails is not timed.
2. **Time** — fwd+bwd and fwd at ``--seq``, 32 / 8 heads, d 128, bf16, the ids a program argument
   (median of ``--iters``, each step waited for), beside ``benchmarks.masked.jax_anchor``
   (flash_attn3_jax ``flash_mha_varlen`` on the same ids, checked at 4096 tokens); and fwd+bwd
   with ten steps queued before one wait (``queued_ratio``: the host's launch and the wait's
   wake-up, paid by every waited step on both sides, hidden as in a training loop).

Rows go to ``OUT/one-gpu-documents.json`` as they come (a killed call keeps them), the table to
``.md`` at the end.

    python -m benchmarks.one_gpu_documents --out DIR                                (one GPU, JAX)
    python -m benchmarks.one_gpu_documents --out DIR --frameworks torch --stream 50  (one GPU, torch)
    python -m benchmarks.one_gpu_documents --out DIR --smoke --frameworks jax,torch (CPU: the checks, small)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

PASS = 2e-2


def _mesh_call(backend: str):
    """fwd+bwd and fwd programs of jax_impl on a one-device mesh, ids as an argument."""
    import jax
    from jax.sharding import Mesh

    import jax_impl

    mesh = Mesh(np.array(jax.devices()[:1]), ("ring",))

    def attention(q, k, v, ids):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="contiguous",
                                                    block_backend=backend, segment_ids=ids)

    def step(q, k, v, do, ids):
        o, pull = jax.vjp(lambda q, k, v: attention(q, k, v, ids), q, k, v)
        return o, *pull(do)

    return jax.jit(step), jax.jit(attention)


def _inputs(seq: int, heads: int, kv_heads: int, d: int, dtype, seed: int = 0):
    import jax

    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(x, (1, seq, heads, d)).astype(dtype) for x in keys[:2])
    k, v = (jax.random.normal(x, (1, seq, kv_heads, d)).astype(dtype) for x in keys[2:])
    return q, k, v, do


def check(mix: str, seq: int, backend: str, framework: str = "jax") -> dict:
    """``framework``'s implementation with ``backend`` against the portable kernel in float32 on
    ``mix``'s ids at ``seq`` (8 / 2 heads, d 128)."""
    from benchmarks.common import Problem

    return _side(framework).check_ids(mix, Problem(seq=seq, heads=8, kv_heads=2, documents=mix).segment_ids(), backend)


def check_ids(mix: str, ids, backend: str, heads=8, kv_heads=2, d=128) -> dict:
    """:func:`check` on the given ``ids`` [1, seq] (``mix``: the row's label)."""
    import jax.numpy as jnp

    ids = jnp.asarray(ids, jnp.int32)
    seq = ids.shape[1]
    low = _inputs(seq, heads, kv_heads, d, jnp.bfloat16, seed=1)
    got = _mesh_call(backend)[0](*low, ids)
    want = _mesh_call("reference")[0](*(x.astype(jnp.float32) for x in low), ids)
    errors = {name: float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
              for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    passed = all(np.isfinite(e) and e <= PASS for e in errors.values())
    return {"kind": "check", "framework": "jax", "mix": mix, "seq": seq, "backend": backend, "errors": errors,
            "passed": passed}


def timed(mix: str, seq: int, backend: str, iters: int, warmup: int, heads=32, kv_heads=8, d=128) -> dict:
    """jax_impl's fwd+bwd and fwd at ``seq`` on ``mix`` beside flash_mha_varlen on the same ids."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import Problem
    from benchmarks.masked import jax_anchor, jax_ms, jax_queued_ms
    from jax_impl.block import device_kind_of, resolve_backend
    from seqplan.schedule import BlockMask, MaskKind

    problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, documents=mix)
    ids_np = problem.segment_ids()
    ids = jnp.asarray(ids_np)
    q, k, v, do = _inputs(seq, heads, kv_heads, d, jnp.bfloat16)
    step, forward = _mesh_call(backend)
    began = time.perf_counter()
    jax.block_until_ready(step(q, k, v, do, ids))
    compile_s = time.perf_counter() - began
    step_ms = jax_ms(step, q, k, v, do, ids, iters=iters, warmup=warmup)
    fwd_ms = jax_ms(forward, q, k, v, ids, iters=iters, warmup=warmup)
    queued_ms = jax_queued_ms(step, q, k, v, do, ids)
    anchor = jax_anchor(seq, heads, kv_heads, d, problem=problem)
    kernel = resolve_backend(backend, device_kind=device_kind_of(q), dtype="bfloat16",
                             mask=BlockMask(MaskKind.CAUSAL, documents=True))
    documents = int(1 + np.sum(ids_np[0, 1:] != ids_np[0, :-1]))
    return {"kind": "time", "framework": "jax", "mix": mix, "seq": seq, "documents": documents, "backend": backend,
            "kernel": kernel, "compile_s": round(compile_s, 1), "impl_ms": step_ms, "impl_fwd_ms": fwd_ms,
            "impl_tflops": problem.flops(False) / step_ms / 1e9, "anchor_kernel": anchor["kernel"],
            "anchor_ms": anchor["fwd_bwd_ms"],
            "anchor_fwd_ms": anchor["fwd_ms"], "anchor_tflops": anchor["tflops_fwd_bwd"],
            "anchor_verified": anchor["verified"], "ratio": anchor["fwd_bwd_ms"] / step_ms,
            "impl_queued_ms": queued_ms, "anchor_queued_ms": anchor["fwd_bwd_queued_ms"],
            "queued_ratio": anchor["fwd_bwd_queued_ms"] / queued_ms,
            "fwd_ratio": anchor["fwd_ms"] / fwd_ms}


def markdown(rows: list[dict], command: str, versions: dict) -> str:
    lines = [f"# jax_impl / torch_impl on packed documents, one GPU — {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{command}`; {versions}", "", "| framework | mix | tokens | check (o / dq / dk / dv) | passed |",
             "|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "check"):
        e = r["errors"]
        lines.append(f"| {r['framework']} | {r['mix']} | {r['seq']} | {e['o']:.1e} / {e['dq']:.1e} / {e['dk']:.1e} / "
                     f"{e['dv']:.1e} | {r['passed']} |")
    lines += ["", "| framework | mix | tokens | documents | kernel | fwd+bwd ms (TFLOP/s) | anchor | anchor ms (TFLOP/s) "
              "| ÷ anchor | fwd ms / anchor fwd ms | ÷ anchor fwd | queued ms / anchor queued ms | ÷ anchor queued "
              "| anchor verified |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "time"):
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['mix']} | {r['seq']} | | | {r['error']} | | | | | | | | |")
            continue
        lines.append(f"| {r['framework']} | {r['mix']} | {r['seq']} | {r['documents']} | {r['kernel']} | "
                     f"{r['impl_ms']:.2f} ({r['impl_tflops']:.0f}) | {r['anchor_kernel']} | {r['anchor_ms']:.2f} "
                     f"({r['anchor_tflops']:.0f}) | **{r['ratio']:.3f}** | {r['impl_fwd_ms']:.2f} / "
                     f"{r['anchor_fwd_ms']:.2f} | {r['fwd_ratio']:.3f} | {_queued(r)} | {r['anchor_verified']} |")
    stream = [r for r in rows if r["kind"] == "stream"]
    if stream:
        lines += ["", "FA4's compile stream (torch_impl fwd+bwd, new ids every batch; `max_seqlen` bucketed or the "
                  "raw longest run), each path checked first:", ""]
        lines += [f"- bucketed {r['bucketed']}: {r['mix']} at {r['seq']} tokens, o / dq / dk / dv "
                  f"{' / '.join(f'{e:.1e}' for e in r['errors'].values())}, passed {r['passed']}"
                  for r in rows if r["kind"] == "stream check"]
        lines += ["", "| bucketed | batch | mix | longest | max_seqlen | ms | new FA4 variants |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['bucketed']} | {r['batch']} | {r['mix']} | {r['longest']} | {r['max_seqlen']} | {r['ms']:.1f} "
                  f"| {r['new_variants']} |" for r in stream]
    return "\n".join(lines) + "\n"


def _queued(row: dict) -> str:
    """The queued columns (rows without them: torch's, and JAX rows from before 2026-11-29)."""
    if "queued_ratio" not in row:
        return " | "
    return f"{row['impl_queued_ms']:.2f} / {row['anchor_queued_ms']:.2f} | **{row['queued_ratio']:.3f}**"


def _side(framework: str):
    """The module holding ``framework``'s ``check_ids`` and ``timed`` (JAX: this one)."""
    if framework == "jax":
        return sys.modules[__name__]
    if framework == "torch":
        from benchmarks import one_gpu_documents_torch

        return one_gpu_documents_torch
    raise ValueError(f"--frameworks takes jax and torch, not {framework!r}")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.one_gpu_documents", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--check-seq", type=int, default=8192)
    ap.add_argument("--mixes", default="", help="comma-separated balance mixes or parity.core.documents patterns "
                    "(default: every balance mix, then `mix`, the ids of the 2026-11-25 measurement)")
    ap.add_argument("--frameworks", default="jax", help="comma-separated: jax, torch")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream", type=int, default=0, help="torch: FA4's compile stream of this many batches at --seq "
                    "(bucketed), then --raw-stream batches with the bucketing off")
    ap.add_argument("--raw-stream", type=int, default=8)
    ap.add_argument("--smoke", action="store_true",
                    help="the checks only, at 512 tokens, on the portable kernel (what a CPU can run)")
    a = ap.parse_args(argv)
    from benchmarks.documents import mix_names

    sides = {name: _side(name) for name in a.frameworks.split(",")}  # an unknown name refused before any work
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save(row: dict) -> None:
        rows.append(row)
        (out / "one-gpu-documents.json").write_text(json.dumps(rows, indent=1))
        print(row, flush=True)

    mixes = a.mixes.split(",") if a.mixes else [*mix_names(), "mix"]
    backend, check_seq = ("reference", 512) if a.smoke else (a.backend, a.check_seq)
    for framework, side in sides.items():
        passed = []
        for mix in mixes:
            row = check(mix, check_seq, backend, framework)
            save(row)
            if row["passed"]:
                passed.append(mix)
        for mix in passed if not a.smoke else ():
            try:
                save(side.timed(mix, a.seq, backend, a.iters, a.warmup))
            except Exception as err:  # noqa: BLE001 — one row failing keeps the others
                save({"kind": "time", "framework": framework, "mix": mix, "seq": a.seq,
                      "error": f"{type(err).__name__}: {err}"[:300]})
    if a.stream and "torch" in sides:
        seq = 512 if a.smoke else a.seq
        for bucketed, batches, seed0 in ((True, a.stream, 1000), (False, a.raw_stream, 2000)):
            for row in sides["torch"].stream(seq, batches, backend, bucketed, seed0):
                save(row)
    command = "python -m benchmarks.one_gpu_documents " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "one-gpu-documents.md").write_text(markdown(rows, command, _versions(sides)))
    return rows


def _versions(sides) -> dict:
    versions = {}
    if "jax" in sides:
        import jax

        versions |= {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    if "torch" in sides:
        import torch

        versions |= {"torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        from importlib.metadata import PackageNotFoundError, version

        try:
            versions["flash-attn-4"] = version("flash-attn-4")
        except PackageNotFoundError:
            versions["flash-attn-4"] = None
    return versions


if __name__ == "__main__":
    main()
