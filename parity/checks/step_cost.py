"""The step-time model's FLOPs and bytes against what the compiled JAX program executes
(``parity.accounting.hlo_cost``: optimized HLO, loop trip counts, a conditional's largest
branch), per device — the compute side of ``python -m parity accounting``, beside the
communication check.

- FLOPs, per pass (forward = the loss program; backward = loss + gradients minus the loss;
  step = the whole step minus both): the model's matmul FLOPs (``step_model.matmul_flops`` on
  the device's tokens; the FFN step's ``ffn_step_flops``) and the attention FLOPs the portable
  kernel executes (``step_model.executed_attention_flops``: whole blocks) equal the HLO's dots
  outside and inside the attention within 1 % (``FLOPS_RTOL``).
- Bytes (the whole-model step on one device, the timed path): the model's memory term for
  XLA:CPU (``step_model.memory_passes(..., "jax", backend="cpu")``) equals the bytes of the
  program's memory-bound kernels (every class but matmul, attention and collectives) within
  10 % (``BYTES_RTOL``). The check runs in float32 — XLA:CPU computes bf16 products in float32
  (converting operands and results), traffic no GPU program has; the bf16 GPU program is counted
  by ``python -m parity.training.llama_gpu time`` on the GPU. Named differences, not counted
  on either side: the attention kernel's own traffic (on the CPU the portable kernel's scores in
  memory; on a GPU inside the fused kernel, whose time is FLOPs / C_attn) and the dots' operands
  (their time is FLOPs / C).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.mesh import MeshShape
from ..training.llama import LlamaConfig, ModelCase
from ..training.reference import TrainCase

FLOPS_RTOL = 0.01
BYTES_RTOL = 0.10
PASSES = ("fwd", "bwd", "step")
MEMORY_CLASSES = ("other", "loss", "optimizer")

# The whole-model step on one device — the path llama_gpu times — with bytes checked too.
STEP_COST_CONFIGS = [
    ModelCase(LlamaConfig(vocab=300, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, d_ff=160),
              MeshShape(ring=1), fsdp=False, layout="contiguous", batch=1, seq=128),
]


@dataclass
class CostVerdict:
    """One configuration's model and HLO counts (per device)."""

    name: str
    flops: dict = field(default_factory=dict)  # (pass, class) -> (model, hlo)
    bytes: tuple | None = None  # (model, hlo) of the memory-bound kernels, when checked
    error: str | None = None

    def worst_flops(self) -> float:
        """The largest |HLO − model| / model over passes and classes (0 when all agree)."""
        return max((abs(h - m) / max(abs(m), 1.0) for m, h in self.flops.values()), default=0.0)

    def problems(self) -> list[str]:
        if self.error:
            return [self.error]
        out = []
        for (pass_, cls), (model, hlo) in self.flops.items():
            if abs(hlo - model) > FLOPS_RTOL * max(abs(model), 1.0):
                out.append(f"{pass_} {cls} FLOPs: model {model:,.0f}, HLO {hlo:,.0f}")
        if self.bytes is not None:
            model, hlo = self.bytes
            if abs(hlo - model) > BYTES_RTOL * model:
                out.append(f"memory bytes: model {model:,.0f}, HLO {hlo:,.0f} ({hlo / model:.3f}x)")
        return out


def _per_pass(texts: list[str]):
    """HloCost of each pass: program i minus program i-1."""
    from ..accounting.hlo_cost import count_cost

    costs = [count_cost(t) for t in texts]
    out = {}
    for i, pass_ in enumerate(PASSES[: len(costs)]):
        flops = dict(costs[i].flops)
        if i:
            for key, value in costs[i - 1].flops.items():
                flops[key] = flops.get(key, 0.0) - value
        out[pass_] = flops
    return out, costs[-1]


def llama_cost_verdict(case: ModelCase, texts: list[str], check_bytes: bool = False,
                       dtype: str = "float32") -> CostVerdict:
    """The model against the three compiled programs (loss, loss + gradients, step) of ``case``,
    per pass — or against the step program alone (one text), all passes together."""
    from ..training import step_model as sm

    per_pass, whole = _per_pass(texts)
    tokens = case.batch * case.seq // case.mesh.devices
    matmul = sm.matmul_flops(case.model, tokens)
    attention = sm.executed_attention_flops(case.model, case.mesh, case.layout, case.batch, case.seq)
    if len(texts) == 1:  # the step program alone: every pass together
        per_pass = {"all": per_pass["fwd"]}
        model = {("all", "matmul"): matmul, ("all", "attention"): attention}
    else:
        model = {("fwd", "matmul"): matmul / 3, ("bwd", "matmul"): 2 * matmul / 3,
                 ("fwd", "attention"): attention * 4 / 14, ("bwd", "attention"): attention * 10 / 14,
                 ("step", "matmul"): 0.0, ("step", "attention"): 0.0}
    verdict = CostVerdict(f"{case.name} (JAX)")
    for (pass_, cls), value in model.items():
        verdict.flops[(pass_, cls)] = (value, per_pass[pass_].get(cls, 0.0))
    extra = {k for f in per_pass.values() for k in f} - {"matmul", "attention"}
    for cls in sorted(extra):  # products the model does not know of
        verdict.flops[("other products", cls)] = (0.0, sum(f.get(cls, 0.0) for f in per_pass.values()))
    if check_bytes:
        hlo = sum(whole.bytes.get(c, 0.0) for c in MEMORY_CLASSES)
        passes = sm.memory_passes(case.model, tokens, "jax", dtype, backend="cpu")
        verdict.bytes = (sm.memory_bytes(passes)["total"], hlo)
    return verdict


def ffn_cost_verdict(case: TrainCase, texts: list[str]) -> CostVerdict:
    """The FFN step's matmul FLOPs (``ffn_step_flops``) against its compiled programs."""
    from ..training.traffic_model import ffn_step_flops

    per_pass, _ = _per_pass(texts)
    model = ffn_step_flops(case.model_step())
    verdict = CostVerdict(f"{case.name} (JAX)")
    for pass_ in PASSES:
        verdict.flops[(pass_, "matmul")] = (float(model.get(pass_, 0)), per_pass[pass_].get("matmul", 0.0))
    return verdict


def torch_cost_verdict(config: LlamaConfig, seq: int, dtype: str = "bfloat16", block_backend: str = "aten_cpu",
                       device: str = "cpu", traced=None) -> CostVerdict:
    """The torch step ``llama_gpu`` times (one row of ``seq`` tokens, foreach Adam) counted op by
    op (``accounting.torch_cost``) against the model: matmul FLOPs within 1 %, the memory term
    (every op but the products and the attention kernel itself: its glue counts) within 10 %.
    On the CPU ``aten_cpu`` runs the attention through the same adapter as ``aten_cudnn`` does on
    a GPU, so the glue is the GPU's; its lse copy (the CPU op's is strided) is the one difference.
    ``traced``: ``llama_gpu.trace_torch_step``'s result, when already taken."""
    from ..training import step_model as sm
    from ..training.llama_gpu import trace_torch_step

    if dtype != "bfloat16":
        raise ValueError(f"the timed torch step runs in bfloat16, got {dtype!r}")
    cost, glue = traced or trace_torch_step(config, seq, block_backend, device)
    verdict = CostVerdict(f"torch {config.d_model}x{config.layers} T{seq}")
    verdict.flops[("all", "matmul")] = (sm.matmul_flops(config, seq), cost.flops.get("matmul", 0.0))
    traced = cost.bytes.get("other", 0.0) + cost.bytes.get("optimizer", 0.0) + glue
    verdict.bytes = (sm.memory_bytes(sm.memory_passes(config, seq, "torch", dtype))["total"], traced)
    return verdict


def check_step_cost(case: ModelCase, per_pass: bool = True) -> CostVerdict:
    """FLOPs and bytes of one single-device whole-model step (``STEP_COST_CONFIGS``): per pass
    (three programs compiled), or with ``per_pass=False`` from the step program alone (the
    closing check of the main ``python -m parity`` run, one compile)."""
    try:
        from ..training import llama_jax

        texts = llama_jax.compiled_texts(case, which=(0, 1, 2) if per_pass else (2,))
        return llama_cost_verdict(case, texts, check_bytes=True)
    except Exception as err:  # noqa: BLE001 — reported as the configuration's failure
        return CostVerdict(f"{case.name} (JAX)", error=f"{type(err).__name__}: {err}")


def print_cost_verdicts(verdicts: list[CostVerdict]) -> int:
    """A table (FLOPs per pass and class, bytes: model / HLO); returns the number of failures."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="compute per device: step model == compiled HLO (FLOPs within 1 %, memory bytes within 10 %)")
    for col in ("config", "fwd FLOPs", "bwd FLOPs", "worst FLOPs Δ", "memory bytes model / HLO", "ok"):
        table.add_column(col, no_wrap=True)
    bad = 0
    for v in verdicts:
        ok = not v.problems()
        bad += not ok
        pass_flops = {p: sum(m for (q, _), (m, _) in v.flops.items() if q == p) for p in ("fwd", "bwd")}
        nbytes = "-" if v.bytes is None else f"{v.bytes[0]:,.0f} / {v.bytes[1]:,.0f} ({v.bytes[1] / v.bytes[0]:.3f})"
        table.add_row(v.name, f"{pass_flops['fwd']:,.0f}", f"{pass_flops['bwd']:,.0f}", f"{v.worst_flops():.1e}", nbytes,
                      "[green]==[/]" if ok else "[bold red]differs[/]")
    console = Console(width=200)
    console.print(table)
    for v in verdicts:
        for p in v.problems():
            console.print(f"[bold red]MISMATCH[/] {v.name}: {p}", highlight=False)
    return bad
