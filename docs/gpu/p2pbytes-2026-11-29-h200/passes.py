"""Which XLA pass changes the bytes of the JAX twin's ring sends: reads a dump of every pass
(``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_pass_re=.*``) of the step's module in pass order and
prints each pass after which the collective-permutes' (count, bytes by dtype, forward / backward)
change, from the program as lowered to the program that runs.

    python docs/gpu/p2pbytes-2026-11-29-h200/passes.py DUMP_DIR [MODULE_SUBSTRING]
"""

import os
import re
import sys
from collections import Counter

WIDTH = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
ARRAY = re.compile(r"\b(bf16|f16|f32|f64|s32|u32|s8|u8|pred)\[([0-9,]*)\]")


def sends(text: str) -> Counter:
    """(direction, dtype) -> [calls, bytes] of the permutes' operands in one dumped module: each
    ``collective-permute`` / ``-start`` instruction's operand shapes (from its result shape: the
    result of a start holds (operands, destinations, context); the first half is what is sent)."""
    out = Counter()
    for line in text.splitlines():
        m = re.search(r"= (.*?)\s+collective-permute(-start)?\(", line)
        if not m:
            continue
        direction = "bwd" if "transpose(" in line else "fwd"
        arrays = [(d, s) for d, s in ARRAY.findall(m.group(1)) if s]  # rank-0 context words left out
        if m.group(2):  # a start's result: (sent..., received...): the first half is sent
            arrays = arrays[: len(arrays) // 2]
        for dtype, dims in arrays:
            n = 1
            for d in dims.split(","):
                n *= int(d)
            out[(direction, dtype, "calls")] += 1
            out[(direction, dtype, "bytes")] += n * WIDTH[dtype]
    return out


def main(root: str, module: str = "jit_step") -> None:
    def order(f: str) -> int | None:  # before XLA's passes, each pass's dump by its counter, the program that runs
        if f.endswith(".before_optimizations.txt"):
            return -1
        if re.search(r"_after_optimizations\.txt$", f):
            return 10**9
        counter = re.search(r"\.(\d{4})\.", f)
        return int(counter.group(1)) if counter else None  # buffer assignment, memory reports: skipped

    files = [f for f in os.listdir(root) if module in f and f.endswith(".txt") and order(f) is not None]
    last = None
    for f in sorted(files, key=order):
        with open(os.path.join(root, f)) as fh:
            now = sends(fh.read())
        if now != last:
            print(f"{f[-110:]}: {dict(sorted(now.items()))}")
            last = now
    print(f"{len(files)} dumps of {module} read")


if __name__ == "__main__":
    main(*sys.argv[1:])
