"""Tier 1 — the ``"flex"`` block backend (torch FlexAttention, ``torch_impl/kernels/flex.py``) on
CPU: forward and backward for every static mask kind, with packed documents and with a window on
original positions, against a float64 masked computation and the portable kernel (float32, and
bf16 within the numerics policy); the backward given a GLOBAL o / lse merged from two blocks
(per-block gradients sum to the true gradient, lse cotangent included) by both backward routes
(torch's backward operator; the recomputed forward with rescaled cotangents); GQA / MQA; the tile
classification behind the kernel's block sparsity (which CPU's unfused math path does not use: it
is checked here on its own, against the pairs and against torch's create_block_mask); the
compiled path traced by dynamo (a counting backend) without recompiling on new data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.core.numerics import check_tensor
from seqplan.schedule import BLOCK_MASKS, CAUSAL_MASK, FULL_MASK, STRICT_MASK, BlockMask, MaskKind
from torch_impl import merge_partials
from torch_impl.block import AUTO_ROUTES, get_backend
from torch_impl.kernels import flex

F64 = torch.float64
NAMES = ("o", "lse", "dq", "dk", "dv")


@pytest.fixture(scope="module", autouse=True)
def flex_runs_on_cpu():
    """Skip (with the reason) where this torch's FlexAttention cannot run forward and backward on CPU."""
    if not flex.available():
        pytest.skip("torch has no FlexAttention with its backward operator")
    x = torch.zeros(1, 4, 1, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            o, lse = flex.flex_block_fwd(x, x, x, CAUSAL_MASK, 1.0)
            flex.flex_block_bwd(x, x, x, x, o, lse, CAUSAL_MASK, 1.0)
        except (NotImplementedError, RuntimeError) as err:
            pytest.skip(f"FlexAttention does not run on CPU in torch {torch.__version__}: {err}")
    with warnings.catch_warnings():  # torch warns once that flex runs uncompiled (as intended on CPU)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


# ---- truth ----------------------------------------------------------------------------------------

def visible_pairs(mask: BlockMask, t: int, s: int, segments=None, positions=None):
    """[b or 1, t, s] bool: the pairs BlockMask.visible admits, vectorised."""
    i, j = torch.arange(t)[:, None], torch.arange(s)[None, :]
    vis = {MaskKind.FULL: torch.ones(t, s, dtype=torch.bool), MaskKind.CAUSAL: j <= i, MaskKind.STRICT: j < i}[mask.kind]
    vis = vis[None]
    if mask.documents:
        q_ids, kv_ids = segments
        vis = vis & (q_ids[:, :, None] == kv_ids[:, None, :])
    if mask.window is not None:
        (q_pos, kv_pos), (left, right) = positions, mask.window
        vis = vis & ((kv_pos[None, :] >= q_pos[:, None] - left) & (kv_pos[None, :] <= q_pos[:, None] + right))[None]
    return vis


def brute_force_visible(mask, t, s, segments=None, positions=None):
    """The same from BlockMask.visible pair by pair (checks visible_pairs itself, on small blocks)."""
    b = 1 if segments is None else segments[0].shape[0]
    out = torch.zeros(b, t, s, dtype=torch.bool)
    for r in range(b):
        for i in range(t):
            for j in range(s):
                ids = (int(segments[0][r, i]), int(segments[1][r, j])) if segments is not None else (None, None)
                pos = (int(positions[0][i]), int(positions[1][j])) if positions is not None else (None, None)
                out[r, i, j] = mask.visible(i, j, *ids, *pos)
    return out


def dense(q, k, v, visible, scale, do, dlse, dtype):
    """Attention under ``visible`` [b, t, s] in ``dtype`` (float64: the truth; bf16: the policy's
    same-dtype control, scores and probabilities rounded to it) and its gradients for (do, dlse).
    Rows with no visible key: o = 0, lse = -inf, no gradient."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))  # never the caller's tensors
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = (torch.einsum("bthd,bshd->bhts", q, kk) * scale).to(dtype)
    vis = visible[:, None]
    has_key = vis.any(-1)
    wide = scores.to(F64 if dtype == F64 else torch.float32)
    wide = wide.masked_fill(~vis, float("-inf")).masked_fill(~has_key[..., None], 0.0)
    lse = torch.logsumexp(wide, dim=-1)
    p = (torch.exp(wide - lse[..., None]) * vis).to(dtype)
    o = torch.einsum("bhts,bshd->bthd", p, vv)
    torch.autograd.backward((o, lse.masked_fill(~has_key, 0.0)), (do.to(dtype), dlse.to(lse.dtype) * has_key))
    out = (o, lse.masked_fill(~has_key, float("-inf")), q.grad, k.grad, v.grad)
    return {n: x.detach() for n, x in zip(NAMES, out)}


def flash_ideal(q, k, v, visible, scale, do, dlse, dtype, o_read) -> dict:
    """The policy's flash ideal for one block (docs/contract.md's amendment; the whole-problem
    twin is ``parity.core.inputs.flash_ideal``): exact float64 attention except where a
    flash-style backward must round — D = rowsum(dO∘O) reads the low-precision ``o_read`` the
    backward under test is given (its forward's o), the matmul operands P and dS are rounded to
    ``dtype``, GQA's per-head dK / dV are rounded before the group sum (torch's flex backward
    and FlashAttention-2 do all three) — and every output rounded (lse to float32).
    Why each: on rows that see one or two keys the dense control never rounds o and sits several
    times closer to the truth than any flash kernel can; o rounded here from float64 can land one
    ulp from the kernel's own o, which moves D on such rows; a dK that is the sum of two rounded
    heads lands a whole ulp off where one rounding would not. On the windowed documents case a
    right kernel went up to 1.55× over the control-only bound (60 seeds) and failed on one seed in
    a hundred with only the o rounding modelled; with all three the worst of 1100 seeds used 0.75
    of the bound."""
    q, k, v, do, dlse = (x.to(F64) for x in (q, k, v, do, dlse))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    vis = visible[:, None]
    has_key = vis.any(-1)
    scores = (torch.einsum("bthd,bshd->bhts", q, kk) * scale).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores.masked_fill(~has_key[..., None], 0.0), dim=-1)
    p = torch.exp(scores - lse[..., None]) * vis
    o = torch.einsum("bhts,bshd->bthd", p, vv).to(dtype).to(F64)
    dp = torch.einsum("bthd,bshd->bhts", do, vv)
    rowsum = torch.einsum("bthd,bthd->bht", do, o_read.to(F64))
    ds = p * (dp - rowsum[..., None] + (dlse * has_key)[..., None])
    ds, p = ((x * c).to(dtype).to(F64) / c for x, c in ((ds, scale), (p, 1.0)))  # matmul operands, rounded
    dq = torch.einsum("bhts,bshd->bthd", ds, kk) * scale
    per_head = (torch.einsum("bhts,bthd->bshd", ds, q) * scale, torch.einsum("bhts,bthd->bshd", p, do))
    dk, dv = (x.to(dtype).to(F64).unflatten(2, (-1, group)).sum(3) for x in per_head)  # GQA: heads rounded, then summed
    lse = lse.masked_fill(~has_key, float("-inf")).float().to(F64)
    return {"o": o, "lse": lse} | {n: g.to(dtype).to(F64) for n, g in zip(("dq", "dk", "dv"), (dq, dk, dv))}


def assert_within_policy(got: dict, truth: dict, dtype: str, control: dict | None = None,
                          ideal: dict | None = None, label: str = ""):
    """Every tensor within the contract's numerics policy of the float64 truth; -inf lse (rows
    with no visible key) in the same places, o = 0 there."""
    errors = {}
    for name in NAMES:
        g, w = got[name].double(), truth[name]
        if name == "lse":
            empty = torch.isinf(w)
            assert torch.equal(torch.isinf(g) & (g < 0), empty), f"{label} lse: -inf rows differ"
            g, w = g.masked_fill(empty, 0.0), w.masked_fill(empty, 0.0)
        c = None if control is None else control[name].double()
        if c is not None and name == "lse":
            c = c.masked_fill(empty, 0.0)
        i = None if ideal is None else ideal[name].masked_fill(empty, 0.0) if name == "lse" else ideal[name]
        check = check_tensor(name, g.numpy(), w.numpy(), dtype, None if c is None else c.numpy(),
                             None if i is None else i.numpy())
        assert check.ok, f"{label} {check}"
        errors[name] = check.error
    return errors


def ids_with_gaps(b: int, n: int, gen) -> torch.Tensor:
    """Packed ids [b, n] in runs of 1-7, values from a small set so a value recurs in runs apart."""
    values = torch.randint(0, 4, (b, n), generator=gen)
    lengths = torch.randint(1, 8, (b, n), generator=gen)
    return torch.stack([torch.repeat_interleave(values[r], lengths[r])[:n] for r in range(b)]).int()


def make_block(mask: BlockMask, heads: int, kv_heads: int, gen, t: int = 24, s: int | None = None, d: int = 16):
    s = t if s is None else s
    q, do = (torch.randn(2, t, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, s, kv_heads, d, generator=gen) for _ in range(2))
    dlse = torch.randn(2, heads, t, generator=gen)
    extra = {}
    if mask.documents:  # the last query's document has no key here: every seed has a row with no visible key
        q_ids, kv_ids = ids_with_gaps(2, t, gen), ids_with_gaps(2, s, gen)
        q_ids[:, -1] = kv_ids.max() + 1
        extra["segments"] = (q_ids, kv_ids)
    if mask.window is not None:  # original positions out of local order (stripe-like), keys offset
        extra["positions"] = (torch.randperm(t, generator=gen).int() * 3, torch.randperm(s, generator=gen).int() * 3 + 1)
    return q, k, v, do, dlse, extra


def variants(windows=((7, 4),)):
    """Every static kind × documents or not × no window or each of ``windows``."""
    out = []
    for m in BLOCK_MASKS:
        for documents in (False, True):
            for window in (None, *windows):
                mask = BlockMask(m.kind, documents=documents, window=window)
                name = f"{m.kind.value}{'-documents' if documents else ''}{f'-window{window[0]}' if window else ''}"
                out.append(pytest.param(mask, id=name))
    return out


# ---- one block ------------------------------------------------------------------------------------

def test_visible_pairs_is_block_mask_visible():
    gen = torch.Generator().manual_seed(0)
    for mask in [p.values[0] for p in variants()]:
        t, s = (6, 6) if mask.kind is not MaskKind.FULL else (6, 5)
        _, _, _, _, _, extra = make_block(mask, 1, 1, gen, t, s, d=2)
        want = brute_force_visible(mask, t, s, extra.get("segments"), extra.get("positions"))
        assert torch.equal(visible_pairs(mask, t, s, extra.get("segments"), extra.get("positions")).expand_as(want),
                           want)


HEAD_LAYOUTS = ((4, 4), (4, 2), (4, 1))  # MHA, GQA, MQA: one per variant, in turn


@pytest.mark.parametrize("case", range(len(variants())), ids=[p.id for p in variants()])
def test_flex_block_matches_float64_truth_and_the_portable_kernel(case, seed):
    """float32: o, lse (fwd) and dq, dk, dv (bwd with its own o / lse and an lse cotangent) within
    1e-5 relative of the float64 masked attention; rows with no visible key o = 0, lse = -inf,
    dq = 0; also equal (to float32 rounding) to the reference kernel. MHA, GQA and MQA in turn
    over the variants."""
    mask, (heads, kv_heads) = variants()[case].values[0], HEAD_LAYOUTS[case % 3]
    gen = torch.Generator().manual_seed(seed)
    s = 24 if mask.kind is not MaskKind.FULL else 17  # a full block may be rectangular (zigzag halves)
    q, k, v, do, dlse, extra = make_block(mask, heads, kv_heads, gen, 24, s)
    scale = 0.3
    o, lse = flex.flex_block_fwd(q, k, v, mask, scale, **extra)
    dq, dk, dv = flex.flex_block_bwd(do, q, k, v, o, lse, mask, scale, dlse, **extra)
    got = dict(zip(NAMES, (o, lse, dq, dk, dv)))
    assert o.shape == q.shape and lse.shape == (2, heads, 24) and lse.dtype == torch.float32
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    visible = visible_pairs(mask, 24, s, extra.get("segments"), extra.get("positions")).expand(2, 24, s)
    truth = dense(q, k, v, visible, scale, do, dlse, F64)
    assert_within_policy(got, truth, "float32", label=str(mask))
    empty = ~visible.any(-1)  # [b, t]
    if mask.documents or mask.kind is MaskKind.STRICT:
        assert empty.any(), "the case must hold rows with no visible key"
    assert torch.all(o[empty] == 0) and torch.all(dq[empty] == 0)
    assert torch.all(lse.transpose(1, 2)[empty] == float("-inf"))
    ref = get_backend("reference")
    o_r, lse_r = ref.fwd(q, k, v, mask, scale, **extra)
    want = (o_r, lse_r, *ref.bwd(do, q, k, v, o_r, lse_r, mask, scale, dlse, **extra))
    for name, g, w in zip(NAMES, got.values(), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


BF16_CASES = [(FULL_MASK, "operator"), (BlockMask("causal", documents=True, window=(5, 0)), "operator"),
              (BlockMask("causal", documents=True, window=(5, 0)), "recompute"), (BlockMask("full", documents=True), "operator")]


@pytest.mark.parametrize("mask,route", BF16_CASES, ids=[f"{m.kind.value}{'-documents' if m.documents else ''}"
                                                        f"{'-window' if m.window else ''}-{r}" for m, r in BF16_CASES])
def test_flex_block_bfloat16_within_policy(mask, route, monkeypatch, seed):
    """bf16 inputs, GQA: every tensor within the low-precision policy (2 × max(the same-dtype dense
    control's error, the flash ideal's) + a quarter-ulp floor) of the float64 truth on the same
    rounded inputs, by either backward route. Without the flash ideal the windowed documents case
    (rows of zero to two keys) failed on about one seed in fifty with the kernel right."""
    monkeypatch.setitem(flex.BACKWARD_ROUTES, "cpu", route)
    heads, kv_heads = 4, 2
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do, dlse, extra = make_block(mask, heads, kv_heads, gen, 48)
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    o, lse = flex.flex_block_fwd(q, k, v, mask, 0.25, **extra)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.25, dlse, **extra)  # its own bf16 o, as a 1-block ring
    assert all(g.dtype == torch.bfloat16 for g in grads)
    visible = visible_pairs(mask, 48, 48, extra.get("segments"), extra.get("positions")).expand(2, 48, 48)
    truth = dense(q, k, v, visible, 0.25, do, dlse, F64)
    control = dense(q, k, v, visible, 0.25, do, dlse, torch.bfloat16)
    ideal = flash_ideal(q, k, v, visible, 0.25, do, dlse, torch.bfloat16, o)
    assert_within_policy(dict(zip(NAMES, (o, lse, *grads))), truth, "bfloat16", control, ideal, label=str(mask))


# ---- the backward with a GLOBAL o / lse --------------------------------------------------------------

MERGED = [(FULL_MASK, False, None, 4, 4, "operator"), (FULL_MASK, True, (9, 2), 4, 2, "operator"),
          (STRICT_MASK, True, None, 4, 4, "operator"), (STRICT_MASK, False, (9, 2), 4, 1, "operator"),
          (FULL_MASK, True, (9, 2), 4, 2, "recompute"), (STRICT_MASK, False, (9, 2), 4, 1, "recompute")]


@pytest.mark.parametrize("first,documents,window,heads,kv_heads,route", MERGED, ids=[
    f"{m.kind.value}{'-documents' if d else ''}{'-window' if w else ''}-{({4: 'mha', 2: 'gqa', 1: 'mqa'})[hk]}-{r}"
    for m, d, w, _, hk, r in MERGED])
def test_per_block_gradients_with_the_merged_o_lse_sum_to_the_true_gradient(first, documents, window, heads,
                                                                           kv_heads, route, monkeypatch, seed):
    """Two blocks of one query shard — keys A under ``first`` (full: an earlier shard; strict: a
    stripe's later shard) and keys B under causal (the own shard) — merged with merge_partials into
    the global (o, lse); each block's backward given that GLOBAL o / lse (and the global lse's
    cotangent) yields gradients whose sum (dq) and concatenation (dk, dv) equal the float64
    gradients of attention over A ∪ B — by either backward route (module docstring: (a) torch's
    backward operator given the global o / lse, (b) the block's forward recomputed and
    differentiated with rescaled cotangents)."""
    monkeypatch.setitem(flex.BACKWARD_ROUTES, "cpu", route)
    gen = torch.Generator().manual_seed(seed)
    t, d, scale = 32, 16, 0.3
    q, do = (torch.randn(2, t, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2 * t, kv_heads, d, generator=gen) for _ in range(2))
    dlse = torch.randn(2, heads, t, generator=gen)
    ids = ids_with_gaps(2, 2 * t, gen)
    pos = torch.arange(2 * t, dtype=torch.int32)  # A: positions 0..t-1, B (and the queries): t..2t-1
    q_ids, q_pos = ids[:, t:], pos[t:]
    blocks = []
    for m, keys in ((first, slice(0, t)), (CAUSAL_MASK, slice(t, 2 * t))):
        mask = BlockMask(m.kind, documents=documents, window=window)
        extra = {}
        if documents:
            extra["segments"] = (q_ids, ids[:, keys])
        if window is not None:
            extra["positions"] = (q_pos, pos[keys])
        blocks.append((mask, keys, extra))
    parts = [flex.flex_block_fwd(q, k[:, keys], v[:, keys], mask, scale, **extra) for mask, keys, extra in blocks]
    o, lse = merge_partials(*parts[1], *parts[0])  # the own (causal) block first: never empty
    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    for mask, keys, extra in blocks:
        g = flex.flex_block_bwd(do, q, k[:, keys], v[:, keys], o, lse, mask, scale, dlse, **extra)
        dq += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    visible = torch.cat([visible_pairs(mask, t, t, extra.get("segments"), extra.get("positions")).expand(2, t, t)
                         for mask, _, extra in blocks], dim=-1)
    truth = dense(q, k, v, visible, scale, do, dlse, F64)
    assert_within_policy(dict(zip(NAMES, (o, lse, dq, dk, dv))), truth, "float32", label=f"{first} {documents} {window}")


# ---- the tiles behind the kernel's block sparsity ----------------------------------------------------

def tile_truth(visible, t, s):
    """Per tile: any visible pair, every pair visible (from the pairs themselves; past the end of
    t or s counts as hidden, so a ragged edge tile is never full)."""
    tile = flex.TILE
    pad = torch.zeros(visible.shape[0], -(-t // tile) * tile, -(-s // tile) * tile, dtype=torch.bool)
    pad[:, :t, :s] = visible
    tiles = pad.reshape(pad.shape[0], pad.shape[1] // tile, tile, pad.shape[2] // tile, tile).transpose(2, 3)
    return tiles.flatten(3).any(-1), tiles.flatten(3).all(-1)


@pytest.mark.parametrize("mask", variants(windows=((7, 4), (200, 130))))  # narrower and wider than a tile
@pytest.mark.parametrize("ragged", [False, True], ids=["whole-tiles", "ragged"])
@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_tiles_are_sound_and_exact_where_the_summaries_are(mask, ragged, order, seed):
    """tile_visibility on one original sequence of t + s tokens (queries: its last t; keys: its
    first s, or for causal / strict the queries' own tokens): a tile called empty holds no visible
    pair and a tile called full only visible pairs (and is not ragged), for any ids and positions
    ("scattered": ids recurring in runs apart, positions shuffled); with documents as runs of
    consecutive ids and contiguous positions ("runs") the classes are exact."""
    t = 300 if ragged else 384
    s = t if mask.kind is not MaskKind.FULL else (200 if ragged else 256)  # full blocks: rectangular
    gen = torch.Generator().manual_seed(seed)
    n = t + s
    if order == "runs":
        ids = torch.stack([torch.repeat_interleave(torch.arange(n), torch.randint(1, 90, (n,), generator=gen))[:n]
                           for _ in range(2)]).int()
        pos = torch.arange(n, dtype=torch.int32)
    else:
        ids, pos = ids_with_gaps(2, n, gen), torch.randperm(n, generator=gen).int()
    queries = slice(n - t, n)
    keys = slice(0, s) if mask.kind is MaskKind.FULL else queries
    segments = (ids[:, queries], ids[:, keys]) if mask.documents else None
    positions = (pos[queries], pos[keys]) if mask.window is not None else None
    some, every = flex.tile_visibility(mask, t, s, "cpu", segments, positions)
    visible = visible_pairs(mask, t, s, segments, positions)
    true_some, true_every = (x.expand_as(some) for x in tile_truth(visible, t, s))
    assert not (~some & true_some).any(), "a tile with a visible pair was called empty"
    assert not (every & ~true_every).any(), "a tile with a hidden pair (or past the end) was called full"
    if order == "runs":
        assert torch.equal(some, true_some) and torch.equal(every, true_every)


@pytest.mark.parametrize("mask", [FULL_MASK, CAUSAL_MASK, STRICT_MASK, BlockMask("causal", window=(200, 0)),
                                  BlockMask("full", window=(40, 300))], ids=str)
def test_block_mask_equals_torch_create_block_mask(mask):
    """Where the tile classes are exact (static kinds, windows on contiguous positions) the
    BlockMask built from summaries equals the one torch's create_block_mask computes from every
    pair: the same partial and full tiles, in the same order, and the mask_mod is applied."""
    from torch.nn.attention.flex_attention import create_block_mask

    t = s = 520
    positions = (torch.arange(t, dtype=torch.int32) + 100, torch.arange(s, dtype=torch.int32)) if mask.window else None
    mine = flex.block_mask_for(mask, t, s, "cpu", positions=positions)
    vis = visible_pairs(mask, t, s, positions=positions)[0]
    theirs = create_block_mask(lambda b, h, i, j: vis[i, j], None, None, t, s, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    for name, count in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        for row, n in enumerate(getattr(mine, count)[0, 0].tolist()):
            assert sorted(getattr(mine, name)[0, 0, row, :n].tolist()) == sorted(getattr(theirs, name)[0, 0, row, :n].tolist())
    assert mine.seq_lengths == (t, s) and mine.BLOCK_SIZE == (flex.TILE, flex.TILE)


# ---- interface, routing, errors ---------------------------------------------------------------------

def test_flex_is_selectable_by_name_and_not_routed_by_auto():
    backend = get_backend("flex")
    assert backend.name == "flex" and backend.available()
    assert "flex" not in {r.backend for r in AUTO_ROUTES}
    for mask in [p.values[0] for p in variants()]:
        assert all(backend.supports(mask, dt) for dt in ("float32", "bfloat16", "float16"))
    assert not backend.supports(FULL_MASK, "float64")


def test_missing_ids_positions_and_bad_shapes_are_refused():
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="a document mask needs segments"):
        flex.flex_block_fwd(x, x, x, CAUSAL_MASK.with_documents(), 1.0)
    with pytest.raises(ValueError, match="a windowed mask needs positions"):
        flex.flex_block_bwd(x, x, x, x, x, torch.zeros(1, 2, 4), CAUSAL_MASK.with_window((1, 1)), 1.0)
    with pytest.raises(ValueError, match="needs a square block"):
        flex.flex_block_fwd(x, x[:, :3], x[:, :3], STRICT_MASK, 1.0)
    with pytest.raises(ValueError, match="positions must be"):
        flex.flex_block_fwd(x, x, x, FULL_MASK.with_window((1, 1)), 1.0, positions=(torch.arange(4), torch.arange(3)))


def test_the_compiled_path_traces_once_per_variant_and_not_per_data(monkeypatch, seed):
    """The functions compiled on CUDA, here under dynamo with a counting backend (its graphs run
    eagerly on CPU): fullgraph tracing succeeds, new ids / positions / values reuse the graph (one
    forward and one backward graph per static variant and shape), and the results equal the
    uncompiled ones."""
    if not flex.operator_backward_compiles():
        pytest.skip(f"torch {torch.__version__}'s dynamo cannot trace the flex backward operator alone: "
                    "compiled, the recompute route runs, and its compiled forward needs CUDA")
    monkeypatch.setattr(flex, "BACKWARD_ROUTES", {})
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    gen = torch.Generator().manual_seed(seed)
    mask = BlockMask("causal", documents=True, window=(6, 0))
    eager = []
    for _ in range(3):
        q, k, v, do, dlse, extra = make_block(mask, 4, 2, gen, 20)
        o, lse = flex.flex_block_fwd(q, k, v, mask, 0.3, **extra)
        eager.append(((q, k, v, do, dlse, extra), (o, lse, *flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.3, dlse,
                                                                                **extra))))
    monkeypatch.setitem(flex.COMPILE_BACKENDS, "cpu", counting)
    assert flex.backward_route("cpu") == "operator"
    for (q, k, v, do, dlse, extra), want in eager:
        o, lse = flex.flex_block_fwd(q, k, v, mask, 0.3, **extra)
        got = (o, lse, *flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.3, dlse, **extra))
        for name, g, w in zip(NAMES, got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    assert len(graphs) == 2, f"{len(graphs)} graphs for one variant and shape: data must not recompile"
    q, k, v, do, dlse, extra = make_block(FULL_MASK, 4, 2, gen, 20, 12)
    o, lse = flex.flex_block_fwd(q, k, v, FULL_MASK, 0.3)
    flex.flex_block_bwd(do, q, k, v, o, lse, FULL_MASK, 0.3)
    assert len(graphs) == 4
    assert "flex_attention_backward" in graphs[1].code and "flex_attention_backward" in graphs[3].code


# ---- soft-capping: the score_mod ------------------------------------------------------------------

SOFTCAP_BLOCKS = [(CAUSAL_MASK, "operator"), (BlockMask("full", documents=True, window=(7, 4)), "operator"),
                  (STRICT_MASK, "recompute"), (BlockMask("causal", documents=True, window=(5, 0)), "recompute")]


@pytest.mark.parametrize("mask,route", SOFTCAP_BLOCKS, ids=[f"{m.kind.value}{'-documents' if m.documents else ''}"
                                                           f"{'-window' if m.window else ''}-{r}"
                                                           for m, r in SOFTCAP_BLOCKS])
def test_softcapped_blocks_equal_the_portable_kernel_with_a_global_o_lse(mask, route, monkeypatch, seed):
    """``softcap=`` (the scaled logits capped by a score_mod): forward, and the backward given a
    GLOBAL o / lse merged from this block and another (and an lse cotangent), equal the portable
    kernel's capped block (itself checked against float64 in test_blockwise_reference.py) to
    float32 rounding, by either backward route, GQA; and they differ from the uncapped block."""
    monkeypatch.setitem(flex.BACKWARD_ROUTES, "cpu", route)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):  # a block with a visible pair: with none, capped and uncapped could not differ
        q, k, v, do, dlse, extra = make_block(mask, 4, 2, gen, 24)  # (seed 2053917404 drew none, causal window 5)
        if visible_pairs(mask, 24, 24, extra.get("segments"), extra.get("positions")).any():
            break
    other_k, other_v = (torch.randn(2, 24, 2, 16, generator=gen) for _ in range(2))
    ref, cap = get_backend("reference"), 0.8
    o, lse = merge_partials(*ref.fwd(q, other_k, other_v, FULL_MASK, 0.3, softcap=cap),  # never empty: first
                            *ref.fwd(q, k, v, mask, 0.3, softcap=cap, **extra))  # the global o, lse
    got = (*flex.flex_block_fwd(q, k, v, mask, 0.3, softcap=cap, **extra),
           *flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.3, dlse, softcap=cap, **extra))
    want = (*ref.fwd(q, k, v, mask, 0.3, softcap=cap, **extra),
            *ref.bwd(do, q, k, v, o, lse, mask, 0.3, dlse, softcap=cap, **extra))
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    uncapped = flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.3, dlse, **extra)
    assert (uncapped[0] - got[2]).abs().max() > 1e-2
    assert flex.supports(mask, "bfloat16", softcap=True) and get_backend("flex", softcap=cap).name == "flex"


def test_the_compiled_path_traces_a_softcapped_variant_of_its_own(monkeypatch, seed):
    """Compiled (dynamo, a counting backend, run eagerly on CPU): a capped block's forward traces
    one graph of its own — the cap inside it — reused for new data, with the eager results; its
    backward takes the recompute route (the compiled forward differentiated), never the backward
    operator (whose joint graph dynamo cannot derive for the cap). The recompute itself needs
    CUDA compiled (the public op has no CPU backward): checked eagerly above."""
    monkeypatch.setitem(flex.BACKWARD_ROUTES, "cpu", "operator")
    graphs, recomputed = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    gen = torch.Generator().manual_seed(seed)
    mask = BlockMask("causal", window=(6, 0))
    blocks = [make_block(mask, 4, 2, gen, 20) for _ in range(2)]
    eager = [flex.flex_block_fwd(q, k, v, mask, 0.3, softcap=1.3, **extra) for q, k, v, _, _, extra in blocks]
    monkeypatch.setitem(flex.COMPILE_BACKENDS, "cpu", counting)
    for (q, k, v, _, _, extra), want in zip(blocks, eager):
        for name, g, w in zip(NAMES, flex.flex_block_fwd(q, k, v, mask, 0.3, softcap=1.3, **extra), want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    assert len(graphs) == 1, f"{len(graphs)} graphs for one capped variant and shape: data must not recompile"
    assert any("tanh" in getattr(m, "code", "") for m in graphs[0].modules())  # the score_mod's subgraph
    monkeypatch.setattr(flex, "_recompute_backward", lambda *a: recomputed.append(a[-1]) or (None,) * 3)
    q, k, v, do, dlse, extra = blocks[0]
    flex.flex_block_bwd(do, q, k, v, *eager[0], mask, 0.3, dlse, softcap=1.3, **extra)
    assert len(recomputed) == 1 and len(graphs) == 1  # the compiled forward handed over, no backward graph


def test_measured_errors_are_small_not_just_within_tolerance(seed):
    """A float32 causal + documents + window block: every tensor's relative error is far inside
    the 1e-5 policy (the kernel is the same math as the truth, in float32)."""
    mask = BlockMask("causal", documents=True, window=(5, 0))
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do, dlse, extra = make_block(mask, 4, 2, gen, 40)
    o, lse = flex.flex_block_fwd(q, k, v, mask, 0.3, **extra)
    grads = flex.flex_block_bwd(do, q, k, v, o, lse, mask, 0.3, dlse, **extra)
    visible = visible_pairs(mask, 40, 40, extra["segments"], extra["positions"])
    errors = assert_within_policy(dict(zip(NAMES, (o, lse, *grads))), dense(q, k, v, visible, 0.3, do, dlse, F64),
                                  "float32")
    assert max(errors.values()) < 2e-6, errors
    assert np.isfinite(list(errors.values())).all()
