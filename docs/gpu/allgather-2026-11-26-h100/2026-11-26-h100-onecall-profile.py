"""Where a device's time goes in all-gather-KV's one varlen call (torch, issue 36): per balance
mix at 128k over a replayed ring of 8, the busiest device's fwd+bwd replay time against (a) the
same FA2 varlen calls alone on pre-made offsets and gathered keys, (b) torch.profiler's CUDA
kernel totals, (c) the host planning. Checked first: the one call's o against the portable
kernel's block walk at 2048 tokens is the benchmark's job (its rows say verified); here the
bare calls' o is compared with the replay's o on the same inputs (same kernel, same plan).
    python docs/gpu/allgather-2026-11-26-h100/2026-11-26-h100-onecall-profile.py [--smoke]   (EMULATE=1: FA2's ops emulated)"""
# ruff: noqa: B023  (every lambda here is timed where it is made, inside its loop iteration)

import json
import os
import sys
import time

import numpy as np
import torch

from benchmarks.documents import fit_documents, layout_keywords
from parity.probes.balance import MIXES
from seqplan.strategy import Strategy
from torch_impl import replay
from torch_impl.kernels import varlen

smoke = "--smoke" in sys.argv
T, R, H, HK, D = (2048, 8, 4, 2, 16) if smoke else (131072, 8, 32, 8, 128)
dev = "cuda" if torch.cuda.is_available() else "cpu"
emulate = os.environ.get("EMULATE") == "1"  # the CPU smoke: FA2's varlen ops emulated (tests/varlen_ops.py)
if emulate:
    sys.path.insert(0, "tests")
    import varlen_ops

    varlen_ops.emulate(varlen)
backend = "aten_varlen" if dev == "cuda" or emulate else "reference"
out = {}


def cuda_ms(fn, iters=5):
    fn()
    times = []
    for _ in range(iters):
        if dev == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            s = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - s))
    return float(np.median(times))


for mix in MIXES:
    ids = fit_documents(mix.segment_ids(T)[None].astype(np.int32), R)
    lk = layout_keywords(ids, R, "document-hybrid")
    seg = torch.from_numpy(lk["segment_ids"]).to(dev)
    index = torch.from_numpy(np.ascontiguousarray(lk["token_index"])).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, do = (torch.randn(1, T, H, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, T, HK, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(strategy=Strategy(ring=R, kv_exchange="allgather"), causal=True, layout="contiguous",
              block_backend=backend, segment_ids=seg, token_index=index)
    with torch.no_grad():
        o, lse = replay.replay_attention(q, k, v, **kw)
    rows = {}
    for device in range(R):
        plan = replay.one_call_plan(device, q, **kw)
        start = time.perf_counter()
        replay.one_call_plan(device, q, **kw)
        host_ms = 1e3 * (time.perf_counter() - start)
        with torch.no_grad():
            fwd = cuda_ms(lambda: replay.device_forward(device, q, k, v, **kw))
            bwd = cuda_ms(lambda: replay.device_backward(device, q, k, v, o, lse, do, **kw))
        row = {"replay_fwd_ms": fwd, "replay_bwd_ms": bwd, "plan_host_ms": host_ms, "one_call": plan is not None}
        if plan is not None and (dev == "cuda" or emulate):
            t = T // R
            q_d, o_d, do_d = (x[:, device * t:(device + 1) * t] for x in (q, o, do))
            lse_d = lse[:, :, device * t:(device + 1) * t]
            cu_q, cu_k, key = (torch.from_numpy(x).to(dev) for x in (plan.cu_q, plan.cu_k, plan.key_index))
            kp, vp = (x.reshape(-1, HK, D).index_select(0, key) for x in (k, v))
            flat = lambda x: x.reshape(-1, H, D)
            fa = lambda: varlen.flash_forward(flat(q_d), kp, vp, cu_q, cu_k, plan.max_q, plan.max_k, 0.0, True, False,
                                              scale=D ** -0.5)
            o_bare = fa()[0]
            o_err = float((o_bare.float() - flat(o_d).float()).norm() / flat(o_d).float().norm())
            rng, unused = varlen._rng_state(q.device, q.dtype, D)
            lse_p = lse_d.float().transpose(0, 1).reshape(H, -1).contiguous()
            fb = lambda: varlen.flash_backward(flat(do_d), flat(q_d), kp, vp, flat(o_d), lse_p, cu_q, cu_k, plan.max_q,
                                               plan.max_k, 0.0, True, rng, unused, scale=D ** -0.5)
            row |= {"bare_fwd_ms": cuda_ms(fa), "bare_bwd_ms": cuda_ms(fb), "bare_o_vs_replay": o_err,
                    "gather_ms": cuda_ms(lambda: k.reshape(-1, HK, D).index_select(0, key)),
                    "runs": len(plan.cu_q) - 1, "keys": plan.keys, "max_q": plan.max_q, "max_k": plan.max_k}
            if device == 0 and dev == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    replay.device_forward(device, q, k, v, **kw)
                    replay.device_backward(device, q, k, v, o, lse, do, **kw)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
                row["profile"] = table
                print(table, flush=True)
        rows[device] = row
        print(mix.name, device, {k_: v_ for k_, v_ in row.items() if k_ != "profile"}, flush=True)
    out[mix.name] = rows

path = os.path.join(os.environ.get("OUT", "/tmp"), "onecall-profile.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
