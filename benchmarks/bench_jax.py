"""JAX side of the benchmark, one process driving every GPU: the single-GPU ceilings (cuDNN
through ``jax.nn.dot_product_attention``; FlashAttention-3 through flash_attn3_jax when
installed), jax_impl in each mesh shape and block backend, and flash_attn3_jax's own ring.

    python -m benchmarks.bench_jax --out rows.json [--seqs 32768,131072] [--meshes ring-r4,usp-r2xu2]

Times are medians of ``--iters`` runs of one jitted program (forward, or forward+backward via
``jax.vjp``), each waited for with ``block_until_ready`` (and ``extra.queued_ms``: ``--iters`` runs
queued before one wait, per run); memory is XLA's compiled memory
analysis per device (arguments + outputs + temporaries): JAX cannot reset its runtime peak.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from parity.core.devices import OVERLAP_FLAG

# Set before JAX starts: overlap collectives with compute (the latency-hiding scheduler).
os.environ.setdefault("XLA_FLAGS", OVERLAP_FLAG)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .common import (
    MeshSpec,
    Problem,
    Row,
    anchor_problems,
    best_anchor,
    check_layouts,
    documents_names,
    finish,
    fwd_modes,
    head_groups_extra,
    lay_out,
    mask_extra,
    mesh_rows,
    one_call_record,
    problem_masks,
    record_queued,
    row_problem,
    shared_arguments,
    weak_paths,
    window_anchored,
)
from .overlap import jax_variant, probe_rows


def _time(fn, args, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _compiled_bytes(fn, args) -> float | None:
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 — not every backend reports it
        return None


def random_inputs(problem: Problem, sharding, seed: int = 0):
    """q, k, v and the output cotangent of ``problem``, drawn on the devices of ``sharding``."""
    key = jax.random.key(seed)
    kq, kk, kv, kd = jax.random.split(key, 4)
    b, s, h, hk, d = problem.batch, problem.seq, problem.heads, problem.kv_heads, problem.head_dim
    dt = jnp.dtype(problem.dtype)

    def make(k, heads):
        return jax.jit(lambda: jax.random.normal(k, (b, s, heads, d), dt), out_shardings=sharding)()

    return make(kq, h), make(kk, hk), make(kv, hk), make(kd, h)


def attention_programs(attention):
    """(forward, forward+backward) jitted programs of ``attention(q, k, v, *aux) -> o``; ``aux``
    (segment ids, token indices) are arguments of the program, never constants folded into it."""
    fwd = jax.jit(lambda q, k, v, do, *aux: attention(q, k, v, *aux))

    def both(q, k, v, do, *aux):
        o, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *aux), q, k, v)
        return o, vjp(do)

    return fwd, jax.jit(both)


def _measure(row: Row, problem: Problem, attention, sharding, iters: int, warmup: int, aux=()) -> Row:
    try:
        args = (*random_inputs(problem, sharding), *aux)
        fwd, both = attention_programs(attention)
        fn = fwd if row.fwd_only else both
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))  # the compilation, timed apart from the warmup
        row.extra["compile_s"] = round(time.perf_counter() - began, 1)
        times = _time(fn, args, iters, warmup)
        from .masked import jax_queued_ms  # the host running ahead: the queued beside the waited times

        record_queued(row, lambda: jax_queued_ms(fn, *args, steps=iters, repeats=1))
        finish(row, problem, times, _compiled_bytes(fn, args))
    except Exception as err:  # noqa: BLE001 — a failing configuration is a row, not a crash
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        traceback.print_exc()
    return row


def device_mesh(axes: dict, devices):
    """The first prod(axes) of ``devices`` as a mesh of ``axes`` (name -> size; none: one "ring" of one)."""
    names = tuple(axes) or ("ring",)
    shape = tuple(axes.values()) or (1,)
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def ceiling_rows(problem: Problem, iters: int, warmup: int) -> list[Row]:
    one = NamedSharding(device_mesh({}, jax.devices()), P())
    rows = []
    for fwd_only in (True, False):
        row = Row("jax_cudnn_ceiling", "single", "-", problem.seq, 1, 1, 1, fwd_only)
        rows.append(_measure(row, problem, lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=problem.causal, implementation="cudnn"), one, iters, warmup))
        try:
            from flash_attn3_jax import flash_mha
        except ImportError as err:
            rows.append(Row("fa3_jax_ceiling", "single", "-", problem.seq, 1, 1, 1, fwd_only, note=f"not installed: {err}"))
            continue
        row = Row("fa3_jax_ceiling", "single", "-", problem.seq, 1, 1, 1, fwd_only)
        if not fwd_only and not problem.causal:
            row.note = FA3_LIBRARY_BACKWARD
            rows.append(row)
            continue
        rows.append(_measure(row, problem, lambda q, k, v: flash_mha(q, k, v, is_causal=problem.causal), one,
                             iters, warmup))
    return rows


# flash_attn3_jax 0.2.3's own backward writes past its undersized workspaces on full-mask blocks
# (docs/decisions.md, "fa3"): a row that would run it is reported, not timed. jax_impl's "fa3"
# backend calls the same kernel with correct workspaces.
FA3_LIBRARY_BACKWARD = ("not timed: flash_attn3_jax 0.2.3's own backward is wrong on full-mask blocks "
                        "(undersized workspaces; docs/decisions.md)")


def impl_rows(problem: Problem, spec: MeshSpec, layout: str, backend: str, iters: int, warmup: int,
              fwd_modes=(True, False), variant: str = "") -> list[Row]:
    """jax_impl on ``spec``'s mesh in ``layout`` (static, or per-row: ids fitted to the ring,
    explicit token indices) — the ids and indices passed as program arguments, as in training."""
    import jax_impl
    from jax_impl.api import partition_specs

    problem = row_problem(problem, spec, layout)
    laid = lay_out(problem, spec, layout)
    mesh = device_mesh(spec.axes, jax.devices())
    x_spec, _ = partition_specs(mesh)
    place = NamedSharding(mesh, P(*x_spec[:2]))  # like q's first two dimensions
    names = [n for n, a in (("segment_ids", laid.segment_ids), ("token_index", laid.token_index)) if a is not None]
    aux = tuple(jax.device_put(a, place) for a in (laid.segment_ids, laid.token_index) if a is not None)
    from jax_impl import replay
    from jax_impl.kernels.fa3_varlen import backward_groups

    path = one_call_record(problem, spec, laid, backend, replay, lambda: jnp.zeros(
        (problem.batch, problem.seq, problem.heads, problem.head_dim), jnp.dtype(problem.dtype),
        device=NamedSharding(mesh, x_spec)), lambda a: a)
    rows = []
    for fwd_only in fwd_modes:
        row = Row("jax_impl", spec.strategy, layout, problem.seq, spec.devices, spec.ulysses, spec.ring, fwd_only,
                  extra={"block_backend": backend, "mesh": spec.name, "heads": problem.heads, "kv_heads": problem.kv_heads,
                         **mask_extra(problem), **head_groups_extra(spec), **path,
                         # the one call's backward setting (RINGBRIDGE_BACKWARD_GROUPS: 1 one call, 2 two
                         # groups of runs where the split pays; which one a device took is not recorded)
                         **({"backward_groups": backward_groups()} if path and not fwd_only else {}),
                         **({"variant": variant} if variant else {}),
                         **({"controllers": jax.process_count()} if jax.process_count() > 1 else {})})

        def attention(q, k, v, *aux, backend=backend):
            return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=problem.causal, layout=laid.api_layout,
                                                        kv_exchange=spec.kv_exchange, block_backend=backend,
                                                        window=problem.window, **laid.shared, **dict(zip(names, aux)))

        rows.append(_measure(row, problem, attention, NamedSharding(mesh, x_spec), iters, warmup, aux))
    return rows


def _init_multi_controller() -> None:
    """One JAX process per GPU (multi-controller), started by ``torchrun``: its rendezvous
    variables name the coordinator (MASTER_PORT + 1), the process count and this process."""
    env = os.environ
    jax.distributed.initialize(coordinator_address=f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}",
                               num_processes=int(env["WORLD_SIZE"]), process_id=int(env["RANK"]),
                               local_device_ids=[int(env["LOCAL_RANK"])])


def fa3_ring_rows(problem: Problem, ring: int, iters: int, warmup: int) -> list[Row]:
    """flash_attn3_jax's ring: its custom partitioning turns flash_mha on sequence-sharded
    inputs into a ring (contiguous layout, every block computed then masked by a switch)."""
    rows = []
    for fwd_only in (True, False):
        row = Row("fa3_jax", "ring", "contiguous", problem.seq, ring, 1, ring, fwd_only)
        if not fwd_only and ring > 1:  # the ring's off-diagonal blocks are full-mask
            row.note = FA3_LIBRARY_BACKWARD
            rows.append(row)
            continue
        try:
            from flash_attn3_jax import flash_mha
        except ImportError as err:
            row.note = f"not installed: {err}"
            rows.append(row)
            continue
        mesh = device_mesh({"ring": ring}, jax.devices())
        rows.append(_measure(row, problem, lambda q, k, v: flash_mha(q, k, v, is_causal=problem.causal),
                             NamedSharding(mesh, P(None, "ring", None, None)), iters, warmup))
    return rows


def _save(rows: list[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.to_dict() for r in rows], f, indent=1)


def anchor_rows(problems: list[Problem]) -> list[Row]:
    """flash_attn3_jax's varlen kernel on one GPU over each problem's ids, checked at 4096 tokens
    first (``benchmarks.masked.jax_anchor``): the ``jax_varlen_anchor`` rows."""
    from .masked import jax_anchor

    fa3 = {"fa3": lambda p: jax_anchor(p.seq, p.heads, p.kv_heads, p.head_dim, problem=p)}
    return [best_anchor("jax_varlen_anchor", p, fa3) for p in problems]


def window_anchor_rows(problem: Problem) -> list[Row]:
    """flash_attn3_jax's own sliding window on one GPU at ``problem``'s length and window, checked
    at 4096 tokens first (``benchmarks.masked.jax_window_anchor``): the ``jax_window_anchor`` row a
    windowed run's efficiency is taken over."""
    from .masked import jax_window_anchor

    fa3 = {"fa3": lambda p: jax_window_anchor(p.seq, p.window[0], p.heads, p.kv_heads, p.head_dim)}
    return [best_anchor("jax_window_anchor", problem, fa3)]


def main(argv=None) -> None:
    ap = shared_arguments(__doc__.splitlines()[0])
    ap.add_argument("--no-peers", action="store_true", help="skip flash_attn3_jax's ring")
    ap.add_argument("--jax-backends", default="auto",
                    help="jax_impl block backends to run (auto, cudnn, fa3, reference; default auto)")
    ap.add_argument("--multi-controller", action="store_true",
                    help="one process per GPU under torchrun (jax.distributed.initialize); no ceilings or peers")
    args, _ = ap.parse_known_args(argv)  # the driver passes one flag set to both sides
    check_layouts(args.layout, args.documents)
    if args.multi_controller:
        _init_multi_controller()
        args.ceiling_seq, args.no_peers, args.weak, args.overlap = 0, True, "", False
    lead = jax.process_index() == 0
    masked = args.documents != "none" or args.window is not None
    rows = ceiling_rows(Problem(seq=args.ceiling_seq, heads=args.heads, kv_heads=args.kv_heads), args.iters,
                        args.warmup) if args.ceiling_seq and not masked else []
    if window_anchored(args) and lead:
        rows += window_anchor_rows(Problem(seq=args.ceiling_seq, heads=args.heads, kv_heads=args.kv_heads,
                                           window=(args.window, 0)))
    specs = [MeshSpec(name) for name in filter(None, args.meshes.split(","))]
    for seq in (int(s) for s in args.seqs.split(",") if s):
        for documents in documents_names(args.documents):
            problem = Problem(seq=seq, heads=args.heads, kv_heads=args.kv_heads, **problem_masks(args, documents))
            if documents != "none" and args.ceiling_seq and not args.multi_controller:
                rows += anchor_rows(anchor_problems(problem, specs, args.layout))
            for spec, backend, layout in mesh_rows(specs, args.jax_backends, args.layout):
                rows += impl_rows(problem, spec, layout, backend, args.iters, args.warmup, fwd_modes(args.passes))
                if args.overlap and spec.strategy == "ring":
                    rows += probe_rows(impl_rows, jax_variant, problem, spec, layout, backend, args.iters,
                                       args.warmup)
                if lead:
                    _save(rows, args.out)  # a run cut short keeps what it measured
            if not args.no_peers and not masked:
                rows += fa3_ring_rows(problem, len(jax.devices()), args.iters, args.warmup)
            if lead:
                _save(rows, args.out)
                print(f"jax seq {seq} documents {documents} done", flush=True)
    for spec, layout, backend, problem in weak_paths(args, len(jax.devices())):  # verified as benchmarks.verify plans
        for row in impl_rows(problem, spec, layout, backend, args.iters, args.warmup, fwd_modes=(False,)):
            row.extra["weak_scaling"] = True
            rows.append(row)
    if not lead:
        return
    _save(rows, args.out)
    for r in rows:
        print(f"{r.framework:18s} {r.strategy:12s} {r.layout:16s} {r.seq_len:7d} fwd_only={r.fwd_only!s:5s} "
              f"{r.extra.get('block_backend', ''):8s} {r.extra.get('documents', '')!s:10s} "
              f"{r.ms_per_iter or float('nan'):9.2f} ms {r.tflops_per_gpu or float('nan'):6.1f} TFLOP/s/GPU {r.note[:80]}")


if __name__ == "__main__":
    main()
