"""``python -m parity calibrate``: measure this machine's hardware profile — C (bf16 matmul FLOP/s
on one device), W_hbm (``hbm``: bytes read + written per second by a large elementwise copy on
one device — the step model's memory term, ``parity.training.step_model``) and W (bytes per
second per device, by the contract's (docs/contract.md) definition of bytes, for p2p,
all-to-all, all-gather, reduce-scatter, all-reduce over all devices: NCCL on GPUs, gloo on CPU)
— and write it as a JSON profile that ``python -m parity bstar --hardware FILE`` reads
(``parity.capacity.bstar.Hardware.load``).

``--predict`` then times two workloads on the same machine and compares them with what the
model predicts from the profile just measured:
- the FFN FSDP+TP training step (torch FSDP2 + DTensor, ``parity.training.torch_step``);
- USP attention, forward + backward (``torch_impl``).
Prediction: T_math = FLOPs per device / C; T_comm = Σ over collective kinds of model bytes / W;
printed both overlapped (max) and serial (sum). Attention's T_math also uses C_attention, the
single-device attention kernel's own measured FLOP/s, since attention kernels do not reach the
matmul peak.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from ..accounting.model import KINDS, attention_traffic
from ..core.cases import Case
from ..core.names import Device
from ..runners.torch_runner import world_backend
from ..runners.torch_world import get_world, make_mesh
from ..training.reference import TrainCase
from ..training.traffic_model import ffn_step_flops, ffn_step_traffic


@dataclass(frozen=True)
class Sizes:
    """What to measure with. GPU defaults; ``--small`` (CPU / tests) shrinks everything."""

    matmul: int = 8192  # n of the n×n×n bf16 matmul
    buffer_mib: int = 256  # per-device buffer of each collective
    warmup: int = 3
    iters: int = 10
    train: TrainCase = TrainCase("fsdp_tp", fsdp=2, tp=2, blocks=4, d_model=8192, d_ff=32768, tokens=16384,
                                 dtype="bfloat16")
    attention: Case = Case(ring=2, ulysses=2, batch=1, seq=65536, heads=32, kv_heads=8, head_dim=128,
                           dtype="bfloat16", causal=True, layout="zigzag")
    block_backend: str = "aten_flash"


SMALL = Sizes(matmul=256, buffer_mib=1, warmup=1, iters=3,
              train=TrainCase("fsdp_tp", fsdp=2, tp=2, blocks=2, d_model=64, d_ff=256, tokens=256, dtype="bfloat16"),
              attention=Case(ring=2, ulysses=2, seq=256, heads=4, kv_heads=4, head_dim=16, dtype="bfloat16"),
              block_backend="reference")


def _device(device_type: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def median_seconds(fn, device_type: str, warmup: int, iters: int, barrier: bool = True) -> float:
    """Median wall time of ``fn`` (synchronized; behind a barrier when running in a world)."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(warmup + iters):
        if device_type == "cuda":
            torch.cuda.synchronize()
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: float) -> float:
    """The slowest rank's time: a collective is done when its last participant is."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def profile_task(sizes: Sizes, device_type: str) -> dict:
    """Runs on every rank: C on each device (rank 0's reported) and W per collective kind."""
    import torch
    import torch.distributed as dist

    dev, n = _device(device_type), dist.get_world_size()
    a = torch.randn(sizes.matmul, sizes.matmul, device=dev, dtype=torch.bfloat16)
    t = median_seconds(lambda: a @ a, device_type, sizes.warmup, sizes.iters, barrier=False)
    flops = 2 * sizes.matmul**3 / slowest(t)
    # W_hbm: a large elementwise copy, bytes read + written per second (the step model's memory term)
    src = torch.randn(sizes.buffer_mib * 2**20 // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = median_seconds(lambda: dst.copy_(src), device_type, sizes.warmup, sizes.iters, barrier=False)
    hbm = 2 * src.numel() * src.element_size() / slowest(t)

    elems = sizes.buffer_mib * 2**20 // 2  # bf16
    buf = torch.randn(elems, device=dev, dtype=torch.bfloat16)
    out_a2a, gathered, scattered = torch.empty_like(buf), torch.empty(n * elems, device=dev, dtype=buf.dtype), \
        torch.empty(elems // n, device=dev, dtype=buf.dtype)
    recv = torch.empty_like(buf)
    rank = dist.get_rank()

    def p2p():  # a ring shift: send to the next rank, receive from the previous
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    nbytes = buf.numel() * buf.element_size()
    runs = {  # kind -> (call, bytes per device by docs/contract.md)
        "p2p": (p2p, nbytes),
        "all-to-all": (lambda: dist.all_to_all_single(out_a2a, buf), Fraction(nbytes * (n - 1), n)),
        "all-gather": (lambda: dist.all_gather_into_tensor(gathered, buf), nbytes * (n - 1)),
        "reduce-scatter": (lambda: dist.reduce_scatter_tensor(scattered, buf), Fraction(nbytes * (n - 1), n)),
        "all-reduce": (lambda: dist.all_reduce(buf), Fraction(2 * nbytes * (n - 1), n)),
    }
    bandwidth = {}
    for kind in KINDS:
        call, moved = runs[kind]
        seconds = slowest(median_seconds(call, device_type, sizes.warmup, sizes.iters))
        bandwidth[kind] = float(moved) / seconds
    return {"flops": flops, "hbm": hbm, "bandwidth": bandwidth, "devices": n}


def attention_task(case: Case, device_type: str, block_backend: str, warmup: int, iters: int,
                   single: bool) -> tuple[float, int]:
    """Runs on every rank: (median seconds, sequence length) of forward + backward of USP
    attention on ``case``'s mesh — or, with ``single``, of one device's SDPA kernel (flash on GPUs)
    on a causal problem of the same per-device FLOPs (seq/√devices tokens), which gives C_attention."""
    import torch

    import torch_impl

    dev, dtype = _device(device_type), getattr(torch, case.dtype)
    if single:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s = int(case.seq / case.devices**0.5) // 128 * 128
        q = torch.randn(case.batch, case.heads, s, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(case.batch, case.kv_heads, s, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
                for _ in range(2))
        kernel = SDPBackend.FLASH_ATTENTION if device_type == "cuda" else SDPBackend.MATH

        def run():
            with sdpa_kernel(kernel):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)
            o.backward(torch.ones_like(o))

        return median_seconds(run, device_type, warmup, iters, barrier=False), s
    t = case.seq // case.devices
    q = torch.randn(case.batch, t, case.heads, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(case.batch, t, case.kv_heads, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
            for _ in range(2))
    mesh = make_mesh(device_type, tuple(case.mesh_axes.items()))
    do = torch.randn_like(q)

    def run():
        o = torch_impl.sequence_parallel_attention(q, k, v, mesh, causal=case.causal, layout=case.layout,
                                                   block_backend=block_backend, return_lse=False)
        o.backward(do)

    return slowest(median_seconds(run, device_type, warmup, iters)), case.seq


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Forward + backward matmul FLOPs: 4·b·h·s²·d forward (halved when causal), ×3.5 in all."""
    return 3.5 * 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)


def _comm_seconds(traffic, bandwidth: dict) -> float:
    return sum(float(b) / bandwidth[kind] for (_, kind), (_, b) in traffic.rows().items())


def predict(sizes: Sizes, profile: dict, backend: str, device_type: str) -> list[dict]:
    """Measured vs predicted seconds for the FSDP+TP step and USP attention."""
    from ..training import torch_step

    rows = []
    tc = sizes.train
    measured = max(get_world(tc.devices, backend).run(torch_step.timed_step_task, tc, device_type, sizes.warmup,
                                                      sizes.iters))
    math = sum(ffn_step_flops(tc.model_step()).values()) / profile["flops"]
    comm = _comm_seconds(ffn_step_traffic(tc.model_step()), profile["bandwidth"])
    rows.append({"workload": f"FFN step {tc.name} D{tc.d_model} F{tc.d_ff} T{tc.tokens}", "measured_s": measured,
                 "t_math_s": math, "t_comm_s": comm, "predicted_overlap_s": max(math, comm),
                 "predicted_serial_s": math + comm})
    ac = sizes.attention
    world = get_world(ac.devices, backend)
    single, s1 = world.run(attention_task, ac, device_type, sizes.block_backend, sizes.warmup, sizes.iters, True)[0]
    c_attention = attention_flops(ac.batch, ac.heads, s1, ac.head_dim, ac.causal) / single
    measured, _ = max(world.run(attention_task, ac, device_type, sizes.block_backend, sizes.warmup, sizes.iters, False))
    flops = attention_flops(ac.batch, ac.heads, ac.seq, ac.head_dim, ac.causal) / ac.devices
    comm = _comm_seconds(attention_traffic(ac, return_lse=False), profile["bandwidth"])
    for label, c in (("C matmul", profile["flops"]), ("C attention", c_attention)):
        math = flops / c
        rows.append({"workload": f"USP attention {ac.name} ({label} {c / 1e12:.0f} TFLOP/s)", "measured_s": measured,
                     "t_math_s": math, "t_comm_s": comm, "predicted_overlap_s": max(math, comm),
                     "predicted_serial_s": math + comm})
    return rows


def hardware_profile(name: str, command: str, measured: dict, device_name: str, world: int, sizes: Sizes,
                     software: str) -> dict:
    """:func:`profile_task`'s measurement as a hardware profile — the JSON ``python -m parity bstar
    --hardware FILE`` reads (``bstar.Hardware.load``): name, source, C, W_hbm, W per kind.
    ``software``: the framework that measured it and its version ("torch 2.11.0", "jax 0.11.2")."""
    return {"name": name, "source": f"{command} on {world}x {device_name}, {software}, "
            f"{time.strftime('%Y-%m-%d')}; W per device, {sizes.buffer_mib} MiB bf16 buffers",
            "flops": measured["flops"], "hbm": measured["hbm"], "bandwidth": measured["bandwidth"]}


def calibrate(devices: Device, world: int | None = None, small: bool = False, predict_times: bool = False,
              name: str | None = None, out: Path = Path("calibration")) -> int:
    """``python -m parity calibrate``: measure, write ``out/<name>.json`` (and the predictions)."""
    import torch

    from ..runners.torch_world import close_worlds

    backend, device_type = world_backend(devices)
    world = world or (torch.cuda.device_count() if devices == "gpu" else 4)
    if world < 2:
        raise ValueError(f"calibrating collectives needs at least 2 devices, found {world}")
    sizes = SMALL if small else Sizes()
    try:
        result = get_world(world, backend).run(profile_task, sizes, device_type)[0]
        name = name or f"calibrated-{devices}{world}"
        gpu = torch.cuda.get_device_name(0) if devices == "gpu" else "CPU"
        profile = hardware_profile(name, "python -m parity calibrate", result, gpu, world, sizes,
                                   f"torch {torch.__version__}")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(profile, indent=1) + "\n")
        print(f"C = {profile['flops'] / 1e12:.1f} TFLOP/s (bf16 matmul {sizes.matmul}³); W_hbm = "
              f"{profile['hbm'] / 1e9:.0f} GB/s (copy of {sizes.buffer_mib} MiB)")
        for kind, w in profile["bandwidth"].items():
            print(f"W {kind:>14} = {w / 1e9:8.1f} GB/s per device")
        if predict_times:
            rows = predict(sizes, profile, backend, device_type)
            (out / f"{name}-predict.json").write_text(json.dumps({"sizes": repr(asdict(sizes)), "rows": rows},
                                                                      indent=1) + "\n")
            for r in rows:
                print(f"{r['workload']}: measured {r['measured_s'] * 1e3:.2f} ms; predicted overlap "
                      f"{r['predicted_overlap_s'] * 1e3:.2f} ms / serial {r['predicted_serial_s'] * 1e3:.2f} ms "
                      f"(T_math {r['t_math_s'] * 1e3:.2f}, T_comm {r['t_comm_s'] * 1e3:.2f})")
    finally:
        close_worlds()
    print(f"profile written to {out}/")
    return 0
