"""The whole model's communication (NumPy only): one training step of the tiny Llama
(``parity.training.llama``) — attention context parallelism in every layer, FSDP or replicated
weights, the loss's count — per device, per pass and kind, as the implementations move it.

Per step, with N = every device of the mesh and e the wire dtype's bytes (``dtype``: float32 for
the CPU reference step, 4; bfloat16 for the timed GPU step, whose weights, gradients and
activations are all bf16, 2):
- each attention layer: ``attention_traffic`` of its call (K/V hops, all-to-alls, all-gathers),
  segment ids included where the case gives them (``ModelCase.segment_ids``: packed documents);
- the loss's denominator: one all-reduce of a float32 count over N devices (forward);
- FSDP: forward all-gather of every weight ((N-1)/N of it); backward all-gather again and one
  reduce-scatter of its gradient; replicated: one all-reduce of every gradient (backward).
The frameworks differ where their machinery differs, each difference measured, not assumed:
- torch (FSDP2) moves a unit's weights in one collective (``ModelCase.fsdp_units``: a unit per
  weight, or per decoder block as torchtitan wraps) and re-gathers every unit but the root before
  its backward (the root, which holds a tied embedding, is gathered once per step); each attention
  call gathers
  the segment ids in its forward and reuses them in its backward;
- JAX (XLA under ``jax.checkpoint``) re-gathers only the layers' matrices — not the embedding
  (tied or not) and not the norm vectors (XLA keeps the forward's gather of those: measured,
  jax 0.10, XLA:CPU), and with all-gather KV the remat gathers each layer's K and V again; the layers' identical
  segment-id gathers are one gather (common-subexpression elimination), and under FSDP the
  rematerialised backward gathers them once more; a replicated tied embedding's gradient is
  all-reduced once per use (lookup and logits).
Attention sinks are not modelled here (refused): their gradient takes a different path under
each framework's FSDP; ``attention_traffic`` covers them for the attention call alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

from ..accounting.model import FRAMEWORKS, KINDS, Traffic, allreduce_bytes, attention_traffic
from ..core.cases import Case
from ..core.names import DTYPE_BYTES
from .llama import ModelCase, fsdp_groups, weight_shapes


def attention_case(case: ModelCase, dtype: str = "float32") -> Case:
    """The attention call of one layer as a parity ``Case`` (what ``attention_traffic`` reads)."""
    c, m = case.model, case.mesh
    return Case(ring=m.ring, ulysses=m.ulysses, data=m.data, ring_outer=m.ring_outer, kv_exchange=m.kv_exchange,
                batch=case.batch, seq=case.seq, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                layout=case.layout, causal=True, dtype=dtype, documents="mix", window=c.window)


def llama_step_traffic(case: ModelCase, framework: str, dtype: str = "float32") -> Traffic:
    """Per-device traffic of one training step of ``case`` under ``framework`` (fwd / bwd / step),
    weights, gradients and activations in ``dtype``."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    if case.model.sinks:
        raise ValueError("attention sinks are not in the whole-step model (their gradient path differs per "
                         "framework under FSDP); use a configuration without sinks")
    t, n = Traffic(), case.mesh.devices
    layer = attention_case(case, dtype)
    with_ids = attention_traffic(layer, return_lse=False)
    without_ids = attention_traffic(replace(layer, documents="none"), return_lse=False)
    # the segment ids' gathers: what one attention call's forward moves with them and not without
    forward = lambda traffic, kind: traffic.rows().get(("fwd", kind), (0, 0))
    ids = {kind: (forward(with_ids, kind)[0] - forward(without_ids, kind)[0],
                  forward(with_ids, kind)[1] - forward(without_ids, kind)[1]) for kind in KINDS}
    ids = {kind: entry for kind, entry in ids.items() if entry[0]} if case.segment_ids else {}  # none given, none moved
    per_layer = with_ids if framework == "torch" and case.segment_ids else without_ids
    for _ in range(case.model.layers):
        for (pass_, kind), (calls, nbytes) in per_layer.rows().items():
            t.add(pass_, kind, nbytes, calls)
    if framework == "jax":  # the ids once per forward, and once more in the rematerialised backward
        for kind, (calls, nbytes) in ids.items():
            for pass_ in ("fwd", "bwd") if case.fsdp else ("fwd",):
                t.add(pass_, kind, nbytes, calls)
        if case.fsdp and case.mesh.kv_exchange == "allgather":  # remat gathers K and V again
            calls, nbytes = without_ids.rows()[("fwd", "all-gather")]
            t.add("bwd", "all-gather", case.model.layers * nbytes, case.model.layers * calls)
    if n > 1:
        t.add("fwd", "all-reduce", allreduce_bytes(4, n))  # the global labelled count
    if n == 1:
        return t
    ring, shapes = Fraction(n - 1, n), weight_shapes(case.model)
    size = {name: DTYPE_BYTES[dtype] * math.prod(shape) for name, shape in shapes.items()}
    if not case.fsdp:
        for name in shapes:
            # XLA transposes each use of a replicated weight into its own all-reduce: a tied
            # embedding (lookup and logits) has two (measured, jax 0.10); torch sums it first.
            uses = 2 if framework == "jax" and name == "embed" and case.model.tie_embeddings else 1
            t.add("bwd", "all-reduce", uses * allreduce_bytes(size[name], n), calls=uses)
    elif framework == "torch":  # one gather / reduce-scatter per FSDP2 unit; the root's kept gathered
        *units, root = fsdp_groups(case.model, case.fsdp_units)
        for group, regathered in [(u, True) for u in units] + [(root, False)]:
            nbytes = ring * sum(size[name] for name in group)
            if group:
                t.add("fwd", "all-gather", nbytes)
                if regathered:
                    t.add("bwd", "all-gather", nbytes)
                t.add("bwd", "reduce-scatter", nbytes)
    else:  # XLA: per weight; the backward re-gathers the matrices alone (not the embedding, not norms)
        for name, shape in shapes.items():
            t.add("fwd", "all-gather", ring * size[name])
            if len(shape) == 2 and name != "embed":
                t.add("bwd", "all-gather", ring * size[name])
            t.add("bwd", "reduce-scatter", ring * size[name])
    return t
