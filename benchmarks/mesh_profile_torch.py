"""Issues 46 and 47: where a device's step goes (torch_impl) — by default on the 128k short mix
(``MIXES``: any balance mixes, or ``none`` for no documents) over all-gather KV on 4 GPUs, the
per-document hybrid with and without the shared prefix; ``PATHS`` (``mesh:layout`` pairs, e.g.
``ring-r4:zigzag,ulysses-u4:contiguous``) any mesh strategy — one torch.profiler window per path
on every rank, each rank's summary written as it comes. Checked before it is profiled:
rank 0 compares the same call at 4096 tokens (the short mix, or no documents) with the float64
oracle (relative error <= 2e-2 on o and the gradients), so the profiled path is a verified one.

    torchrun --nproc_per_node 4 benchmarks/mesh_profile_torch.py      # GPUs
    torchrun --nproc_per_node 4 benchmarks/mesh_profile_torch.py --smoke   # CPU, gloo

Per rank and layout: the step's wall time (CUDA-synchronised, median of 5), the summed device
time of its kernels by kind (attention kernels, NCCL, copies / index ops, the rest) over the
profiled steps, the host time spent inside the attention call (including any wait for the GPU
in a device-to-host copy), and the top 20 rows by device time (operators and kernels both).
(The 2026-11-26 runs summed operator and annotation rows with kernel rows in
``device_ms_per_step_by_kind``, counting kernels twice; docs/gpu/documents-2026-11-26-h200x4.md reads
the kernel rows instead; :func:`is_kernel` now keeps kernels only.)
Written to ``$OUT/profile-short/{mix}[-window{W}]-{mesh}-{layout}-rank{r}.json`` (``WINDOW=W``:
a sliding window (W, 0) on every path).

``STACKS=1``: three more steps traced with Python stacks per rank, read by ``benchmarks.trace_gaps``
(each idle gap on the GPU with the host call that ended it and this project's frames then), to
``{...}-rank{r}-gaps.md``.

Host side (rank 0, after the timed steps): the synchronising CUDA calls of one step
(``torch.cuda.set_sync_debug_mode``: each with the frames of this project that made it) and a
cProfile of five steps (the 40 functions with the most own time, and the 40 with the most time
inside them), to ``{layout}-rank0-host.txt``. ``SEQ`` sets the global tokens (default 131072;
65536 over two GPUs keeps a rank's 32k), ``LAYOUTS`` a comma list of the layouts.
``RINGBRIDGE_HOST_IDS=1``: the steps (and the check) run inside ``torch_impl.host_ids`` over the
batch's laid-out rows, one block around a path's steps as the benchmark's rows hold it (files
tagged ``-hostids``).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SMOKE = "--smoke" in sys.argv
LAYOUTS = tuple(os.environ.get("LAYOUTS", "document-hybrid,document-hybrid-shared").split(","))
SEQ = int(os.environ.get("SEQ", "131072"))
# the balance mixes profiled (full size only), or "none": no documents (issue 47's unmasked strategies)
MIXES = tuple(os.environ.get("MIXES", "short").split(","))
# mesh:layout pairs (default: all-gather KV over every rank in each of LAYOUTS)
PATHS = os.environ.get("PATHS", "")
# WINDOW=4096: a sliding window (WINDOW, 0) on every path (the check at 4096 tokens takes a window
# of an eighth of its length, so the window masks something there too)
WINDOW = int(os.environ.get("WINDOW", "0"))
# RINGBRIDGE_HOST_IDS=1: every call (the check's too) inside torch_impl.host_ids over the batch's laid-out rows,
# as the benchmark's rows take it (parity.runners.torch_runner.host_ids_if_asked)
HOST_IDS = os.environ.get("RINGBRIDGE_HOST_IDS") == "1"
TAG = (f"-window{WINDOW}" if WINDOW else "") + ("-hostids" if HOST_IDS else "")  # in the result files' names
# STACKS=1: three more steps traced with Python stacks, read by benchmarks.trace_gaps (where the GPU waits
# for the host, and on which call): {...}-rank{r}-gaps.md (host times inflated by the stacks)
STACKS = os.environ.get("STACKS") == "1"


def host_report(step, sync, cuda: bool) -> str:
    """The synchronising CUDA calls of one step (where in this project each was made) and a
    cProfile of five steps."""
    lines = []
    if cuda:
        caught = []  # (message, this project's frames at the moment of the warning)
        ours = lambda: [f"{f.filename.rsplit('/', 2)[-2]}/{f.name}:{f.lineno}" for f in traceback.extract_stack()
                        if "/torch_impl/" in f.filename or "/seqplan/" in f.filename]
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *_args, **_kw: caught.append((str(message)[:90], ours()))
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        sync()
        lines.append(f"synchronising calls in one step: {len(caught)}")
        lines += [f"  {message} @ {' < '.join(reversed(frames))}" for message, frames in caught]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    sync()
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
        lines.append(text.getvalue())
    return "\n".join(lines)


def stack_gaps(step, sync, cuda: bool) -> list:
    """``benchmarks.trace_gaps.gaps`` of three steps traced with Python stacks, each step a
    ``record_function("step")`` range (no GPU: no kernels, so no gaps)."""
    import tempfile

    from benchmarks import trace_gaps

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(3):
            with torch.profiler.record_function("step"):
                step()
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_gaps.gaps(trace_gaps.load(path), "step", 20.0)


def _block(spec, mesh) -> int:
    from parity.core.mesh import sequence_block

    return sequence_block(dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), spec.axes)


def is_kernel(name: str) -> bool:
    """A GPU kernel's row, not an annotation's: torch 2.11 also gives ``record_function`` ranges,
    autograd functions and ``nccl:*`` / ``record_param_comms`` device time on the GPU timeline
    (the 11-26 run4 summed them with the kernels under them)."""
    return name.startswith(("void ", "ncclDevKernel", "kernel_", "Memcpy", "Memset")) or (
        "kernel" in name.lower() and not name.startswith(("nccl:", "aten::")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "nccl"
    if any(s in lowered for s in ("flash", "fmha", "attention", "sm90", "cutlass", "kernel_cutlass")):
        return "attention"
    if any(s in lowered for s in ("index", "gather", "scatter", "copy", "memcpy", "memset", "cat", "fill")):
        return "copies/index"
    return "other"


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import torch_impl
    from benchmarks.bench_torch import local_shard
    from benchmarks.common import MeshSpec, Problem, check_layouts, lay_out, row_problem
    from parity.core.reference import attention_backward, attention_forward
    from parity.runners.torch_runner import host_ids_if_asked
    from seqplan.layouts import layout_permutation

    cuda = torch.cuda.is_available() and not SMOKE
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    paths = [tuple(p.split(":")) for p in PATHS.split(",") if p] or [(f"ring-agkv-r{world}", la) for la in LAYOUTS]
    for mix in MIXES:  # a per-row layout without documents, or an unknown name: refused before any work
        check_layouts(",".join(layout for _, layout in paths), mix)
    meshes = {}  # mesh name -> DeviceMesh, built once

    def mesh_of(spec):
        if spec.name not in meshes:
            meshes[spec.name] = init_device_mesh("cuda" if cuda else "cpu", tuple(spec.axes.values()),
                                                 mesh_dim_names=tuple(spec.axes))
        return meshes[spec.name]

    out = Path(os.environ.get("OUT", "/tmp")) / "profile-short"
    out.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def call(problem, spec, layout, dtype, seed=0):
        problem = row_problem(problem, spec, layout)
        laid = lay_out(problem, spec, layout)
        mesh = mesh_of(spec)
        ids, index = (local_shard(a, spec, mesh, device) for a in (laid.segment_ids, laid.token_index))
        gen = torch.Generator().manual_seed(seed)
        make = lambda h: torch.randn(problem.batch, problem.seq, h, problem.head_dim, generator=gen)
        full = {"q": make(problem.heads), "k": make(problem.kv_heads), "v": make(problem.kv_heads),
                "do": make(problem.heads)}
        mine = {n: local_shard(x, spec, mesh, device).to(dtype).requires_grad_(n != "do") for n, x in full.items()}

        def step():
            for n in ("q", "k", "v"):
                mine[n].grad = None
            with torch.profiler.record_function("attention_call"):
                o = torch_impl.sequence_parallel_attention(
                    mine["q"], mine["k"], mine["v"], mesh, causal=True, layout=laid.api_layout,
                    kv_exchange=spec.kv_exchange, segment_ids=ids, token_index=index, window=problem.window,
                    **laid.shared)
                o.backward(mine["do"])
            return o
        return step, mine, full, laid, problem

    def held(laid):
        """The path's steps inside one ``torch_impl.host_ids`` block with RINGBRIDGE_HOST_IDS=1 (as
        the benchmark holds it around a row's steps: its uploads made once, not once a step)."""
        return host_ids_if_asked(laid.segment_ids, laid.token_index) or contextlib.nullcontext()

    def check(spec, layout, documents) -> float:
        seq = 512 if SMOKE else 4096
        problem = Problem(seq=seq, heads=8, kv_heads=2, documents=documents,
                          window=(min(WINDOW, seq // 8), 0) if WINDOW else None)
        step, mine, full, laid, problem = call(problem, spec, layout, torch.float32 if SMOKE else torch.bfloat16, seed=1)
        with held(laid):
            o = step()
        got = {n: torch.empty((world, *x.shape), dtype=x.dtype, device=device) for n, x in
               (("o", o.detach()), ("dq", mine["q"].grad), ("dk", mine["k"].grad), ("dv", mine["v"].grad))}
        mine_out = {"o": o.detach(), "dq": mine["q"].grad, "dk": mine["k"].grad, "dv": mine["v"].grad}
        for n in got:
            dist.all_gather_into_tensor(got[n].view(-1, *got[n].shape[2:]), mine_out[n].contiguous())
        if spec.ulysses > 1:  # rank order -> sequence-block order (block r·U + u of each rank's coordinates)
            blocks = torch.tensor([_block(spec, mesh_of(spec))], device=device)
            order = torch.empty(world, dtype=blocks.dtype, device=device)
            dist.all_gather_into_tensor(order, blocks)
            got = {n: x[torch.argsort(order)] for n, x in got.items()}
        if rank:
            return 0.0
        laid_np = {n: x.double().numpy() for n, x in full.items()}
        ids = laid.segment_ids
        # the truth in original order: undo the layout (per-row token indices, or the static layout's
        # permutation), attend causally (by document), compare in the same order
        index = laid.token_index if laid.token_index is not None else np.broadcast_to(
            layout_permutation(problem.seq, laid.api_layout, spec.ring, spec.ulysses), (problem.batch, problem.seq))
        perm = np.argsort(index, axis=1)  # layout position of each original index
        orig = {n: np.take_along_axis(x, perm[:, :, None, None], 1) for n, x in laid_np.items()}
        ids_orig = None if ids is None else np.take_along_axis(ids, perm, 1)
        fwd = attention_forward(orig["q"], orig["k"], orig["v"], causal=True, segment_ids=ids_orig,
                                window=problem.window)
        grads = attention_backward(fwd, orig["q"], orig["k"], orig["v"], orig["do"], np.zeros_like(fwd.lse))
        worst = 0.0
        for n, want in zip(("o", "dq", "dk", "dv"), (fwd.o, *grads)):
            x = got[n].float().cpu().numpy()  # [R, b, t, h, d]
            x = np.concatenate(list(x), axis=1)
            x = np.take_along_axis(x, perm[:, :, None, None], 1)
            worst = max(worst, float(np.linalg.norm(x - want) / np.linalg.norm(want)))
        return worst

    checked: dict[tuple, float] = {}  # one check per path (4096 tokens: the short mix, or none), mixes reuse it
    for mix, (mesh_name, layout) in [(m, p) for m in MIXES for p in paths]:
        spec = MeshSpec(mesh_name)
        key = (mesh_name, layout, mix == "none")
        error = checked[key] if key in checked else checked.setdefault(
            key, check(spec, layout, "none" if mix == "none" else "short"))
        verdict = torch.tensor([error <= 2e-2], device=device)
        dist.broadcast(verdict, 0)
        if not bool(verdict.item()):
            if rank == 0:
                (out / f"{mix}{TAG}-{mesh_name}-{layout}-NOT-VERIFIED.txt").write_text(f"relative error {error:.3e}\n")
            continue
        problem = Problem(seq=4096 if SMOKE else SEQ, heads=4 if SMOKE else 32, kv_heads=2 if SMOKE else 8,
                          documents=mix, window=(WINDOW, 0) if WINDOW else None)
        step, _, _, laid, _ = call(problem, spec, layout, torch.float32 if SMOKE else torch.bfloat16)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        walls = []
        with held(laid):
            for _ in range(3):
                step()
            sync()
            for _ in range(5):
                began = time.perf_counter()
                step()
                sync()
                walls.append((time.perf_counter() - began) * 1e3)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    step()
                sync()
        events = prof.key_averages()
        device_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        kinds: dict[str, float] = {}
        for e in events:  # the kernels' own rows only: an operator's row repeats its kernels' time
            if is_kernel(e.key):
                kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + device_us(e) / 1e3 / 3
        host = [e for e in events if e.key == "attention_call"]
        top = sorted(events, key=device_us, reverse=True)[:20]
        summary = {"mix": mix, "mesh": mesh_name, "layout": layout, "rank": rank,
                   "verified_error_4096": error if rank == 0 else None,
                   "shared_tokens": lay_out(row_problem(problem, spec, layout), spec, layout).shared_tokens,
                   "wall_ms_median": statistics.median(walls), "walls_ms": walls,
                   "device_ms_per_step_by_kind": kinds,
                   "attention_call_host_ms_per_step": host[0].cpu_time_total / 1e3 / 3 if host else None,
                   "top_device_ops": [{"name": e.key[:120], "device_ms_per_step": device_us(e) / 1e3 / 3,
                                       "calls_per_step": e.count / 3} for e in top]}
        if STACKS:
            from benchmarks.trace_gaps import summary as gap_table

            with held(laid):
                found = stack_gaps(step, sync, cuda)
            (out / f"{mix}{TAG}-{mesh_name}-{layout}-rank{rank}-gaps.md").write_text(gap_table(found) + "\n")
            summary["stacked_gaps_per_step"] = len(found) / 3
            summary["stacked_idle_ms_per_step"] = sum(g.idle_us for g in found) / 3e3
        (out / f"{mix}{TAG}-{mesh_name}-{layout}-rank{rank}.json").write_text(json.dumps(summary, indent=1))
        with held(laid):
            host_text = host_report(step, sync, cuda)  # every rank steps (the collectives); rank 0 writes
        if rank == 0:
            (out / f"{mix}{TAG}-{mesh_name}-{layout}-rank0-host.txt").write_text(host_text)
        if rank == 0:
            print(json.dumps({k: summary[k] for k in ("mix", "mesh", "layout", "shared_tokens", "wall_ms_median",
                                                      "device_ms_per_step_by_kind", "attention_call_host_ms_per_step",
                                                      "verified_error_4096")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
