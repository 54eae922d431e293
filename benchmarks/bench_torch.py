"""torch side of the benchmark, one process per GPU under ``torchrun`` (multi-host ready: every
rank holds only its own shards): the single-GPU ceilings (SDPA cuDNN and flash on rank 0),
torch_impl in each mesh shape, torch's context_parallel and yunchang's USP (when installed).

    torchrun --standalone --nproc-per-node 4 -m benchmarks.bench_torch --out rows.json

Times: each rank records CUDA events around every iteration (after a barrier); a row's time is
the slowest rank's median. Memory: ``torch.cuda.max_memory_allocated`` after a reset, the
slowest rank's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqplan.documents import forget_plans

from .common import (
    MeshSpec,
    Problem,
    Row,
    anchor_problems,
    anchor_row,
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
from .overlap import probe_rows, torch_variant


def _rank() -> int:
    return dist.get_rank()


def _time(step, iters: int, warmup: int, group=None) -> list[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _queued_ms(step, steps: int, group=None) -> float:
    """ms a step with ``steps`` steps issued back to back between two events (the host running
    ahead, as in a training loop: ``benchmarks.masked.cuda_queued_ms``), the ranks starting
    together, beside the per-step event times, each of which also counts the host's launch of its
    first kernels."""
    from .masked import cuda_queued_ms

    dist.barrier(group=group)
    return cuda_queued_ms(step, steps)


def _worst_queued(step, steps: int, group=None) -> float:
    """The slowest rank's :func:`_queued_ms`. A rank whose own timing raised outside the steps'
    collectives (the events, the barrier) still reaches the reduction, with +inf (NCCL's MAX keeps
    an infinity; a NaN would lose to any number), so the row gets no queued time and no rank waits
    there alone. A step that fails on one rank mid-collective hangs the others, as in ``_time``."""
    try:
        mine = _queued_ms(step, steps, group)
    except Exception:  # noqa: BLE001 — reported through the reduction, below
        traceback.print_exc()
        mine = math.inf
    worst = _worst(mine, group)
    if not math.isfinite(worst):
        raise RuntimeError("a rank's queued timing failed (its traceback is in its log)")
    return worst


def _worst(value: float, group=None) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _measure(row: Row, problem: Problem, make_step, iters: int, warmup: int, group=None) -> Row:
    """``make_step()`` builds inputs and returns the per-iteration callable; it runs on every
    rank of ``group``. An error becomes this rank's row note (rank 0's rows are the ones saved)."""
    error = ""
    try:
        torch.cuda.reset_peak_memory_stats()
        step = make_step()
        times = _time(step, iters, warmup, group)
        peak = torch.cuda.max_memory_allocated()
        median = sorted(times)[len(times) // 2]
        worst = _worst(median, group)
        times = [t * worst / median for t in times]  # this rank's spread, at the slowest rank's median
        record_queued(row, lambda: _worst_queued(step, iters, group))
        finish(row, problem, times, _worst(peak, group))
    except Exception as err:  # noqa: BLE001 — a failing configuration is a row, not a crash
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        traceback.print_exc()
    row.note = error
    return row


def _randn(*shape, requires_grad=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(requires_grad)


def _train_step(run, q, k, v, do, fwd_only: bool):
    """One iteration: forward only under no_grad, or forward + backward (gradients dropped)."""
    if fwd_only:
        def step():
            with torch.no_grad():
                run(q, k, v)
    else:
        def step():
            q.grad = k.grad = v.grad = None
            run(q, k, v).backward(do)
    return step


def ceiling_rows(problem: Problem, iters: int, warmup: int) -> list[Row]:
    """SDPA on one GPU (rank 0; the others wait at a barrier). [b, h, s, d] layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank0 = dist.new_group([0])  # every rank creates it; only rank 0 runs in it
    rows = []
    kernels = (("torch_cudnn_ceiling", SDPBackend.CUDNN_ATTENTION), ("torch_flash_ceiling", SDPBackend.FLASH_ATTENTION))
    for name, backend in kernels:
        for fwd_only in (True, False):
            row = Row(name, "single", "-", problem.seq, 1, 1, 1, fwd_only)
            if _rank() == 0:
                def make_step():
                    b, s, h, d = problem.batch, problem.seq, problem.heads, problem.head_dim
                    q, do = _randn(b, h, s, d, requires_grad=True), _randn(b, h, s, d, seed=3)
                    k, v = (_randn(b, problem.kv_heads, s, d, requires_grad=True, seed=i) for i in (1, 2))

                    def run(q, k, v):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=problem.causal,
                                                                  enable_gqa=problem.kv_heads != problem.heads)
                    return _train_step(run, q, k, v, do, fwd_only)

                _measure(row, problem, make_step, iters, warmup, group=rank0)
            dist.barrier()
            rows.append(row)
    return rows + _fa4_ceiling_rows(problem, iters, warmup)


def _fa4_ceiling_rows(problem: Problem, iters: int, warmup: int) -> list[Row]:
    """FlashAttention-4's dense causal kernel as one more torch ceiling, forward and forward +
    backward (rank 0; the others wait), checked at 4096 tokens first (``masked.fa4_dense_anchor``):
    none where flash-attn-4 is not installed or the problem is not causal (FA4 is torch's fastest
    kernel where it runs, so the ceiling the rows are held to must include it)."""
    from .masked import fa4_dense_anchor

    rows = []
    if problem.causal and _rank() == 0:
        try:
            result = fa4_dense_anchor(problem.seq, problem.heads, problem.kv_heads, problem.head_dim, iters, warmup)
        except ImportError:
            result = None  # not installed: no row (the SDPA ceilings stand)
        except Exception as err:  # noqa: BLE001 — a failing kernel is a row with its error, not a lost run
            traceback.print_exc()
            result = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        if result is not None:
            rows = [anchor_row("torch_fa4_ceiling", problem, result, fwd_only) for fwd_only in (True, False)]
    dist.barrier()
    return rows


def _local_shape(problem: Problem, devices: int, heads: int):
    return problem.batch, problem.seq // devices, heads, problem.head_dim


def local_shard(array, spec: MeshSpec, mesh, device="cuda"):
    """This rank's shard of a global [b, seq, ...] array in layout order (None stays None): the
    sequence block r·U + u of its ring and Ulysses coordinates (torch_impl's contract)."""
    if array is None:
        return None
    from parity.core.mesh import sequence_block

    block = sequence_block(dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), spec.axes)
    t = array.shape[1] // (spec.ring * spec.ulysses)
    return torch.as_tensor(array[:, block * t:(block + 1) * t], device=device)


def impl_rows(problem: Problem, spec: MeshSpec, layout: str, backend: str, iters: int, warmup: int,
              fwd_modes=(True, False), variant: str = "") -> list[Row]:
    """torch_impl on ``spec``'s mesh in ``layout`` (static, or per-row: ids fitted to the ring,
    explicit token indices), every rank holding its own shards."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch_impl

    problem = row_problem(problem, spec, layout)
    laid = lay_out(problem, spec, layout)
    mesh = init_device_mesh("cuda", tuple(spec.axes.values()), mesh_dim_names=tuple(spec.axes))
    ids, index = local_shard(laid.segment_ids, spec, mesh), local_shard(laid.token_index, spec, mesh)
    from torch_impl import replay

    # the plan reads q's shape, dtype and device only: one head stands in for all of them
    path = one_call_record(problem, spec, laid, backend, replay, lambda: torch.empty(
        problem.batch, problem.seq, 1, problem.head_dim, device="cuda", dtype=getattr(torch, problem.dtype)),
        lambda a: torch.as_tensor(a, device="cuda")) if _rank() == 0 else {}
    rows = []
    # RINGBRIDGE_FRESH_PLANS=1: the host's plans forgotten and the ids and token indices new tensors every
    # step, so each step pays the planning and the checks a training step with new ids pays (the row records
    # it; JAX plans on the device, in every step). Under RINGBRIDGE_HOST_IDS=1 the host_ids block, held around
    # the row's steps, still keeps its shards and device copies from step to step.
    fresh_plans = os.environ.get("RINGBRIDGE_FRESH_PLANS") == "1"
    for fwd_only in fwd_modes:
        row = Row("torch_impl", spec.strategy, layout, problem.seq, spec.devices, spec.ulysses, spec.ring, fwd_only,
                  extra={"block_backend": backend, "mesh": spec.name, "heads": problem.heads, "kv_heads": problem.kv_heads,
                         **mask_extra(problem), **head_groups_extra(spec), **path,
                         **({"variant": variant} if variant else {}), **({"fresh_plans": True} if fresh_plans else {})})

        def make_step():
            n = spec.devices
            q, do = _randn(*_local_shape(problem, n, problem.heads), requires_grad=True), _randn(
                *_local_shape(problem, n, problem.heads), seed=3)
            k, v = (_randn(*_local_shape(problem, n, problem.kv_heads), requires_grad=True, seed=i) for i in (1, 2))

            def run(q, k, v):
                step_ids, step_index = ids, index
                if fresh_plans:  # every step as a new batch's: plans (cached by content) and checks (by tensor) anew
                    forget_plans()
                    step_ids, step_index = (None if x is None else x.clone() for x in (ids, index))
                return torch_impl.sequence_parallel_attention(q, k, v, mesh, causal=problem.causal,
                                                              layout=laid.api_layout, kv_exchange=spec.kv_exchange,
                                                              block_backend=backend, segment_ids=step_ids,
                                                              window=problem.window, token_index=step_index,
                                                              **laid.shared)
            return _train_step(run, q, k, v, do, fwd_only)

        with _host_ids_block(laid, row):
            rows.append(_measure(row, problem, make_step, iters, warmup))
    return rows


def _host_ids_block(laid, row: Row):
    """With ``RINGBRIDGE_HOST_IDS=1`` the row's calls run inside ``torch_impl.host_ids`` over the
    laid-out ids and token indices (no copy of the gathered ids to the host a call; the row
    records ``host_ids``; its check runs the same block: ``parity.runners.torch_runner``)."""
    from parity.runners.torch_runner import host_ids_if_asked

    block = host_ids_if_asked(laid.segment_ids, laid.token_index)
    if block is None:
        return contextlib.nullcontext()
    row.extra["host_ids"] = True
    return block


def context_parallel_rows(problem: Problem, iters: int, warmup: int, load_balance: bool) -> list[Row]:
    """torch's context parallelism (experimental API): SDPA under ``context_parallel`` with the
    cuDNN backend; the buffers are sharded in place on entry ([b, h, s, d], sequence dim 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = dist.get_world_size()
    mesh = init_device_mesh("cuda", (n,), mesh_dim_names=("cp",))
    rows = []
    for fwd_only in (True, False):
        row = Row("torch_cp", "ring", "head-tail" if load_balance else "contiguous", problem.seq, n, 1, n, fwd_only,
                  extra={"rotate": "default"})
        stack = []

        def make_step():
            cp_attention._cp_options.enable_load_balance = load_balance
            b, s, h, d = problem.batch, problem.seq, problem.heads, problem.head_dim
            q, k, v, do = (_randn(b, h, s, d, seed=i) for i in range(4))
            ctx = context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2])
            ctx.__enter__()
            stack.append((ctx, (q, k, v)))
            for x in (q, k, v):
                x.requires_grad_()

            def run(q, k, v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=problem.causal)
            return _train_step(run, q, k, v, do, fwd_only)

        try:
            rows.append(_measure(row, problem, make_step, iters, warmup))
        finally:
            while stack:  # it restores the buffers by resizing them: no longer leaves with grads
                ctx, leaves = stack.pop()
                for x in leaves:
                    x.grad = None
                    x.requires_grad_(False)
                ctx.__exit__(None, None, None)
    return rows


# yunchang 0.6.4 without the flash-attn package (not installable on the GPU image), read from its
# kernels/attention.py: every torch attention type's backward raises, and its TORCH_CUDNN (and
# TORCH_MATH) forward returns lse = 0, so a ring of 2 or more merges its blocks with wrong weights.
# Such rows are reported, not timed: a fast wrong result is not a throughput.
YUNCHANG_NO_BACKWARD = ("not timed: yunchang 0.6.4's torch attention types have no backward "
                        "('Not implemented backward for PyTorch attention types')")
YUNCHANG_ZERO_LSE = ("not timed: yunchang 0.6.4's TORCH_CUDNN forward returns lse = 0, so its ring merges are wrong "
                     "(Ulysses alone merges nothing)")


def yunchang_rows(problem: Problem, ulysses: int, ring: int, iters: int, warmup: int) -> list[Row]:
    """yunchang's LongContextAttention (USP), zigzag ring, torch's cuDNN SDPA kernel (no
    flash-attn package on the GPU image)."""
    rows = []
    for fwd_only in (True, False):
        row = Row("yunchang", "usp" if ulysses > 1 and ring > 1 else "ulysses" if ulysses > 1 else "ring", "zigzag",
                  problem.seq, ulysses * ring, ulysses, ring, fwd_only)
        try:
            import yunchang
            from yunchang import LongContextAttention, set_seq_parallel_pg
            from yunchang.kernels import AttnType
        except Exception as err:  # noqa: BLE001 — import errors of an optional peer are a row note
            row.note = f"not usable: {type(err).__name__}: {err}"
            rows.append(row)
            continue
        row.extra["version"] = getattr(yunchang, "__version__", "?")
        if not fwd_only:
            row.note = YUNCHANG_NO_BACKWARD
            rows.append(row)
            continue
        if ring > 1:
            row.note = YUNCHANG_ZERO_LSE
            rows.append(row)
            continue

        def make_step():
            set_seq_parallel_pg(ulysses, ring, dist.get_rank(), dist.get_world_size())
            attn = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.TORCH_CUDNN)
            n = ulysses * ring
            q, do = _randn(*_local_shape(problem, n, problem.heads), requires_grad=True), _randn(
                *_local_shape(problem, n, problem.heads), seed=3)
            k, v = (_randn(*_local_shape(problem, n, problem.kv_heads), requires_grad=True, seed=i) for i in (1, 2))
            return _train_step(lambda q, k, v: attn(q, k, v, dropout_p=0.0, causal=problem.causal), q, k, v, do, fwd_only)

        rows.append(_measure(row, problem, make_step, iters, warmup))
    return rows


def _save(rows: list[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.to_dict() for r in rows], f, indent=1)


def anchor_rows(problems: list[Problem]) -> list[Row]:
    """On rank 0 (the others wait): torch's fastest fused varlen kernel on one GPU over each
    problem's ids — FA2 varlen (``aten``), and FlashAttention-4 when installed — each checked at
    4096 tokens first (``benchmarks.masked``): the ``torch_varlen_anchor`` rows."""
    from .masked import anchor, fa4_anchor

    candidates = {name: (lambda p, fn=fn: fn(p.seq, p.heads, p.kv_heads, p.head_dim, problem=p))
                  for name, fn in (("fa2", anchor), ("fa4", fa4_anchor))}
    rows = []
    for p in problems:
        if _rank() == 0:
            rows.append(best_anchor("torch_varlen_anchor", p, candidates))
        dist.barrier()
    return rows


def window_anchor_rows(problem: Problem) -> list[Row]:
    """On rank 0 (the others wait): torch's fastest fused sliding window on one GPU at ``problem``'s
    length and window — FA2's (``aten_window``) and FlashAttention-4's when installed — each checked
    at 4096 tokens first: the ``torch_window_anchor`` row a windowed run's efficiency is taken over."""
    from .masked import fa4_window_anchor, window_anchor

    candidates = {name: (lambda p, fn=fn: fn(p.seq, p.window[0], p.heads, p.kv_heads, p.head_dim))
                  for name, fn in (("fa2", window_anchor), ("fa4", fa4_window_anchor))}
    rows = [best_anchor("torch_window_anchor", problem, candidates)] if _rank() == 0 else []
    dist.barrier()
    return rows


def main(argv=None) -> None:
    ap = shared_arguments(__doc__.splitlines()[0])
    ap.add_argument("--torch-backends", default="auto", help="torch_impl block backends to run (default auto)")
    ap.add_argument("--peers", default="cp,yunchang")
    ap.add_argument("--weak-only", action="store_true",
                    help="time only --weak's ring over this world's ranks (the driver starts a world per ring size)")
    args, _ = ap.parse_known_args(argv)  # the driver passes one flag set to both sides
    check_layouts(args.layout, args.documents)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if args.weak_only:
        weak_main(args)
        return
    masked = args.documents != "none" or args.window is not None
    rows = ceiling_rows(Problem(seq=args.ceiling_seq, heads=args.heads, kv_heads=args.kv_heads), args.iters,
                        args.warmup) if args.ceiling_seq and not masked else []
    if window_anchored(args):
        rows += window_anchor_rows(Problem(seq=args.ceiling_seq, heads=args.heads, kv_heads=args.kv_heads,
                                           window=(args.window, 0)))
    n = dist.get_world_size()
    peers = [p for p in args.peers.split(",") if p]
    specs = [spec for spec in (MeshSpec(name) for name in filter(None, args.meshes.split(","))) if spec.devices == n]
    for seq in (int(s) for s in args.seqs.split(",") if s):
        for documents in documents_names(args.documents):
            problem = Problem(seq=seq, heads=args.heads, kv_heads=args.kv_heads, **problem_masks(args, documents))
            if documents != "none" and args.ceiling_seq:
                rows += anchor_rows(anchor_problems(problem, specs, args.layout))
            for spec, backend, layout in mesh_rows(specs, args.torch_backends, args.layout):
                rows += impl_rows(problem, spec, layout, backend, args.iters, args.warmup, fwd_modes(args.passes))
                if args.overlap and spec.strategy == "ring":
                    rows += probe_rows(impl_rows, torch_variant, problem, spec, layout, backend, args.iters,
                                       args.warmup)
                if _rank() == 0:
                    _save(rows, args.out)  # a run cut short keeps what it measured
            rows += _peer_rows(problem, peers, masked, n, args)
            if _rank() == 0:
                _save(rows, args.out)
                print(f"torch seq {seq} documents {documents} done", flush=True)
    if _rank() == 0:
        _save(rows, args.out)
        for r in rows:
            print(f"{r.framework:20s} {r.strategy:12s} {r.layout:16s} {r.seq_len:7d} fwd_only={r.fwd_only!s:5s} "
                  f"{r.extra.get('documents', '')!s:10s} {r.ms_per_iter or float('nan'):9.2f} ms "
                  f"{r.tflops_per_gpu or float('nan'):6.1f} TFLOP/s/GPU {r.note[:90]}")
    dist.destroy_process_group()


def weak_main(args) -> None:
    """``--weak-only``: the weak-scaling ring over this world's ranks (``common.weak_paths`` of this
    world's size), fwd+bwd, each row marked ``weak_scaling``; the world is one of several the driver
    starts (1, 2, 4 … ranks), as JAX's one process times its rings on 1, 2, 4 … of the GPUs."""
    n, rows = dist.get_world_size(), []
    for spec, layout, backend, problem in weak_paths(args, n, "torch"):
        if spec.devices != n:
            continue
        for row in impl_rows(problem, spec, layout, backend, args.iters, args.warmup, (False,)):
            row.extra["weak_scaling"] = True
            rows.append(row)
        if _rank() == 0:
            _save(rows, args.out)
    if _rank() == 0:
        _save(rows, args.out)
    dist.destroy_process_group()


def _peer_rows(problem: Problem, peers: list[str], masked: bool, n: int, args) -> list[Row]:
    """torch's context_parallel and yunchang on the same problem (neither takes document masks)."""
    rows = []
    if "cp" in peers and masked:  # no document or window mask through context_parallel's SDPA path
        rows.append(Row("torch_cp", "ring", "head-tail", problem.seq, n, 1, n, False,
                        note="not run: context_parallel shards SDPA, which takes no document / window mask here"))
    elif "cp" in peers:
        try:
            rows += context_parallel_rows(problem, args.iters, args.warmup, load_balance=True)
        except Exception as err:  # noqa: BLE001 — the experimental API changes between releases
            traceback.print_exc()
            rows.append(Row("torch_cp", "ring", "head-tail", problem.seq, n, 1, n, False, note=f"{type(err).__name__}: {err}"))
    if "yunchang" in peers and not masked:
        for u, r in dict.fromkeys(((n, 1), (2, n // 2), (1, n))):  # one row per distinct mesh
            rows += yunchang_rows(problem, u, r, args.iters, args.warmup)
    return rows


if __name__ == "__main__":
    main()
