"""``python -m parity accounting``: the analytical communication model against what XLA's compiled
HLO and torch's collectives move — bytes and calls, per device, per pass and collective kind —
for sequence-parallel attention and for the FFN training step under DP / FSDP / TP / FSDP+TP /
ZeRO-1. The same check closes the main ``python -m parity`` run.

Every configuration is three-way: model == JAX HLO == torch trace, exactly. On XLA:CPU, bf16
collectives are widened to float32 by the compiler (its CPU collectives have no bf16 path), so
the JAX side of a low-precision configuration is compared with the model at 4 bytes per element
there — a backend fact, pinned by its own test; GPUs move what the model says. With attention
sinks the model itself differs per framework (JAX all-reduces their cotangent, torch moves
nothing for them: ``attention_traffic(..., framework=)``), so each framework is compared with its
own (``Verdict.expected``).
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..accounting.model import DTYPE_BYTES, FRAMEWORKS, Traffic, attention_traffic
from ..core.cases import Case
from ..core.mesh import MeshShape
from ..core.names import Device
from ..training.llama import LlamaConfig, ModelCase
from ..training.llama_traffic import llama_step_traffic
from ..training.reference import TrainCase, make_train_inputs
from ..training.traffic_model import ffn_step_traffic
from . import step_cost

ATTENTION_CONFIGS = [
    Case(ring=2), Case(ring=4), Case(ring=8), Case(ring=4, layout="stripe", kv_heads=2),
    Case(ring=8, layout="contiguous", kv_heads=1, causal=False), Case(ring=4, layout="zigzag", head_dim=40),
    Case(ulysses=2), Case(ulysses=4, kv_heads=2), Case(ulysses=8, kv_heads=1), Case(ulysses=4, kv_heads=8, causal=False),
    Case(ring=2, ulysses=2), Case(ring=2, ulysses=2, kv_heads=1), Case(ring=2, ulysses=4, kv_heads=2),
    Case(ring=4, ulysses=2, kv_heads=4, layout="stripe"), Case(ring=2, ulysses=2, data=2, batch=4, kv_heads=2),
    Case(ring=4, data=2, batch=2), Case(ulysses=2, data=4, batch=4), Case(ring=1, data=8, batch=8),
    Case(ring=4, kv_exchange="allgather"), Case(ring=8, layout="stripe", kv_heads=2, kv_exchange="allgather"),
    Case(ring=2, ulysses=2, kv_heads=1, kv_exchange="allgather"),
    Case(ring=4, ring_outer=2), Case(ring=4, ring_outer=2, ulysses=2, kv_heads=2, layout="stripe"),
    Case(ring=8, ring_outer=4, layout="contiguous", kv_heads=1), Case(ring=8, ring_outer=2, causal=False),
    # packed documents: the segment ids' all-gathers over Ulysses, the ring, the double ring's two rings
    Case(ring=4, kv_exchange="allgather", documents="interleaved"), Case(ulysses=4, kv_heads=2, documents="one"),
    Case(ring=4, ring_outer=2, ulysses=2, kv_heads=2, batch=2, documents="mix"),
    # sliding windows (zigzag and stripe: every K/V hop still happens) and attention sinks (JAX all-reduces their
    # cotangent: over the ring (and data) devices, under Ulysses its heads' part first, then [h] over Ulysses)
    Case(ring=4, layout="zigzag", window=(5, 2)), Case(ring=8, layout="stripe", kv_heads=2, causal=False, window=(20, 9)),
    Case(ring=4, ring_outer=2, ulysses=2, kv_heads=2, layout="stripe", window=(5, 2), sinks=True),  # both all-reduces
    Case(ring=4, layout="zigzag", kv_exchange="allgather", window=(20, 9), sinks=True),
    Case(ring=4, layout="contiguous", kv_heads=2, sinks=True), Case(ulysses=4, kv_heads=2, sinks=True),
    Case(ring=2, ulysses=2, data=2, batch=4, kv_heads=2, sinks=True),
    # windows that truncate the ring (contiguous layout, causal or right 0): reach 1, 3, 1 (USP), 1, 0, then
    # a ring of 2 (whole) — the reach-1 ones and the ring of 2 with a window shorter than a shard trim hops to its halo
    Case(ring=4, layout="contiguous", window=(5, 0)), Case(ring=8, layout="contiguous", kv_heads=2, window=(17, 4)),
    Case(ring=4, ulysses=2, layout="contiguous", kv_heads=2, window=(10, 0)),
    Case(ring=4, layout="contiguous", causal=False, window=(6, 0)), Case(ring=4, layout="contiguous", window=(0, 0)),
    Case(ring=2, layout="contiguous", window=(5, 0)),  # a ring of 2: not truncated, its one hop trimmed to the halo
    # explicit token indices (the per-document zigzag's): one more int32 all-gather over the groups the ids use —
    # alone (no ids) on a ring; with ids under USP (two gathers per group); on the double ring's two rings
    Case(ring=4, token_index=True), Case(ring=2, ulysses=2, kv_heads=2, batch=2, documents="mix", token_index=True),
    Case(ring=4, ring_outer=2, documents="one", token_index=True),
    Case(ring=4, layout="contiguous", window=(5, 0), token_index=True),  # the window on the indices: no truncation
]

TRAINING_CONFIGS = [
    TrainCase("dp", fsdp=2), TrainCase("dp", fsdp=4), TrainCase("dp", fsdp=8, blocks=3),
    TrainCase("fsdp", fsdp=2), TrainCase("fsdp", fsdp=4), TrainCase("fsdp", fsdp=8, blocks=3),
    TrainCase("tp", tp=2), TrainCase("tp", tp=4, blocks=3),
    TrainCase("fsdp_tp", fsdp=2, tp=2), TrainCase("fsdp_tp", fsdp=2, tp=4), TrainCase("fsdp_tp", fsdp=4, tp=2, blocks=3),
    TrainCase("zero1", fsdp=2), TrainCase("zero1", fsdp=4, blocks=3),
]

# The whole model's step (parity.training.llama_traffic): attention CP in every layer + FSDP or
# replicated weights, every strategy, tied embeddings and all-gather KV among them; torch's FSDP2
# units per weight and per decoder block (tied: the embedding in the root unit).
LLAMA_CONFIGS = [
    ModelCase(LlamaConfig(window=(6, 0)), MeshShape(ring=2)),
    ModelCase(LlamaConfig(), MeshShape(ulysses=2), fsdp=False),
    ModelCase(LlamaConfig(), MeshShape(data=2, ring=2, ulysses=2), layout="stripe"),
    ModelCase(LlamaConfig(tie_embeddings=True, kv_heads=1), MeshShape(ring=4, ring_outer=2), fsdp=False,
              layout="contiguous"),
    ModelCase(LlamaConfig(tie_embeddings=True), MeshShape(ring=4, kv_exchange="allgather"), fsdp_units="block"),
]


def _attention_path(case: Case) -> tuple:
    """The branch of ``attention_traffic`` a configuration exercises: algorithm, KV exchange,
    whether Ulysses replicates KV heads (float32 dK/dV back through the all-to-all), data axis;
    every configuration with sinks is one path (the first of them takes both of the sinks'
    all-reductions; the rest of its traffic is a path without sinks), so the default run's
    accounting stays within its time."""
    if case.sinks:
        return ("sinks",)
    if case.token_index:  # the extra int32 gather: once without Ulysses, once through it (the ring's path is the same)
        return "token index", case.ulysses > 1
    if case.window is not None and case.layout == "contiguous" and case.kv_exchange == "ring" and case.ring_outer == 1:
        return ("truncated ring",)  # one path: the model's truncated branch (the reach-0 case is in the full list)
    return case.strategy, case.kv_exchange, case.ulysses > 1 and case.kv_heads < case.ulysses, case.data > 1


def one_per_path(attention: list[Case], training: list[TrainCase]) -> tuple[list[Case], list[TrainCase]]:
    """The first configuration of every distinct model path (attention: ``_attention_path``;
    training: the strategy). The main ``python -m parity`` run closes with these — every branch
    of both models, three-way, in about half the time of the whole list (19 of its 48
    configurations); ``python -m parity accounting`` and the tests check every configuration."""
    def first(items, key):
        seen = {}
        for item in items:
            seen.setdefault(key(item), item)
        return list(seen.values())

    return first(attention, _attention_path), first(training, lambda c: c.strategy)


@dataclass
class Verdict:
    """One configuration: the model and each framework's measurement (None: not run)."""

    name: str
    model: Traffic  # JAX's (the one shown in the table)
    measured: dict[str, Traffic | str] = field(default_factory=dict)  # str: the error that stopped it
    widened: Traffic | None = None  # what XLA:CPU moves for a low-precision config (see above)
    models: dict[str, Traffic] = field(default_factory=dict)  # a framework's own model where they differ (sinks)
    cost: object = None  # the JAX program's FLOPs against the step model (parity.checks.step_cost.CostVerdict)

    def problems(self) -> list[str]:
        out = []
        for framework, got in self.measured.items():
            if isinstance(got, str):
                out.append(f"{framework}: {got}")
            elif got != self.expected(framework):
                out.append(f"{framework}:\n" + self.expected(framework).diff(got, ("model", framework)))
        return out

    def expected(self, framework: str) -> Traffic:
        if framework == "jax" and self.widened is not None:
            return self.widened
        return self.models.get(framework, self.model)


def _jax_widens(dtype: str, devices: str) -> bool:
    return devices == "cpu" and DTYPE_BYTES[dtype] < 4


def _last_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


def check_attention(case: Case, frameworks, devices: Device = "cpu", return_lse: bool = True) -> Verdict:
    measured = {}
    for framework in frameworks:
        try:
            if framework == "jax":
                from ..runners import jax_runner

                measured[framework] = jax_runner.measure_attention_traffic(case, return_lse=return_lse)
            else:
                from ..runners import torch_runner

                measured[framework] = torch_runner.measure_attention_traffic(case, devices=devices,
                                                                             return_lse=return_lse)
        except Exception:  # noqa: BLE001 — reported as that framework's failure
            measured[framework] = _last_line()
    widened = None
    if _jax_widens(case.dtype, devices):
        widened = attention_traffic(replace(case, dtype="float32"), return_lse=return_lse, framework="jax")
    models = {f: attention_traffic(case, return_lse=return_lse, framework=f) for f in FRAMEWORKS}
    return Verdict(case.name + ("" if return_lse else "-o-only"), models["jax"], measured, widened, models)


def _cost(fn, case, texts):
    """``fn(case, texts)``: a CostVerdict, or one that carries the error that stopped it."""
    try:
        return fn(case, texts)
    except Exception:  # noqa: BLE001 — reported as the configuration's failure
        return step_cost.CostVerdict(f"{case.name} (JAX)", error=_last_line())


def check_training(case: TrainCase, frameworks, devices: Device = "cpu") -> Verdict:
    measured, cost = {}, None
    for framework in frameworks:
        try:
            if framework == "jax":
                from ..training import jax_step

                texts = jax_step.compiled_texts(case)
                measured[framework] = jax_step.measure_traffic(case, texts)
                cost = _cost(step_cost.ffn_cost_verdict, case, texts)
            else:
                from ..training import torch_step

                measured[framework] = torch_step.measure_traffic(case, make_train_inputs(case), devices=devices)
        except Exception:  # noqa: BLE001 — reported as that framework's failure
            measured[framework] = _last_line()
    widened = ffn_step_traffic(case.model_step(4)) if _jax_widens(case.dtype, devices) else None
    return Verdict(case.name, ffn_step_traffic(case.model_step()), measured, widened, cost=cost)


def check_llama(case: ModelCase, frameworks, devices: Device = "cpu") -> Verdict:
    """One whole-model training step: each framework against its own model (they differ where
    their FSDP machinery does: ``parity.training.llama_traffic``)."""
    measured, cost = {}, None
    for framework in frameworks:
        try:
            if framework == "jax":
                from ..training import llama_jax

                texts = llama_jax.compiled_texts(case)
                measured[framework] = llama_jax.measure_traffic(case, texts)
                cost = _cost(step_cost.llama_cost_verdict, case, texts)
            else:
                from ..training import llama_torch

                measured[framework] = llama_torch.measure_traffic(case, devices=devices)
        except Exception:  # noqa: BLE001 — reported as that framework's failure
            measured[framework] = _last_line()
    models = {f: llama_step_traffic(case, f) for f in FRAMEWORKS}
    return Verdict(case.name, models["jax"], measured, None, models, cost=cost)


def run_all(frameworks, devices: Device = "cpu", name_filter: str = "", device_limit: int = 8,
            every_config: bool = True) -> list[Verdict]:
    """Every built-in configuration (or, with ``every_config=False``, one per model path: see
    ``one_per_path``) that fits on ``device_limit`` devices and matches the filter."""
    from rich.progress import track

    def keep(name: str, n: int) -> bool:
        return n <= device_limit and all(t in name for t in name_filter.split())

    attention = [c for c in ATTENTION_CONFIGS if keep(c.name, c.devices)]
    training = [c for c in TRAINING_CONFIGS if keep(c.name, c.devices)]
    llama = [c for c in LLAMA_CONFIGS if keep(c.name, c.mesh.devices)]
    if not every_config:
        attention, training = one_per_path(attention, training)
        llama = llama[:1]
    jobs = ([(check_attention, c) for c in attention] + [(check_training, c) for c in training]
            + [(check_llama, c) for c in llama])
    costs = [] if "jax" not in frameworks else [  # the single-device step's FLOPs and bytes (JAX only: the HLO count)
        (lambda c, *_: step_cost.check_step_cost(c, per_pass=every_config), c)
        for c in step_cost.STEP_COST_CONFIGS if keep(c.name, 1)]
    if "torch" not in frameworks or "jax" not in frameworks:
        return [fn(c, frameworks, devices) for fn, c in track(jobs + costs, description="accounting")]
    # Both: torch's traces run on its worlds' ranks from a second thread (it mostly waits on their
    # queues) while this thread compiles the JAX programs — one after the other they took 14 s + 39 s
    # of `python -m parity` on 2 cores (2026-11-28).
    with ThreadPoolExecutor(1) as pool:
        torch_side = pool.submit(lambda: [fn(c, ["torch"], devices) for fn, c in jobs])
        jax_side = [fn(c, ["jax"], devices) for fn, c in track(jobs + costs, description="accounting")]
        merged_jobs = [merged(j, t) for j, t in zip(jax_side, torch_side.result())]
    return merged_jobs + jax_side[len(jobs):]


def merged(jax_verdict: Verdict, torch_verdict: Verdict) -> Verdict:
    """One configuration's verdict from its JAX-only and torch-only checks (the models, built for
    both frameworks either way, and the JAX program's cost come with the JAX one)."""
    return replace(jax_verdict, measured={**jax_verdict.measured, **torch_verdict.measured})


def print_verdicts(verdicts: list) -> int:
    """A table (model bytes per pass; ok per framework), then the compute table of the JAX
    programs' FLOPs and bytes (``step_cost``); returns the number of mismatches."""
    from rich.console import Console
    from rich.table import Table

    costs = [v for v in verdicts if isinstance(v, step_cost.CostVerdict)]
    costs += [v.cost for v in verdicts if isinstance(v, Verdict) and v.cost is not None]
    verdicts = [v for v in verdicts if isinstance(v, Verdict)]

    frameworks = sorted({f for v in verdicts for f in v.measured})
    table = Table(title="communication per device: model == measured (bytes and calls, every pass and kind)")
    for col in ("config", "fwd B", "bwd B", "step B", "calls", *frameworks):
        table.add_column(col, no_wrap=True)
    bad = 0
    for v in verdicts:
        calls = sum(c for c, _ in v.model.rows().values())
        marks = []
        for f in frameworks:
            got = v.measured.get(f)
            ok = isinstance(got, Traffic) and got == v.expected(f)
            marks.append("-" if got is None else "[green]==[/]" if ok else "[bold red]differs[/]")
        bad += bool(v.problems())
        table.add_row(v.name, *(f"{float(v.model.bytes(p)):,.0f}" for p in ("fwd", "bwd", "step")), str(calls), *marks)
    console = Console(width=200)
    console.print(table)
    for v in verdicts:
        for p in v.problems():
            console.print(f"[bold red]MISMATCH[/] {v.name} {p}", highlight=False)
    if costs:
        bad += step_cost.print_cost_verdicts(costs)
    return bad


def summary(verdicts: list) -> str:
    """"a of b configurations equal the communication model; c of d programs the step model"."""
    comm = [v for v in verdicts if isinstance(v, Verdict)]
    costs = [v for v in verdicts if isinstance(v, step_cost.CostVerdict)] + [v.cost for v in comm if v.cost]
    text = f"{sum(not v.problems() for v in comm)} of {len(comm)} configurations equal the communication model"
    if costs:
        text += (f"; {sum(not v.problems() for v in costs)} of {len(costs)} JAX programs equal the step model's "
                 "FLOPs (and memory bytes)")
    return text


def run_accounting(frameworks=("jax", "torch"), devices: Device = "cpu", name_filter: str = "") -> int:
    """``python -m parity accounting``: every configuration, a table, exit status 1 on a mismatch
    (JAX must already be configured for ``devices``)."""
    from ..runners.base import Unavailable, load_runner
    from ..runners.torch_world import close_worlds

    runners = {f: load_runner(f) for f in frameworks}
    available = [f for f, r in runners.items() if not isinstance(r, Unavailable)]
    for f, r in runners.items():
        if isinstance(r, Unavailable):
            print(f"{f}: skipped ({r.reason})")
    limit = min((runners[f].device_count(devices) for f in available), default=0)
    start = time.time()
    try:
        verdicts = run_all(available, devices, name_filter, limit) if available else []
    finally:
        close_worlds()
    bad = print_verdicts(verdicts)
    print(f"{summary(verdicts)} in {time.time() - start:.0f} s")
    return 1 if bad or not verdicts else 0
