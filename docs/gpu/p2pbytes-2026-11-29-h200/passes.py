"""Which XLA pass changes the bytes of the JAX twin's ring sends: reads a dump of every pass
(``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_pass_re=.*``) of the step's module in pass order and
prints each pass after which the collective-permutes' (count, bytes by dtype, forward / backward)
change, from the program as lowered to the program that runs.

    PYTHONPATH=$PWD python docs/gpu/p2pbytes-2026-11-29-h200/passes.py DUMP_DIR [MODULE_SUBSTRING]
"""

import os
import re
import sys
from collections import Counter

from parity.accounting.hlo import ARRAY, CONTEXT_WORDS, ELEMENT_BYTES, INSTRUCTION


def sends(text: str) -> Counter:
    """(direction, dtype, "calls" | "bytes") -> total over the permutes of one dumped module, read
    with the accounting's HLO pieces (``parity.accounting.hlo``): each ``collective-permute`` /
    ``-start``'s shape, an async start's trailing context words dropped and, of its (sent,
    received) halves, the first; "bwd" where the op came from a transpose (the backward)."""
    out = Counter()
    for line in text.splitlines():
        m = INSTRUCTION.match(line)
        if not m or m.group("op") not in ("collective-permute", "collective-permute-start"):
            continue
        shape = m.group("shape")
        start = m.group("op").endswith("-start")
        if start and (words := CONTEXT_WORDS.search(shape)):
            shape = shape[:words.start()] + ")"
        arrays = [(a.group("dt"), a.group("dims")) for a in ARRAY.finditer(shape) if a.group("dt") in ELEMENT_BYTES]
        if start:
            arrays = arrays[: len(arrays) // 2]
        direction = "bwd" if "transpose(" in line else "fwd"
        for dtype, dims in arrays:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out[(direction, dtype, "calls")] += 1
            out[(direction, dtype, "bytes")] += n * ELEMENT_BYTES[dtype]
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
