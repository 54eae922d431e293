"""torch_impl on one GPU, 32k packed documents through FA4 (third session, 2026-11-29): where the
step's 1.2 ms over FA4's own varlen call goes, and what removes it. Each variant is checked at 8,192
tokens against the portable kernel in float32 (``one_gpu_documents_torch.check_ids``), then timed
(fwd+bwd and fwd, median of 20 after 5 warm-up steps, each waited for), then 3 steps traced with
torch.profiler (Python stacks on) and read by ``benchmarks.trace_gaps``; FA4's own varlen call on
the same ids (``benchmarks.masked.fa4_anchor``) timed beside them.

Variants (patched here, for the measurement only):
  base      the library as committed
  hostids   the batch's ids declared on the host (``torch_impl.host_ids``): no device-to-host copy
  pinned    the run offsets uploaded from pinned memory (a pageable upload may wait for the queue)
  planonce  the backward reuses its forward's run lists and device offsets (no second plan, no upload)
  replan    the library with its per-block memo off (what it did before: each pass plans and uploads)
  walk      a causal diagonal block planned by the pairwise walk (``document_runs``' FULL path on its equal
            ids: the same runs), not by its rows' runs (``_own_runs``, the library since 7230722)
A trailing digit repeats a variant (``base2``): rows in one call, to read the spread.

    python3 docs/gpu/documents-2026-11-29-h200/torch_trace.py --out DIR [--mixes short,few-long] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import one_gpu_documents_torch as side  # noqa: E402
from benchmarks import trace_gaps  # noqa: E402


@contextlib.contextmanager
def variant(name: str, ids_np):
    from torch_impl.kernels import fa4, varlen

    saved = (fa4.run_offsets, fa4._plan, varlen.document_runs)
    from seqplan.documents import HostPair

    remembered = HostPair.remembered
    name = name.rstrip("0123456789")
    try:
        if name == "walk":
            import numpy as np

            def walked(q_ids, kv_ids, causal, _real=saved[2]):
                same = causal and np.shape(q_ids) == np.shape(kv_ids) and np.array_equal(q_ids, kv_ids)
                return _real(q_ids, kv_ids, False) if same else _real(q_ids, kv_ids, causal)

            varlen.document_runs = walked
        if name == "replan":
            def upload(runs, device):
                to = lambda x: None if x is None else torch.from_numpy(x).to(device, non_blocking=True)
                return to(runs.cu_q), to(runs.cu_k), to(runs.empty_rows), to(runs.unread_keys)

            HostPair.remembered = lambda self, key, make: make()
            fa4.run_offsets = upload
        if name == "hostids":
            import torch_impl

            with torch_impl.host_ids(ids_np):
                yield
            return
        if name == "pinned":
            def pinned(runs, device):
                pin = (lambda x: x.pin_memory()) if torch.cuda.is_available() else (lambda x: x)
                to = lambda x: None if x is None else pin(torch.from_numpy(x)).to(device, non_blocking=True)
                return to(runs.cu_q), to(runs.cu_k), to(runs.empty_rows), to(runs.unread_keys)

            fa4.run_offsets = pinned
        if name == "planonce":  # the forward's run lists found again by content, their offsets by identity
            from seqplan.documents import cached_plan

            offsets = {}

            def offsets_once(runs, device, _real=saved[0]):
                if id(runs) not in offsets:
                    offsets.clear()
                    offsets[id(runs)] = (_real(runs, device), runs)  # holds runs: its id stays its own
                return offsets[id(runs)][0]

            varlen.document_runs = lambda *a, **k: cached_plan(saved[2], *a, **k)
            fa4.run_offsets = offsets_once
        yield
    finally:
        fa4.run_offsets, fa4._plan, varlen.document_runs = saved
        HostPair.remembered = remembered


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixes", default="short,few-long")
    ap.add_argument("--variants", default="base,hostids,pinned,planonce")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.common import Problem
    from benchmarks.masked import cuda_ms, fa4_anchor

    cuda = torch.cuda.is_available()
    seq, check_seq, backend = (a.seq, 8192, "auto") if not a.smoke else (512, 512, "reference")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []

    def save(row):
        rows.append(row)
        (out / "torch-trace.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(row)[:400], flush=True)

    for mix in a.mixes.split(","):
        small = Problem(seq=check_seq, heads=8, kv_heads=2, documents=mix).segment_ids()
        problem = Problem(seq=seq, heads=32 if not a.smoke else 4, kv_heads=8 if not a.smoke else 2, documents=mix)
        ids_np = problem.segment_ids()
        ids = torch.as_tensor(ids_np, device="cuda" if cuda else "cpu")
        q, k, v, do = side._inputs(seq, problem.heads, problem.kv_heads, 128 if not a.smoke else 16,
                                   torch.bfloat16 if cuda else torch.float32)
        step, forward = side._calls(backend)
        if cuda:
            anchor = fa4_anchor(seq, problem.heads, problem.kv_heads, 128, 20, 5, problem=problem)
            save({"kind": "anchor", "mix": mix, "fwd_bwd_ms": anchor["fwd_bwd_ms"], "fwd_ms": anchor["fwd_ms"],
                  "verified": anchor["verified"]})
        for name in a.variants.split(","):
            with variant(name, small):
                checked = side.check_ids(mix, small, backend)
            row = {"kind": "variant", "mix": mix, "variant": name, "check": checked["errors"],
                   "passed": checked["passed"]}
            if not checked["passed"]:
                save(row)
                continue
            with variant(name, ids_np):
                if cuda:
                    row["fwd_bwd_ms"] = cuda_ms(partial(step, q, k, v, do, ids), 20, 5)
                    with torch.no_grad():
                        row["fwd_ms"] = cuda_ms(partial(forward, q, k, v, ids), 20, 5)
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                      if cuda else [])
                with torch.profiler.profile(activities=activities, with_stack=True) as prof:
                    for _ in range(3):
                        with torch.profiler.record_function("step"):
                            step(q, k, v, do, ids)
                        sync()
            trace = out / f"{mix}-{name}.trace.json"
            prof.export_chrome_trace(str(trace))
            found = trace_gaps.gaps(trace_gaps.load(trace), "step", 20.0)
            (out / f"{mix}-{name}.gaps.md").write_text(trace_gaps.summary(found) + "\n")
            row["gaps_per_step"] = len(found) / 3
            row["idle_ms_per_step"] = sum(g.idle_us for g in found) / 3e3
            save(row)
            import gzip

            (out / f"{mix}-{name}.trace.json.gz").write_bytes(gzip.compress(trace.read_bytes()))
            trace.unlink()
    np.save(out / "done.npy", np.array(len(rows)))


if __name__ == "__main__":
    main()
