"""Single-GPU benchmark (``python -m benchmarks --gpus 1``): each strategy's per-device work timed
alone on one GPU through the replay (``jax_impl.replay`` / ``torch_impl.replay``
``device_forward`` / ``device_backward`` of one virtual device — the block kernels, merges, casts
and accumulators that device runs, without its communication), next to the bare block kernels on
the whole problem.

Every row's path is verified first (``benchmarks.verify``): the same strategy, layout, backend and
dtype on a reduced problem through ``check_case`` in replay mode; a path that fails is a row marked
failing, never timed. The resolved kernel of each mask kind (``resolve_backend``) is in every row.

    python -m benchmarks --gpus 1 [--seq 32768] [--strategies zigzag-r2,...] [--frameworks jax,torch]
    python -m benchmarks --gpus 1 --dry-run      (the grid and what each row would verify, no GPU)
    python -m benchmarks --gpus 1 --smoke        (CPU: tiny sizes, portable kernel, every step run)

Timing: JAX — one jitted program per (device, pass), host clock around ``block_until_ready``;
torch — CUDA events (host clock on CPU). Median of ``--iters`` after ``--warmup``. A row's ms is
one device's forward, or forward + backward; TFLOP/s/GPU is the problem's FLOPs over devices,
divided by that time (the per-device share, so a balanced layout's row is comparable with a
multi-GPU row of the same mesh, minus communication).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from .common import Problem, Row, lay_out, row_problem
from .documents import DOCUMENT_LAYOUTS, verify_document_path

__all__ = ["STRATEGIES", "ReplaySpec", "main", "replay_rows"]


@dataclass(frozen=True)
class ReplaySpec:
    """One strategy of the grid: its name, mesh sizes and layout."""

    name: str
    ring: int = 1
    ulysses: int = 1
    outer: int = 1
    kv_exchange: str = "ring"
    layout: str = "zigzag"

    @property
    def devices(self) -> int:
        return self.ring * self.ulysses

    @property
    def strategy(self) -> str:
        if self.outer > 1:
            return "double_ring"
        if self.kv_exchange == "allgather":
            return "allgather"
        return "usp" if self.ring > 1 and self.ulysses > 1 else "ulysses" if self.ulysses > 1 else "ring"

    def shape(self):
        from parity.core.mesh import MeshShape

        return MeshShape(ring=self.ring, ulysses=self.ulysses, ring_outer=self.outer, kv_exchange=self.kv_exchange)


STRATEGIES = {s.name: s for s in (
    ReplaySpec("ring-r1", ring=1), ReplaySpec("zigzag-r2", ring=2), ReplaySpec("zigzag-r4", ring=4),
    ReplaySpec("zigzag-r8", ring=8),
    ReplaySpec("stripe-r4", ring=4, layout="stripe"), ReplaySpec("stripe-r8", ring=8, layout="stripe"),
    ReplaySpec("contiguous-r2", ring=2, layout="contiguous"), ReplaySpec("contiguous-r4", ring=4, layout="contiguous"),
    ReplaySpec("contiguous-r8", ring=8, layout="contiguous"),
    ReplaySpec("allgather-r4", ring=4, kv_exchange="allgather"), ReplaySpec("allgather-r8", ring=8, kv_exchange="allgather"),
    ReplaySpec("double-ring-2x2", ring=4, outer=2),
    ReplaySpec("ulysses-u4", ulysses=4), ReplaySpec("usp-r2xu2", ring=2, ulysses=2),
)}


def _mask_keywords(problem: Problem, spec: ReplaySpec, to_array) -> dict:
    """The replay's layout and mask keywords (``common.lay_out``, as the mesh rows): the static
    name the call passes, ``segment_ids`` in the spec's layout order and, for a per-row layout,
    ``token_index`` (through ``to_array``, the framework's array constructor), and ``window`` —
    each only when set. A per-row layout replays under the static name "contiguous" (which then
    only fixes seq's divisibility: the masks read the token indices)."""
    if spec.layout in DOCUMENT_LAYOUTS and problem.documents == "none":
        raise ValueError(f"--layout {spec.layout} needs --documents")
    laid = lay_out(problem, spec, spec.layout)
    kw = {"layout": laid.api_layout}
    kw.update({name: to_array(a) for name, a in (("segment_ids", laid.segment_ids), ("token_index", laid.token_index))
               if a is not None})
    if problem.window is not None:
        kw["window"] = problem.window
    return kw


# The default grid (the rows of the committed 2026-11-23 report); the others are for masked runs.
DEFAULT_STRATEGIES = ("zigzag-r2", "zigzag-r4", "zigzag-r8", "stripe-r4", "contiguous-r4", "allgather-r4",
                      "double-ring-2x2", "ulysses-u4", "usp-r2xu2")


def _median(times: list[float]) -> tuple[float, float]:
    return statistics.median(times), max(times) - min(times)


def _jax_timer(problem: Problem, spec: ReplaySpec, backend: str, devices_to_time, iters: int, warmup: int):
    """{device: (fwd ms list, bwd ms list)} for the JAX replay."""
    import functools

    import jax
    import jax.numpy as jnp

    from jax_impl import replay

    strategy = replay.Strategy(ring=spec.ring, ulysses=spec.ulysses, outer=spec.outer, kv_exchange=spec.kv_exchange)
    kw = {"strategy": strategy, "causal": problem.causal, "block_backend": backend,
          **_mask_keywords(problem, spec, jnp.asarray)}
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.dtype(problem.dtype)
    b, s, d = problem.batch, problem.seq, problem.head_dim
    q, do = (jax.random.normal(k_, (b, s, problem.heads, d), dt) for k_ in keys[:2])
    k, v = (jax.random.normal(k_, (b, s, problem.kv_heads, d), dt) for k_ in keys[2:])
    # The segment ids are a jitted argument, as in training (never a compile-time constant: XLA
    # would fold the run lists and the portable kernel's masks at compile time — minutes at 128k,
    # and a program that is not the one a training step runs).
    ids = kw.pop("segment_ids", None)
    index = kw.pop("token_index", None)  # the per-document zigzag's token indices: an argument too
    index_kw = {} if index is None else {"token_index": index}

    def program(fn, device=None):
        call = fn if device is None else functools.partial(fn, device)
        if index is None:
            return jax.jit(lambda ids, *args: call(*args, segment_ids=ids, **kw))
        return jax.jit(lambda ids, *args, token_index: call(*args, segment_ids=ids, token_index=token_index, **kw))


    def own_rows(device, o_d, lse_d):
        """The global (o, lse) a device's backward reads: only its own shard's rows and heads
        (``replay.device_backward`` slices them), so its own forward's output placed into zeros is
        exact — and no program of every device's forward (``replay_attention``) is compiled: at
        R 8 over 128k that one program alone outlasted a 300 s step on an H100 (2026-11-25)."""
        r, u = divmod(device, spec.ulysses)
        t, heads = s // spec.ring, strategy.head_groups(problem.heads, problem.kv_heads, u)[0]
        o = jnp.zeros((b, s, problem.heads, d), o_d.dtype).at[:, r * t:(r + 1) * t, heads].set(o_d)
        lse = jnp.zeros((b, problem.heads, s), lse_d.dtype).at[:, heads, r * t:(r + 1) * t].set(lse_d)
        return o, lse

    def clock(fn, *args):
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(1e3 * (time.perf_counter() - start))
        return times

    def compiled(fn, *args):
        """(the program compiled once, ahead of time, XLA's temporaries — outputs and arguments not
        counted — or None): the timed calls and the memory report share one compilation."""
        start = time.perf_counter()
        executable = fn.lower(*args, **index_kw).compile()
        try:
            temp = int(executable.memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 — not every backend reports it
            temp = None
        print(f"jax {spec.name} device program compiled in {time.perf_counter() - start:.1f} s", flush=True)
        return functools.partial(executable, **index_kw), temp

    # every device's programs compiled side by side (XLA compiles outside the GIL): at R 8 over
    # 128k a device's token-index programs take 15-50 s each on an H100 host, 16 of them in turn
    # outlasted a 570 s step (2026-11-26)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(devices_to_time)) as pool:
        forwards = dict(zip(devices_to_time, pool.map(
            lambda dev: compiled(program(replay.device_forward, dev), ids, q, k, v), devices_to_time)))
        saved = {dev: own_rows(dev, *forwards[dev][0](ids, q, k, v)) for dev in devices_to_time}  # o, lse
        backwards = dict(zip(devices_to_time, pool.map(
            lambda dev: compiled(program(replay.device_backward, dev), ids, q, k, v, *saved[dev], do),
            devices_to_time)))
    out = {}
    for device in devices_to_time:
        (fwd, fwd_temp), (bwd, bwd_temp), (o, lse) = forwards[device], backwards[device], saved[device]
        out[device] = (clock(fwd, ids, q, k, v), clock(bwd, ids, q, k, v, o, lse, do), (fwd_temp, bwd_temp),
                       _one_call_fields(replay.one_call_plan(device, q, segment_ids=ids, **index_kw, **kw)))
    return out


def _torch_timer(problem: Problem, spec: ReplaySpec, backend: str, devices_to_time, iters: int, warmup: int):
    """{device: (fwd ms list, bwd ms list)} for the torch replay (CUDA events on a GPU)."""
    import torch

    from torch_impl import replay

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    strategy = replay.Strategy(ring=spec.ring, ulysses=spec.ulysses, outer=spec.outer, kv_exchange=spec.kv_exchange)
    kw = {"strategy": strategy, "causal": problem.causal, "block_backend": backend,
          **_mask_keywords(problem, spec, lambda a: torch.as_tensor(a, device=device_type))}
    gen = torch.Generator(device=device_type).manual_seed(0)
    dt = getattr(torch, problem.dtype)
    b, s, d = problem.batch, problem.seq, problem.head_dim
    q, do = (torch.randn(b, s, problem.heads, d, generator=gen, device=device_type, dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, s, problem.kv_heads, d, generator=gen, device=device_type, dtype=dt) for _ in range(2))

    def clock(fn):
        with torch.no_grad():
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                if device_type == "cuda":
                    torch.cuda.synchronize()
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times.append(begin.elapsed_time(end))
                else:
                    start = time.perf_counter()
                    fn()
                    times.append(1e3 * (time.perf_counter() - start))
        return times

    def temporaries(fn):
        """Peak allocated during the call beyond what was allocated before it, less the call's
        outputs (as XLA's temp_size excludes them: the replay hands back every visited shard's
        float32 dK/dV, which the real loop keeps as one travelling pair)."""
        if device_type != "cuda":
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        outputs = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(result)
                      if isinstance(t, torch.Tensor))
        del result
        return int(peak - outputs)

    with torch.no_grad():
        o, lse = replay.replay_attention(q, k, v, **kw)
    out = {}
    for device in devices_to_time:
        run_fwd = lambda device=device: replay.device_forward(device, q, k, v, **kw)
        run_bwd = lambda device=device: replay.device_backward(device, q, k, v, o, lse, do, **kw)
        path = _one_call_fields(replay.one_call_plan(device, q, **kw))
        out[device] = (clock(run_fwd), clock(run_bwd), (temporaries(run_fwd), temporaries(run_bwd)), path)
    return out


def _one_call_fields(plan) -> dict:
    """A row's record of all-gather-KV's one varlen call (``replay.one_call_plan``): taken or not,
    and its runs and gathered keys."""
    return {"one_call": plan is not None} | ({} if plan is None else {"runs": len(plan.cu_q) - 1,
                                                                      "gathered_keys": plan.keys})


def _devices_to_time(spec: ReplaySpec, which: str) -> list[int]:
    if which == "all":
        return list(range(spec.devices))
    return sorted({0, spec.devices - 1})  # both ends: contiguous causal's lightest and heaviest device


def replay_rows(problem: Problem, spec: ReplaySpec, framework: str, backend: str, devices: str, which: str,
                iters: int, warmup: int, seed: int = 0) -> list[Row]:
    """Verify the path, then time each chosen device's forward and forward + backward."""
    from parity.probes.backend_sweep import resolved_backends

    from .verify import reduced_case, verify_path

    per_document = spec.layout in DOCUMENT_LAYOUTS
    # the parity case of the path (the per-document zigzag: its static stand-in, for the resolved
    # kernels; a balance mix: the harness's "mix" pattern)
    case = reduced_case(spec.shape(), "contiguous" if per_document else spec.layout, problem)
    resolved_case = replace(case, token_index=True) if per_document else case  # its blocks' masks
    extra = {"block_backend": backend, "strategy_name": spec.name, "heads": problem.heads,
             "kv_heads": problem.kv_heads, "resolved": resolved_backends(framework, backend, resolved_case, devices),
             "documents": problem.documents, "window": problem.window,
             "verified_as": f"{spec.layout} replay vs the float64 oracle, 2048 tokens" if per_document
             else case.name}
    began = time.perf_counter()
    try:
        if per_document:
            verdict = verify_document_path(framework, problem, spec.ring, spec.ulysses, spec.outer, spec.kv_exchange,
                                           backend, devices, seed=seed, layout=spec.layout)
        else:
            verdict = verify_path(framework, case, backend, devices, replay=True, seed=seed)
    except Exception as err:  # noqa: BLE001 — a path that cannot be checked is not verified
        verdict = (False, f"verification raised {type(err).__name__}: {err}")
    print(f"{framework} {spec.name} {backend}: verification {verdict} ({time.perf_counter() - began:.0f} s)",
          flush=True)

    def row(device, fwd_only):
        return Row(f"{framework}_impl_replay", spec.strategy, spec.layout, problem.seq, spec.devices, spec.ulysses,
                   spec.ring, fwd_only, extra={**extra, "replay_device": device}, verified=verdict[0])

    chosen = _devices_to_time(spec, which)
    if not verdict[0]:
        from .verify import mark

        return [mark(row(d, f), verdict) for d in chosen for f in (True, False)]
    timer = _jax_timer if framework == "jax" else _torch_timer
    rows = []
    try:
        measured = timer(problem, spec, backend, chosen, iters, warmup)
    except Exception as err:  # noqa: BLE001 — a failing configuration is a row, not a crash
        traceback.print_exc()
        return [Row(f"{framework}_impl_replay", spec.strategy, spec.layout, problem.seq, spec.devices, spec.ulysses,
                    spec.ring, f, extra=extra, verified=verdict[0], note=f"{type(err).__name__}: {str(err)[:200]}")
                for f in (True, False)]
    share = spec.devices
    from seqplan.layouts import ring_positions

    # each virtual device's queries: ring shard device // U (original positions; TFLOP/s on its own pairs)
    if per_document:
        shard_positions = lay_out(problem, spec, spec.layout).token_index[0].reshape(spec.ring, -1)
    else:
        shard_positions = ring_positions(spec.layout, spec.ring, problem.seq // spec.ring)
    # busiest / mean device fwd+bwd time over the devices timed (every one with --replay-devices all)
    totals = {d: _median([a + b for a, b in zip(fwd, bwd)])[0] for d, (fwd, bwd, *_) in measured.items()}
    time_balance = max(totals.values()) / (sum(totals.values()) / len(totals))
    for device, (fwd, bwd, temps, *path) in measured.items():
        bare = _bare_kernels(framework, backend, spec, problem, device, iters, warmup)
        for fwd_only in (True, False):
            r = row(device, fwd_only)
            times = fwd if fwd_only else [a + b for a, b in zip(fwd, bwd)]
            r.ms_per_iter, r.ms_spread = _median(times)
            r.tflops_per_gpu = problem.flops(fwd_only) / share / (r.ms_per_iter * 1e-3) / 1e12
            own = problem.own_flops(shard_positions[device // spec.ulysses], 1 / spec.ulysses, fwd_only)
            r.extra = {**r.extra, "tflops_own_pairs": own / (r.ms_per_iter * 1e-3) / 1e12,
                       "time_balance": time_balance, "time_balance_devices": sorted(totals), **(path[0] if path else {})}
            temp = temps[0] if fwd_only else (None if None in temps else max(temps))
            floor = problem.min_bytes_per_device(spec.devices, fwd_only)
            r.extra = {**r.extra, "temporaries_mb": None if temp is None else temp / 2**20,
                       "temporaries_vs_floor": None if temp is None else temp / floor}
            if bare is not None:
                kernels = bare["kernels_fwd_ms" if fwd_only else "kernels_fwd_bwd_ms"]
                r.extra = {**r.extra, "kernels_ms": kernels, "replay_efficiency": kernels / r.ms_per_iter,
                           "block_calls": bare["calls"]}
            rows.append(r)
    return rows


def _bare_kernels(framework, backend, spec, problem, device, iters, warmup) -> dict | None:
    """The device's block calls timed alone (``benchmarks.efficiency``); None for masked problems."""
    if problem.documents != "none" or problem.window is not None:
        return None
    from .efficiency import kernels_ms

    try:
        return kernels_ms(framework, backend, spec, problem, device, iters, warmup)
    except Exception:  # noqa: BLE001 — the row keeps its timing; the efficiency is missing, said in the log
        traceback.print_exc()
        return None


def kernel_rows(problem: Problem, framework: str, backend: str, devices: str, iters: int, seed: int) -> list[Row]:
    """The bare block kernel that ``backend`` resolves to for the problem's diagonal mask, on the
    whole problem (one block of ``seq`` tokens), verified first at 1024-token blocks
    (``parity.probes.kernels``)."""
    from parity.probes import kernels
    from parity.probes.backend_sweep import resolved_backends

    from .verify import reduced_case

    mask = "causal" if problem.causal else "full"
    case = reduced_case(STRATEGIES["zigzag-r2"].shape(), "zigzag", problem)
    name = resolved_backends(framework, backend, case, devices).get(mask, backend)
    subject = kernels.cases(1024, {framework: (name,)}, [problem.dtype], [problem.head_dim])
    results = kernels.verify([c for c in subject if c.mask == mask and (c.heads, c.kv_heads) == (8, 8)], seed,
                             lambda *_: None)
    ok = bool(results) and all(r.status == "pass" for r in results)
    rows = []
    for fwd_only in (True, False):
        r = Row(f"{framework}_kernel", "single", "-", problem.seq, 1, 1, 1, fwd_only,
                extra={"block_backend": name, "resolved": {mask: name}}, verified=ok)
        if not ok:
            r.note = "NOT VERIFIED, not timed: " + "; ".join(sorted({x.status for x in results if x.status != "pass"}))[:200]
        elif name in kernels.UNTIMED:
            r.note = f"not timed: {kernels.UNTIMED[name]}"
        else:
            t = kernels.time_block(framework, name, kernels.Mask(mask), problem.seq, problem.heads, problem.head_dim,
                                   problem.dtype, iters, seed)
            label = "fwd" if fwd_only else "fwd_bwd"
            r.ms_per_iter, r.ms_spread = t[f"{label}_ms"], t[f"{label}_spread_ms"]
            r.tflops_per_gpu = t[f"{label}_tflops"]
        rows.append(r)
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks --gpus 1", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--documents", default="none",
                    help="packed documents: a parity.core.documents pattern drawn at seed 0 (e.g. mix) or a "
                         "parity.probes.balance.BENCHMARK_MIXES name (short, heavy-tail, few-long, quarter-capped); "
                         "TFLOP/s count the mask area")
    ap.add_argument("--layout", default=None,
                    help="comma-separated layouts every strategy runs in instead of its own: contiguous, zigzag, "
                         "stripe, document-zigzag, document-hybrid (the per-row layouts pass explicit token "
                         "indices; they need --documents)")
    ap.add_argument("--window", type=int, default=None, help="sliding window left extent (right 0)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help=f"comma-separated of {sorted(STRATEGIES)} (default: {','.join(DEFAULT_STRATEGIES)})")
    ap.add_argument("--frameworks", default="jax,torch")
    ap.add_argument("--backend", default="auto", help="block backend of both frameworks (default: auto)")
    ap.add_argument("--replay-devices", choices=("ends", "all"), default="ends",
                    help="time virtual devices 0 and R·U-1 (default) or every one")
    ap.add_argument("--per-device-tokens", default="",
                    help="comma-separated tokens per virtual device: each strategy runs at seq = tokens × its devices "
                         "(instead of --seq), e.g. 8192,32768 (issue 28's grid)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-kernels", action="store_true", help="skip the bare-kernel rows")
    ap.add_argument("--dry-run", action="store_true", help="print the grid and the verification cases; run nothing")
    ap.add_argument("--partial", default=None, help="rewrite this JSON file with the rows so far after each strategy")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: 256 tokens, 4 heads (2 kv), d 16")
    return ap


def main(argv=None) -> list[Row]:
    a = build_parser().parse_args(argv)
    if a.smoke:
        a.seq, a.heads, a.kv_heads, a.head_dim, a.iters, a.warmup = 256, 4, 2, 16, 2, 1
    import torch

    from parity.core.devices import configure_jax_devices

    devices = "gpu" if torch.cuda.is_available() else "cpu"
    configure_jax_devices(devices)
    masks = dict(documents=a.documents, window=None if a.window is None else (a.window, 0))
    shape = dict(heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype, causal=not a.full)
    problem = Problem(seq=a.seq, **shape, **masks)
    specs = [STRATEGIES[n] for n in a.strategies.split(",") if n]
    if a.layout is not None:
        layouts = [name for name in a.layout.split(",") if name]
        for name in layouts:
            if name not in ("contiguous", "zigzag", "stripe", *DOCUMENT_LAYOUTS):
                raise SystemExit(f"--layout takes contiguous, zigzag, stripe, {', '.join(DOCUMENT_LAYOUTS)}; "
                                 f"got {name!r}")
            if name in DOCUMENT_LAYOUTS and a.documents == "none":
                raise SystemExit(f"--layout {name} needs --documents")
        specs = [replace(spec, name=f"{spec.name}:{name}", layout=name) for spec in specs for name in layouts]
    frameworks = [f for f in a.frameworks.split(",") if f]
    per_device = [int(t) for t in a.per_device_tokens.split(",") if t]
    # (problem, spec) pairs: one problem for the grid, or seq = tokens × devices per strategy
    grid = [(Problem(seq=t * spec.devices, **shape, **masks), spec) for t in per_device for spec in specs] \
        if per_device else [(problem, spec) for spec in specs]
    # the per-document zigzag: each strategy's ids fitted to its ring (benchmarks.documents)
    grid = [(row_problem(prob, spec, spec.layout), spec) for prob, spec in grid]
    if a.dry_run:
        from .verify import reduced_case

        for prob, spec in grid:
            case = reduced_case(spec.shape(), "contiguous" if spec.layout in DOCUMENT_LAYOUTS else spec.layout, prob)
            print(f"{spec.name:16s} devices {spec.devices}: time devices {_devices_to_time(spec, a.replay_devices)} "
                  f"of {prob.seq} tokens; verify {case.name} (replay) for {frameworks} backend {a.backend}")
        return []
    for prob, spec in grid:
        print(prob.floor_arithmetic(spec.devices, False), flush=True)
    rows = []
    for framework in frameworks:
        if not a.no_kernels:
            rows += kernel_rows(problem, framework, a.backend, devices, a.iters, 0)
        for prob, spec in grid:
            new = replay_rows(prob, spec, framework, a.backend, devices, a.replay_devices, a.iters, a.warmup)
            rows += new
            for r in new:
                print(f"{r.framework} {spec.name} {prob.seq} dev {r.extra.get('replay_device')} "
                      f"{'fwd' if r.fwd_only else 'fwd+bwd'} {r.ms_per_iter} ms verified={r.verified} "
                      f"efficiency={r.extra.get('replay_efficiency')} temporaries/floor="
                      f"{r.extra.get('temporaries_vs_floor')} {r.note[:100]}", flush=True)
            if a.partial:  # what is done survives a step's time limit
                Path(a.partial).write_text(json.dumps([r.to_dict() for r in rows]))
    return rows
