"""What a compiled XLA program executes, counted from its optimized HLO text: FLOPs of every
matrix product and bytes every kernel reads and writes, by class — the measurement the step-time
model (``parity.training.step_model``) is checked against, as ``hlo.count_collectives`` is the
measurement of the communication model.

``compiled.cost_analysis()`` will not do: XLA counts a ``while`` body once (a scan of 8 matmuls
reports one) and a conditional's largest branch. Here, walking the module as ``hlo.py`` does:

- a ``while`` body (and its condition) counts ``known_trip_count`` times (a loop without one is
  refused); ``call`` and async wrappers once; a ``conditional`` counts its **largest branch** by
  FLOPs (the busiest device's work: the program is SPMD and the branch taken depends on the
  device — :class:`HloCost` keeps the smallest too, ``flops_min``, so a caller sees when
  branches differ);
- FLOPs: ``dot`` = 2 · (output elements) · (the contracted dimensions' sizes), wherever it is —
  inside fusions too; cuBLAS GEMM custom calls (``__cublas$gemm``, ``__cublas$lt$matmul``) the
  same from their ``dot_dimension_numbers``. Elementwise work is not counted as FLOPs (it is
  memory-bound: its cost is the bytes). Fused attention custom calls (cuDNN) have no FLOPs here:
  their calls are counted (``attention_calls``);
- bytes: every kernel of an executed computation (not the inside of a fusion, which is one
  kernel) reads its operands and writes its output once: Σ operand bytes + output bytes. Two
  refinements as XLA's own cost analysis makes them: an in-place ``dynamic-update-slice`` (alone
  or as a fusion's root) reads and writes only the update, not the buffer it updates; a fusion
  operand used inside only through ``slice`` / ``dynamic-slice`` / ``gather`` reads only what
  those take. Free instructions (parameter, constant, tuple, get-tuple-element, bitcast, control
  flow) move nothing; collectives are counted apart (class ``collective``: ``hlo.py`` counts them
  against the communication model).

Classes (``classify``): a kernel is ``matmul`` when it holds a dot (or is a GEMM), and
otherwise takes the first matching class of its ``metadata={op_name=...}`` by the name scopes the
models put there (``parity.training.llama_jax``: ``core_attention`` in every layer, ``loss``,
``optimizer``) — else ``other``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from .hlo import ARRAY, COLLECTIVES, ELEMENT_BYTES, HEADER, INSTRUCTION

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
        "after-all", "opt-barrier", "partition-id", "replica-id", "domain", "add-dependency", "async-done",
        "async-update", "copy-done", "send-done", "recv-done"}
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
ATTENTION_TARGETS = ("__cudnn$fmha", "__cudnn$flash", "flash_attn", "fmha")
SLICING = {"slice", "dynamic-slice", "gather"}


def _elements(dims: str) -> int:
    n = 1
    for dim in filter(None, dims.split(",")):
        n *= int(dim)
    return n


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple gives their sum; tokens and unknown types 0)."""
    return sum(_elements(m.group("dims")) * ELEMENT_BYTES.get(m.group("dt"), 0) for m in ARRAY.finditer(shape))


def _dims(shape: str) -> list[int]:
    m = ARRAY.search(shape)
    if m is None:
        raise ValueError(f"not an array shape: {shape[:120]}")
    return [int(d) for d in filter(None, m.group("dims").split(","))]


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.$-]+)", self.line)
        return m.group(1) if m else None

    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.line)
        return m.group(1) if m else ""


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)  # instruction name -> shape


def _operands(args: str) -> list[str]:
    depth, end = 0, len(args)
    for i, ch in enumerate(args):  # the operand list ends at the ")" that closes "op("
        if ch in "({":
            depth += 1
        elif ch in ")}":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.-]+)", args[:end])


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """(computation name -> Computation, the entry's name) of an HLO module's text."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            header = HEADER.match(line)
            if header is None or line.startswith("HloModule"):
                continue
            current = Computation(header.group("name"))
            comps[current.name] = current
            if line.startswith("ENTRY"):
                entry = current.name
            continue
        if current is None:
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name = re.match(r"^\s*(?:ROOT\s+)?%?([\w.-]+)", line).group(1)
        ins = Instr(name, m.group("shape"), m.group("op"), _operands(m.group("args")), line)
        current.instrs.append(ins)
        current.shapes[name] = ins.shape
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _contracted(line: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([0-9,]*)\}}", line)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def dot_flops(ins: Instr, shapes: dict[str, str]) -> int:
    """2 · output elements · contracted size of one ``dot`` (or GEMM custom call)."""
    if ins.op == "dot":
        lhs, contracting = _dims(shapes[ins.operands[0]]), _contracted(ins.line, "lhs_contracting_dims")
    else:  # a GEMM custom call: backend_config's dot_dimension_numbers, output first in a tuple
        config = re.search(r"backend_config=(\{.*\})", ins.line)
        dims = json.loads(config.group(1)).get("gemm_backend_config", {}).get("dot_dimension_numbers", {}) \
            if config else {}
        lhs, contracting = _dims(shapes[ins.operands[0]]), [int(x) for x in dims.get("lhs_contracting_dimensions", [])]
    k = 1
    for d in contracting:
        k *= lhs[d]
    return 2 * _elements(",".join(map(str, _dims(ins.shape)))) * k


@dataclass
class HloCost:
    """Counted per device: FLOPs (largest branch; ``flops_min`` smallest), bytes and kernels by
    class, fused-attention calls."""

    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    flops_min: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    kernels: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    attention_calls: float = 0

    def total_flops(self) -> float:
        return sum(self.flops.values())

    def add(self, other: HloCost, times: float, minimum: HloCost | None = None) -> None:
        for key, value in other.flops.items():
            self.flops[key] += value * times
        for key, value in (minimum or other).flops_min.items():
            self.flops_min[key] += value * times
        for key, value in other.bytes.items():
            self.bytes[key] += value * times
        for key, value in other.kernels.items():
            self.kernels[key] += value * times
        self.attention_calls += other.attention_calls * times


def _holds_dot(comps, name: str, seen=None) -> bool:
    seen = seen if seen is not None else set()
    if name in seen or name not in comps:
        return False
    seen.add(name)
    for ins in comps[name].instrs:
        if _is_gemm(ins):
            return True
        callee = ins.attr("calls")
        if callee and _holds_dot(comps, callee, seen):
            return True
    return False


CLASSES = (("core_attention", "attention"), ("optimizer", "optimizer"), ("loss", "loss"))
_WRAPPER = re.compile(r"^(?:[\w]+\()+")  # jvp(, transpose(jvp(, jit( ... around a scope's name


def scopes(op_name: str) -> list[str]:
    """The name scopes of an ``op_name`` path, unwrapped: "jit(step)/transpose(jvp(loss))/exp" ->
    ["step", "loss", "exp"]."""
    return [_WRAPPER.sub("", seg).rstrip(")") for seg in op_name.split("/")]


def scope_class(op_name: str) -> str | None:
    """The class a kernel's name scopes give it (attention before the others), or None."""
    names = scopes(op_name)
    return next((cls for scope, cls in CLASSES if scope in names), None)


def _is_gemm(ins: Instr) -> bool:
    return ins.op == "dot" or (ins.op == "custom-call" and any(t in ins.line for t in GEMM_TARGETS))


def _op_name(ins: Instr, comps) -> str:
    """An instruction's op_name, or for a fusion without one, the first one inside it."""
    name = ins.op_name()
    if not name and ins.op == "fusion":
        fused = comps.get(ins.attr("calls"))
        name = next((i.op_name() for i in reversed(fused.instrs) if i.op_name()), "") if fused else ""
    return name


def classify(ins: Instr, comps, context: str | None = None) -> str:
    """The class of one kernel (module docstring); ``context``: the class of the control flow
    it runs under (a conditional's branch or a loop's body inherits its instruction's)."""
    if ins.op in COLLECTIVES or any(ins.op == f"{o}-start" or ins.op == f"{o}-done" for o in COLLECTIVES):
        return "collective"
    if ins.op == "custom-call" and any(t in ins.line for t in ATTENTION_TARGETS):
        return "attention"
    cls = scope_class(_op_name(ins, comps)) or context
    if cls == "attention":  # its dots are attention FLOPs, not the model's matmuls
        return cls
    if _is_gemm(ins) or (ins.op == "fusion" and _holds_dot(comps, ins.attr("calls"))):
        return "matmul"
    return cls or "other"


def _fusion_bytes(ins: Instr, comp: Computation, comps) -> float:
    """Bytes one fusion kernel moves (module docstring: in-place updates, sliced operands)."""
    fused = comps.get(ins.attr("calls"))
    if fused is None:
        return sum(shape_bytes(comp.shapes.get(o, "")) for o in ins.operands) + shape_bytes(ins.shape)
    params = {}  # fused parameter name -> index
    for i in fused.instrs:
        if i.op == "parameter":
            params[i.name] = int(re.search(r"parameter\((\d+)\)", i.line).group(1))
    users = defaultdict(list)
    for i in fused.instrs:
        for o in i.operands:
            users[o].append(i)
    root = next((i for i in fused.instrs if i.line.lstrip().startswith("ROOT")), fused.instrs[-1])
    aliased, written = set(), shape_bytes(ins.shape)
    if root.op == "dynamic-update-slice":
        written = shape_bytes(fused.shapes.get(root.operands[1], ""))
        if root.operands[0] in params:
            aliased.add(root.operands[0])
    read = 0.0
    for pname, index in params.items():
        if pname in aliased or index >= len(ins.operands):
            continue
        uses = users[pname]
        if uses and all(u.op in SLICING and u.operands[0] == pname for u in uses):
            read += sum(shape_bytes(u.shape) for u in uses)
        else:
            read += shape_bytes(comp.shapes.get(ins.operands[index], ""))
    return read + written


def _kernel_bytes(ins: Instr, comp: Computation, comps) -> float:
    if ins.op == "fusion":
        return _fusion_bytes(ins, comp, comps)
    if ins.op == "dynamic-update-slice":
        return 2 * shape_bytes(comp.shapes.get(ins.operands[1], ""))
    if ins.op in SLICING:
        return 2 * shape_bytes(ins.shape)
    operands = ins.operands[1:] if ins.op.endswith("-start") else ins.operands
    return sum(shape_bytes(comp.shapes.get(o, "")) for o in operands) + shape_bytes(ins.shape)


def _fused_flops(comps, name: str, shapes_cache: dict) -> float:
    """FLOPs of every dot inside a fused (or nested fused) computation."""
    comp = comps.get(name)
    if comp is None:
        return 0.0
    if name in shapes_cache:
        return shapes_cache[name]
    total = 0.0
    for ins in comp.instrs:
        if ins.op == "dot":
            total += dot_flops(ins, comp.shapes)
        elif ins.op == "fusion":
            total += _fused_flops(comps, ins.attr("calls"), shapes_cache)
    shapes_cache[name] = total
    return total


def count_cost(text: str) -> HloCost:
    """FLOPs, bytes and kernels of one compiled program, per device (module docstring)."""
    comps, entry = parse_module(text)
    fused_cache: dict = {}
    memo: dict[tuple, HloCost] = {}

    def visit(name: str, context: str | None) -> HloCost:
        if (name, context) in memo:
            return memo[(name, context)]
        comp, cost = comps.get(name), HloCost()
        if comp is None:
            return cost
        for ins in comp.instrs:
            inner = scope_class(ins.op_name()) or context
            if ins.op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.line)
                if not trip:
                    raise ValueError(f"a while loop without known_trip_count ({ins.name}): cannot count its work")
                n = int(trip.group(1))
                cost.add(visit(ins.attr("body"), inner), n)
                cost.add(visit(ins.attr("condition"), inner), n + 1)
                continue
            if ins.op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", ins.line)
                names = re.findall(r"%?([\w.-]+)", branches.group(1)) if branches else \
                    re.findall(r"(?:true|false)_computation=%?([\w.-]+)", ins.line)
                costs = [visit(b, inner) for b in names]
                largest = max(costs, key=lambda c: (c.total_flops(), sum(c.bytes.values())))
                smallest = min(costs, key=lambda c: sum(c.flops_min.values()))
                cost.add(largest, 1, minimum=smallest)
                continue
            if ins.op in ("call", "async-start") or (ins.op.endswith("-start") and ins.attr("calls")):
                callee = ins.attr("calls") or ins.attr("to_apply")
                if callee:
                    cost.add(visit(callee, inner), 1)
                if ins.op in ("call", "async-start"):
                    continue
            if ins.op in FREE:
                continue
            cls = classify(ins, comps, context)
            flops = 0.0
            if _is_gemm(ins):
                flops = dot_flops(ins, comp.shapes)
            elif ins.op == "fusion":
                flops = _fused_flops(comps, ins.attr("calls"), fused_cache)
            if ins.op == "custom-call" and cls == "attention":
                cost.attention_calls += 1
            if flops:
                cost.flops[cls] += flops
                cost.flops_min[cls] += flops
            cost.bytes[cls] += _kernel_bytes(ins, comp, comps)
            cost.kernels[cls] += 1
        memo[(name, context)] = cost
        return cost

    return visit(entry, None)
