"""Backend ``"fa3_varlen"``: document-masked blocks on FlashAttention-3's varlen kernels through
flash_attn3_jax (Hopper GPUs, bf16 / fp16), forward and a mended backward.

The block's runs come from ``runs.varlen_offsets`` (traced, static shapes: b·m sequences for the
smallest m of ``runs.VARLEN_RUN_SLOTS`` — for a causal block the finer ``CAUSAL_VARLEN_RUN_SLOTS``
(:func:`run_slots`) — that holds them, picked by ``runs.dispatch``; unused ones zero-length): the
queries stay in place (packed [b·t]) and each query run's keys — its document's key run — are
gathered into consecutive packed keys (no gather on a causal diagonal block, whose runs are its
own tokens: ``runs.causal_offsets``). A FULL block whose keys all precede its queries (every
off-diagonal block of a causal call: ``runs.boundary_runs``) is three runs a row over its own
memory instead, no gather. A query document with no key in the block gets o = 0, lse = -inf and
zero dq, and a key no query reads zero dK / dV, written here; gathered dK / dV are scattered back
to the block's keys. The backward's ``max_seqlen`` is the smallest of ``runs.length_ladder`` (a
causal block: ``runs.causal_length_ladder``) that bounds the block's longest run (its grid is
launched for it), chosen by a switch around the backward's FFI call alone
(``runs.length_choice``: the run lists and the packing are compiled once per run-slot count, not
once per bound). A block of a causal call given
``token_index`` (FULL, the window "key index <= query index" on per-row ``positions``:
``seqplan.schedule.by_token_index``) takes the same forms through ``runs.index_dispatch``: a
diagonal block whose indices increase within each document is the causal document block, any
other the FULL document block on ``runs.index_segments``' new ids (queries that see a key prefix
of their document, keys in it). A block
that is not expressible as runs goes to the portable kernel (the same ``lax.switch``); a window,
a strict block or an lse cotangent go there statically — never guessed, never unmasked.

**Why the library's FFI targets**, as ``fa3.py``: the ring needs the varlen forward's lse (the
public ``flash_mha_varlen`` does not return it) and a backward with the *global* o and lse. The
library's own varlen forward (``flash_attn3_jax.varlen_fwd``) declares its lse
``[nseq, h, max_seqlen_q]`` while the kernel writes ``[h, total_q]`` at the front of that buffer
(read back by :func:`_lse_tokens`): at 256 slots over a 128k-token block that is 4.3 GB of float32
per call, where ``total_q`` needs 16 MB. Its varlen backward sizes the two float32 workspaces
``[h, round_up(total_q + nseq·128, 128)]``; the kernel's own rounding is
``round_up(total_q + nseq·m, m)`` for its tile height m (80 for a non-causal block on sm90), which
that can miss by up to m − 1 rows — the out-of-bounds write ``fa3.py`` documents for the
non-varlen call. So :func:`varlen_fwd` and :func:`varlen_bwd` bind the library's FFI targets
``flash_mha_fwd`` / ``flash_mha_bwd`` themselves: the lse buffers declared
``[nseq, h, ceil(total_q / nseq)]`` (:func:`_lse_buffer_shape`), the backward's workspaces
``total_q + (nseq + 1)·128`` rows. Both need flash_attn3_jax == ``fa3.VERIFIED_VERSION``
(``available``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind, by_token_index

from ..block import BlockBackend, register_backend
from ..config import kernels_deterministic
from . import branches, groups
from . import runs as run_plans
from .fa3 import MAX_TILE_ROWS, forward_ffi, verified
from .reference import reference_block_bwd, reference_block_fwd
from .runs import (
    CAUSAL_VARLEN_RUN_SLOTS,
    VARLEN_RUN_SLOTS,
    VarlenRuns,
    dispatch,
    index_dispatch,
    prefix_dispatch,
    switch_with_fallback,
)

F32 = jnp.float32


def _packed_kv(x, runs: VarlenRuns):
    """[b, s, hk, d] -> the runs' keys packed [b·s, hk, d] (zero rows past the last run: the
    index b·s is out of range and reads as zero, so no copy of the keys with a zero row appended)."""
    flat = x.reshape(-1, *x.shape[2:])
    if runs.identity:
        return flat
    return flat.at[runs.kv_index].get(mode="fill", fill_value=0)


def _lse_tokens(lse_buffer, b: int, h: int, t: int):
    """The varlen forward's lse buffer (``[h, total_q]`` written at its front) -> [b, h, t]."""
    return lse_buffer.reshape(-1)[: h * b * t].reshape(h, b, t).transpose(1, 0, 2)


def _lse_buffer_shape(nseq: int, h: int, total_q: int) -> tuple[int, int, int]:
    """The declared shape of a varlen lse buffer: ``[nseq, h, ceil(total_q / nseq)]`` — room for
    the ``[h, total_q]`` the kernels read and write at its front (module docstring), not the
    library's ``[nseq, h, max_seqlen_q]`` (at 256 slots over 128k tokens: 4.3 GB per call)."""
    return nseq, h, -(-total_q // nseq)


def varlen_fwd(q, k, v, causal: bool, scale: float, runs: VarlenRuns, packed: tuple | None = None):
    """FA3 varlen forward on an expressible block: (o [b, t, h, d] in q's dtype, lse [b, h, t] float32),
    through the library's FFI target ``flash_mha_fwd`` with the lse buffer at its real size
    (``packed``: the runs' keys and values already packed, :func:`plans_packed_kv`)."""
    b, t, h, d = q.shape
    nseq = runs.cu_q.shape[0] - 1
    k_p, v_p = (_packed_kv(k, runs), _packed_kv(v, runs)) if packed is None else packed
    o, lse = forward_ffi(q.reshape(b * t, h, d), k_p, v_p, runs.cu_q, runs.cu_k,
                         _lse_buffer_shape(nseq, h, b * t), t, k.shape[1], causal, scale)
    o, lse = o.reshape(b, t, h, d), _lse_tokens(lse, b, h, t)
    if runs.every_query:  # nothing to blank (a select is a pass over o)
        return o, lse
    covered = runs.covered_q
    return jnp.where(covered[:, :, None, None], o, 0), jnp.where(covered[:, None, :], lse, -jnp.inf)


def _lse_rows(lse, runs: VarlenRuns):
    """The forward's lse [b, h, t] as the backward reads it, [h·b·t] float32 (rows with no key
    here get any finite value: their gradients are zeroed after the call)."""
    lse_t = lse.astype(F32) if runs.every_query else jnp.where(runs.covered_q[:, None, :], lse.astype(F32), 0.0)
    return lse_t.transpose(1, 0, 2).reshape(-1)


def _bwd_call(do, q, k_p, v_p, o, lse_rows, causal: bool, scale: float, runs: VarlenRuns, t: int, s: int):
    """The FFI target on packed tensors (q, do, o [b·t, h, d]; keys [m, hk, d]): (dq, dk, dv) packed,
    as the kernel wrote them — rows outside every run (``used_q`` / ``used_k``) unwritten."""
    import flash_attn3_jax.flash_hlo  # noqa: F401  (registers the library's FFI targets)

    total, h, d = q.shape
    nseq = runs.cu_q.shape[0] - 1
    # The kernel reads [h, b·t] at the front of the buffer, whatever its declared shape
    shape = _lse_buffer_shape(nseq, h, total)
    lse_buffer = jnp.pad(lse_rows, (0, shape[0] * h * shape[2] - h * total)).reshape(shape)
    rows = total + (nseq + 1) * MAX_TILE_ROWS
    result_types = [jax.ShapeDtypeStruct((total, h, d), q.dtype), jax.ShapeDtypeStruct(k_p.shape, q.dtype),
                    jax.ShapeDtypeStruct(v_p.shape, q.dtype), jax.ShapeDtypeStruct((h, rows), F32),
                    jax.ShapeDtypeStruct((h, rows), F32)]
    absent = jnp.zeros((0,), jnp.int32)
    used_q = absent if runs.used_q is None else runs.used_q
    used_k = absent if runs.used_k is None else runs.used_k
    operands = (do.astype(q.dtype), q, k_p, v_p, o.astype(q.dtype), lse_buffer, runs.cu_q, runs.cu_k, used_q, used_k)

    deterministic = kernels_deterministic()  # FA3's own deterministic mode (config.deterministic_kernels)

    def call(max_q: int, max_k: int):
        return lambda *operands: jax.ffi.ffi_call(
            "flash_mha_bwd", result_types, has_side_effect=False, input_layouts=[None] * 10, output_layouts=[None] * 5,
        )(*operands, max_seqlen_q_val=max_q, max_seqlen_q_has_value=True, max_seqlen_k_val=max_k,
          max_seqlen_k_has_value=True, softmax_scale_val=float(scale), softmax_scale_has_value=True,
          is_causal=bool(causal), window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=deterministic,
          sm_margin=0)[:3]

    if runs.bounds is None:  # one static bound (None: the block's own lengths)
        return call(t if runs.max_q is None else runs.max_q, s if runs.max_k is None else runs.max_k)(*operands)
    # the device's pick among the bounds (runs.length_choice): a switch around this call alone
    # (bound_at indexes runs.bounds; one bound: a direct call)
    return branches.Selection(runs.bound_at, runs.bounds, tuple(call(*bound) for bound in runs.bounds)).switch(*operands)


def _bwd_finish(dq, dk_p, dv_p, runs: VarlenRuns, b: int, t: int, s: int):
    """The packed gradients as the block's: dq [b, t, h, d] with the rows no run covers zeroed; dK
    / dV on the block's own keys (identity runs) or scattered back from the gathered ones, float32."""
    hk, d = dk_p.shape[1:]
    dq = dq.reshape(b, t, *dq.shape[1:])
    own = lambda g: g.reshape(b, s, hk, d)  # the block's own keys (identity runs)
    if runs.covers_block:  # every query and key in a run: the kernel wrote every row
        return dq, own(dk_p), own(dv_p)
    if not runs.every_query:
        dq = jnp.where(runs.covered_q[:, :, None, None], dq, 0)
    if runs.identity:  # keys no query reads: zero, written here rather than trusted to the kernel
        read = runs.covered_kv[:, :, None, None]
        return dq, jnp.where(read, own(dk_p), 0), jnp.where(read, own(dv_p), 0)
    # past the last run the index is b·s, out of range: dropped (adding every padding row into one
    # zero row serialized them — 2.3-2.8 ms against 0.9-1.1 for a device's one call at 128k, H100)
    scatter = lambda g: (jnp.zeros((b * s, hk, d), F32).at[runs.kv_index].add(g.astype(F32), mode="drop")
                         .reshape(b, s, hk, d))
    return dq, scatter(dk_p), scatter(dv_p)


def _bwd_inputs(do, q, k, v, o, lse, runs: VarlenRuns, packed: tuple | None = None) -> tuple:
    """:func:`_bwd_call`'s first six arguments: do, q, the keys and values packed by ``runs`` (or
    ``packed``), o, the lse rows."""
    b, t, h, d = q.shape
    flat = lambda x: x.reshape(b * t, h, d)
    k_p, v_p = (_packed_kv(k, runs), _packed_kv(v, runs)) if packed is None else packed
    return flat(do), flat(q), k_p, v_p, flat(o), _lse_rows(lse, runs)


def varlen_bwd(do, q, k, v, o, lse, causal: bool, scale: float, runs: VarlenRuns, packed: tuple | None = None):
    """FA3 varlen backward through the FFI target with padded workspaces (module docstring);
    ``packed``: the runs' keys and values already packed (:func:`plans_packed_kv`)."""
    b, t = q.shape[:2]
    s = k.shape[1]
    out = _bwd_call(*_bwd_inputs(do, q, k, v, o, lse, runs, packed), causal, scale, runs, t, s)
    return _bwd_finish(*out, runs, b, t, s)


def varlen_bwd_groups(do, q, k, v, o, lse, causal: bool, scale: float, runs: VarlenRuns, sizes, ladder,
                      always: bool = False):
    """:func:`varlen_bwd` on one plan's runs (every real run first, none skipped) as the two calls
    of ``groups.split_runs`` — the long runs and the others, each with its own slots and bound,
    over the same packed queries and keys; each call's rows taken where its runs are."""
    b, t = q.shape[:2]
    s = k.shape[1]
    packed = _bwd_inputs(do, q, k, v, o, lse, runs)
    split = groups.split_runs(runs, tuple(sizes), tuple(ladder), always)
    call = lambda group: _bwd_call(*packed, causal, scale, group, t, s)
    empty = lambda: tuple(jnp.zeros(x.shape, q.dtype) for x in packed[1:4])  # no row of it is read
    group_call = lambda members, choice: branches.select(
        groups.group_variants(call, runs, members, sizes, ladder, t, s, empty), choice).switch()
    short = group_call(~split.long & (jnp.diff(runs.cu_q) > 0), split.choices[1])

    def with_long():  # the long runs' call, and each call's rows where its runs are
        long = group_call(split.long, split.choices[0])
        q_long = groups.per_position(runs.cu_q, split.long, b * t)[:, None, None]
        k_long = groups.per_position(runs.cu_k, split.long, packed[2].shape[0])[:, None, None]
        return tuple(jnp.where(at, a, c) for at, a, c in zip((q_long, k_long, k_long), long, short))

    # no long run (the one call: the split saves too little): the short call alone, no second call,
    # no zeros for it and no select
    grads = lax.cond(jnp.any(split.long), with_long, lambda: short)
    return _bwd_finish(*grads, runs, b, t, s)


BACKWARD_GROUPS = ("1", "2", "always")
CHECK_RUNGS = (64, 128)  # "always" only: bounds below the ladder's lowest, so a check's short runs split


def backward_groups() -> str:
    """How the one-call backward (:func:`one_call_backward`) runs, from ``RINGBRIDGE_BACKWARD_GROUPS``:
    "1" (one call, the default), "2" (the long runs and the others where that saves enough,
    ``groups``), "always" (the two calls wherever both would hold runs: what a check runs, so the
    small problems it checks exercise the two calls). "2" uses FA3's ``seqused`` backward of
    flash_attn3_jax 0.2.3 for the first time: the default once a GPU run has verified and timed it.
    Read when a program is traced."""
    value = os.environ.get("RINGBRIDGE_BACKWARD_GROUPS", "1")
    if value not in BACKWARD_GROUPS:
        raise ValueError(f"RINGBRIDGE_BACKWARD_GROUPS must be one of {BACKWARD_GROUPS}, got {value!r}")
    return value


def plans_packed_kv(k, v, plans: list[VarlenRuns]) -> tuple:
    """The one call's keys and values packed once, outside its plan switch: every plan of
    ``runs.prefix_plans`` that fits holds the same runs over the same key capacity, so their
    ``kv_index`` agree and the largest plan's serves whichever the device picks. Inside the switch
    each plan's branch carried its own copy of the gather. The price: where none fits, the
    fallback runs with these unread buffers (the key capacity, twice) still live — a path taken
    only when a batch outgrows the largest plan; gating the gather would add a conditional, and a
    host round trip, to every call. Plans over the block's own keys (``runs.own_key_plans``:
    ``identity``) pack nothing: the keys are read in place."""
    return _packed_kv(k, plans[-1]), _packed_kv(v, plans[-1])


def one_call_forward(q, k, v, scale: float, plans: list[VarlenRuns], fallback):
    """A device's one causal varlen call (``runs.prefix_plans``) against keys ``k`` / ``v`` [b, S, hk, d]:
    (o, lse) on the plan with the fewest slots that holds the runs, or ``fallback()`` where none does."""
    packed = plans_packed_kv(k, v, plans)
    return prefix_dispatch(plans, lambda runs: varlen_fwd(q, k, v, True, scale, runs, packed), fallback,
                           keys=k.shape[1])


def one_call_backward(do, q, k, v, o, lse, scale: float, plans: list[VarlenRuns], fallback):
    """The backward of a device's one call (``runs.prefix_plans``: the same runs over each slot
    count, the largest last) on keys ``k`` / ``v`` [b, S, hk, d]: (dq, dk, dv), or ``fallback()``
    where the runs do not fit: the one call (``runs.prefix_dispatch``, the smallest plan that holds
    the runs), or with :func:`backward_groups` "2" / "always" the two calls of :func:`varlen_bwd_groups`."""
    keys = k.shape[1]
    mode = backward_groups()
    if mode == "1":
        packed = plans_packed_kv(k, v, plans)
        return prefix_dispatch(plans, lambda runs: varlen_bwd(do, q, k, v, o, lse, True, scale, runs, packed),
                               fallback, keys=keys, lengths=True)
    runs, sizes = plans[-1], tuple(plan.cu_q.shape[0] - 1 for plan in plans)
    ladder = run_plans.prefix_length_ladder(keys)
    if mode == "always":  # a check's runs are short: rungs below the ladder's 256 give them a split too
        ladder = tuple(sorted({*(r for r in CHECK_RUNGS if r < ladder[0]), *ladder}))
    split = lambda: varlen_bwd_groups(do, q, k, v, o, lse, True, scale, runs, sizes, ladder,
                                      always=mode == "always")
    return switch_with_fallback({GROUPS: split}, branches.First([(runs.ok, GROUPS)]), fallback)


GROUPS = (groups.GROUP, "split")


def _static_fit(mask: BlockMask, q, segments, positions, dlse=None) -> bool:
    """Whether the block can take the document form (``segments``, no window) or the token-index
    form (:func:`by_token_index`, per-row ``positions``) at all — decided on static facts."""
    if dlse is not None or mask.kind is MaskKind.STRICT or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    if q.shape[-1] % 8:
        return False
    if mask.window is None:
        return segments is not None and positions is None
    return by_token_index(mask) and positions is not None and positions[0].ndim == 2


def run_slots(causal: bool) -> tuple[int, ...]:
    """The run-slot counts a block's varlen form is compiled for: finer for a causal block, whose
    form is only its run starts (``runs.CAUSAL_VARLEN_RUN_SLOTS``)."""
    return CAUSAL_VARLEN_RUN_SLOTS if causal else VARLEN_RUN_SLOTS


def fa3_varlen_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    portable = lambda: reference_block_fwd(q, k, v, mask, scale, segments, positions)
    if not _static_fit(mask, q, segments, positions):
        return portable()
    kernel = lambda causal, runs: varlen_fwd(q, k, v, causal, scale, runs)
    if mask.window is not None:
        return index_dispatch(segments, positions, kernel, portable)
    causal = mask.kind is MaskKind.CAUSAL
    return dispatch(segments, causal, lambda runs: kernel(causal, runs), portable, run_slots(causal), boundary=True)


def fa3_varlen_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None,
                         positions=None):
    portable = lambda: reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)
    if not _static_fit(mask, q, segments, positions, dlse):
        return portable()
    kernel = lambda causal, runs: varlen_bwd(do, q, k, v, o, lse, causal, scale, runs)
    if mask.window is not None:
        return index_dispatch(segments, positions, kernel, portable, lengths=True)
    causal = mask.kind is MaskKind.CAUSAL
    return dispatch(segments, causal, lambda runs: kernel(causal, runs), portable, run_slots(causal), boundary=True,
                    lengths=True)


def _one_run_documents(q, mask: BlockMask) -> bool:
    """A document block without a window that the varlen form takes (:func:`_static_fit`): one
    document covering it is one run (``BlockBackend.one_run_documents``)."""
    return mask.documents and mask.window is None and _static_fit(mask, q, segments=(), positions=None)


def _supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
    if softcap or mask.kind is MaskKind.STRICT or dtype not in LOW_PRECISION:
        return False
    return (mask.documents and mask.window is None) or by_token_index(mask)


register_backend(BlockBackend(
    "fa3_varlen", fa3_varlen_block_fwd, fa3_varlen_block_bwd, typed_for_shard_map=False,
    supports=_supports, available=verified, one_run_documents=_one_run_documents))
