"""The whole model on several devices, timed (torch): one training step per strategy next to the
accounting model's prediction from C and W measured in the same run, and the B* sweep.

    python -m parity.capacity.llama_scale --devices gpu --out DIR
        [--strategies zigzag,ulysses,allgather] [--seq 65536,131072] [--batches 1,2,4]
    python -m parity.capacity.llama_scale --devices cpu --small --out DIR   # the same code on gloo

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
  kinds of bytes / W[kind]; ``overlap`` = max(T_math, T_comm), ``serial`` = their sum
  (``predicted_s``). C (bf16 n³ matmul), W_hbm (a large elementwise copy) and W (per collective
  kind, bytes per device as docs/contract.md counts them) come from ``calibrate.profile_task`` on
  the same world; C_attn is the resolved causal block kernel alone on T/N tokens
  (``llama_gpu.attention_rate``, run on the same ranks, rank 0's rate).

B* (``critical_batch``): with B rows of T tokens, FLOPs, the activations' memory traffic and the
attention's K/V bytes grow with B while the FSDP weight bytes and Adam's traffic do not, so
T_math = m + a·B and T_comm = c + y·B (affine: checked on the model itself, ``affine_in_batch``).
The step turns compute-bound at B* = (c − m) / (a − y) ("sum": all traffic serial on the links,
compute overlapping it) or (c − m) / a ("max": each kind on its own link), 0 when m ≥ c already,
infinite when a ≤ y (attention traffic alone outgrows compute). The sweep times B = 1, 2, 4, …
rows of ``bstar_seq`` tokens and reports measured / T_math per B: the knee should sit near B*.

Rows are one-document batches (``llama_gpu.one_document``): every block runs the fused kernels
and FLOPs are exactly affine in B. docs/model.md says how to read the file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..core.mesh import MeshShape
from ..runners.torch_runner import world_backend
from ..runners.torch_world import close_worlds, get_world
from ..training.llama import LlamaConfig, ModelCase, TokenBatch, packed_corpus, step_flops
from ..training.llama_gpu import GPU_MODEL, attention_rate, one_document
from ..training.llama_traffic import llama_step_traffic
from .calibrate import SMALL, Sizes, median_seconds, profile_task, slowest

LAYOUTS = {"zigzag": "zigzag", "stripe": "stripe", "contiguous": "contiguous", "ulysses": "zigzag",
           "allgather": "zigzag"}  # strategy -> the layout its tokens are permuted into


def strategy_mesh(name: str, world: int) -> MeshShape:
    """The attention mesh of strategy ``name`` over ``world`` devices (no data axis: B* grows B)."""
    if name not in LAYOUTS:
        raise ValueError(f"strategy must be one of {sorted(LAYOUTS)}, got {name!r}")
    if name == "ulysses":
        return MeshShape(ulysses=world)
    return MeshShape(ring=world, kv_exchange="allgather" if name == "allgather" else "ring")


@dataclass(frozen=True)
class ScaleRun:
    """What one invocation measures.

    model:      the decoder (default: the GPU-sized one of ``llama_gpu``; ``--small``: the tiny one).
    strategies: names of ``LAYOUTS`` (zigzag, stripe, contiguous ring; ulysses; all-gather KV).
    seqs:       tokens per row T (global, over all devices); each strategy × T timed at one row.
    bstar_seq, batches: the B* sweep — the first strategy at T = ``bstar_seq`` with B rows. Short
                rows: the GPU-sized model is compute-bound at one row of 16k tokens already
                (predicted B* ≈ 0.1 row there, ≈ 7 rows of 512, on the 2026-11-22 H200
                calibration), so the knee is only visible where B·T is a few thousand tokens.
    dtype:      the model's dtype (weights, activations, gradients on the wire).
    block_backend: the attention's block kernel ("auto": the routing table).
    warmup, iters: steps not timed, and timed (the median is reported).
    sizes:      calibration sizes (``calibrate.Sizes``) for C and W.
    """

    model: LlamaConfig = GPU_MODEL
    strategies: tuple[str, ...] = ("zigzag", "ulysses", "allgather")
    seqs: tuple[int, ...] = (65536, 131072)
    bstar_seq: int = 512
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    dtype: str = "bfloat16"
    block_backend: str = "auto"
    warmup: int = 2
    iters: int = 5
    sizes: Sizes = Sizes()


SMALL_RUN = ScaleRun(model=LlamaConfig(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, head_dim=8, d_ff=64),
                     strategies=("zigzag", "ulysses"), seqs=(64,), bstar_seq=32, batches=(1, 2), dtype="float32",
                     warmup=1, iters=2, sizes=SMALL)


def model_case(run: ScaleRun, strategy: str, seq: int, batch: int, world: int) -> ModelCase:
    return ModelCase(run.model, strategy_mesh(strategy, world), fsdp=True, layout=LAYOUTS[strategy], batch=batch,
                     seq=seq)


def rows_of_one_document(case: ModelCase) -> TokenBatch:
    """The case's batch (original order), each row one document."""
    return one_document(packed_corpus(case.model, case.batch, case.seq, case.seed + 1))


def timed_step_task(case: ModelCase, device_type: str, dtype: str, warmup: int, iters: int) -> dict:
    """Runs on every rank: the first step traced, then ``iters`` steps timed (slowest rank)."""
    import torch

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
    return {"seconds": seconds, "peak_bytes": peak, "traffic": tracer.traffic.rows()}


def traffic_equal(model_rows: dict, traced_rows: dict) -> bool:
    """The model's (calls, bytes) per (pass, kind) equal the trace's, exactly."""
    nonzero = lambda rows: {k: (int(c), float(b)) for k, (c, b) in rows.items() if c or b}
    return nonzero(model_rows) == nonzero(traced_rows)


def predict(case: ModelCase, dtype: str, profile: dict, c_attention: float) -> dict:
    """T_math, T_comm (seconds per device) of one step of ``case`` from the model's FLOPs and
    bytes: T_math = matmul FLOPs / N / C + attention FLOPs / N / C_attn + memory bytes / W_hbm
    (``step_model``: torch's memory-bound kernels on the device's tokens, Adam on its 1/N of the
    weights — FSDP; ``profile["hbm"]``, measured by ``calibrate.profile_task``)."""
    from ..training import step_model as sm

    if "hbm" not in profile:
        raise ValueError("the profile has no 'hbm' (bytes/s of a large elementwise copy): calibrate again "
                         "(calibrate.profile_task measures it) or add one")
    flops = step_flops(case.model, rows_of_one_document(case))
    n = case.mesh.devices
    matmul_s = (flops["matmul_fwd"] + flops["matmul_bwd"]) / n / profile["flops"]
    attention_s = (flops["attention_fwd"] + flops["attention_bwd"]) / n / c_attention
    tokens = case.batch * case.seq // n
    memory = sm.memory_bytes(sm.memory_passes(case.model, tokens, "torch", dtype, shards=n))["total"]
    memory_s = memory / profile["hbm"]
    math_s = matmul_s + attention_s + memory_s
    rows = llama_step_traffic(case, "torch", dtype).rows()
    comm_s = sum(float(b) / profile["bandwidth"][kind] for (_, kind), (_, b) in rows.items())
    return {"t_math_s": math_s, "t_matmul_s": matmul_s, "t_attention_s": attention_s, "t_memory_s": memory_s,
            "memory_bytes_per_device": memory, "t_comm_s": comm_s, "overlap_s": max(math_s, comm_s),
            "serial_s": math_s + comm_s, "predicted_s": math_s + comm_s, "flops_per_device": sum(flops.values()) / n}


def affine_in_batch(run: ScaleRun, strategy: str, seq: int, world: int, profile: dict, c_attention: float,
                    batches=(1, 2, 3)) -> tuple[float, float, float, float]:
    """(m, a, c, y) with T_math = m + a·B and T_comm = c + y·B from B = 1 and 2, after checking
    the model is exactly affine in B at every other B of ``batches`` (ValueError otherwise). m:
    the memory-bound work that does not grow with the batch (Adam over the device's weights, the
    embedding's gradient buffer)."""
    p = {b: predict(model_case(run, strategy, seq, b, world), run.dtype, profile, c_attention)
         for b in sorted({1, 2, *batches})}
    a = p[2]["t_math_s"] - p[1]["t_math_s"]
    m = p[1]["t_math_s"] - a
    y = p[2]["t_comm_s"] - p[1]["t_comm_s"]
    c = p[1]["t_comm_s"] - y
    for b in p:
        if not (math.isclose(p[b]["t_math_s"], m + a * b, rel_tol=1e-9)
                and math.isclose(p[b]["t_comm_s"], c + y * b, rel_tol=1e-9)):
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


def measure(run: ScaleRun, devices: str, world: int | None = None) -> dict:
    """Calibrate, time every strategy × T at one row, then the B* sweep. The result dict."""
    import torch

    backend, device_type = world_backend(devices)
    world = world or (torch.cuda.device_count() if devices == "gpu" else 2)
    if world < 2:
        raise ValueError(f"the whole model over several devices needs at least 2, found {world}")
    ranks = get_world(world, backend)
    profile = ranks.run(profile_task, run.sizes, device_type)[0]
    c = run.model
    # on the ranks, each on its own device, as C was: the parent never holds GPU memory
    kernels = {seq: ranks.run(attention_rate, run.block_backend, seq // world, c.heads, c.head_dim, device_type,
                              run.dtype)[0] for seq in (*run.seqs, run.bstar_seq)}

    def row(strategy: str, seq: int, batch: int) -> dict:
        case = model_case(run, strategy, seq, batch, world)
        measured = ranks.run(timed_step_task, case, device_type, run.dtype, run.warmup, run.iters)[0]
        model_rows = llama_step_traffic(case, "torch", run.dtype).rows()
        pred = predict(case, run.dtype, profile, kernels[seq][1])
        s = measured["seconds"]
        return {"strategy": strategy, "mesh": case.mesh.name, "layout": case.layout, "seq": seq, "batch": batch,
                "framework": "torch", "measured_s": s,
                "peak_gib": None if measured["peak_bytes"] is None else measured["peak_bytes"] / 2**30,
                "traffic_equal": traffic_equal(model_rows, measured["traffic"]),
                "comm_bytes_per_device": sum(float(b) for _, b in model_rows.values()), **pred,
                "measured_over_overlap": s / pred["overlap_s"], "measured_over_serial": s / pred["serial_s"],
                "achieved_tflops": pred["flops_per_device"] / s / 1e12}

    rows = [row(st, seq, 1) for st in run.strategies for seq in run.seqs]
    first, seq0 = run.strategies[0], run.bstar_seq
    m, a, c_, y = affine_in_batch(run, first, seq0, world, profile, kernels[seq0][1])
    sweep = [row(first, seq0, b) for b in run.batches]
    env = {"devices": f"{world}x {torch.cuda.get_device_name(0) if devices == 'gpu' else 'CPU'}",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    return {"env": env, "run": {**asdict(run), "sizes": repr(run.sizes)}, "profile": profile,
            "attention_kernel": {str(s): {"kernel": k, "tflops": r / 1e12} for s, (k, r) in kernels.items()},
            "rows": rows, "bstar": {"strategy": first, "seq": seq0, "m_s": m, "a_s_per_row": a, "c_s": c_,
                                    "y_s_per_row": y, "rows_sum": critical_batch(a, c_, y, "sum", m),
                                    "rows_max": critical_batch(a, c_, y, "max", m),
                                    "sweep": sweep}}


def markdown(result: dict) -> str:
    """The result as the tables a dated results file holds."""
    lines = [f"# Whole model on {result['env']['devices']} — {result['env']['date']}", "",
             f"torch {result['env']['torch']}; C = {result['profile']['flops'] / 1e12:.1f} TFLOP/s; W_hbm = "
             f"{result['profile']['hbm'] / 1e9:.0f} GB/s; W (GB/s per device): "
             + ", ".join(f"{k} {w / 1e9:.1f}" for k, w in result["profile"]["bandwidth"].items()), "",
             "| strategy | T | B | measured ms | T_math ms (of it memory) | T_comm ms | measured / overlap "
             "| measured / serial | TFLOP/s | peak GiB | bytes == trace |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"
    for r in result["rows"] + result["bstar"]["sweep"]:
        lines.append(f"| {r['strategy']} ({r['mesh']}) | {r['seq']} | {r['batch']} | {r['measured_s'] * 1e3:.1f} "
                     f"| {r['t_math_s'] * 1e3:.1f} ({r['t_memory_s'] * 1e3:.1f}) | {r['t_comm_s'] * 1e3:.1f} "
                     f"| {r['measured_over_overlap']:.2f} "
                     f"| {r['measured_over_serial']:.2f} | {r['achieved_tflops']:.1f} | {fmt(r['peak_gib'])} "
                     f"| {r['traffic_equal']} |")
    b = result["bstar"]
    lines += ["", f"B* ({b['strategy']}, T = {b['seq']}): {b['rows_sum']:.2f} rows (sum), {b['rows_max']:.2f} rows "
              f"(max); T_math = m + a·B with m = {b['m_s'] * 1e3:.2f} ms, a = {b['a_s_per_row'] * 1e3:.2f} ms/row; "
              f"T_comm = c + y·B with c = {b['c_s'] * 1e3:.2f} ms, y = {b['y_s_per_row'] * 1e3:.2f} ms/row."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.capacity.llama_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU check of the command)")
    ap.add_argument("--strategies", default=None, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--seq", default=None, help="comma-separated tokens per row")
    ap.add_argument("--batches", default=None, help="comma-separated rows per step (the B* sweep)")
    ap.add_argument("--bstar-seq", type=int, default=None, help="tokens per row of the B* sweep")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    run = SMALL_RUN if a.small else ScaleRun()
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)
    run = replace(run, **{k: v for k, v in (("strategies", a.strategies and tuple(a.strategies.split(","))),
                                             ("seqs", a.seq and ints(a.seq)),
                                             ("batches", a.batches and ints(a.batches)),
                                             ("bstar_seq", a.bstar_seq)) if v})
    try:
        result = measure(run, a.devices, a.world)
    finally:
        close_worlds()
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"llama-scale-{result['env']['date']}"
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (a.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all(r["traffic_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
