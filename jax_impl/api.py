"""``sequence_parallel_attention`` on global arrays: validate, shard, pick the algorithm.

The mesh's axis names choose the algorithm (docs/contract.md): ``"ring"`` -> ring attention,
``"ulysses"`` -> Ulysses, both -> USP, ``"ring_outer"`` + ``"ring_inner"`` -> the double ring
(with ``"ulysses"``: double-ring USP), ``"data"`` shards the batch. Inputs are global arrays in
layout order with any sharding; they are resharded to

    q, k, v, o: P("data", ("ring", "ulysses"), None, None)     lse: P("data", None, ("ring", "ulysses"))
    segment_ids, token_index: P("data", ("ring", "ulysses"))    sinks: P() (replicated)

(``("ring_outer", "ring_inner", "ulysses")`` for the double ring) so the device at ring
coordinate r (o·I + i in the double ring) and Ulysses coordinate u holds sequence block r*U + u.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from seqplan.axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from seqplan.config import default_check_ranks, default_head_groups
from seqplan.shared import check_shared_exchange, check_shared_tokens, ring_shards
from seqplan.validation import (
    Decomposition,
    check_head_groups,
    check_segment_ids,
    check_sinks,
    check_softcap,
    check_token_index,
    check_token_index_range,
    check_window,
    dtype_name,
    shape_and_dtype,
    validate,
)

from .block import get_backend
from .config import check_deterministic_ready, default_deterministic
from .double_ring import DOUBLE_RING, double_ring_attention
from .ulysses import ulysses_attention
from .usp import KV_EXCHANGE, usp_attention


def _per_device(algorithm: str, *, layout: str, return_lse: bool, kv_exchange: str, head_groups: int = 1, **kw):
    # head_groups (checked: 1 unless there is a Ulysses axis) reaches only the Ulysses algorithms
    if algorithm == "usp":
        return partial(usp_attention, ring_axis=RING, ulysses_axis=ULYSSES, layout=layout, return_lse=return_lse,
                       kv_exchange=kv_exchange, head_groups=head_groups, **kw)
    if algorithm == "double_ring_usp":
        return partial(usp_attention, ring_axis=DOUBLE_RING, ulysses_axis=ULYSSES, layout=layout,
                       return_lse=return_lse, head_groups=head_groups, **kw)
    if algorithm == "double_ring":
        return partial(double_ring_attention, axis_name=DOUBLE_RING, layout=layout, **kw)
    if algorithm == "ulysses":
        return partial(ulysses_attention, axis_name=ULYSSES, return_lse=return_lse, head_groups=head_groups, **kw)
    axis = RING if algorithm == "ring" else None
    return partial(KV_EXCHANGE[kv_exchange], axis_name=axis, layout=layout, **kw)


def _global_shape(local_shape, mesh_sizes: dict) -> tuple[int, ...]:
    """The global [b, t, heads, d] of a per-device shard inside ``shard_map`` over a mesh of these sizes."""
    b, t, h, d = local_shape
    seq_split = 1
    for axis in (RING, RING_OUTER, RING_INNER, ULYSSES):
        seq_split *= mesh_sizes.get(axis, 1)
    return (b * mesh_sizes.get(DATA, 1), t * seq_split, h, d)


def local_attention(q, k, v, mesh, *, causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                    kv_exchange: str = "ring", return_lse: bool = False, block_backend: str = "auto",
                    deterministic: bool | None = None, segment_ids=None, window=None, sinks=None,
                    softcap=None, token_index=None, shared_tokens: int | None = None, head_groups: int | None = None):
    """``sequence_parallel_attention`` for code already inside ``jax.shard_map`` over ``mesh``: the
    arguments are THIS device's shards, as torch_impl's entry point takes them —

        q: [b/D, t/(R·U), h, d]   k, v: [b/D, t/(R·U), hk, d]   segment_ids: [b/D, t/(R·U)] or None
        token_index: [b/D, t/(R·U)] or None                  sinks: [h] or None (the full array on every device)
        ->  o like q (and lse [b/D, h, t/(R·U)])

    — in layout order, device at ring coordinate r and Ulysses coordinate u holding sequence block
    r·U + u. Validation runs on the global shape the shards imply, at trace time, before any
    collective. The caller's ``shard_map`` must map every sequence axis of ``mesh`` (and "data");
    with a block backend that is not typed for ``shard_map`` (``BlockBackend.typed_for_shard_map``)
    it must also pass ``check_vma=False``. ``shared_tokens``: as in ``sequence_parallel_attention``
    (the ids are tracers here: a broken promise makes the outputs NaN)."""
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic)
    sizes = dict(mesh.shape)
    decomposition: Decomposition = validate(
        *(_global_shape(x.shape, sizes) for x in (q, k, v)), tuple(dtype_name(x.dtype) for x in (q, k, v)), sizes,
        layout=layout, kv_exchange=kv_exchange, scale=scale)
    check_segment_ids(*shape_and_dtype(segment_ids), q.shape, what="local ")
    check_token_index(*shape_and_dtype(token_index), q.shape, what="local ")  # values: tracers here
    window, softcap = check_window(window), check_softcap(softcap)
    check_sinks(*shape_and_dtype(sinks), q.shape[2])
    get_backend(block_backend, deterministic=deterministic)  # an unknown or refused kernel fails here
    shared = check_shared_exchange(shared_tokens, decomposition.algorithm, kv_exchange)
    groups = check_head_groups(default_head_groups(head_groups, decomposition.ulysses), q.shape[2], k.shape[2],
                               decomposition.ulysses)
    per_device = _per_device(decomposition.algorithm, layout=layout, causal=causal, scale=scale,
                             block_backend=block_backend, return_lse=return_lse, kv_exchange=kv_exchange,
                             deterministic=deterministic, window=window, softcap=softcap, head_groups=groups, **shared)
    given = {name: x for name, x in (("segment_ids", segment_ids), ("token_index", token_index), ("sinks", sinks))
             if x is not None}
    o, lse = per_device(q, k, v, **given)
    return (o, lse) if return_lse else o


def partition_specs(mesh) -> tuple[P, P]:
    """(spec of q/k/v/o, spec of lse) for ``mesh``."""
    names = mesh.axis_names
    batch = DATA if DATA in names else None
    seq = tuple(a for a in (RING, RING_OUTER, RING_INNER, ULYSSES) if a in names) or None
    return P(batch, seq, None, None), P(batch, None, seq)


def _ids_spec(x_spec: P) -> P:
    """The spec of segment ids or token indices [b, t]: q's batch and sequence axes."""
    return P(*x_spec[:2])


def _onto_mesh(x, sharding: NamedSharding, explicit: bool):
    """Concrete arrays (any sharding, any devices, or NumPy) are placed on the mesh; traced ones
    are resharded when the mesh has Explicit axes (shard_map reshards Auto-axis inputs itself)."""
    if not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, sharding)
    return jax.reshard(x, sharding) if explicit else x


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cotangents_onto_mesh(outputs: tuple, shardings: tuple, explicit: bool) -> tuple:
    """Identity on the outputs; their cotangents are placed on the mesh as the outputs are, the
    way the inputs were (see ``sequence_parallel_attention``: "Cotangents")."""
    return outputs


def _cotangents_onto_mesh_fwd(outputs, shardings, explicit):
    return tuple(x.value for x in outputs), None  # symbolic_zeros=True wraps the primals


def _cotangents_onto_mesh_bwd(shardings, explicit, _, cotangents):
    # An unused output's cotangent stays symbolic (None): the kernels tell a missing lse cotangent
    # from a zero one (fused backward kernels take none).
    return (tuple(None if isinstance(ct, SymbolicZero) else _onto_mesh(ct, sharding, explicit)
                  for ct, sharding in zip(cotangents, shardings)),)


_cotangents_onto_mesh.defvjp(_cotangents_onto_mesh_fwd, _cotangents_onto_mesh_bwd, symbolic_zeros=True)


def sequence_parallel_attention(q, k, v, mesh, *, causal: bool = False, layout: str = "zigzag",
                                scale: float | None = None, kv_exchange: str = "ring",
                                return_lse: bool = False, block_backend: str = "auto",
                                deterministic: bool | None = None, check_ranks: bool | None = None,
                                segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                                shared_tokens: int | None = None, head_groups: int | None = None):
    """Attention of global ``q: [b, t, h, d]`` against ``k, v: [b, t, hk, d]`` (layout order),
    sequence-parallel over ``mesh``. Returns o (and lse: [b, h, t] float32 if ``return_lse``),
    sharded over the mesh. Works under ``jax.jit`` and ``jax.grad``.

    ``segment_ids``: packed documents, an integer [b, t] array in layout order (like q's first
    two dimensions, any sharding: it is placed as the sequence is) or None. Query i sees key j
    only if ``segment_ids[i] == segment_ids[j]`` (and, causal, j's original position <= i's). The
    ids take no gradient. Blocks whose queries and keys share no document are skipped.

    ``window``: a sliding window on original positions — None, an int w (= (w, w)) or
    ``(left, right)`` of non-negative ints: query i sees key j only if i - left <= j <= i + right
    (with ``causal`` also j <= i), as ``jax.nn.dot_product_attention``'s ``local_window_size``.
    Combines with ``segment_ids`` (both must hold). Blocks the window does not reach are skipped.

    ``sinks``: attention sinks, a float [h] array of logits (gpt-oss) or None: every row's softmax
    denominator gains exp(sinks[head]) with no value vector, and the returned lse includes it. It
    is replicated onto every device and differentiable (``jax.grad`` w.r.t. it sums every
    device's rows).

    ``softcap``: logit soft-capping (Gemma 2's ``attn_logit_softcapping``), None or a positive
    float: every scaled logit x = scale·q·k becomes softcap · tanh(x / softcap) before the
    softmax, in every block, forward and backward (the sinks are not capped; the lse is that of
    the capped logits). Blocks run on a kernel that applies it: the portable one (no fused JAX
    kernel soft-caps; a fused ``block_backend`` named with it runs capped blocks on the portable
    kernel).

    ``token_index``: the original token index of every token, an integer [b, t] array in layout
    order (like ``segment_ids``: any sharding, placed as the sequence is; no gradient), or None:
    the positions the static ``layout`` implies (``layout_permutation`` in every row). Given, it
    replaces those positions for ``causal`` and ``window``: with ``causal``, query i sees key j
    only if token_index[j] <= token_index[i]; a window compares token indices too. It is how a
    per-row layout such as the per-document zigzag (``seqplan.layouts.document_layout``, whose
    ``token_index`` it takes) is run. Every ring shard's indices are all-gathered once per call
    (int32, as the segment ids); blocks are then decided at run time from each row's index
    range, on the non-causal schedule (no hop is saved by a window). Checked: shape [b, t] like
    q's first two dimensions and an integer dtype, and, for a concrete array (not a tracer under
    ``jax.jit``), every value in [0, t). Not the layers' RoPE ``positions``, which restart at every
    document (``seqplan.layouts.rope_positions`` derives them from token_index and segment_ids).

    ``shared_tokens``: with ``kv_exchange="allgather"`` (ring or USP) and causal packed documents,
    a promise that every token whose document also lies on another ring shard sits within the
    first ``shared_tokens`` tokens of its ring shard — the per-document hybrid layout's order;
    ``seqplan.chooser.choose_layout`` gives the value — so only those K/V are gathered and their
    dK / dV reduce-scattered, the rest attending locally (``seqplan.shared``). Checked for concrete
    ``segment_ids`` (a ``ValueError``); under ``jax.jit`` the ids are tracers, and a broken
    promise makes the outputs NaN instead of wrong.

    Cotangents are placed on the mesh the way the inputs are: a pullback (``jax.vjp``'s returned
    function) may be given a cotangent of any sharding JAX lets through — sharded like the output,
    freshly made with ``jnp`` outside ``jax.set_mesh``, committed to one device — and it is resharded
    to the output's sharding (o: ``x_spec``, lse: ``lse_spec`` of ``partition_specs(mesh)``) before
    shard_map's backward, which needs exactly that. On an Explicit mesh inside ``jax.set_mesh`` a
    cotangent's type includes its sharding, and JAX's own pullback refuses one typed with another
    sharding (e.g. ``jnp.ones`` there is replicated), naming the expected type
    ("expected float32[2@data,32@ring,4,16]"): give it ``jax.reshard(ct, o.sharding)``.

    ``head_groups``: with a Ulysses axis, the heads in this many consecutive groups, each through
    its own all-to-alls and attention, so that one group's all-to-all can travel while another
    group attends, forward and backward (torch issues them asynchronously; in JAX, XLA's
    latency-hiding scheduler places them) — the same attention, head for head. For steps whose
    attention is short beside the all-to-all (a sliding window: on 4× H200 the all-to-all was a
    quarter of USP's windowed step). It must divide heads and kv_heads, and each group must be a
    valid Ulysses split on its own; None reads ``RINGBRIDGE_HEAD_GROUPS`` (default 1) on meshes with
    a Ulysses axis and means 1 on the others.

    ``deterministic``: run-to-run deterministic block kernels (default: whether XLA_FLAGS has
    ``--xla_gpu_deterministic_ops=true``): a kernel not deterministic in that mode is refused, and
    FA3's kernels are asked for their deterministic backward (``config.deterministic_kernels``).
    XLA reads its flags when its backend starts, so ``deterministic=True`` cannot make XLA's own
    ops deterministic: on a GPU it is refused unless the process started with that flag.
    ``check_ranks``: accepted for parity with torch_impl (default: RINGBRIDGE_CHECK_RANKS=1), and
    there is nothing to check: one controller passes global arrays, which have one shape, dtype
    and set of options by construction."""
    default_check_ranks(check_ranks)  # nothing to compare in single-controller JAX (see above)
    deterministic = default_deterministic(deterministic)
    check_deterministic_ready(deterministic)
    call = _checked_call(q, k, v, mesh, layout=layout, kv_exchange=kv_exchange, scale=scale, segment_ids=segment_ids,
                         token_index=token_index, window=window, softcap=softcap, sinks=sinks,
                         shared_tokens=shared_tokens, head_groups=head_groups)
    per_device = _per_device(call.decomposition.algorithm, layout=layout, causal=causal, scale=scale,
                             block_backend=block_backend, return_lse=return_lse, kv_exchange=kv_exchange,
                             deterministic=deterministic, window=call.window, softcap=call.softcap,
                             head_groups=call.head_groups, **call.shared)
    x_spec, _ = partition_specs(mesh)
    optional = {name: (x, spec) for name, x, spec in (("segment_ids", segment_ids, _ids_spec(x_spec)),
                                                     ("token_index", token_index, _ids_spec(x_spec)),
                                                     ("sinks", sinks, P())) if x is not None}

    def attention(q, k, v, *given):
        o, lse = per_device(q, k, v, **dict(zip(optional, given)))
        return (o, lse) if return_lse else o

    typed = get_backend(block_backend, deterministic=deterministic).typed_for_shard_map
    return _on_mesh(attention, mesh, (q, k, v), optional, return_lse=return_lse, check_vma=typed)


class _CheckedCall(NamedTuple):
    """What :func:`_checked_call` resolves: the mesh's decomposition, the window as ``(left,
    right)`` or None, the soft cap, and the shared-prefix keyword (``{}`` or
    ``{"shared_tokens": n}``)."""

    decomposition: Decomposition
    window: tuple[int, int] | None
    softcap: float | None
    shared: dict
    head_groups: int


def _checked_call(q, k, v, mesh, *, layout, kv_exchange, scale, segment_ids, token_index, window, softcap, sinks,
                  shared_tokens, head_groups=None) -> _CheckedCall:
    """Every check of a call, before any collective: shapes, dtypes and options against the mesh,
    the optional arrays, and — for concrete arrays, not tracers — the token indices' range and
    the shared-prefix promise."""
    decomposition: Decomposition = validate(
        q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), dict(mesh.shape),
        layout=layout, kv_exchange=kv_exchange, scale=scale)
    check_segment_ids(*shape_and_dtype(segment_ids), q.shape)
    check_token_index(*shape_and_dtype(token_index), q.shape)
    if token_index is not None and not isinstance(token_index, jax.core.Tracer):  # a tracer's values are unknown
        with jax.ensure_compile_time_eval():  # concrete, even when closed over inside a jit
            check_token_index_range(int(token_index.min()), int(token_index.max()), q.shape[1])
    window, softcap = check_window(window), check_softcap(softcap)
    check_sinks(*shape_and_dtype(sinks), q.shape[2])
    shared = check_shared_exchange(shared_tokens, decomposition.algorithm, kv_exchange)
    if shared and segment_ids is not None and not isinstance(segment_ids, jax.core.Tracer):
        with jax.ensure_compile_time_eval():  # concrete ids: the promise checked before any collective
            check_shared_tokens(ring_shards(np.asarray(segment_ids), decomposition.ring), shared_tokens)
    groups = check_head_groups(default_head_groups(head_groups, decomposition.ulysses), q.shape[2], k.shape[2],
                               decomposition.ulysses)
    return _CheckedCall(decomposition, window, softcap, shared, groups)


def _on_mesh(attention, mesh, qkv, optional: dict, *, return_lse: bool, check_vma: bool):
    """``attention(q, k, v, *optional arrays)`` as a ``shard_map`` over ``mesh``: the inputs placed
    with their specs (``optional``: name -> (array, spec)), an eager call jitted, and the
    cotangents of the outputs placed back onto the mesh (:func:`_cotangents_onto_mesh`)."""
    x_spec, lse_spec = partition_specs(mesh)
    inputs = (*qkv, *(x for x, _ in optional.values()))
    specs_in = (x_spec,) * 3 + tuple(spec for _, spec in optional.values())
    specs = (x_spec, lse_spec) if return_lse else (x_spec,)
    sharded = jax.shard_map(attention, mesh=mesh, in_specs=specs_in, out_specs=specs if return_lse else x_spec,
                            check_vma=check_vma)
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    # The kernels' custom_vjp keeps an unused lse cotangent symbolic (fused backward kernels take
    # none); JAX implements that for shard_map under a trace only, so an eager call is jitted.
    traced = any(isinstance(x, jax.core.Tracer) for x in inputs)
    outputs = (sharded if traced else jax.jit(sharded))(
        *(_onto_mesh(x, NamedSharding(mesh, spec), explicit) for x, spec in zip(inputs, specs_in)))
    outputs = _cotangents_onto_mesh(tuple(outputs) if return_lse else (outputs,),
                                    tuple(NamedSharding(mesh, s) for s in specs), explicit)
    return outputs if return_lse else outputs[0]
