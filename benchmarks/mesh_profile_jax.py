"""Issue 46: where a device's step goes in jax_impl on the 4-GPU mesh, packed documents — the
JAX twin of ``mesh_profile_torch.py``. One process drives the mesh (single controller);
every (mix, mesh, layout) path is first verified on the mesh (``benchmarks.verify.verify_one``:
the reduced problem against the float64 oracle), then the full-size fwd+bwd program (ids and token
indices as program arguments, as the driver times it) is compiled, timed (median of 5, each step
waited for, as the driver times it; beside it the host's dispatch time and the step time with 5
steps queued before one wait) and traced over 3 steps with ``jax.profiler``, 30 ms of host sleep
between them so the trace splits into steps unambiguously.

Per GPU, from the trace: kernel time by kind (attention kernels, GEMMs, NCCL, copies, the rest:
XLA fusions, scatters; ``kind_of``), the time any kernel runs (the union: the rest of the step the GPU idles), and
the exposed share of each collective kind (``parity.capacity.exposure.exposed_times``: NCCL time
no other kernel covers), the "other" kernels' time by the phase that launched them (their op names
from the compiled program's HLO, which XLA dumps; the shared-prefix call names its phases:
``jax_impl.allgather.SCOPES``), and where the idle time sits: per step, the device span (first kernel
to last) against the busy time, and the longest gaps inside a step with the kernels on either
side (a gap after a small kernel that returns a value to the host — a ``lax.switch`` index, a
sync — reads differently from one after a collective); and per GPU what the host was doing in
those gaps and in XLA's per-execution phases (``host``: ``benchmarks.host_gaps`` on the same
trace). Each row is written to
``$OUT/jax-profile/{mix}[-window{W}]-{mesh}-{layout}.json`` as it finishes, with the top kernels of
GPU 0 (``WINDOW=W``: a sliding window (W, 0) on every path).

    JAX_PLATFORMS=cuda python benchmarks/mesh_profile_jax.py
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python benchmarks/mesh_profile_jax.py --smoke   # CPU: the path only

``MIXES`` (default ``short,heavy-tail``), ``PATHS`` (``mesh:layout`` comma list, default the
chooser's all-gather hybrid with the shared prefix and the static zigzag ring), ``SEQ`` (131072).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SMOKE = "--smoke" in sys.argv
MIXES = os.environ.get("MIXES", "short,heavy-tail").split(",")
PATHS = [p.split(":") for p in os.environ.get(
    "PATHS", "ring-agkv-r4:document-hybrid-shared,ring-r4:zigzag,usp-agkv-r2xu2:document-hybrid-shared").split(",")]
SEQ = int(os.environ.get("SEQ", "131072"))
WINDOW = int(os.environ.get("WINDOW", "0"))  # > 0: a sliding window (WINDOW, 0) on every path
TAG = f"-window{WINDOW}" if WINDOW else ""  # in the result files' names
OUT = Path(os.environ.get("OUT", "/tmp")) / "jax-profile"
HLO_DUMP = Path("/tmp/jaxprof-hlo")  # the compiled programs' HLO, for the kernels' op names (large: not in $OUT)


def dump_compiled_hlo() -> None:
    """Have XLA write each compiled ``both`` program's optimized HLO (set before JAX starts a
    backend; the latency-hiding scheduler kept on, as the driver has it)."""
    from parity.core.devices import OVERLAP_FLAG

    flags = os.environ.get("XLA_FLAGS", OVERLAP_FLAG)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={HLO_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*both.*"


def new_hlo(before: set[str]) -> str:
    """The optimized HLO text of the ``both`` program XLA dumped since ``before`` (the file names
    then), or "" if none."""
    fresh = [p for p in HLO_DUMP.glob("*jit_both*after_optimizations.txt") if p.name not in before]
    return max(fresh, key=lambda p: p.stat().st_size).read_text() if fresh else ""  # the program, not a report


def op_names(hlo_text: str) -> dict[str, str]:
    """Kernel name -> JAX op name, from an optimized HLO module: an instruction's name with "." and
    "-" as "_" (the name XLA gives the GPU kernel of a fusion) -> its metadata's ``op_name``."""
    found = re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{[^}\n]*?op_name="([^"]*)"', hlo_text, re.M)
    return {re.sub(r"[.\-]", "_", m.group(1)): m.group(2) for m in found}


def scope_of(op_name: str) -> str:
    """What a kernel's time is summed under: forward or backward (``transpose(`` in the op name),
    then the first named scope of a phase (``jax_impl.allgather.SCOPES``), else the op name's last
    two components."""
    scoped = re.search(r"shared_prefix\.\w+", op_name)  # as "jvp(shared_prefix.plan)" too
    phase = scoped.group(0) if scoped else "/".join(op_name.split("/")[-2:])
    return ("bwd " if "transpose(" in op_name else "fwd ") + phase


def other_by_scope(rows, names: dict[str, str], steps: int, top: int = 20) -> dict[str, float]:
    """The "other" kernels' ms per step by :func:`scope_of` their op name ("unmapped": no HLO name)."""
    sums: dict[str, float] = defaultdict(float)
    for name, lo, hi in rows:
        if kind_of(name) == "other":
            op = names.get(name)
            sums[scope_of(op) if op else "unmapped"] += (hi - lo) / steps
    return dict(sorted(sums.items(), key=lambda kv: -kv[1])[:top])


# Which kind a kernel's name says it is, first match wins. FA3's kernels are CUTLASS templates named
# for flash attention (so attention comes before the GEMM marks); cuBLAS's Hopper GEMMs are "nvjet_*"
# or "sm90_xmma_gemm_*" — until 2026-11-29 an "sm90" mark read those as attention, and GEMMs and
# copies were summed into "other" (no attention-only profile before then ran a GEMM of note).
KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "sdpa", "cudnn", "attention")),
         ("gemm", ("gemm", "nvjet", "xmma", "cublas", "cutlass")), ("copy", ("memcpy", "memset")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lowered for m in marks)), "other")


def device_kernels(trace_dir: str) -> dict[str, list[tuple[str, float, float]]]:
    """{GPU process name: [(kernel name, start ms, end ms)]} from the profile's trace."""
    from parity.capacity.exposure import xla_trace_kernels

    return {gpu: [(name, lo * 1e3, hi * 1e3) for name, lo, hi in rows] for gpu, rows in xla_trace_kernels(trace_dir).items()}


def union_ms(intervals) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted((lo, hi) for _, lo, hi in intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


STEP_BREAK_MS = 10.0  # the traced steps are 30 ms of host sleep apart: no gap inside a step is this long
GAP_MS = 0.02  # gaps shorter than this are launch spacing, not listed


def idle_inside_steps(rows, steps: int, top: int = 10) -> dict:
    """Per GPU: its kernels split into steps at gaps over ``STEP_BREAK_MS``; each step's device span
    and busy time (ms), the idle inside the steps per step, and the ``top`` longest gaps inside any
    step with the kernels before and after (names cut to 80 characters)."""
    ordered = sorted(rows, key=lambda r: r[1])
    groups, end = [], float("-inf")
    for row in ordered:
        if row[1] - end > STEP_BREAK_MS:
            groups.append([])
        groups[-1].append(row)
        end = max(end, row[2])
    spans, gaps = [], []
    for group in groups:
        busy, last = union_ms(group), group[0]
        spans.append((max(r[2] for r in group) - group[0][1], busy))
        reach = group[0][2]
        for row in group[1:]:
            if row[1] - reach > GAP_MS:
                gaps.append((row[1] - reach, last[0][:80], row[0][:80]))
            if row[2] >= reach:
                reach, last = row[2], row
    gaps.sort(reverse=True)
    return {"steps_found": len(groups), "span_ms": [round(a, 3) for a, _ in spans],
            "busy_in_span_ms": [round(b, 3) for _, b in spans],
            "idle_inside_ms_per_step": sum(a - b for a, b in spans) / max(1, len(spans)),
            "gaps_over_20us_per_step": len(gaps) / max(1, len(spans)),
            "longest_gaps": [{"ms": round(g, 3), "after": a, "before": b} for g, a, b in gaps[:top]]}


def step_times(both, args, warmup: int = 2, steps: int = 5) -> dict:
    """A compiled step's wall times as the profile reports them: each step waited for (median and
    every one), the host's share (how long the call takes to return, no wait) and the step with
    ``steps`` queued before one wait (the host running ahead)."""
    from benchmarks.masked import jax_queued_ms

    for _ in range(warmup):
        jax.block_until_ready(both(*args))
    walls, dispatch = [], []
    for _ in range(steps):
        began = time.perf_counter()
        jax.block_until_ready(both(*args))
        walls.append((time.perf_counter() - began) * 1e3)
    for _ in range(steps):
        began = time.perf_counter()
        out = both(*args)
        dispatch.append((time.perf_counter() - began) * 1e3)
        jax.block_until_ready(out)
    return {"wall_ms_median": statistics.median(walls), "walls_ms": walls,
            "dispatch_ms_median": statistics.median(dispatch),
            "queued_ms_per_step": jax_queued_ms(both, *args, steps=steps, repeats=1)}


def host_side(trace_dir: str) -> dict:
    """Per GPU of the trace, what the host did while that GPU idled inside a step, and XLA's
    per-execution phases step by step (``benchmarks.host_gaps``: the trace's host events on the
    GPUs' clock; the phases are the whole host's, the same under every GPU), the ten longest gaps
    listed. A trace it cannot read is the row's ``host_error``, not a lost profile."""
    from benchmarks.host_gaps import read_trace, summary

    try:
        trace = read_trace(trace_dir)
        return {"host": {f"GPU:{gpu}": {k: v for k, v in summary(trace, gpu, detail=10).items() if k != "trace"}
                         for gpu in sorted(trace.devices)}}
    except Exception as err:  # noqa: BLE001 — the device half of the row stands without it
        return {"host_error": f"{type(err).__name__}: {err}"[:300]}


def summarize(kernels: dict, steps: int, send_recv, names: dict[str, str] | None = None) -> dict:
    """Per GPU of ``kernels`` ({process: [(name, start ms, end ms)]}, ``steps`` traced steps apart):
    kernel time and launches by :func:`kind_of`, busy time, each collective kind's kernel and
    exposed time, the idle inside the steps, and the "other" kernels by phase (``names``);
    ValueError where the trace does not split into ``steps`` (kernels not in ms, or a step with a
    gap over ``STEP_BREAK_MS`` inside)."""
    from parity.capacity.exposure import exposed_times

    per_gpu = {}
    for process, rows in sorted(kernels.items()):
        found = idle_inside_steps(rows, steps)
        if found["steps_found"] != steps:
            raise ValueError(f"{process}: the trace splits into {found['steps_found']} steps, not {steps} "
                             f"(kernels in ms, steps more than {STEP_BREAK_MS:.0f} ms apart expected)")
        by_kind: dict[str, float] = defaultdict(float)
        launches: dict[str, float] = defaultdict(float)
        for name, lo, hi in rows:
            kind = kind_of(name)
            by_kind[kind] += (hi - lo) / steps
            launches[kind] += 1 / steps
        exposed = exposed_times(rows, send_recv)
        per_gpu[process] = {"kernel_ms_per_step": dict(by_kind), "launches_per_step": dict(launches),
                            "busy_ms_per_step": union_ms(rows) / steps,
                            # exposed_times keeps its input's unit (ms here): "_s" names, ms per step
                            "exposed_ms_per_step": {k: {n.removesuffix("_s"): v / steps for n, v in x.items()}
                                                    for k, x in exposed.items()}, **found}
        if names:
            per_gpu[process]["other_by_scope_ms_per_step"] = other_by_scope(rows, names, steps)
    first = sorted(kernels)[0] if kernels else None
    top: dict[str, float] = defaultdict(float)
    for name, lo, hi in kernels.get(first, []):
        top[name[:100]] += (hi - lo) / steps
    return {"per_gpu": per_gpu, "top_kernels_gpu0": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25])}


def main() -> None:
    import jax.numpy as jnp

    import jax_impl
    from benchmarks.bench_jax import attention_programs, device_mesh, random_inputs
    from benchmarks.common import MeshSpec, Problem, lay_out, row_problem
    from benchmarks.verify import verify_one
    from jax_impl.api import partition_specs

    dump_compiled_hlo()
    OUT.mkdir(parents=True, exist_ok=True)
    verdicts: dict[tuple, dict] = {}
    for mix in MIXES:
        for mesh_name, layout in PATHS:
            spec = MeshSpec(mesh_name)
            base = Problem(seq=1024 if SMOKE else SEQ, heads=4 if SMOKE else 32, kv_heads=2 if SMOKE else 8,
                           documents=mix, window=(WINDOW, 0) if WINDOW else None)
            key = (mesh_name, layout)
            if key not in verdicts:
                verdicts[key] = verify_one("jax", mesh_name, layout, "auto", base, "cpu" if SMOKE else "gpu")
                print("verify", key, verdicts[key], flush=True)
            row = {"mix": mix, "mesh": mesh_name, "layout": layout, "seq": base.seq, "verified": verdicts[key]}
            path = OUT / f"{mix}{TAG}-{mesh_name}-{layout}.json"
            if not verdicts[key].get("passed"):
                path.write_text(json.dumps(row, indent=1, default=str))
                continue
            problem = row_problem(base, spec, layout)
            laid = lay_out(problem, spec, layout)
            mesh = device_mesh(spec.axes, jax.devices())
            x_spec, _ = partition_specs(mesh)
            place = NamedSharding(mesh, P(*x_spec[:2]))
            names = [n for n, a in (("segment_ids", laid.segment_ids), ("token_index", laid.token_index)) if a is not None]
            aux = tuple(jax.device_put(a, place) for a in (laid.segment_ids, laid.token_index) if a is not None)

            def attention(q, k, v, *aux, laid=laid, mesh=mesh, spec=spec, names=names, window=problem.window):
                return jax_impl.sequence_parallel_attention(
                    q, k, v, mesh, causal=True, layout=laid.api_layout, kv_exchange=spec.kv_exchange,
                    block_backend="auto", window=window, **laid.shared, **dict(zip(names, aux)))

            _, both = attention_programs(attention)
            args = (*random_inputs(problem, NamedSharding(mesh, x_spec)), *aux)
            before = {p.name for p in HLO_DUMP.glob("*")}
            began = time.perf_counter()
            jax.block_until_ready(both(*args))
            row["compile_s"] = round(time.perf_counter() - began, 1)
            names = op_names(new_hlo(before))
            row["hlo_kernels_named"] = len(names)
            row.update(step_times(both, args))
            row["tflops_per_gpu"] = problem.flops(False) / (row["wall_ms_median"] * 1e-3) / spec.devices / 1e12
            trace_dir = f"/tmp/jaxprof-4gpu/{mix}{TAG}-{mesh_name}-{layout}"
            try:
                with jax.profiler.trace(trace_dir):
                    for _ in range(3):
                        jax.block_until_ready(both(*args))
                        time.sleep(0.03)  # STEP_BREAK_MS splits the trace here
                kernels = device_kernels(trace_dir)
                send_recv = ("p2p",) if spec.kv_exchange == "ring" and spec.ring > 1 else ("all-to-all",)
                row.update(summarize(kernels, 3, send_recv, names))
                row.update(host_side(trace_dir))
            except Exception as err:  # noqa: BLE001 — a profiler that cannot start is a row, not a crash
                row["profile_error"] = f"{type(err).__name__}: {err}"[:300]
            del args
            jnp.zeros(1).block_until_ready()
            path.write_text(json.dumps(row, indent=1, default=str))
            gpus = row.get("per_gpu", {})
            print(mix, mesh_name, layout, f"wall {row['wall_ms_median']:.2f} ms (queued {row['queued_ms_per_step']:.2f}, "
                  f"dispatch {row['dispatch_ms_median']:.2f}) compile {row['compile_s']} s",
                  {p[-6:]: {k: round(v, 2) for k, v in g["kernel_ms_per_step"].items()}
                   | {"busy": round(g["busy_ms_per_step"], 2), "idle_inside": round(g["idle_inside_ms_per_step"], 2)}
                   for p, g in gpus.items()}, flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
