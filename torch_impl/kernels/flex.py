"""Backend ``"flex"``: torch's FlexAttention, the block mask applied inside the kernel.

    fwd(q, k, v, mask, scale, segments=None, positions=None, softcap=None)                   -> (o, lse)
    bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None, softcap=None)
                                                                                    -> (dq, dk, dv)

q, do, o: [b, t, h, d]; k, v: [b, s, hk, d] (GQA: h a multiple of hk); lse, dlse: [b, h, t]
float32 (natural log). ``segments = (q_ids [b, t], kv_ids [b, s])`` with ``mask.documents``,
``positions = (q_pos [t], kv_pos [s])`` (original positions) with ``mask.window`` — the block
interface of ``block.py``. o and the gradients come back in the input dtype, lse in float32; a
row with no visible key gets o = 0, lse = -inf (FlexAttention's own convention, checked by the
tests) and no gradient.

**Soft-capping** (``softcap``, Gemma 2) is a FlexAttention ``score_mod``: FlexAttention scales the
logits first and hands them to it, so ``softcap · tanh(score / softcap)`` caps the scaled logits,
as Gemma 2 (and ringbridge's contract) define it. Its gradient (the slope 1 − tanh²) comes from
the score_mod's joint graph: eagerly, route (a) below is given the joint graph traced here
(:func:`joint_graph_for`, torch's private ``create_fw_bw_graph``; derived by the operator itself
it comes out empty), and route (b) gets it from the forward's autograd. Compiled, dynamo (torch
2.13) neither derives a non-identity score_mod's joint graph for the backward operator called on
its own nor accepts one as an argument, so there a capped block's backward takes route (b) — the
public compiled flex_attention with a score_mod, differentiated (one more block forward). One
score_mod per cap value (:func:`score_mod_for`), so the compiled functions see the same object
every call.

**The mask inside the kernel.** Every :class:`schedule.BlockMask` becomes a FlexAttention
``mask_mod`` (local indices: causal j <= i, strict j < i; documents q_ids[b, i] == kv_ids[b, j];
window q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right) plus a FlexAttention ``BlockMask`` of
:data:`TILE` × :data:`TILE` tiles. The tiles are classified from per-tile summaries — local index
bounds, the smallest and largest id and position of each tile's rows and columns (the same tests
as ``schedule.document_flags`` / ``window_flags``) — never from a [t, s] mask: empty (skipped),
full (the kernel skips ``mask_mod``) or partial (``mask_mod`` decides each pair). Empty and full
are sound for any ids and positions, and exact when each document is a run of consecutive ids
along the original order and positions are contiguous (zigzag, contiguous); otherwise a tile may
be called partial that is in fact empty, which costs time, never correctness. Static masks
(no documents, no window) are cached per shape; the others cost a few [b, t / TILE, s / TILE]
tensor ops per call, with no host synchronisation.

**The backward with the global o and lse.** The public ``flex_attention`` differentiates only
with its own o and lse; a block's gradient needs the global ones. Two routes (issue 25, "Fast
kernels"), chosen once per device type by :func:`backward_route` (or set in :data:`BACKWARD_ROUTES`,
e.g. to time one against the other):

(a) ``"operator"`` — preferred: torch's flex backward higher-order operator,
``torch.ops.higher_order.flex_attention_backward(q, k, v, out, logsumexp, grad_out,
grad_logsumexp, score_mod, joint_graph, block_mask, scale, kernel_options, (), ())``
(torch/_higher_order_ops/flex_attention.py), takes out and logsumexp as arguments: we give it
the global ones. Its conventions (torch's source; checked by the tests): logsumexp in base 2
(lse / ln 2), grad_logsumexp the cotangent of that (dlse · ln 2); ``joint_graph=None`` lets the
operator (eager) or dynamo (compiled) derive the identity score_mod's joint graph. The kernels
read ``out`` only through delta = rowsum(dO ∘ O) − dlse (dS = P ∘ (dP − delta)), so we pass
out = 0 and grad_logsumexp = (dlse − rowsum(dO ∘ O)) · ln 2 with the rowsum of the float32
global o: o is never rounded to the input dtype, and a given dlse is taken as is. Eagerly it runs
on any torch; compiled it needs a dynamo that traces the operator called on its own (torch 2.13
does; torch 2.11, on the GPU machines in 2026-11, does not: "Missing Dynamo support for
FlexAttentionBackward HOP argument").

(b) ``"recompute"`` — where (a) does not compile: the block's forward is run again with autograd
(o_b, lse_b) and differentiated with rescaled cotangents. With w = exp(lse_b − lse) (0 where
lse_b = −inf), P = w·P_b, and the block's share of the global gradient is dS = P ∘ (dP − D +
dlse), D = rowsum(dO ∘ O). The autograd of (o_b, lse_b) with cotangents (do_b, dlse_b) gives
dS_b = P_b ∘ (do_b Vᵀ − rowsum(do_b ∘ o_b) + dlse_b) and dV = P_bᵀ do_b; so do_b = w·dO and
dlse_b = rowsum(do_b ∘ o_b) − w·(D − dlse) give dS_b = w·P_b ∘ (dP − D + dlse) = dS and
dV = Pᵀ dO (the tests check it equals (a) and the truth). It costs one more block forward. On
CUDA the forward is the compiled public op; elsewhere (the public op has no CPU backward) the
forward operator under autograd, eagerly.

The operators are private: their argument lists can change between torch releases; they are
used here only, and checked on a GPU by ``tests/gpu/test_one_gpu_kernels.py``.

**Compilation.** FlexAttention is only fast compiled. On device types listed in
:data:`COMPILE_BACKENDS` (CUDA: inductor's Triton kernels, ``BACKEND="TRITON"``: the FLASH
backend takes no lse cotangent) the passes run through ``torch.compile(fullgraph=True,
dynamic=False)``, one compiled callable per static variant (function, mask kind, documents,
window, dtype) built once per process. Ids, positions and tiles are tensors (the mask_mod's
captured tensors and the BlockMask's are graph inputs), so new data never recompiles; a new block
shape compiles once. Dynamo keeps compiled entries, and its recompile limit (8), per code object,
and a run's variants × block shapes exceed 8: each variant runs a copy of the function with a
code object of its own (:func:`_own_code`). Elsewhere (CPU) the functions run eagerly on torch's
unfused math path, which materialises the [b, h, t, s] scores and ignores the tiles — correct,
for tests only ("reference" is the CPU kernel); :func:`tile_visibility` is tested on its own.

Not in ``"auto"``'s routing table: selectable by name (``block_backend="flex"``) until the lead
has measured it on a GPU.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable

import torch

from seqplan.routing import LOW_PRECISION
from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend
from .reference import reference_block_bwd, reference_block_fwd

LN2 = math.log(2.0)
TILE = 128  # FlexAttention's default sparse block size (query rows × key columns per tile)
# torch.compile backend per device type; a device type not listed runs the flex functions eagerly.
COMPILE_BACKENDS: dict[str, str | Callable] = {"cuda": "inductor"}
_TRITON = {"BACKEND": "TRITON"}
# The options the public op hands its backward (torch's _apply_kernel_options), for our own call.
_BACKWARD_OPTIONS = {"BACKEND": "TRITON", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
                     "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True,
                     "OUTPUT_MAX": False}


def _flex():
    """torch's FlexAttention pieces: (public module, forward operator, backward operator), or
    None where this torch has none."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
        from torch.nn.attention import flex_attention as api
    except ImportError:
        return None
    if not all(hasattr(api, n) for n in ("flex_attention", "BlockMask", "AuxRequest", "and_masks", "noop_mask")):
        return None
    return api, flex_attention, flex_attention_backward


_PIECES = _flex()  # resolved once: the compiled functions read it as a global


# ---- the mask: mask_mod and tiles -------------------------------------------------------------------

def _causal(b, h, i, j):
    return j <= i


def _strict(b, h, i, j):
    return j < i


def _check_block(mask: BlockMask, t: int, s: int, segments, positions) -> None:
    if mask.kind is not MaskKind.FULL and t != s:
        raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
    if mask.documents:
        if segments is None:
            raise ValueError("a document mask needs segments = (q_ids [b, t], kv_ids [b, s])")
        q_ids, kv_ids = segments
        if q_ids.shape[1] != t or kv_ids.shape[1] != s:
            raise ValueError(f"segments must be [b, {t}] and [b, {s}] like the block, got {tuple(q_ids.shape)} "
                             f"and {tuple(kv_ids.shape)}")
    if mask.window is not None:
        if positions is None:
            raise ValueError("a windowed mask needs positions = (q_pos [t], kv_pos [s])")
        q_pos, kv_pos = positions
        if len(q_pos) != t or len(kv_pos) != s:
            raise ValueError(f"positions must be [{t}] and [{s}] like the block, got {len(q_pos)} and {len(kv_pos)}")


def _ids(segments, device):
    return tuple(torch.as_tensor(x, device=device).to(torch.int32).contiguous() for x in segments)


def _positions(positions, device):
    return tuple(torch.as_tensor(x, device=device).to(torch.int32).reshape(-1).contiguous() for x in positions)


def mask_mod_for(mask: BlockMask, segments=None, positions=None):
    """The FlexAttention ``mask_mod(b, h, i, j) -> bool`` of ``mask`` (local indices; ``segments``
    and ``positions`` as device int32 tensors, given when ``mask`` has documents / a window).
    The tensors are captured by closure, which dynamo lifts into graph inputs (new data, same
    graph); bound as default arguments of a mask_mod defined in a loop instead, the compiled op
    gave wrong o and lse for the second of two blocks (torch 2.11, H100; not root-caused)."""
    api = _PIECES[0]
    conditions = {MaskKind.CAUSAL: [_causal], MaskKind.STRICT: [_strict]}.get(mask.kind, [])
    if mask.documents:
        q_ids, kv_ids = segments

        def same_document(b, h, i, j):
            return q_ids[b, i] == kv_ids[b, j]

        conditions.append(same_document)
    if mask.window is not None:
        (q_pos, kv_pos), (left, right) = positions, mask.window

        def in_window(b, h, i, j):
            return (kv_pos[j] >= q_pos[i] - left) & (kv_pos[j] <= q_pos[i] + right)

        conditions.append(in_window)
    if not conditions:
        return api.noop_mask
    return conditions[0] if len(conditions) == 1 else api.and_masks(*conditions)


def _tile_bounds(n: int, device):
    """First and last index of each tile of n: two [ceil(n / TILE)] tensors."""
    first = torch.arange(0, n, TILE, device=device)
    return first, torch.clamp(first + TILE, max=n) - 1


def _tile_range(x):
    """Smallest and largest value of each tile along the last axis: x [..., n] -> two [..., ceil(n / TILE)]."""
    pad = -x.shape[-1] % TILE
    if pad:  # repeat the last value: neither bound moves
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    x = x.reshape(*x.shape[:-1], -1, TILE)
    return x.amin(-1), x.amax(-1)


def tile_visibility(mask: BlockMask, t: int, s: int, device, segments=None, positions=None):
    """``(some, every)``: bool [B, ceil(t / TILE), ceil(s / TILE)] (B = b with documents, else 1):
    whether a tile of the block may hold a visible pair, and whether every pair of it is visible.
    ``some`` False proves the tile empty and ``every`` True proves it full (a ragged edge tile,
    past the end of t or s, is never full); in between the kernel evaluates the mask_mod.
    ``segments`` / ``positions``: device int32 tensors as in :func:`mask_mod_for`."""
    r_first, r_last = _tile_bounds(t, device)
    c_first, c_last = _tile_bounds(s, device)
    r_first, r_last, c_first, c_last = r_first[:, None], r_last[:, None], c_first[None, :], c_last[None, :]
    shape = (1, len(r_first), c_first.shape[1])
    if mask.kind is MaskKind.CAUSAL:  # j <= i
        some, every = (c_first <= r_last)[None], (c_last <= r_first)[None]
    elif mask.kind is MaskKind.STRICT:  # j < i
        some, every = (c_first < r_last)[None], (c_last < r_first)[None]
    else:
        some = every = torch.ones(shape, dtype=torch.bool, device=device)
    if mask.documents:
        (q_lo, q_hi), (kv_lo, kv_hi) = (_tile_range(x) for x in segments)  # [b, tiles]
        q_lo, q_hi, kv_lo, kv_hi = q_lo[:, :, None], q_hi[:, :, None], kv_lo[:, None, :], kv_hi[:, None, :]
        some = some & (q_hi >= kv_lo) & (kv_hi >= q_lo)  # the id ranges meet
        every = every & (q_lo == q_hi) & (kv_lo == kv_hi) & (q_lo == kv_lo)  # one and the same id
    if mask.window is not None:
        (q_lo, q_hi), (kv_lo, kv_hi) = (_tile_range(x) for x in positions)  # schedule.window_flags per tile
        q_lo, q_hi, kv_lo, kv_hi = q_lo[:, None], q_hi[:, None], kv_lo[None, :], kv_hi[None, :]
        left, right = mask.window
        some = some & ((kv_hi >= q_lo - left) & (kv_lo <= q_hi + right))[None]
        every = every & ((kv_lo >= q_hi - left) & (kv_hi <= q_lo + right))[None]
    ragged = torch.zeros(shape[1:], dtype=torch.bool, device=device)
    ragged[-1, :] |= t % TILE != 0
    ragged[:, -1] |= s % TILE != 0
    return some, every & ~ragged & some


def _ordered(tiles):
    """bool [B, rows, cols] -> FlexAttention's (num_blocks [B, 1, rows], indices [B, 1, rows, cols]) int32."""
    tiles = tiles.to(torch.int32)[:, None]
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32).contiguous()


def block_mask_for(mask: BlockMask, t: int, s: int, device, segments=None, positions=None):
    """The FlexAttention ``BlockMask`` of one block: :func:`tile_visibility`'s partial and full
    tiles, :func:`mask_mod_for`'s mask_mod. Static masks (no documents, no window) are cached."""
    device = torch.device(device)
    if not mask.documents and mask.window is None:
        return _static_block_mask(mask.kind, t, s, device)
    segments = _ids(segments, device) if mask.documents else None
    positions = _positions(positions, device) if mask.window is not None else None
    return _build(mask, t, s, device, segments, positions)


def _build(mask, t, s, device, segments, positions):
    api = _PIECES[0]
    some, every = tile_visibility(mask, t, s, device, segments, positions)
    return api.BlockMask.from_kv_blocks(*_ordered(some & ~every), *_ordered(every), BLOCK_SIZE=TILE,
                                        mask_mod=mask_mod_for(mask, segments, positions), seq_lengths=(t, s))


@functools.lru_cache(maxsize=64)
def _static_block_mask(kind: MaskKind, t: int, s: int, device):
    return _build(BlockMask(kind), t, s, device, None, None)


# ---- the two passes (eager, or compiled per static variant) ----------------------------------------

def _score_identity(score, b, h, i, j):
    return score


@functools.lru_cache(maxsize=16)
def score_mod_for(softcap: float | None):
    """The FlexAttention ``score_mod`` of a soft-cap: ``softcap · tanh(score / softcap)`` of the
    scaled logit, or None (no score_mod: the identity) without one. Cached per value: the same
    function object for every block of a call (and every call with that cap)."""
    if softcap is None:
        return None

    def softcap_mod(score, b, h, i, j):
        return torch.tanh(score / softcap) * softcap

    return softcap_mod


@functools.lru_cache(maxsize=16)
def joint_graph_for(softcap: float):
    """The joint graph (score_mod and its gradient) of :func:`score_mod_for`'s cap, traced with
    grad enabled by torch's own ``create_fw_bw_graph`` (private: see the module docstring). The
    eager backward operator given ``joint_graph=None`` derives it with grad disabled, and gets a
    graph whose every gradient is None (torch 2.13, CPU: its vmap then fails); the identity
    score_mod is unaffected (its gradient is its input)."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    example = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int) for _ in range(4)))
    with torch.enable_grad():
        return create_fw_bw_graph(score_mod_for(softcap), example, ())[1]


def _forward(q, k, v, block_mask, scale, score_mod=None):
    """q: [b, t, h, d], k, v: [b, s, hk, d] -> (o [b, t, h, d] input dtype, lse [b, h, t] float32,
    natural log), through the public op (differentiable where torch has its backward: not on CPU)."""
    api = _PIECES[0]
    o, aux = api.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                                block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
                                return_aux=api.AuxRequest(lse=True), kernel_options=_TRITON)
    return o.transpose(1, 2), aux.lse


def _operator_forward(q, k, v, block_mask, scale, score_mod=None):
    """:func:`_forward` through the forward operator itself, differentiable on any device (the
    public op refuses CPU inputs that require grad): the recompute route's eager forward."""
    out = _PIECES[1](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod or _score_identity,
                     block_mask.as_tuple(), scale, dict(_BACKWARD_OPTIONS))
    return out[0].transpose(1, 2), out[1] * LN2  # the operator's lse is in base 2


def _backward(do, q, k, v, o, lse, dlse, block_mask, scale, score_mod=None, joint_graph=None):
    """Route (a): dq [b, t, h, d], dk, dv [b, s, hk, d] (input dtype) for the global o, lse and
    the lse cotangent dlse (zeros when lse is unused), through torch's flex backward operator."""
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2)  # [b, h, t] float32: rowsum(dO ∘ O), global O
    grad_out = do.to(q.dtype).transpose(1, 2)
    dq, dk, dv, _ = _PIECES[2](
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), torch.zeros_like(grad_out), lse.float() / LN2,
        grad_out, (dlse.float() - delta) * LN2, score_mod or _score_identity, joint_graph, block_mask.as_tuple(), scale,
        dict(_BACKWARD_OPTIONS), (), ())
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _recompute_backward(do, q, k, v, o, lse, dlse, block_mask, scale, score_mod, forward):
    """Route (b): the same gradients as :func:`_backward`, from the autograd of ``forward``'s
    (o_b, lse_b) with the cotangents of the module docstring."""
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o_b, lse_b = forward(q, k, v, block_mask, scale, score_mod)
        with torch.no_grad():
            w = torch.where(torch.isneginf(lse_b), 0.0, torch.exp(lse_b - lse))  # [b, h, t]; 0 for empty rows
            do_b = (do.float() * w.transpose(1, 2)[..., None]).to(o_b.dtype)
            delta = (do.float() * o.float()).sum(-1).transpose(1, 2)
            dlse_b = (do_b.float() * o_b.float()).sum(-1).transpose(1, 2) - w * (delta - dlse)
        return torch.autograd.grad((o_b, lse_b), (q, k, v), (do_b, dlse_b))


def _own_code(fn, tag: str):
    """A copy of ``fn`` with a code object of its own: dynamo caches compiled entries, and counts
    them against its recompile limit, per code object (module docstring)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


_COMPILED: dict = {}


def _runner(fn, mask: BlockMask, dtype, device, capped: bool = False):
    """``fn`` itself (eager), or on a device type of :data:`COMPILE_BACKENDS` its compiled copy
    for this static variant — built on first use, then reused for the whole process."""
    backend = COMPILE_BACKENDS.get(device.type)
    if backend is None:
        return fn
    key = (fn.__name__, mask.kind, mask.documents, mask.window is not None, dtype, device.type, backend, capped)
    if key not in _COMPILED:
        tag = "_".join([mask.kind.value, "documents" if mask.documents else "plain",
                        "window" if mask.window is not None else "nowindow", str(dtype).removeprefix("torch.")]
                       + (["softcap"] if capped else []))
        _COMPILED[key] = torch.compile(_own_code(fn, tag), backend=backend, fullgraph=True, dynamic=False)
    return _COMPILED[key]


# device type -> "operator" (route (a)) or "recompute" (route (b)); unset: chosen by backward_route.
BACKWARD_ROUTES: dict[str, str] = {}


def operator_backward_compiles() -> bool:
    """Whether this torch's dynamo traces the flex backward operator called on its own (route (a)
    compiled): one tiny CPU trace, run eagerly. False where dynamo reports the operator unsupported."""
    from torch._dynamo.exc import Unsupported

    x = torch.zeros(1, 4, 1, 8)
    lse = torch.zeros(1, 1, 4)
    probe = torch.compile(_own_code(_backward, "probe"), backend="eager", fullgraph=True)
    try:
        probe(x, x, x, x, x, lse, lse, block_mask_for(BlockMask(MaskKind.CAUSAL), 4, 4, "cpu"), 1.0)
    except Unsupported:
        return False
    return True


def backward_route(device_type: str) -> str:
    """The backward route for inputs on ``device_type`` (:data:`BACKWARD_ROUTES`, else chosen once:
    "operator" when the passes run eagerly there or the operator compiles, else "recompute")."""
    if device_type not in BACKWARD_ROUTES:
        eager = COMPILE_BACKENDS.get(device_type) is None
        BACKWARD_ROUTES[device_type] = "operator" if eager or operator_backward_compiles() else "recompute"
    return BACKWARD_ROUTES[device_type]


def _softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap)
            and softcap > 0):
        raise ValueError(f"softcap must be a finite positive number or None, got {softcap!r}")
    return float(softcap)


def _per_row(positions) -> bool:
    """Per-row positions [b, t] (explicit token indices): the portable kernel's job."""
    return positions is not None and positions[0].dim() == 2


def flex_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None, softcap=None):
    """The block forward (module docstring): (o [b, t, h, d] input dtype, lse [b, h, t] float32);
    ``softcap``: the scaled logits capped by :func:`score_mod_for`."""
    if _per_row(positions):  # explicit per-row token indices: not in this adapter (routed, never reshaped)
        return reference_block_fwd(q, k, v, mask, scale, segments, positions, softcap)
    t, s = q.shape[1], k.shape[1]
    _check_block(mask, t, s, segments, positions)
    softcap = _softcap(softcap)
    block_mask = block_mask_for(mask, t, s, q.device, segments, positions)
    run = _runner(_forward, mask, q.dtype, q.device, capped=softcap is not None)
    return run(q.detach(), k.detach(), v.detach(), block_mask, float(scale), score_mod_for(softcap))


def flex_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None, positions=None,
                   softcap=None):
    """The block backward with the global ``o`` and ``lse`` (and ``dlse``, their lse cotangent,
    or None): (dq [b, t, h, d], dk, dv [b, s, hk, d]) in the input dtype, by :func:`backward_route`
    (``softcap``: through the cap's score_mod)."""
    if _per_row(positions):
        return reference_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions, softcap)
    t, s = q.shape[1], k.shape[1]
    _check_block(mask, t, s, segments, positions)
    softcap = _softcap(softcap)
    capped = softcap is not None
    block_mask = block_mask_for(mask, t, s, q.device, segments, positions)
    lse = lse.float().contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()  # one compiled variant
    args = (do.detach(), q.detach(), k.detach(), v.detach(), o.detach(), lse, dlse, block_mask, float(scale),
            score_mod_for(softcap))
    compiled = COMPILE_BACKENDS.get(q.device.type) is not None
    # capped and compiled: dynamo neither derives the cap's joint graph for the backward operator
    # (torch 2.13) nor takes one as an argument — the recompute route (module docstring)
    if backward_route(q.device.type) == "operator" and not (capped and compiled):
        joint = joint_graph_for(softcap) if capped else None
        return _runner(_backward, mask, q.dtype, q.device, capped)(*args, joint)
    forward = _runner(_forward, mask, q.dtype, q.device, capped) if compiled else _operator_forward
    return _recompute_backward(*args, forward)


def supports(mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
    """Every block mask (kind, documents, window) in float32 and the low-precision dtypes,
    soft-capped or not."""
    return dtype == "float32" or dtype in LOW_PRECISION


def available() -> bool:
    """torch has FlexAttention with its backward operator, and, where CUDA is present, Triton
    (the compiled path's kernels)."""
    if _PIECES is None:
        return False
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        return has_triton()
    return True


register_backend(BlockBackend("flex", flex_block_fwd, flex_block_bwd, supports=supports, available=available))
