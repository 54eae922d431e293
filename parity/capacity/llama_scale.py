"""The whole model on several devices, timed (torch): one training step per strategy next to the
accounting model's prediction from C and W measured in the same run, and the B* sweep.

    python -m parity.capacity.llama_scale --devices gpu --out DIR
        [--strategies zigzag,ulysses,allgather] [--seq 65536,131072] [--batches 1,2,4]
    python -m parity.capacity.llama_scale --devices cpu --small --out DIR   # the same code on gloo
    python -m parity.capacity.llama_scale --framework jax ...   # the JAX twin (llama_scale_jax)

Per strategy and sequence length, on a world of N ranks (every GPU; 2 gloo ranks on the CPU):
- **measured**: the median step (forward, backward, FSDP reduce-scatter, Adam) of
  ``parity.training.llama_torch``'s model — FSDP over every rank, the attention's mesh the
  strategy's, weights and activations in ``--dtype`` — behind a barrier, the slowest rank's time;
  peak memory per device; the first step's collectives traced (``CommTracer``).
- **the model's bytes**: ``llama_step_traffic(case, "torch", dtype)``, equal to the trace per pass
  and kind (``traffic_equal``) — the prediction below reads these bytes, so they are checked first.
- **predicted**: T_math = matmul FLOPs / N / C + attention FLOPs / N / C_attn + memory bytes /
  W_hbm (``parity.training.step_model``: torch's memory-bound kernels — norms, RoPE, SwiGLU, the
  casts, the loss over [tokens, vocab], Adam on the device's 1/N of the weights); T_comm = Σ over
  kinds of bytes / W[kind]; ``predicted_s`` = max(host floor, T_math + Σ T_comm[kind] × the
  kind's exposed fraction) — in JAX's twin the floor's excess over its own math adds instead
  (:data:`FIXED_COST_ADDS`) — the bounds ``bound_overlap_s`` = max(T_math, T_comm) and
  ``bound_serial_s`` = their sum. Calibrated in the same run, never on a row it predicts: C (bf16
  n³ matmul), W_hbm (a large elementwise copy) and W (per collective kind, bytes per device as
  docs/contract.md counts them) by ``calibrate.profile_task``; C_attn, the resolved causal block
  kernel alone on the row's B rows of T/N tokens (``llama_gpu.attention_rate``, rank 0's rate);
  the exposed fractions from a CUDA profile of each strategy's step at ``exposure_seq``
  (``exposure``); the host floor, each strategy's step at ``host_seq`` tokens (with one more
  step under cProfile on rank 0: ``-host-STRATEGY.txt``, where a floor's time goes).

B* (``critical_batch``): with B rows of T tokens, FLOPs, the activations' memory traffic and the
attention's K/V bytes grow with B while the FSDP weight bytes and Adam's traffic do not, so
T_math = m + a·B and T_comm = c + y·B (affine: checked on the model itself, ``affine_in_batch``).
The step turns compute-bound at B* = (c − m) / (a − y) ("sum": all traffic serial on the links,
compute overlapping it) or (c − m) / a ("max": each kind on its own link), 0 when m ≥ c already,
infinite when a ≤ y (attention traffic alone outgrows compute). The host floor adds its own
B* (T_math reaching it); ``predicted_bstar`` is the larger. The sweep times B = 1, 2, 4, … rows of
``bstar_seq`` tokens; its knee (:func:`knee`) is measured and predicted alike. Rows go to
``emit`` (the CLI: a ``-rows.jsonl`` file) as each finishes.

Rows are one-document batches (``llama_gpu.one_document``): every block runs the fused kernels
and FLOPs are exactly affine in B. docs/model.md says how to read the file.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..accounting.model import Traffic
from ..core.mesh import MeshShape
from ..runners.torch_runner import world_backend
from ..runners.torch_world import close_worlds, get_world
from ..training.llama import FSDP_UNITS, LlamaConfig, ModelCase, TokenBatch, packed_corpus, step_flops
from ..training.llama_gpu import GPU_MODEL, attention_rate, one_document
from ..training.llama_traffic import llama_step_traffic
from .calibrate import SMALL, Sizes, hardware_profile, median_seconds, profile_task, slowest
from .exposure import SERIAL, fractions

LAYOUTS = {"zigzag": "zigzag", "stripe": "stripe", "contiguous": "contiguous", "ulysses": "zigzag",
           "allgather": "zigzag", "usp": "zigzag"}  # strategy -> the layout its tokens are permuted into
USP_ULYSSES = 2  # USP's Ulysses degree: the rest of the devices form its ring (4 devices: 2 × 2)


def strategy_mesh(name: str, world: int) -> MeshShape:
    """The attention mesh of strategy ``name`` over ``world`` devices (no data axis: B* grows B);
    USP: Ulysses over :data:`USP_ULYSSES` devices, a zigzag ring over the rest (at least 2)."""
    if name not in LAYOUTS:
        raise ValueError(f"strategy must be one of {sorted(LAYOUTS)}, got {name!r}")
    if name == "ulysses":
        return MeshShape(ulysses=world)
    if name == "usp":
        if world % USP_ULYSSES or world // USP_ULYSSES < 2:
            raise ValueError(f"usp needs a multiple of {USP_ULYSSES} devices, at least {2 * USP_ULYSSES} "
                             f"(Ulysses {USP_ULYSSES} × a ring of 2 or more), got {world}")
        return MeshShape(ring=world // USP_ULYSSES, ulysses=USP_ULYSSES)
    return MeshShape(ring=world, kv_exchange="allgather" if name == "allgather" else "ring")


@dataclass(frozen=True)
class ScaleRun:
    """What one invocation measures.

    model:      the decoder (default: the GPU-sized one of ``llama_gpu``; ``--small``: the tiny one).
    strategies: names of ``LAYOUTS`` (zigzag, stripe, contiguous ring; ulysses; all-gather KV; usp,
                from 4 devices).
    seqs:       tokens per row T (global, over all devices); each strategy × T timed at one row.
    bstar_seq, batches: the B* sweep — the first strategy at T = ``bstar_seq`` with B rows. Short
                rows: the GPU-sized model is compute-bound at one row of 16k tokens already
                (predicted B* ≈ 0.1 row there, ≈ 7 rows of 512, on the 2026-11-22 H200
                calibration), so the knee is only visible where B·T is a few thousand tokens.
    dtype:      the model's dtype (weights, activations, gradients on the wire).
    fsdp_units: torch's FSDP2 units (``ModelCase.fsdp_units``): ``"block"``, as torchtitan wraps a
                model (the 2026-11-26/27 GPU rows ran ``"weight"``, 39 units: a 180–230 ms host
                floor on 4 GPUs); ``--fsdp-units weight`` repeats those.
    block_backend: the attention's block kernel ("auto": the routing table).
    warmup, iters: steps not timed, and timed (the median is reported).
    sizes:      calibration sizes (``calibrate.Sizes``) for C and W.
    exposure_seq: T of each strategy's calibration step for the exposed fractions (one row; default
                half the shortest of ``seqs``; never a timed row's T).
    host_seq:   T of each strategy's host-floor step (one row; never a timed row's T): eager torch
                issues every kernel from Python, and FSDP2 adds hooks per unit, so a step is never
                shorter than its host's work — measured on a row too short to keep the GPUs busy.
    verify_seq: T of each strategy's check before it is timed (one row): the same step — mesh,
                FSDP, dtype, kernels — against the float64 non-parallel step (``verdict``).
    segment_ids: the rows (one document each) passed with their segment ids (``ModelCase.segment_ids``;
                ``--segment-ids``): the packed-training program, its blocks on the document path. By
                default none are passed — the same mask, on the plain causal kernels whose rate
                C_attn measures: torch dropped one-document ids after a host copy of them every call
                (a sync that held the 64k rows 13–17 % over the prediction, 4x H200, 2026-11-27), JAX
                cannot look at traced ids and ran the document path, whose 2-GPU step compiled in
                277–291 s against 36–54 s for one GPU (2x H200, 2026-11-28).
    """

    model: LlamaConfig = GPU_MODEL
    strategies: tuple[str, ...] = ("zigzag", "ulysses", "allgather")
    seqs: tuple[int, ...] = (65536, 131072)
    bstar_seq: int = 512
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    dtype: str = "bfloat16"
    fsdp_units: str = "block"
    block_backend: str = "auto"
    warmup: int = 2
    iters: int = 5
    sizes: Sizes = Sizes()
    exposure_seq: int | None = None
    host_seq: int = 256
    verify_seq: int = 1024
    segment_ids: bool = False


SMALL_RUN = ScaleRun(model=LlamaConfig(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, head_dim=8, d_ff=64),
                     strategies=("zigzag", "ulysses"), seqs=(64,), bstar_seq=32, batches=(1, 2), dtype="float32",
                     warmup=1, iters=2, sizes=SMALL, exposure_seq=16, host_seq=8, verify_seq=16)


def model_case(run: ScaleRun, strategy: str, seq: int, batch: int, world: int) -> ModelCase:
    return ModelCase(run.model, strategy_mesh(strategy, world), fsdp=True, layout=LAYOUTS[strategy], batch=batch,
                     seq=seq, fsdp_units=run.fsdp_units, segment_ids=run.segment_ids)


def rows_of_one_document(case: ModelCase) -> TokenBatch:
    """The case's batch (original order), each row one document."""
    return one_document(packed_corpus(case.model, case.batch, case.seq, case.seed + 1))


def host_profile(step, sync, top: int = 30) -> str:
    """One ``step`` under cProfile (``sync`` after it, inside the profile: the time the host waits
    for the device shows as the sync's): the functions by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    sync()
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
    return text.getvalue()


def timed_step_task(case: ModelCase, device_type: str, dtype: str, warmup: int, iters: int,
                    profile_host: bool = False) -> dict:
    """Runs on every rank: the first step traced, then ``iters`` steps timed (slowest rank);
    ``profile_host``: then one more step under cProfile (``host_profile``, rank 0's kept)."""
    import torch
    import torch.distributed as dist

    from ..accounting.torch_trace import CommTracer
    from ..training.llama_torch import Rig

    rig = Rig(case, device_type, dtype, rows_of_one_document(case))
    with CommTracer() as tracer:
        rig.step(tracer, keep_grads=False)
    untraced = CommTracer()  # never entered: its phases only label
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = slowest(median_seconds(lambda: rig.step(untraced, keep_grads=False), device_type, warmup, iters))
    peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else None
    out = {"seconds": seconds, "peak_bytes": peak, "traffic": tracer.traffic.rows()}
    if profile_host:
        sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
        text = host_profile(lambda: rig.step(untraced, keep_grads=False), sync)
        out["host_profile"] = text if dist.get_rank() == 0 else None
    return out


def exposure_task(case: ModelCase, device_type: str, dtype: str, warmup: int) -> dict:
    """Runs on every rank: ``warmup`` steps, then one step's collectives against its compute
    (``exposure.exposed_times``); on gloo nothing to profile (``None``, no step run)."""
    import torch

    from ..accounting.torch_trace import CommTracer
    from ..training.llama_torch import Rig
    from .exposure import exposed_times, profiled_kernels, send_recv_kinds

    if device_type != "cuda":
        return None
    rig = Rig(case, device_type, dtype, rows_of_one_document(case))
    untraced = CommTracer()
    for _ in range(max(1, warmup)):
        rig.step(untraced, keep_grads=False)
    kinds = {kind for _, kind in llama_step_traffic(case, "torch", dtype).rows()}
    kernels = profiled_kernels(lambda: rig.step(untraced, keep_grads=False), torch.cuda.synchronize)
    return exposed_times(kernels, send_recv_kinds(kinds))


def verify_task(case: ModelCase, device_type: str, dtype: str) -> dict:
    """Runs on every rank: one step of the timed rig with its gradients kept — this rank's loss
    share, and on rank 0 the full gradients by weight name (for :func:`verdict`)."""
    import torch.distributed as dist

    from ..accounting.torch_trace import CommTracer
    from ..training.llama_torch import Rig, full_grads

    rig = Rig(case, device_type, dtype, rows_of_one_document(case))
    loss, grads = rig.step(CommTracer(), keep_grads=True)  # the tracer is never entered: its phases only label
    grads = full_grads(grads, case.model)  # every rank: FSDP's gathers are collectives
    return {"loss": loss, "grads": grads if dist.get_rank() == 0 else None}


def verdict(case: ModelCase, dtype: str, loss: float, grads: dict) -> dict:
    """A parallel step's loss and gradients (``case``'s one-document batch) against the float64
    non-parallel torch step on the same ``dtype``-rounded weights, under the numerics policy for
    ``dtype`` (its control: the same non-parallel step in ``dtype``). On the host's CPU."""
    import torch

    from ..core.numerics import check_tensor, step_verdict
    from ..training.llama_gpu import loss_and_grads, rounded

    weights, batch = rounded(case.inputs()[0], dtype), rows_of_one_document(case)
    step = lambda torch_dtype: loss_and_grads(case, weights, torch_dtype, packed=False, device="cpu", batch=batch)
    ref_loss, ref = step(torch.float64)
    ctl_loss, ctl = (None, {}) if dtype == "float32" else step(getattr(torch, dtype))
    checks = [check_tensor("loss", [loss], [ref_loss], dtype, control=None if ctl_loss is None else [ctl_loss])]
    checks += [check_tensor(n, grads[n], ref[n], dtype, control=ctl.get(n)) for n in ref]
    return {"seq": case.seq, **step_verdict(checks), "loss": loss, "loss_ref": ref_loss}


def whole_step(rows: dict) -> dict:
    """Per-(pass, kind) rows summed over the passes: {("step", kind): (calls, bytes)} — what one
    compiled program of the whole step shows (``count_collectives(text, "step")``)."""
    total = Traffic()
    for (_, kind), (calls, nbytes) in rows.items():
        total.add("step", kind, nbytes, calls)
    return total.rows()


def traffic_differences(model_rows: dict, traced_rows: dict, scope: str = "per pass") -> dict:
    """{"pass/kind": {"model": [calls, bytes], "traced": [calls, bytes]}} for every (pass, kind),
    or with ``scope`` "whole step" every kind over the whole step (a trace read from the step's
    program alone), where the model's calls or bytes differ from the trace's; empty when equal."""
    if scope not in ("per pass", "whole step"):
        raise ValueError(f"scope is 'per pass' or 'whole step', got {scope!r}")
    nonzero = lambda rows: {k: (int(c), float(b)) for k, (c, b) in rows.items() if c or b}
    collapse = whole_step if scope == "whole step" else (lambda rows: rows)
    model, traced = nonzero(collapse(model_rows)), nonzero(collapse(traced_rows))
    return {"/".join(key): {"model": list(model.get(key, (0, 0.0))), "traced": list(traced.get(key, (0, 0.0)))}
            for key in sorted(model.keys() | traced.keys()) if model.get(key) != traced.get(key)}


def traffic_equal(model_rows: dict, traced_rows: dict, scope: str = "per pass") -> bool:
    """The model's (calls, bytes) equal the trace's, exactly: per (pass, kind), or with ``scope``
    "whole step" per kind over the whole step (:func:`traffic_differences` empty)."""
    return not traffic_differences(model_rows, traced_rows, scope)


# Where a framework's fixed per-step cost adds to the math instead of hiding it. A compiled JAX step
# is one dispatch: XLA's per-execution host work runs before the first kernel (1.5-1.9 ms on 2x H200),
# and the FSDP pipeline's first gathers and last reduce-scatters, the copies and the idle gaps do not
# shrink as B grows — traced from 256 to 16k tokens a step, the step minus its compute kernels stayed
# 6.1-6.3 ms while the exposed NCCL time fell from 4.9 to 2.2 ms (docs/gpu/llamajax-profile-2026-11-29-h200x2.md).
# The floor step measures that cost at once: the twin's step is floor − T_math(floor) + T_math. Eager
# torch issues kernels while the GPU runs earlier ones: its floor is a floor (the larger of the two).
FIXED_COST_ADDS = frozenset({"jax"})


def predict(case: ModelCase, dtype: str, profile: dict, c_attention: float, exposed: dict | None = None,
            host_s: float = 0.0, framework: str = "torch", floor_math_s: float | None = None) -> dict:
    """T_math, T_comm (seconds per device) of one step of ``case`` from the model's FLOPs and
    bytes: T_math = matmul FLOPs / N / C + attention FLOPs / N / C_attn + memory bytes / W_hbm
    (``step_model``: torch's memory-bound kernels on the device's tokens, Adam on its 1/N of the
    weights — FSDP; ``profile["hbm"]``, measured by ``calibrate.profile_task``); T_comm = Σ over
    kinds of bytes / W[kind]. Bounds: ``bound_overlap_s`` = max(T_math, T_comm) (every transfer
    hidden), ``bound_serial_s`` = their sum (none hidden); ``predicted_s`` = T_math + Σ over kinds
    of T_comm[kind] × ``exposed[kind]`` — the fraction a calibration step left exposed
    (``exposure``; a kind without one counts whole) — or the host's floor ``host_s`` where that
    is longer (``step_model.StepPrediction``'s rule). With ``floor_math_s`` (T_math of the floor
    step itself; :data:`FIXED_COST_ADDS`) the floor's excess over its own math is a fixed cost
    that adds: ``predicted_s`` = ``fixed_s`` + T_math, ``fixed_s`` = ``host_s`` − ``floor_math_s``.
    ``predicted_exposure_s`` = T_math + the exposed part, without any floor, in every row."""
    from ..training import step_model as sm

    if "hbm" not in profile:
        raise ValueError("the profile has no 'hbm' (bytes/s of a large elementwise copy): calibrate again "
                         "(calibrate.profile_task measures it) or add one")
    flops = step_flops(case.model, rows_of_one_document(case))
    n = case.mesh.devices
    matmul_s = (flops["matmul_fwd"] + flops["matmul_bwd"]) / n / profile["flops"]
    attention_s = (flops["attention_fwd"] + flops["attention_bwd"]) / n / c_attention
    tokens = case.batch * case.seq // n
    memory = sm.memory_bytes(sm.memory_passes(case.model, tokens, framework, dtype, shards=n))["total"]
    memory_s = memory / profile["hbm"]
    math_s = matmul_s + attention_s + memory_s
    comm_by_kind: dict[str, float] = {}
    for (_, kind), (_, b) in llama_step_traffic(case, framework, dtype).rows().items():
        comm_by_kind[kind] = comm_by_kind.get(kind, 0.0) + float(b) / profile["bandwidth"][kind]
    comm_s = sum(comm_by_kind.values())
    exposed_s = sum(t * (exposed or {}).get(kind, 1.0) for kind, t in comm_by_kind.items())
    fixed_s = None if floor_math_s is None else host_s - floor_math_s
    return {"t_math_s": math_s, "t_matmul_s": matmul_s, "t_attention_s": attention_s, "t_memory_s": memory_s,
            "memory_bytes_per_device": memory, "t_comm_s": comm_s, "t_comm_by_kind_s": comm_by_kind,
            "t_comm_exposed_s": exposed_s, "bound_overlap_s": max(math_s, comm_s), "bound_serial_s": math_s + comm_s,
            "host_floor_s": host_s, "fixed_s": fixed_s, "predicted_exposure_s": math_s + exposed_s,
            "predicted_s": max(host_s, math_s + exposed_s) if fixed_s is None else fixed_s + math_s,
            "flops_per_device": sum(flops.values()) / n}


def affine_in_batch(run: ScaleRun, strategy: str, seq: int, world: int, profile: dict, c_attention: float,
                    batches=(1, 2, 3), exposed: dict | None = None,
                    framework: str = "torch") -> tuple[float, float, float, float]:
    """(m, a, c, y) with T_math = m + a·B and T_comm = c + y·B from B = 1 and 2, after checking
    the model is exactly affine in B at every other B of ``batches`` (ValueError otherwise). m:
    the memory-bound work that does not grow with the batch (Adam over the device's weights, the
    embedding's gradient buffer). ``exposed``: fractions per kind — T_comm is then the exposed
    part (``predict``'s ``t_comm_exposed_s``)."""
    p = {b: predict(model_case(run, strategy, seq, b, world), run.dtype, profile, c_attention, exposed,
                    framework=framework) for b in sorted({1, 2, *batches})}
    comm = "t_comm_s" if exposed is None else "t_comm_exposed_s"
    a = p[2]["t_math_s"] - p[1]["t_math_s"]
    m = p[1]["t_math_s"] - a
    y = p[2][comm] - p[1][comm]
    c = p[1][comm] - y
    for b in p:
        if not (math.isclose(p[b]["t_math_s"], m + a * b, rel_tol=1e-9)
                and math.isclose(p[b][comm], c + y * b, rel_tol=1e-9)):
            raise ValueError(f"the step's model is not affine in the batch at B={b}: {p[b]}")
    return m, a, c, y


def critical_batch(a: float, c: float, y: float, overlap: str = "sum", m: float = 0.0) -> float:
    """B* (rows): the smallest B ≥ 0 at which T_math = m + a·B reaches the communication: c + y·B
    ("sum") or the larger of the weights' c and the attention's y·B ("max"); infinite when no B
    gets there. m = 0 is the compute-only model (T_math = a·B: B* = c / (a − y) or c / a)."""
    if overlap == "sum":
        if a > y:
            return max(0.0, (c - m) / (a - y))
        return 0.0 if m >= c else math.inf
    if overlap == "max":
        if a >= y:
            return max(0.0, (c - m) / a)
        b = max(0.0, (c - m) / a)  # then m + aB ≥ yB holds only up to m / (y − a)
        return b if b <= m / (y - a) else math.inf
    raise ValueError(f"overlap must be 'sum' or 'max', got {overlap!r}")


def calibration_seqs(run: ScaleRun) -> tuple[int, int]:
    """(exposure T, host-floor T) of the calibration steps: ``run.exposure_seq`` (else half the
    shortest timed T) and ``run.host_seq`` — never a row the run predicts (``ValueError``)."""
    exposure = run.exposure_seq or min(run.seqs) // 2
    timed = {*run.seqs, run.bstar_seq}
    for name, seq in (("exposure_seq", exposure), ("host_seq", run.host_seq)):
        if seq in timed:
            raise ValueError(f"{name} {seq} is a timed row's T ({run.seqs}, B* sweep {run.bstar_seq}): a "
                             "prediction must come from steps it is not checked against")
    return exposure, run.host_seq


def host_floor_seconds(time_once, times: int = 2) -> tuple[float, list[float]]:
    """(the faster, every timing) of ``times`` timings of a host-floor step (``time_once()``:
    seconds). Timed once, right after a check, torch's floor ran slower than the rows it bounds
    (the FSDP × TP step on 4x H200, 2026-11-27: 33.6 ms against 26.1-27.4 at 64-2048 tokens; the
    whole model's 87.7 ms floor above its 82.4 ms 16k row)."""
    timings = [time_once() for _ in range(times)]
    return min(timings), timings


def knee(batches, seconds) -> int:
    """The smallest B whose time per row is within 10 % of the sweep's best time per row."""
    per_row = [s / b for b, s in zip(batches, seconds)]
    return next(b for b, t in zip(batches, per_row) if t <= 1.1 * min(per_row))


def measure(run: ScaleRun, devices: str, world: int | None = None, emit=None) -> dict:
    """Calibrate, time every strategy × T at one row, then the B* sweep. The result dict; each
    row also goes to ``emit(row)`` as it is measured. A row that fails is kept as
    ``{"error": ...}`` and the run goes on."""
    import torch

    backend, device_type = world_backend(devices)
    world = world or (torch.cuda.device_count() if devices == "gpu" else 2)
    if world < 2:
        raise ValueError(f"the whole model over several devices needs at least 2, found {world}")
    for strategy in run.strategies:  # a strategy the world cannot hold fails before any rank starts
        strategy_mesh(strategy, world)
    exposure_seq, host_seq = calibration_seqs(run)
    emit = emit or (lambda row: None)
    ranks = get_world(world, backend)
    profile = ranks.run(profile_task, run.sizes, device_type)[0]
    c = run.model
    device_name = torch.cuda.get_device_name(0) if devices == "gpu" else "CPU"
    kernels: dict[tuple[int, int], tuple[str, float]] = {}

    def kernel(seq: int, batch: int) -> tuple[str, float]:
        """(kernel, C_attn) of one device's causal block of ``batch`` rows of seq / N tokens, timed
        alone — on the ranks, each on its own device, as C was (the parent holds no GPU memory)."""
        if (seq, batch) not in kernels:
            kernels[seq, batch] = ranks.run(attention_rate, run.block_backend, seq // world, c.heads, c.head_dim,
                                            device_type, run.dtype, batch)[0]
        return kernels[seq, batch]
    emit({"hardware": hardware_profile(f"llama-scale-{devices}{world}", "python -m parity.capacity.llama_scale",
                                       profile, device_name, world, run.sizes, f"torch {torch.__version__}")})
    exposures: dict[str, dict] = {}
    floors: dict[str, float] = {}

    def host_floor(strategy: str) -> float:
        """The strategy's step at ``host_seq`` tokens (one row): the host's floor."""
        if strategy not in floors:
            case = model_case(run, strategy, host_seq, 1, world)
            steps = []  # each timing's record: the faster one's host profile is kept

            def floor_step() -> float:
                steps.append(ranks.run(timed_step_task, case, device_type, run.dtype, run.warmup, run.iters, True)[0])
                return steps[-1]["seconds"]

            floors[strategy], timings = host_floor_seconds(floor_step)
            emit({"host_floor": strategy, "seq": host_seq, "seconds": floors[strategy], "timings_s": timings,
                  "host_profile": min(steps, key=lambda step: step["seconds"])["host_profile"]})
        return floors[strategy]

    def exposure(strategy: str) -> dict:
        """The strategy's exposed fraction per kind, from its own step at ``exposure_seq``."""
        if strategy not in exposures:
            case = model_case(run, strategy, exposure_seq, 1, world)
            kinds = sorted({kind for _, kind in llama_step_traffic(case, "torch", run.dtype).rows()})
            per_rank = ranks.run(exposure_task, case, device_type, run.dtype, run.warmup)
            if any(r is None for r in per_rank):  # gloo: nothing overlaps
                exposures[strategy] = {"fractions": {k: 1.0 for k in kinds}, "source": SERIAL, "seq": exposure_seq}
            else:
                exposures[strategy] = {"fractions": fractions(per_rank, kinds), "seq": exposure_seq,
                                       "source": "CUDA profile of one step, mean over ranks", "per_rank": per_rank}
            emit({"exposure": strategy, **exposures[strategy]})
        return exposures[strategy]

    def timed(strategy: str, case: ModelCase) -> tuple[dict, dict, float]:
        """The row's step, and one more under cProfile (rank 0's): the host's share at the row's size."""
        exposed, host_s = exposure(strategy), host_floor(strategy)
        return ranks.run(timed_step_task, case, device_type, run.dtype, run.warmup, run.iters, True)[0], exposed, host_s

    def verify(case: ModelCase) -> dict:
        shares = ranks.run(verify_task, case, device_type, run.dtype)
        return verdict(case, run.dtype, sum(r["loss"] for r in shares), shares[0]["grads"])

    versions = {"framework": "torch", "torch": torch.__version__}
    return scale_result(run, world, versions, device_name, profile, verify, timed, kernel, kernels, exposures, floors,
                        emit)


def scale_result(run: ScaleRun, world: int, versions: dict, device_name: str, profile: dict, verify, timed, kernel,
                 kernels: dict, exposures: dict, floors: dict, emit) -> dict:
    """Every strategy × T at one row, then the B* sweep, each row to ``emit`` as measured (a row
    that fails is kept as ``{"error": ...}``), and the result dict — one body for both frameworks
    (``versions["framework"]``): ``verify(case)`` -> :func:`verdict` checks each strategy's step
    at ``run.verify_seq`` before its first row is timed (its rows carry ``verified``);
    ``timed(strategy, case)`` -> (measured, exposure, host floor s) runs the step;
    ``kernel(seq, batch)`` -> (name, C_attn) fills ``kernels``; ``exposures`` and ``floors`` fill as
    ``timed`` calibrates."""
    framework = versions["framework"]
    calibrated = {"c_flops": profile["flops"], "w_hbm": profile["hbm"], "w_by_kind": profile["bandwidth"]}
    verdicts: dict[str, dict] = {}

    def checked(strategy: str) -> dict:
        if strategy not in verdicts:
            try:
                verdicts[strategy] = verify(model_case(run, strategy, run.verify_seq, 1, world))
            except Exception as err:  # noqa: BLE001 — a check that cannot run is a failed check
                verdicts[strategy] = {"passed": False, "error": f"{type(err).__name__}: {err}"[:500]}
            emit({"verify": strategy, **verdicts[strategy]})
        return verdicts[strategy]

    @functools.cache  # one floor step per strategy: the same T_math for every row
    def floor_math(strategy: str) -> float | None:
        """T_math of the strategy's floor step, where its fixed cost adds (:data:`FIXED_COST_ADDS`)."""
        if framework not in FIXED_COST_ADDS:
            return None
        host_seq = calibration_seqs(run)[1]
        return predict(model_case(run, strategy, host_seq, 1, world), run.dtype, profile, kernel(host_seq, 1)[1],
                       framework=framework)["t_math_s"]

    def row(strategy: str, seq: int, batch: int) -> dict:
        head = {"strategy": strategy, "seq": seq, "batch": batch, "framework": framework, "devices": world,
                "segment_ids": run.segment_ids,
                "device": device_name, "verified": checked(strategy)["passed"]}
        try:
            case = model_case(run, strategy, seq, batch, world)
            measured, exposed, host_s = timed(strategy, case)
            pred = predict(case, run.dtype, profile, kernel(seq, batch)[1], exposed["fractions"], host_s,
                           framework=framework, floor_math_s=floor_math(strategy))
            out = row_record(head, case, run.dtype, measured, pred, calibrated, kernel(seq, batch), exposed)
        except Exception as err:  # noqa: BLE001 — one failing row must not lose the others
            out, measured = {**head, "error": f"{type(err).__name__}: {err}"[:500]}, {}
        emit({**out, "host_profile": measured.get("host_profile")})  # the profile to its own file, not the result
        return out

    rows = [row(st, seq, 1) for st in run.strategies for seq in run.seqs]
    first, seq0 = run.strategies[0], run.bstar_seq
    sweep = [row(first, seq0, b) for b in run.batches]
    env = {"devices": f"{world}x {device_name}", **versions, "date": time.strftime("%Y-%m-%d")}
    return {"env": env, "verified": verdicts, "run": {**asdict(run), "sizes": repr(run.sizes)}, "profile": profile,
            "attention_kernel": {f"{s}x{b}": {"kernel": k, "tflops": r / 1e12} for (s, b), (k, r) in kernels.items()},
            "exposure": exposures, "host_floor_s": floors, "rows": rows,
            # the closed form's one C_attn: the sweep's largest batch (the rate B* is approached at)
            "bstar": bstar_summary(run, world, profile, kernel(seq0, max(run.batches))[1], exposures.get(first),
                                   floors.get(first), sweep, framework=framework)}


def row_record(head: dict, case: ModelCase, dtype: str, measured: dict, pred: dict, calibrated: dict,
               kernel: tuple[str, float], exposed: dict) -> dict:
    """One timed row: ``head`` (strategy, T, B, framework, devices, device), the measured step
    (``measured``: seconds, peak_bytes, the traced traffic rows), its prediction and the bytes the
    model says it moves (``llama_step_traffic`` in ``head["framework"]``) against that trace."""
    model_rows = llama_step_traffic(case, head["framework"], dtype).rows()
    s = measured["seconds"]
    differences = traffic_differences(model_rows, measured["traffic"], measured.get("traffic_scope", "per pass"))
    return {**head, "mesh": case.mesh.name, "layout": case.layout, "measured_s": s,
            "fsdp_units": case.fsdp_units if head["framework"] == "torch" else None,  # JAX: no units (XLA)
            "peak_gib": None if measured["peak_bytes"] is None else measured["peak_bytes"] / 2**30,
            "traffic_equal": not differences, "traffic_differences": differences,
            # JAX: the same step compiled without XLA's collective-quantizer (None for torch: its trace is its calls)
            "traffic_unquantized_differences": None if "traffic_unquantized" not in measured else
            traffic_differences(model_rows, measured["traffic_unquantized"], "whole step"),
            "traffic_scope": measured.get("traffic_scope", "per pass"),
            "comm_bytes_per_device": sum(float(b) for _, b in model_rows.values()), **pred,
            "measured_over_predicted": s / pred["predicted_s"],
            "measured_over_overlap": s / pred["bound_overlap_s"],
            "measured_over_serial": s / pred["bound_serial_s"],
            "achieved_tflops": pred["flops_per_device"] / s / 1e12, **calibrated,
            "c_attention": kernel[1], "attention_kernel": kernel[0],
            "exposed_fraction": exposed["fractions"], "exposure_seq": exposed["seq"]}


def bstar_summary(run: ScaleRun, world: int, profile: dict, c_attention: float, exposure: dict | None,
                  host_s: float | None, sweep: list[dict], framework: str = "torch") -> dict:
    """The sweep's predicted B* and its knees. ``rows_sum`` / ``rows_max``: the links' B*
    (:func:`critical_batch` on all of T_comm); ``rows_exposed``: the same on the exposed part;
    ``rows_host``: where T_math = m + a·B reaches the host's floor; ``predicted_bstar``: the larger
    of the last two (compute then outlasts both). ``measured_knee`` / ``predicted_knee``: :func:`knee`
    of the measured / predicted times."""
    first, seq0 = run.strategies[0], run.bstar_seq
    m, a, c, y = affine_in_batch(run, first, seq0, world, profile, c_attention, framework=framework)
    fractions_ = None if exposure is None else exposure["fractions"]
    _, _, c_e, y_e = affine_in_batch(run, first, seq0, world, profile, c_attention, exposed=fractions_,
                                     framework=framework)
    rows_exposed = critical_batch(a, c_e, y_e, "sum", m)
    rows_host = max(0.0, ((host_s or 0.0) - m) / a)
    done = [r for r in sweep if "error" not in r]
    batches = [r["batch"] for r in done]
    return {"strategy": first, "seq": seq0, "m_s": m, "a_s_per_row": a, "c_s": c, "y_s_per_row": y,
            "c_exposed_s": c_e, "y_exposed_s_per_row": y_e, "host_floor_s": host_s,
            "rows_sum": critical_batch(a, c, y, "sum", m), "rows_max": critical_batch(a, c, y, "max", m),
            "rows_exposed": rows_exposed, "rows_host": rows_host, "predicted_bstar": max(rows_exposed, rows_host),
            "measured_knee": knee(batches, [r["measured_s"] for r in done]) if done else None,
            "predicted_knee": knee(batches, [r["predicted_s"] for r in done]) if done else None, "sweep": sweep}


def framework_of(result: dict) -> str:
    """The framework a result was measured in ("torch" unless its env says otherwise)."""
    return result["env"].get("framework", "torch")


def markdown(result: dict) -> str:
    """The result as the tables a dated results file holds."""
    framework = framework_of(result)
    units = (f"; FSDP2 units: {result['run']['fsdp_units']}" if framework == "torch"
             else f"; XLA GEMMs: {result.get('xla_gemm', 'autotune')}")
    units += ("; rows of one document each, " + ("their segment ids passed" if result["run"].get("segment_ids")
                                                  else "no segment ids passed (the causal mask)"))
    lines = [f"# Whole model on {result['env']['devices']} — {result['env']['date']}", "",
             f"{framework} {result['env'][framework]}{units}; C = {result['profile']['flops'] / 1e12:.1f} TFLOP/s; W_hbm = "
             f"{result['profile']['hbm'] / 1e9:.0f} GB/s; W (GB/s per device): "
             + ", ".join(f"{k} {w / 1e9:.1f}" for k, w in result["profile"]["bandwidth"].items()), "",
             "Exposed fraction per kind (each strategy's calibration step): "
             + "; ".join(f"{st} at T = {e['seq']}: " + ", ".join(f"{k} {f:.2f}" for k, f in e["fractions"].items())
                         for st, e in result["exposure"].items()), "",
             "Host floor (each strategy's step at T = " + str(result["run"]["host_seq"]) + "): "
             + ", ".join(f"{st} {t * 1e3:.1f} ms" for st, t in result["host_floor_s"].items()), "",
             "Verified (each strategy's step at T = " + str(result["run"]["verify_seq"]) + " against the float64 "
             "step; worst tensor's error / tolerance): "
             + ", ".join(f"{st} {'passed' if v['passed'] else 'FAILED'}"
                         + (f" ({v['worst']} {v['worst_ratio']:.2f})" if "worst" in v else f" ({v.get('error')})")
                         for st, v in result.get("verified", {}).items()), "",
             ("predicted = the fixed cost (the floor step less its own T_math) + T_math: a compiled step's fixed "
              "cost adds to its math" if framework in FIXED_COST_ADDS else
              "predicted = max(host floor, T_math + the exposed communication)")
             + "; beside it, measured / (T_math + the exposed communication), no floor", "",
             "| strategy | T | B | measured ms | predicted ms | measured / predicted | T_math ms (of it memory) "
             "| T_comm ms (exposed) | host floor ms (fixed) | bounds: overlap / serial ms | TFLOP/s | peak GiB "
             "| bytes == trace | measured / (T_math + exposed) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"
    for r in result["rows"] + result["bstar"]["sweep"]:
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['seq']} | {r['batch']} | failed: {r['error'][:120]} |"
                         + " |" * 10)
            continue
        ms = lambda key, r=r: f"{r[key] * 1e3:.1f}"
        lines.append(f"| {r['strategy']} ({r['mesh']}) | {r['seq']} | {r['batch']} | {ms('measured_s')} "
                     f"| {ms('predicted_s')} | {r['measured_over_predicted']:.2f} "
                     f"| {ms('t_math_s')} ({ms('t_memory_s')}) | {ms('t_comm_s')} ({ms('t_comm_exposed_s')}) "
                     f"| {ms('host_floor_s')}" + ("" if r.get("fixed_s") is None else f" ({ms('fixed_s')})")
                     + f" | {ms('bound_overlap_s')} / {ms('bound_serial_s')} | {r['achieved_tflops']:.1f} "
                     f"| {fmt(r['peak_gib'])} | {r['traffic_equal']} "
                     f"| {r['measured_s'] / r.get('predicted_exposure_s', r['t_math_s'] + r['t_comm_exposed_s']):.2f} |")
    lines += [f"- bytes differ, {r['strategy']} T = {r['seq']} B = {r['batch']}: "
              + "; ".join(f"{key} model {d['model'][0]} calls / {d['model'][1]:.0f} B, traced {d['traced'][0]} / "
                          f"{d['traced'][1]:.0f}" for key, d in r["traffic_differences"].items())
              + ("" if r.get("traffic_unquantized_differences") is None else
                 " (compiled without XLA's collective-quantizer, which sends exactly widened or narrowed values "
                 "in bf16: " + ("equal to the model)" if not r["traffic_unquantized_differences"] else "differs too)"))
              for r in result["rows"] + result["bstar"]["sweep"] if r.get("traffic_differences")]
    b = result["bstar"]
    lines += ["", f"B* ({b['strategy']}, T = {b['seq']}): links {b['rows_sum']:.2f} rows (sum, all of T_comm), "
              f"{b['rows_exposed']:.2f} (the exposed part); host floor {b['rows_host']:.2f}; predicted B* = "
              f"{b['predicted_bstar']:.2f} rows. Knee (time per row within 10 % of the best): measured "
              f"{b['measured_knee']}, predicted {b['predicted_knee']}. T_math = m + a·B with m = {b['m_s'] * 1e3:.2f} ms, "
              f"a = {b['a_s_per_row'] * 1e3:.2f} ms/row; T_comm = c + y·B with c = {b['c_s'] * 1e3:.2f} ms, "
              f"y = {b['y_s_per_row'] * 1e3:.2f} ms/row."]
    return "\n".join(lines) + "\n"


def rows_emitter(out: Path, stem: str, files=None):
    """A command's ``emit``: each record stamped with its wall time (``at``: the gaps between
    records say where a run's time went) and printed as one line of progress; a calibrated
    profile (``hardware``) written as ``{stem}-hardware.json``, as ``python -m parity bstar
    --hardware FILE`` reads it; ``files(record)`` for the command's own files (it may pop what
    they take); then the record appended to ``{stem}-rows.jsonl`` — a killed run keeps every
    record before it."""
    def emit(row: dict) -> None:
        row = {**row, "at": time.strftime("%H:%M:%S")}
        first = next(iter(row))
        print(f"{row['at']} {first} {row[first] if first != 'hardware' else ''}"
              + (f" T={row['seq']}" if "seq" in row else ""), flush=True)
        if "hardware" in row:
            (out / f"{stem}-hardware.json").write_text(json.dumps(row["hardware"], indent=1) + "\n")
        if files is not None:
            files(row)
        with (out / f"{stem}-rows.jsonl").open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
    return emit


# --xla-gemm (JAX): the XLA flag each choice adds. A compile of the whole step with XLA's Triton GEMM
# autotuning took 291 s at 8,192 tokens on 2x H200 (2026-11-28), half of it tuning Triton GEMMs
# (benchmarks/jax_compile_probe.py): "cublas" keeps cuBLAS's algorithm autotuning and drops that half.
XLA_GEMM = {"autotune": "", "cublas": "--xla_gpu_enable_triton_gemm=false"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.capacity.llama_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch",
                    help="jax: the same rows through llama_jax.Step, one process for every device (llama_scale_jax)")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU check of the command)")
    ap.add_argument("--strategies", default=None, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--seq", default=None, help="comma-separated tokens per row")
    ap.add_argument("--batches", default=None, help="comma-separated rows per step (the B* sweep)")
    ap.add_argument("--bstar-seq", type=int, default=None, help="tokens per row of the B* sweep")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--exposure-seq", type=int, default=None,
                    help="tokens per row of each strategy's calibration step (default: half the shortest --seq)")
    ap.add_argument("--host-seq", type=int, default=None, help="tokens per row of each strategy's host-floor step")
    ap.add_argument("--fsdp-units", choices=FSDP_UNITS, default=None,
                    help="torch's FSDP2 units: block (default, as torchtitan) or weight (one per weight-holding module)")
    ap.add_argument("--segment-ids", action="store_true",
                    help="pass the rows' segment ids (one document a row): the packed-training program, its blocks on "
                         "the document path (default: none passed, the same causal mask on the plain kernels)")
    ap.add_argument("--xla-gemm", choices=XLA_GEMM, default=None,
                    help="jax: how XLA picks GEMM kernels — autotune (default: its Triton GEMMs and cuBLAS's algorithms, "
                         "autotuned) or cublas (Triton GEMMs off, cuBLAS's algorithms still autotuned; on one H200 the "
                         "model's compile took 23 s instead of 52 s at 2,048 tokens)")
    a = ap.parse_args(argv)
    if a.framework != "jax" and a.xla_gemm is not None:
        ap.error("--xla-gemm is XLA's; torch's GEMMs are cuBLAS's")
    if a.framework == "jax" and a.fsdp_units is not None:  # XLA groups the gathers: no units to choose
        ap.error("--fsdp-units is torch's FSDP2 wrapping; --framework jax has no units")
    run = SMALL_RUN if a.small else ScaleRun()
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)
    run = replace(run, **{k: v for k, v in (("strategies", a.strategies and tuple(a.strategies.split(","))),
                                             ("seqs", a.seq and ints(a.seq)),
                                             ("batches", a.batches and ints(a.batches)),
                                             ("bstar_seq", a.bstar_seq), ("exposure_seq", a.exposure_seq),
                                             ("host_seq", a.host_seq), ("fsdp_units", a.fsdp_units),
                                             ("segment_ids", a.segment_ids)) if v})
    calibration_seqs(run)  # a bad --exposure-seq fails before any rank starts
    a.out.mkdir(parents=True, exist_ok=True)  # before any work: rows land as they are measured
    stem = f"llama-scale-{'jax-' if a.framework == 'jax' else ''}{time.strftime('%Y-%m-%d')}"

    def host_profile_file(row: dict) -> None:
        profile = row.pop("host_profile", None)
        if profile:  # a step's cProfile (rank 0), readable as it is: the host floor's, or a row's
            what = row.get("host_floor") or f"{row['strategy']}-T{row['seq']}-B{row['batch']}"
            (a.out / f"{stem}-host-{what}.txt").write_text(profile)

    emit = rows_emitter(a.out, stem, host_profile_file)

    if a.framework == "jax":
        from ..core.devices import configure_jax_devices

        gemm = a.xla_gemm or "autotune"
        if gemm == "cublas":  # before JAX starts, like the rest of XLA_FLAGS
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_GEMM['cublas']}".strip()
        configure_jax_devices(a.devices, autotune=True)  # before JAX starts: XLA's GEMM autotuning on
        from .llama_scale_jax import measure_jax

        def emit_gemm(row: dict, emit=emit) -> None:  # every record says how its GEMMs were compiled
            emit(row | {"xla_gemm": gemm})

        result = measure_jax(run, a.devices, a.world, emit_gemm) | {"xla_gemm": gemm}
    else:
        try:
            result = measure(run, a.devices, a.world, emit)
        finally:
            close_worlds()
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (a.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    rows = result["rows"] + result["bstar"]["sweep"]
    return 0 if all(bytes_as_modelled(r) for r in rows) else 1


def bytes_as_modelled(row: dict) -> bool:
    """Whether a row moved the model's bytes: its trace equals the model, or (JAX) the step compiled
    without XLA's collective-quantizer does — the compiled program then differs only by XLA's exact
    narrowing of a hop to bf16 (docs/gpu/p2pbytes-2026-11-29-h200.md)."""
    return bool(row.get("traffic_equal")) or row.get("traffic_unquantized_differences") == {}


if __name__ == "__main__":
    raise SystemExit(main())
