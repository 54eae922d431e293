"""Issue 46, one H200, 2026-11-29: the whole-sequence document block's backward bounds, timed as
variants of ``benchmarks.one_gpu_documents`` in one call (each variant its own process, checked
before it is timed, the same-run anchor beside it). ``VARIANT`` (comma list of):

- ``base``: the library as committed.
- ``ladder``: the backward's ``max_seqlen`` ladder of the per-block dispatch finer —
  256·2^k·{1, 5/4, 3/2, 7/4} up to n, and n (the committed one: powers of two, 3n/8, 3n/4, n; the
  short mix's longest document at 32k, 4,988 tokens, launches the backward's grid for 8,192).
- ``slots48``: a 48-run size in the varlen block's run slots (the short mix's 35 documents sit on 64).
- ``twoswitch`` (second session, on the library after it): a device's own block with its plain
  variant back — ``loop.under_masks``' switch on "one document covers the block" around the
  kernel's own (``BlockBackend.one_run_documents`` False), as before that change.

The XLA flag variant (device-side conditionals) is set by the caller in XLA_FLAGS.
Ran 2026-11-29 on the library before the change it measured (commit 227a433): ``ladder`` patches
``runs.length_ladder``, which every block then used; since, a causal block takes the finer
``runs.causal_length_ladder`` and ``runs.CAUSAL_VARLEN_RUN_SLOTS`` (with 48) by default.

    VARIANT=ladder,slots48 python docs/gpu/documents-2026-11-29-h200/variants.py --out DIR [one_gpu_documents flags]
"""

import os
import sys

from benchmarks.one_gpu_documents import main
from jax_impl.kernels import fa3_varlen
from jax_impl.kernels import runs as run_plans

VARIANT = os.environ.get("VARIANT", "base").split(",")


def fine_ladder(n: int) -> tuple[int, ...]:
    floor = min(n, 256)
    steps = {floor * (4 + q) << k >> 2 for k in range(n.bit_length()) for q in range(4)}
    return tuple(sorted({b for b in steps if b <= n} | {n}))


if "twoswitch" in VARIANT:  # the own block's plain variant back: a switch on "one document covers it" around the kernel's
    import dataclasses

    from jax_impl import block

    block._BACKENDS["fa3_varlen"] = dataclasses.replace(block._BACKENDS["fa3_varlen"],
                                                        one_run_documents=lambda q, mask: False)
if "ladder" in VARIANT:
    run_plans.length_ladder = fine_ladder
if "slots48" in VARIANT:
    fa3_varlen.VARLEN_RUN_SLOTS = (4, 8, 16, 32, 48, 64, 128, 256)
print("variant", VARIANT, "XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), flush=True)
main(sys.argv[1:])
