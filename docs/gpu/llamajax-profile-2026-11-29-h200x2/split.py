"""The table of the report: each traced step's time split by kernel kind, from the rows of
``benchmarks/llama_profile_jax.py`` (GPU 0; ms per step).

call1's rows were written before the script read its kernels in ms: their ``*_ms_per_step``
values are seconds (read ×1e3 here) and their ``idle_inside`` / ``span`` split is void (the
3 traced steps were not told apart). The idle time comes from ``host_gpu0`` in both calls
(``benchmarks.host_gaps``: gaps over 50 µs inside a step, and the host's time from the call to
the first kernel), which read the trace in µs.

    python docs/gpu/llamajax-profile-2026-11-29-h200x2/split.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
KINDS = ("gemm", "attention", "other", "copy", "nccl")


def rows():
    for call, seq, scale in (("call5", 256, 1.0), ("call1", 1024, 1e3)):
        for path in sorted((HERE / call / "llama-profile").glob("B*.json"), key=lambda p: int(p.stem[1:])):
            r = json.loads(path.read_text())
            gpu = r["per_gpu"]["/device:GPU:0"]
            host = r["host_gpu0"]
            kinds = {k: gpu["kernel_ms_per_step"].get(k, 0.0) * scale for k in KINDS}
            exposed = {k: v * scale for k, v in gpu["nccl_exposed_ms_per_step"].items()}
            yield {"call": call, "T": seq, "B": r["batch"], "waited": r["waited_ms"], "queued": r["queued_ms"],
                   "dispatch": r["dispatch_ms"],
                   "call_to_first_kernel": statistics.median(e["call_to_first_kernel_us"] for e in host["edges"]) / 1e3,
                   "gaps_over_50us": host["gap_us_per_step"] / 1e3, **kinds,
                   "compute": kinds["gemm"] + kinds["attention"] + kinds["other"],
                   "nccl_exposed": sum(exposed.values()), "exposed_by_kind": exposed}


def main():
    head = ("| T | B | waited | call → first kernel | gaps > 50 µs | GEMM | attention | other | copies | NCCL "
            "(exposed) | exposed: all-gather / p2p / reduce-scatter | waited − compute |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows():
        e = r["exposed_by_kind"]
        print(f"| {r['T']} | {r['B']} | {r['waited']:.2f} | {r['call_to_first_kernel']:.2f} | {r['gaps_over_50us']:.2f} "
              f"| {r['gemm']:.2f} | {r['attention']:.2f} | {r['other']:.2f} | {r['copy']:.2f} | {r['nccl']:.2f} "
              f"({r['nccl_exposed']:.2f}) | {e.get('all-gather', 0):.2f} / {e.get('p2p', 0):.2f} / "
              f"{e.get('reduce-scatter', 0):.2f} | {r['waited'] - r['compute']:.2f} |")


if __name__ == "__main__":
    main()
