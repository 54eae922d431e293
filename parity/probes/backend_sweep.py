"""Every block backend of each framework through GPU-sized parity cases (issue 24, item 2): the
part of ``python -m parity --devices gpu`` that the CPU matrix cannot be.

Cases (``sweep_cases``): ring R = 2 at ``seq`` tokens (4096-token local blocks at the default
8192), GQA 8/2, head_dim 128, in bf16 and fp16, one per block-mask mix the schedule produces —
zigzag causal (causal diagonal + full half-blocks), stripe causal (causal + strict), contiguous
non-causal (full) — so every backend meets every mask kind full / causal / strict. Each case runs
through ``check_case`` once per (framework, backend) on one set of inputs: the real mesh when
enough devices are present, else the replay of its strategy on one device (one GPU). Truth: the
float64 oracle, computed by torch on the device (``parity.runners.torch_truth``) — the NumPy
oracle would need minutes per case on a host. Control: each framework's dense attention in the
case's dtype, computed once per case. JAX vs torch: the ``auto`` pair and the ``reference`` pair
on the same low-precision inputs.

Per row the report names, besides pass / fail, the resolved kernel of each mask kind
(``resolve_backend``), the worst error ratio to the dense same-dtype control (the contract's (docs/contract.md) metric:
max |x − truth| / max |control − truth|; the policy allows ``LOWP_FACTOR`` plus a floor) and the
worst relative L2 error next to the control's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..core.cases import Case
from ..core.inputs import TENSORS, flash_ideal, make_inputs, oracle
from ..core.names import Device
from ..runners.base import Unavailable, load_runner
from ..runners.pipeline import Side, check_case, cross_check

__all__ = ["SWEEP_BACKENDS", "SweepRow", "mask_kinds", "resolved_backends", "run_sweep", "sweep_cases",
           "sweep_markdown"]

SWEEP_BACKENDS = {"jax": ("reference", "cudnn", "fa3", "auto"),
                  "torch": ("reference", "aten_flash", "aten_cudnn", "auto")}
CROSS_PAIRS = ("auto", "reference")  # backends checked JAX vs torch (same name in both frameworks)
LAYOUT_MIXES = (("zigzag", True), ("stripe", True), ("contiguous", False))


def sweep_cases(seq: int = 8192, heads: int = 8, kv_heads: int = 2, head_dim: int = 128, ring: int = 2,
                dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> list[Case]:
    """One case per (block-mask mix, dtype); see the module docstring."""
    return [Case(ring=ring, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, layout=layout,
                 causal=causal, dtype=dtype) for dtype in dtypes for layout, causal in LAYOUT_MIXES]


def mask_kinds(case: Case) -> list[str]:
    """The block mask kinds the case's schedule hands the kernels (full, causal, strict)."""
    from seqplan.schedule import step_plan

    plan = step_plan(case.layout, case.causal)
    blocks = [plan.local] + ([plan.from_earlier, plan.from_later] if case.ring * case.ring_outer > 1 else [])
    return sorted({b.mask.kind.value for b in blocks if b is not None})


def resolved_backends(framework: str, backend: str, case: Case, devices: Device) -> dict[str, str]:
    """mask kind -> the concrete kernel ``backend`` runs for it (``resolve_backend``), or why not.
    With packed documents a block is resolved with its document mask (the blocks that hold
    documents); a window is decided per block at run time, so its kinds are named "+window", and
    where a block whose parts are runs of original positions (``BlockMask.offset``) takes another
    kernel than one whose parts are not, both are named."""
    import importlib

    from seqplan.schedule import BlockMask, MaskKind

    block = importlib.import_module(f"{'jax_impl' if framework == 'jax' else 'torch_impl'}.block")
    kind = "cuda" if devices == "gpu" else "cpu"
    documents = case.documents != "none"
    out = {}
    if case.token_index and case.causal and case.window is None:  # every block: FULL, causal by token index
        from seqplan.schedule import UNBOUNDED

        for docs in ((False, True) if documents else (False,)):
            name = "by-token-index" + ("+documents" if docs else "")
            try:
                out[name] = block.resolve_backend(backend, device_kind=kind, dtype=case.dtype, mask=BlockMask(
                    MaskKind.FULL, documents=docs, window=(UNBOUNDED, 0)))
            except Exception as err:  # noqa: BLE001 — reported in the row, the run goes on
                out[name] = f"unresolved: {err}"
        return out
    for mask in mask_kinds(case):
        name = mask + ("+documents" if documents else "") + ("+window" if case.window is not None else "")
        try:
            resolve = lambda offset, m=mask: block.resolve_backend(
                backend, device_kind=kind, dtype=case.dtype,
                mask=BlockMask(MaskKind(m), documents=documents, window=case.window, offset=offset))
            out[name] = resolve(None)
            if case.window is not None and resolve(0) != out[name]:  # a block whose parts are position runs
                out[name] = f"{resolve(0)} (parts that are position runs), else {out[name]}"
        except Exception as err:  # noqa: BLE001 — reported in the row, the run goes on
            out[mask] = f"unresolved: {err}"
    return out


def unavailable(framework: str, backend: str, case: Case) -> str | None:
    """Why ``backend`` cannot run ``case`` here (not installed for this process, or a mask kind /
    dtype its ``supports`` refuses), or None: such a row is *skipped* with that reason."""
    import importlib

    block = importlib.import_module(f"{'jax_impl' if framework == 'jax' else 'torch_impl'}.block")
    if backend == "auto":
        return None
    try:
        kernels = block.get_backend(backend)
    except Exception as err:  # noqa: BLE001 — any refusal is the reason this backend is skipped
        return f"{backend}: {err}"
    if not kernels.available():
        return f"{backend} is not available in this process (package or device missing)"
    refused = [m for m in mask_kinds(case) if not kernels.supports(block.BlockMask(m), case.dtype)]
    return f"{backend} does not take {case.dtype} {'/'.join(refused)} blocks" if refused else None


@dataclass
class SweepRow:
    """One (case, framework, backend) verdict with the report's numbers."""

    case: Case
    framework: str
    backend: str
    side: Side
    resolved: dict[str, str] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)  # tensor -> max error / control's max error
    rel_l2: dict[str, float] = field(default_factory=dict)
    control_rel_l2: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def worst(self) -> tuple[str, float]:
        if not self.ratio:
            return "", float("nan")
        name = max(self.ratio, key=self.ratio.__getitem__)
        return name, self.ratio[name]

    def to_dict(self) -> dict:
        name, ratio = self.worst()
        return {"case": self.case.name, "framework": self.framework, "backend": self.backend,
                "mode": self.side.mode, "status": self.side.status, "resolved": self.resolved,
                "worst_tensor": name, "worst_ratio": ratio, "ratio": self.ratio, "rel_l2": self.rel_l2,
                "control_rel_l2": self.control_rel_l2, "errors": self.side.errors, "detail": self.side.detail,
                "seconds": round(self.seconds, 2)}


def _rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), finite):
        return float("inf")
    return float(np.linalg.norm((got - ref)[finite]) / max(np.linalg.norm(ref[finite]), 1e-300))


def _truth(case: Case, x, devices: Device) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """(float64 truth, flash ideal or None): torch's truth on the GPU for ``gpu`` (no ideal: the
    policy's dense control alone, as a caller giving ``ref`` may), else the NumPy oracle with, for a
    low-precision case, the flash ideal beside it — what ``check_case`` computes when it draws the
    truth itself. Without it the sweep judged bf16 by the dense control alone: a ring-2 stripe
    case's dq (1.70e-2, both frameworks) failed its 1.43e-2 bound (seed 1595859486)."""
    if devices == "gpu":
        from ..runners.replay_runner import torch_device
        from ..runners.torch_truth import case_truth

        return case_truth(case, x, torch_device(devices)), None
    return oracle(case, x), flash_ideal(case, x) if case.dtype != "float32" else None


def run_sweep(cases: list[Case], backends: dict[str, tuple[str, ...]], devices: Device, seed: int,
              replay: bool | None = None, log=print) -> tuple[list[SweepRow], list[tuple[Case, str, Side]]]:
    """Every case through every (framework, backend); ``replay``: True forces the one-device
    replay, False the mesh, None picks by device count (as ``check_case`` does). Returns the rows
    and the JAX-vs-torch verdicts (case, backend, side)."""
    rows, crosses = [], []
    bases = {f: load_runner(f) for f in backends}
    for index, case in enumerate(cases):
        x = make_inputs(case, seed + index)
        ref, ideal = _truth(case, x, devices)
        controls: dict[str, dict | None] = {}
        by_key: dict[tuple[str, str], Side] = {}
        for framework, names in backends.items():
            base = bases[framework]
            for name in names:
                start = time.perf_counter()
                why = base.reason if isinstance(base, Unavailable) else unavailable(framework, name, case)
                if why:
                    side = Side("skipped", detail=why)
                else:
                    runner = type(base)(block_backend=name)
                    if replay or (replay is None and case.devices > runner.device_count(devices)):
                        runner = runner.replay(devices)
                    if framework not in controls:
                        try:
                            controls[framework] = runner.run_control(case, x) if case.dtype != "float32" else None
                        except Exception as err:  # noqa: BLE001 — check_case computes and reports it
                            log(f"{framework} control failed ({err}); each case computes its own")
                            controls[framework] = None
                    side = check_case(case, runner, x=x, ref=ref, devices=devices, control=controls[framework], ideal=ideal)
                row = SweepRow(case, framework, name, side, seconds=time.perf_counter() - start)
                if not isinstance(base, Unavailable):
                    row.resolved = resolved_backends(framework, name, case, devices)
                for check in side.checks:
                    if check.control_error:
                        row.ratio[check.name] = check.error / check.control_error
                for t in TENSORS:
                    if t in side.results:
                        row.rel_l2[t] = _rel_l2(side.results[t], ref[t])
                    if side.control is not None and t in side.control:
                        row.control_rel_l2[t] = _rel_l2(side.control[t], ref[t])
                rows.append(row)
                by_key[(framework, name)] = side
                worst, ratio = row.worst()
                log(f"{case.name} {framework}:{name} [{side.mode}] {side.status} worst {worst or '-'} "
                    f"{ratio:.3g} ({row.seconds:.1f} s) {side.detail[:200] if side.status != 'passed' else ''}")
        for name in CROSS_PAIRS:
            j, t = by_key.get(("jax", name)), by_key.get(("torch", name))
            if j is not None and t is not None and j.checks and t.checks:
                crosses.append((case, name, cross_check(case, j, t)))
                log(f"{case.name} jax-vs-torch {name}: {crosses[-1][2].status}")
    return rows, crosses


def summary(rows: list[SweepRow]) -> list[dict]:
    """Per (framework, backend): cases passed / failed / skipped, the worst ratio to the control
    (and where), the worst relative L2 and the control's, the kernels it resolved to per mask."""
    out: dict[tuple, dict] = {}
    for r in rows:
        s = out.setdefault((r.framework, r.backend), {
            "framework": r.framework, "backend": r.backend, "passed": 0, "failed": 0, "skipped": 0,
            "worst_ratio": 0.0, "worst_at": "", "worst_rel_l2": 0.0, "control_rel_l2": 0.0, "resolved": {}})
        s[r.side.status] += 1
        for mask, kernel in r.resolved.items():
            s["resolved"].setdefault(mask, set()).add(kernel)
        name, ratio = r.worst()
        if name and not ratio <= s["worst_ratio"]:
            s["worst_ratio"], s["worst_at"] = ratio, f"{name} {r.case.name}"
        s["worst_rel_l2"] = max([s["worst_rel_l2"], *r.rel_l2.values()])
        s["control_rel_l2"] = max([s["control_rel_l2"], *r.control_rel_l2.values()])
    for s in out.values():
        s["resolved"] = {m: sorted(k) for m, k in sorted(s["resolved"].items())}
    return list(out.values())


def sweep_markdown(rows: list[SweepRow], crosses: list[tuple[Case, str, Side]]) -> str:
    """The report's section: the per-backend summary, then every row and the JAX-vs-torch checks."""
    from ..core.numerics import LOWP_FACTOR

    lines = ["## Every block backend on GPU-sized cases", "",
             (f"Ratio: max |x − truth| / max |dense same-dtype control − truth| (docs/contract.md; the policy allows "
              f"{LOWP_FACTOR:g} plus a quarter-ulp floor); rel L2: ‖x − truth‖ / ‖truth‖ (the control's beside it). "
              "Truth: float64 on the same rounded inputs. mode: mesh or replay (every virtual device's work on "
              "one device)."), "",
             "| framework | backend | kernels per mask | passed | failed | skipped | worst ratio | at | worst rel L2 "
             "| control rel L2 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary(rows):
        kernels = ", ".join(f"{m}: {'/'.join(k)}" for m, k in s["resolved"].items())
        lines.append(f"| {s['framework']} | {s['backend']} | {kernels} | {s['passed']} | {s['failed']} | "
                     f"{s['skipped']} | {s['worst_ratio']:.3g} | {s['worst_at']} | {s['worst_rel_l2']:.2e} | "
                     f"{s['control_rel_l2']:.2e} |")
    lines += ["", "| case | framework | backend | mode | status | worst tensor | ratio | rel L2 (dq) | seconds |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name, ratio = r.worst()
        dq = f"{r.rel_l2['dq']:.2e}" if "dq" in r.rel_l2 else "–"
        lines.append(f"| {r.case.name} | {r.framework} | {r.backend} | {r.side.mode} | {r.side.status} | "
                     f"{name or '–'} | {ratio:.3g} | {dq} | {r.seconds:.1f} |")
    if crosses:
        lines += ["", "JAX vs torch on identical inputs (error in the policy's metric, tolerance = the sum of "
                  "both sides' tolerances):", ""]
        lines += [f"- `{c.name}` {name}: **{s.status}** {s.detail.strip()}" for c, name, s in crosses]
    bad = [r for r in rows if r.side.status != "passed"]
    if bad:
        lines += ["", "Not passed:", ""] + [f"- `{r.case.name}` {r.framework}:{r.backend} **{r.side.status}**: "
                                            f"{r.side.detail.strip()[:400]}" for r in bad]
    return "\n".join(lines) + "\n"
