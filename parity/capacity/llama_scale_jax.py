"""The JAX twin of :mod:`llama_scale`: the same whole-model step on several devices, timed and
predicted from C and W measured in the same run, with the same row schema and the same B* sweep.

    python -m parity.capacity.llama_scale --framework jax --devices gpu --out DIR [...]
    python -m parity.capacity.llama_scale --framework jax --devices cpu --small --out DIR

One process drives every device (single controller): ``llama_jax.Step`` — FSDP over every device,
the attention's mesh the strategy's — compiled with XLA's GEMM autotuning on (untuned it ran 12×
slower), parameters and Adam states donated and fed back; the median step over ``iters`` after
``warmup``. Per strategy and T, as ``llama_scale`` does for torch:

- **measured**: the step's median wall time (one program: no per-rank skew to take the max of);
  peak memory from the first device's allocator (GPU only);
- **the model's bytes**: ``llama_step_traffic(case, "jax", dtype)`` against the compiled HLO's
  collectives — ``traffic_equal``: on the CPU per pass (``llama_jax.measure_traffic``: the loss,
  loss-and-grads and step programs split into passes), on GPUs per kind over the timed step's
  own program (``traffic_scope`` "whole step": :data:`GPU_TRAFFIC_SCOPE`);
- **predicted**: :func:`llama_scale.predict` with ``framework="jax"`` (the JAX memory table); C
  (jitted bf16 matmul), W_hbm (a jitted elementwise pass) and W per collective kind (a jitted
  ``shard_map`` of each kind over every device, bytes per device as docs/contract.md counts them)
  calibrated here; C_attn, jax_impl's resolved causal block kernel alone at the row's B rows of T/N
  tokens; the exposed fractions from an XLA trace of each strategy's step at ``exposure_seq``
  (GPU; on the CPU every fraction is 1); the fixed cost, the step at ``host_seq`` tokens less its
  own T_math: a JAX step is one dispatch, and the host's per-execution work, the FSDP pipeline's
  fill and drain and the copies add to every step's math (``llama_scale.FIXED_COST_ADDS``), so
  ``predicted_s`` = that fixed cost + T_math (``predicted_exposure_s``: T_math + the exposed
  communication, beside it).
"""

from __future__ import annotations

import tempfile
import time
from fractions import Fraction
from functools import cached_property

from ..accounting.model import KINDS
from ..training.llama import ModelCase
from ..training.llama_traffic import llama_step_traffic
from .calibrate import Sizes
from .exposure import exposed_times, fractions, send_recv_kinds, xla_trace_kernels
from .llama_scale import (
    ScaleRun,
    model_case,
    rows_of_one_document,
    scale_result,
    strategy_mesh,
    verdict,
)

UNPROFILED = "not profiled (XLA:CPU): every fraction 1, the serial bound"


def collective_bandwidth(devices: list, buffer_mib: int, warmup: int, iters: int) -> dict[str, float]:
    """W per collective kind (bytes per device per second, docs/contract.md's bytes as
    ``calibrate.profile_task`` counts them) of jitted ``shard_map`` collectives over ``devices``
    (the run's world) on a 1-D mesh, each on a ``buffer_mib`` MiB bf16 buffer per device."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..training.llama_gpu import jax_median_ms

    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("x",))
    elems = buffer_mib * 2**20 // 2 // n * n  # per device, a multiple of n (the all-to-all's split)
    buf = jax.device_put(jnp.ones((n * elems,), jnp.bfloat16), NamedSharding(mesh, P("x")))
    shift = [(i, (i + 1) % n) for i in range(n)]
    calls = {  # kind -> (per-device function, bytes per device)
        "p2p": (lambda x: lax.ppermute(x, "x", shift), elems * 2),
        "all-to-all": (lambda x: lax.all_to_all(x.reshape(n, -1), "x", 0, 0, tiled=True).reshape(-1),
                       Fraction(elems * 2 * (n - 1), n)),
        "all-gather": (lambda x: lax.all_gather(x, "x", tiled=True), elems * 2 * (n - 1)),
        "reduce-scatter": (lambda x: lax.psum_scatter(x, "x", tiled=True), Fraction(elems * 2 * (n - 1), n)),
        "all-reduce": (lambda x: lax.psum(x, "x"), Fraction(2 * elems * 2 * (n - 1), n)),
    }
    out = {}
    for kind in KINDS:
        fn, moved = calls[kind]
        program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out[kind] = float(moved) / (jax_median_ms(lambda program=program: program(buf), warmup, iters) * 1e-3)
    return out


def jax_profile(sizes: Sizes, devices: list) -> dict:
    """C and W_hbm as XLA compiles them (on the first device), W per kind over ``devices``."""
    from ..training.llama_gpu import jax_hbm_bandwidth, jax_matmul_rate

    return {"flops": jax_matmul_rate(sizes.matmul), "hbm": jax_hbm_bandwidth(sizes.buffer_mib),
            "bandwidth": collective_bandwidth(devices, sizes.buffer_mib, sizes.warmup, sizes.iters),
            "devices": len(devices)}


# XLA:GPU's collective-quantizer moves a convert across a collective-permute / all-gather / all-to-all
# where that is exact: a bf16 value widened before the send, or a value narrowed right after it,
# is sent in bf16. The accounting model counts what the program asks for; the rows count both.
QUANTIZER = "collective-quantizer"


def without_quantizer(base: dict) -> dict:
    """The step's compiler options ``base`` (``jax_step.compiler_options``) without :data:`QUANTIZER`
    too, and without GEMM autotuning (which picks kernels, not collectives)."""
    disabled = ",".join(filter(None, (base.get("xla_disable_hlo_passes"), QUANTIZER)))
    return {**base, "xla_disable_hlo_passes": disabled, "xla_gpu_autotune_level": 0}


class JaxRig:
    """One case's compiled step on the first ``case.mesh.devices`` devices, its batch one document
    per row (its segment ids passed only with ``case.segment_ids``, as the torch rig does)."""

    def __init__(self, case: ModelCase, dtype: str, block_backend: str, abstract: bool = False):
        """``abstract``: compile only (shapes and shardings, ``Step.arguments``): ``lowered``,
        ``compiled`` and ``traffic("whole step" | "lowered")`` work, on devices this process cannot run
        (a mocked GPU topology), and nothing runs."""
        import jax.numpy as jnp

        from ..training.jax_step import compiler_options
        from ..training.llama_jax import Step, make_mesh

        self.case = case
        step = Step(case, make_mesh(case), dtype=getattr(jnp, dtype), block_backend=block_backend)
        params, opt_state, *self.batch = step.arguments(rows_of_one_document(case), abstract=abstract)
        self.programs = step.programs(params, opt_state, donate=True)
        self.options = compiler_options(step.mesh)
        self.state = [params, opt_state]

    @cached_property
    def lowered(self):
        """The full step as JAX lowers it (shapes and shardings only: the state's values may move on)."""
        return self.programs[2].lower(*self.state, *self.batch)

    @cached_property
    def compiled(self):
        """The full step (parameters and Adam states donated), compiled on first use."""
        return self.lowered.compile()

    def loss_and_grads(self) -> tuple[float, dict]:
        """One step's loss and full gradients by weight name (the loss+grads program)."""
        import jax
        import numpy as np

        from ..training.llama_jax import from_params

        loss, grads = self.programs[1](self.state[0], *self.batch)
        return float(np.sum(np.asarray(loss, np.float64))), from_params(jax.device_get(grads), self.case.model)

    def run(self):
        _, _, self.state[0], self.state[1] = self.compiled(*self.state, *self.batch)
        return self.state[0]

    def traffic(self, scope: str = "per pass"):
        """The compiled programs' collectives: "per pass" (``llama_jax.measure_traffic``) or
        "whole step" (the timed step's own program alone, every collective counted as "step"), or
        "lowered": the whole step as JAX lowers it, before XLA's passes (no compile; in the program's
        own dtypes, where XLA:CPU widens bf16 collectives to float32; a ring of more than 2 lowers
        its loop with no known trip count, which the reader refuses), or "unquantized": the whole
        step compiled (untuned) without :data:`QUANTIZER` — XLA:GPU's pass that sends a permute's
        value in bf16 where the sender widened it from bf16 or the receiver narrows it at once (exact;
        on GPUs it sent 0.70 of the ring's p2p bytes: docs/gpu/p2pbytes-2026-11-29-h200.md). Per
        pass, the loss and loss+grads programs are compiled only to be read, never run: without GEMM
        autotuning (which picks kernels, not collectives), so a row costs one tuned compile, not
        three — on 4x H200 the JAX twin's calibration and first rows did not fit a 10-minute call
        (2026-11-27). On GPUs even those two cost minutes: see :data:`GPU_TRAFFIC_SCOPE`."""
        from ..accounting.hlo import count_collectives
        from ..training.llama_jax import measure_traffic

        if scope == "whole step":
            return count_collectives(self.compiled.as_text(), "step")
        if scope == "lowered":
            return count_collectives(self.lowered.as_text(dialect="hlo"), "step")
        if scope == "unquantized":
            return count_collectives(self.lowered.compile(compiler_options=without_quantizer(self.options)).as_text(), "step")
        if scope != "per pass":
            raise ValueError(f"scope must be 'per pass', 'whole step', 'lowered' or 'unquantized', got {scope!r}")
        params, opt_state = self.state
        loss, grads, _ = self.programs
        untuned = {"xla_gpu_autotune_level": 0}
        texts = [loss.lower(params, *self.batch).compile(compiler_options=untuned).as_text(),
                 grads.lower(params, *self.batch).compile(compiler_options=untuned).as_text(),
                 self.compiled.as_text()]
        return measure_traffic(self.case, texts)


def _peak_bytes() -> float | None:
    """The first device's peak allocation so far in this process (XLA keeps no per-step peak: a
    row's figure is the largest of it and every row before it); None where none is reported."""
    import jax

    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use") or None
    except Exception:  # noqa: BLE001 — the CPU reports no memory
        return None


# How a GPU row's bytes are held against the model: the whole step's program, per kind. Per pass
# needs the loss and loss+grads programs compiled too, and on 2x H200 (2026-11-28) one such
# untuned compile of the 2-GPU step at 8k tokens ran over 120 s (the whole twin's 32k row over
# 10 minutes: its tuned step and those two); the per-pass split of the same programs is checked on
# the CPU (tests/multidevice/test_llama_scale.py), where a compile costs seconds.
GPU_TRAFFIC_SCOPE = "whole step"


def timed_step(case: ModelCase, dtype: str, block_backend: str, warmup: int, iters: int,
               traffic_scope: str | None = "per pass") -> dict:
    """The case's step: median seconds, peak bytes, and (``traffic_scope`` not None) its compiled
    collectives in that scope (:meth:`JaxRig.traffic`)."""
    from ..training.llama_gpu import jax_median_ms

    rig = JaxRig(case, dtype, block_backend)
    seconds = jax_median_ms(rig.run, warmup, iters) * 1e-3
    out = {"seconds": seconds, "peak_bytes": _peak_bytes()}
    if traffic_scope is not None:
        out |= {"traffic": rig.traffic(traffic_scope).rows(), "traffic_scope": traffic_scope,
                "traffic_unquantized": rig.traffic("unquantized").rows()}
    return out


def exposure_of(case: ModelCase, dtype: str, block_backend: str, warmup: int) -> dict:
    """Exposed fractions per kind from an XLA trace of one step (after ``warmup``), every GPU of
    the mesh one "rank"; on the CPU nothing is profiled (every fraction 1, :data:`SERIAL`)."""
    import jax

    kinds = sorted({kind for _, kind in llama_step_traffic(case, "jax", dtype).rows()})
    if jax.devices()[0].platform == "cpu":
        return {"fractions": {k: 1.0 for k in kinds}, "source": UNPROFILED, "seq": case.seq}
    start = time.perf_counter()
    rig = JaxRig(case, dtype, block_backend)
    rig.compiled  # noqa: B018 — compiled here, so its time is told apart from the trace's
    compiled = time.perf_counter()
    for _ in range(max(1, warmup)):
        jax.block_until_ready(rig.run())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(rig.run())
        traced = time.perf_counter()
        per_gpu = xla_trace_kernels(trace_dir)
    per_rank = [exposed_times(rows, send_recv_kinds(kinds)) for _, rows in sorted(per_gpu.items())]
    return {"fractions": fractions(per_rank, kinds), "seq": case.seq, "per_rank": per_rank,
            "source": "XLA trace of one step, mean over the GPUs",
            "seconds": {"compile": compiled - start, "warmup_and_trace": traced - compiled,
                        "read_trace": time.perf_counter() - traced}}


def measure_jax(run: ScaleRun, devices: str, world: int | None = None, emit=None) -> dict:
    """``llama_scale.measure`` in JAX: calibrate, every strategy × T at one row, the B* sweep;
    the same result dict (``env["framework"] == "jax"``), each row to ``emit`` as measured."""
    import jax

    from ..training.llama_gpu import jax_attention_rate
    from .calibrate import hardware_profile
    from .llama_scale import calibration_seqs

    world = world or (len(jax.devices()) if devices == "gpu" else 2)
    if world < 2 or world > len(jax.devices()):
        raise ValueError(f"the whole model over several devices needs 2 to {len(jax.devices())}, got {world}")
    for strategy in run.strategies:
        strategy_mesh(strategy, world)
    exposure_seq, host_seq = calibration_seqs(run)
    emit = emit or (lambda row: None)
    profile = jax_profile(run.sizes, jax.devices()[:world])  # the world's devices, as the steps use
    device_name = jax.devices()[0].device_kind
    emit({"hardware": hardware_profile(f"llama-scale-jax-{devices}{world}", "python -m parity.capacity.llama_scale "
                                       "--framework jax", profile, device_name, world, run.sizes,
                                       f"jax {jax.__version__}")})
    kernels: dict[tuple[int, int], tuple[str, float]] = {}
    exposures: dict[str, dict] = {}
    floors: dict[str, float] = {}

    def kernel(seq: int, batch: int) -> tuple[str, float]:
        if (seq, batch) not in kernels:
            c = run.model
            kernels[seq, batch] = jax_attention_rate(run.block_backend, seq // world, c.heads, c.head_dim, batch,
                                                     run.dtype)
        return kernels[seq, batch]

    def calibration(strategy: str) -> tuple[dict, float]:
        if strategy not in exposures:
            exposures[strategy] = exposure_of(model_case(run, strategy, exposure_seq, 1, world), run.dtype,
                                              run.block_backend, run.warmup)
            emit({"exposure": strategy, **exposures[strategy]})
            case = model_case(run, strategy, host_seq, 1, world)
            # timed once, unlike torch's here (``llama_scale.host_floor_seconds``, two timings): a
            # second timing builds and compiles the whole model's step again (GEMM autotuning), in
            # the longest call of the run list; JAX's one measured floor sat within 1.3 % of its
            # smallest rows (the FSDP x TP sweep, 4x H200: 13.04 ms against 12.88-12.99), torch's 27 % above
            floors[strategy] = timed_step(case, run.dtype, run.block_backend, run.warmup, run.iters, None)["seconds"]
            emit({"host_floor": strategy, "seq": host_seq, "seconds": floors[strategy]})
        return exposures[strategy], floors[strategy]

    def timed(strategy: str, case: ModelCase) -> tuple[dict, dict, float]:
        exposed, host_s = calibration(strategy)
        scope = "per pass" if devices == "cpu" else GPU_TRAFFIC_SCOPE
        return timed_step(case, run.dtype, run.block_backend, run.warmup, run.iters, scope), exposed, host_s

    def verify(case: ModelCase) -> dict:
        return verdict(case, run.dtype, *JaxRig(case, run.dtype, run.block_backend).loss_and_grads())

    versions = {"framework": "jax", "jax": jax.__version__}
    return scale_result(run, world, versions, device_name, profile, verify, timed, kernel, kernels, exposures, floors,
                        emit)
