"""Issue 46, one H200, 2026-11-29 (fourth session): a causal block's backward with its run slots
and length bound in one switch (``runs.causal_branches``), against the library without it, and
against one more form of it. Runs on a library with ``pairs/one-switch.patch`` applied (run.sh
unpacks it into ``.exp/`` and puts that first on the path). ``VARIANT``:

- ``new``: the patched library as it is — the offsets computed once at the largest slot count
  before the switch and trimmed in each branch, forward and backward; the backward one (slots,
  bound) switch, and the one call's backward one (plan, bound) switch.
- ``nohoist``: the same one switch in the backward, but each branch computes its own offsets
  (``runs.causal_offsets`` at its slot count, as before the change), forward and backward.

    VARIANT=nohoist python docs/gpu/documents-2026-11-29-h200/pairs.py one_gpu_documents --out DIR ...
    VARIANT=nohoist python docs/gpu/documents-2026-11-29-h200/pairs.py mesh_profile_jax   (env as the script's)
"""

import os
import sys

import jax.numpy as jnp

from jax_impl.kernels import branches
from jax_impl.kernels import runs as R

VARIANT = os.environ.get("VARIANT", "new")


def causal_branches_nohoist(q_ids, kv_ids, kernel, sizes, ok, most, *, lengths=False, ladder=None, prefix=()):
    t = q_ids.shape[1]
    at = lambda m, bound=None: (R.causal_offsets(q_ids, kv_ids, m) if bound is None
                                else R.causal_offsets(q_ids, kv_ids, m).bounded(*bound))
    slot_axis = (sizes, R.searchsorted(jnp.asarray(sizes), most))
    if not lengths:
        variants = {(*prefix, R.RUNS, m): (lambda m=m: kernel(at(m))) for m in sizes}
        return variants, branches.First([(ok, branches.Grid((*prefix, R.RUNS), (slot_axis,)))])
    n = max(t, kv_ids.shape[1])
    longest = jnp.maximum(R._longest_run(q_ids), R._longest_run(kv_ids))
    pick = R.length_choice((ladder or R.causal_length_ladder)(n), t, kv_ids.shape[1], longest)
    reached = lambda m, k: m * max(pick.bounds[k]) >= t

    def serve(name):
        *head, m, k = name
        return (*head, m, next(j for j in range(k, len(pick.bounds)) if reached(m, j)))

    variants = {(*prefix, R.RUNS, m, k): (lambda m=m, bound=bound: kernel(at(m, bound)))
                for m in sizes for k, bound in enumerate(pick.bounds) if reached(m, k)}
    grid = branches.Grid((*prefix, R.RUNS), (slot_axis, (tuple(range(len(pick.bounds))), pick.at)), serve=serve)
    return variants, branches.First([(ok, grid)])


if VARIANT == "nohoist":
    R.causal_branches = causal_branches_nohoist
import jax_impl  # noqa: E402

print("variant", VARIANT, "library", jax_impl.__file__, flush=True)
tool, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
if tool == "one_gpu_documents":
    from benchmarks.one_gpu_documents import main

    main(sys.argv[1:])
else:
    from benchmarks import mesh_profile_jax

    mesh_profile_jax.main()
