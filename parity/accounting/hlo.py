"""Count the collectives of a compiled XLA program from its HLO text, into a ``Traffic``.

Reads every computation, multiplies what a ``while`` body does by the loop's
``known_trip_count``, follows ``call`` / async wrappers, and sizes each collective by the shapes
printed in the instruction (outputs; operand sizes derived from them), using the contract's (docs/contract.md)
definition of bytes. Only ``*-start`` of an async pair counts; ``*-done`` does not.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .model import PASSES, Traffic

ELEMENT_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "pred": 1,
                  "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
COLLECTIVES = {"collective-permute": "p2p", "all-to-all": "all-to-all", "all-gather": "all-gather",
        "reduce-scatter": "reduce-scatter", "all-reduce": "all-reduce"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*(?P<shape>.+?)\s(?P<op>[\w-]+)\((?P<args>.*)$")
HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.-]+)")
ARRAY = re.compile(r"(?P<dt>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")


# an async collective-permute-start's shape ends in its context words: (..., u32[], u32[])
CONTEXT_WORDS = re.compile(r"(?:,\s*[us]32\[\])+\)\s*$")


def _arrays(shape: str) -> list[int]:
    """Byte sizes of the arrays in an HLO shape (a tuple gives several)."""
    out = []
    for m in ARRAY.finditer(shape):
        if m.group("dt") not in ELEMENT_BYTES:
            continue
        n = 1
        for dim in filter(None, m.group("dims").split(",")):
            n *= int(dim)
        out.append(n * ELEMENT_BYTES[m.group("dt")])
    return out


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh form: mesh['a'=2,'b'=4] {'b'}
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes[axis]
        return n
    m = re.search(r"replica_groups=\{\{([0-9,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)  # iota form: [groups, size]
    if m:
        return int(m.group(1).split(",")[-1])
    raise ValueError(f"cannot read the group size of: {line[:200]}")


def _collective(op: str, shape: str, line: str):
    """(kind, bytes, calls) of one collective instruction, or None if ``op`` is not one or its
    group is a single device (it moves nothing). A combined collective (XLA's combiner passes
    merge independent all-reduces, all-gathers, reduce-scatters into one tuple-shaped
    instruction) counts one call per buffer, as the model does."""
    start = op.endswith("-start")
    base = op[: -len("-start")] if start else op
    if base not in COLLECTIVES or op.endswith("-done"):
        return None
    kind = COLLECTIVES[base]
    if start and kind == "p2p":  # its trailing context words (u32[]) are never a buffer sent
        words = CONTEXT_WORDS.search(shape)
        shape = shape if words is None else shape[:words.start()] + ")"
    sizes = _arrays(shape)
    if start and shape.startswith("(("):  # ((operands), outputs[, context]): keep the outputs
        sizes = sizes[len(sizes) // 2:]
    elif start and kind == "p2p":  # (operand, output[, context scalars]): the buffer sent
        sizes = sizes[:1]
    if kind == "p2p":  # the buffers sent; a tuple (K and V combined) is one call each
        return kind, Fraction(sum(sizes)), len(sizes)
    n = _group_size(line)
    if n == 1:
        return None
    if kind == "all-to-all":  # tuple form: one operand per peer of one buffer; array form: the buffer
        return kind, Fraction(sum(sizes) * (n - 1), n), 1
    if kind == "all-gather":  # (n-1)/n of each gathered output
        return kind, Fraction(sum(sizes) * (n - 1), n), len(sizes)
    if kind == "reduce-scatter":  # input = n x output
        return kind, Fraction(sum(sizes) * (n - 1)), len(sizes)
    return kind, Fraction(2 * sum(sizes) * (n - 1), n), len(sizes)  # all-reduce


def _parse(text: str):
    """computation name -> (list of (kind, bytes), list of (callee, multiplier)); entry name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation opens
            current = HEADER.match(line).group("name")
            comps[current] = ([], [])
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        found = _collective(m.group("op"), m.group("shape"), line)
        if found:
            comps[current][0].append(found)
        if m.group("op") == "while":
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            if not trip:
                raise ValueError("a while loop without known_trip_count: cannot count its collectives")
            body = re.search(r"body=%?([\w.-]+)", line).group(1)
            comps[current][1].append((body, int(trip.group(1))))
        elif m.group("op") == "conditional":  # branch_computations={a, b} or true_/false_computation=
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = re.findall(r"%?([\w.-]+)", branches.group(1)) if branches else \
                re.findall(r"(?:true|false)_computation=%?([\w.-]+)", line)
            for name in names:
                comps[current][1].append((name, "branch"))
        else:
            for key in ("to_apply", "calls"):
                for name in re.findall(rf"{key}=%?([\w.-]+)", line):
                    comps[current][1].append((name, 1))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def count_collectives(text: str, pass_: str) -> Traffic:
    """The collectives of one compiled program (all attributed to ``pass_``)."""
    comps, entry = _parse(text)
    traffic = Traffic()

    def visit(name: str, times: int) -> None:
        own, callees = comps.get(name, ([], []))
        for kind, nbytes, calls in own:
            traffic.add(pass_, kind, nbytes * times, calls=calls * times)
        for callee, mult in callees:
            if mult == "branch":
                if _has_collectives(comps, callee):
                    raise ValueError(f"collectives inside a conditional branch ({callee}) cannot be counted statically")
                continue
            visit(callee, times * mult)

    visit(entry, 1)
    return traffic


def _has_collectives(comps, name, seen=None) -> bool:
    seen = seen or set()
    if name in seen or name not in comps:
        return False
    seen.add(name)
    own, callees = comps[name]
    return bool(own) or any(_has_collectives(comps, c, seen) for c, _ in callees)


def split_passes(*texts: str) -> Traffic:
    """Programs that each add one pass to the previous one (forward; forward + backward;
    forward + backward + optimizer step) → per-pass traffic: pass i = program i − program i−1."""
    if not 1 <= len(texts) <= len(PASSES):
        raise ValueError(f"give 1 to {len(PASSES)} programs, one per pass in {PASSES}")
    out, previous = Traffic(), Traffic()
    for pass_, text in zip(PASSES, texts):
        total = count_collectives(text, pass_)
        for (_, kind), (calls, nbytes) in total.rows().items():
            out.add(pass_, kind, nbytes, calls)
        for (_, kind), (calls, nbytes) in previous.rows().items():
            out.add(pass_, kind, -nbytes, -calls)
        previous = total
    return out
