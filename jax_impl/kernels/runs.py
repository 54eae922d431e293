"""Per-block document runs computed on the device, with static shapes (the traced counterpart of
``seqplan.documents``, which torch computes on the host): each query run of a batch row, its
document's key run, whether the block is expressible as runs, and the forms two kernels take —
cuDNN's packed segments (:func:`packed_segments`) and FlashAttention's cumulative offsets with a
gather of the keys (:func:`varlen_offsets`).

:func:`dispatch` is how an adapter uses them: one ``lax.switch`` on the device picks, for the
block's actual number of runs, the smallest static run-slot count of ``RUN_SLOTS`` that holds them
(FA3's varlen backward pays for every slot, empty or not: measured 13.7 ms with 64 slots against
9.0 ms with the 10 real runs of a 32k block, H100) — and, for a backward, the smallest static
``max_seqlen`` of :func:`length_ladder` that bounds the longest run — or the portable kernel when
the block is not expressible (an id in two runs of a row's queries or keys, more runs than
``MAX_RUNS``, a causal block whose keys are not its queries' own tokens). A FULL block whose keys
all precede its queries (:func:`boundary_runs`: at most one shared document) takes three runs a
row over its own memory first: no gather of keys, no scatter of dK / dV.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from seqplan.documents import PREFIX_KEY_FACTOR

from . import branches

RUN_SLOTS = (4, 16, 64)  # static run slots per row the kernels are compiled for
MAX_RUNS = RUN_SLOTS[-1]
# FlashAttention-3's varlen forms hold up to 256 runs (a block of a whole 128k sequence — Ulysses,
# or USP's ring shard — holds 84-163 documents of the balance mixes; past 64 runs it went to the
# portable kernel: 5-10 s a step against 40-60 ms fused, 4x H200, 2026-11-26), in powers of two:
# the varlen backward launches its grid for every slot, empty or not, at a cost that grows with the
# length bound — on the whole 128k few-long sequence (84 documents, H100, 2026-11-26) 94.3 ms with
# 256 slots, 81.8 with 128, 78.2 with the exact 84. Only the slots' offsets grow with them (cuDNN's
# packed form keeps RUN_SLOTS: its workspace grows with the slots).
VARLEN_RUN_SLOTS = (4, 8, 16, 32, 64, 128, 256)
VARLEN_MAX_RUNS = VARLEN_RUN_SLOTS[-1]
# A causal (diagonal) block's varlen form is only its run starts (:func:`causal_offsets`): finer
# sizes cost little to compile there, and the whole sequence on one device (Ulysses, one GPU) is
# such a block — the 32k short mix's 35 documents sat on 64 slots: 6.83 ms fwd+bwd against 6.32
# on 48 (one H200, 2026-11-29; the finer length ladder with it: 6.05, flash_mha_varlen's exact
# call 5.37).
CAUSAL_VARLEN_RUN_SLOTS = (4, 8, 16, 32, 48, 64, 96, 128, 192, VARLEN_MAX_RUNS)
# A token-index block compiles two forms (causal diagonal, FULL on new ids) in every block of a
# device's program, whose blocks all take them (a non-causal schedule): fewer static variants
# each, so a ring of 8 compiles in reasonable time (2026-11-26 on an H100: the full set did not
# finish 16 per-device programs in 9 minutes). Its large size is 256, not 64: USP 2×2's shard of a
# 128k short mix holds ≈ 82 documents, and on (16, 64) that block went to the portable kernel — 9.9 s
# a step against 53 ms fused for few-long (4× H200, 2026-11-26 second run); two sizes keep the
# compile time, and a block of 17-64 runs on 256 slots only launches empty runs' tiles.
INDEX_RUN_SLOTS = (16, VARLEN_MAX_RUNS)


def search_method() -> str:
    """How :func:`searchsorted` searches. ``jnp.searchsorted``'s default (``scan``) is a while loop
    of log2(n) steps: on a GPU every step is a few tiny kernels launched one after another, and a
    step plans its blocks with a dozen such searches (forward and backward, per ring hop) — while
    JAX's documents steps on 4x H200 sat idle 2.4-6.5 ms a step (2026-11-27). ``scan_unrolled``
    traces the same steps as straight-line code XLA fuses; the CPU keeps ``scan`` (its faster
    method, and cheaper to compile for the test suite). Every method returns the same indices."""
    return "scan" if jax.default_backend() == "cpu" else "scan_unrolled"


def searchsorted(a, v, side: str = "left"):
    """``jnp.searchsorted(a, v, side)`` by :func:`search_method` — the only search this module uses."""
    return jnp.searchsorted(a, v, side=side, method=search_method())


def smallest_holding(options, value):
    """The index of the smallest of the sorted ``options`` that is at least ``value`` (traced, any
    shape) — the last option where none is (a caller whose options always hold the value)."""
    return jnp.minimum(searchsorted(jnp.asarray(options), value), len(options) - 1)


# ---- the run lists: typed records (pytrees: a forward keeps a plan for its backward) ----------

@dataclasses.dataclass(frozen=True, eq=False)
class PackedSegments:
    """A block's runs in cuDNN's packed form (:func:`packed_segments`), traced: ``q_seqlen``,
    ``kv_seqlen`` [b, m] and ``q_offsets``, ``kv_offsets`` [b, m + 1] (int32, -1 padded; left-out
    runs -1 too), ``slot`` [b, m] (each run's compacted segment index over the batch, or -1),
    ``q_run`` [b, t] (each query's run), ``q_start`` [b, m] (each run's first query, t unused),
    ``covered_q`` [b, t] / ``covered_kv`` [b, s] (the tokens a run reads) and ``ok`` (scalar
    bool: the block is expressible as these runs)."""

    q_seqlen: jax.Array
    kv_seqlen: jax.Array
    q_offsets: jax.Array
    kv_offsets: jax.Array
    slot: jax.Array
    q_run: jax.Array
    q_start: jax.Array
    covered_q: jax.Array
    covered_kv: jax.Array
    ok: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class VarlenRuns:
    """A block (or a device's one call) as FlashAttention's varlen kernels see it: sequences over
    the packed queries [b·t] and the packed keys. Traced: ``cu_q``, ``cu_k`` (int32 [nseq + 1]),
    ``kv_index`` (int32: which key of the block sits at each packed key position; b·s — out of
    range: a zero key, a dropped gradient — past the last run), ``covered_q`` [b, t], ``ok``
    (scalar bool: the runs are exact), ``covered_kv`` [b, s] (None: not tracked — the keys are
    gathered, never the block's own), ``longest`` (the longest run's keys, for the backward's
    bound; None where the caller computes it). Static: ``identity`` (the packed keys are the
    block's own keys in order: no gather, no scatter), ``covers_block`` (every query and every
    key of the block is in a run — a causal diagonal block's own runs, when ``ok`` — so
    ``covered_q`` / ``covered_kv`` are all true and the kernels skip their masked selects),
    ``covers_queries`` (every query is in a run that reads a key, when ``ok`` — a device's one
    call — so the kernels skip the selects over o, lse and dq, keys aside), ``max_q`` / ``max_k``
    (the backward's ``max_seqlen`` bounds; None: the block's own lengths),
    or ``bounds`` (static: several such pairs) with ``bound_at`` (traced: the one the device
    picked, :func:`length_choice`) — the kernel is compiled once per bound, nothing else is.
    ``used_q`` / ``used_k`` (int32 [nseq], or None): each run's length where it is not the offsets'
    difference — FlashAttention's ``seqused``: a run of the other group is skipped (``groups``)."""

    cu_q: jax.Array
    cu_k: jax.Array
    kv_index: jax.Array
    covered_q: jax.Array
    ok: jax.Array
    covered_kv: jax.Array | None = None
    longest: jax.Array | None = None
    identity: bool = False
    covers_block: bool = False
    covers_queries: bool = False
    max_q: int | None = None
    max_k: int | None = None
    used_q: jax.Array | None = None
    used_k: jax.Array | None = None
    bounds: tuple[tuple[int, int], ...] | None = None
    bound_at: jax.Array | None = None

    @property
    def every_query(self) -> bool:
        """Static: every query is in a run that reads a key (``covers_block`` or ``covers_queries``),
        so the kernels skip their selects over o, lse and dq."""
        return self.covers_block or self.covers_queries

    def bounded(self, max_q: int, max_k: int) -> VarlenRuns:
        """These runs with the backward's ``max_seqlen`` bounds."""
        return dataclasses.replace(self, max_q=max_q, max_k=max_k)

    def bounded_by(self, choice: LengthChoice) -> VarlenRuns:
        """These runs with the backward's bounds chosen on the device (:func:`length_choice`)."""
        return dataclasses.replace(self, bounds=choice.bounds, bound_at=choice.at)

    def chosen_bound(self):
        """(max_q, max_k) the backward launches its grid for: traced with ``bounds``, else static
        (None: the block's own lengths)."""
        if self.bounds is None:
            return self.max_q, self.max_k
        table = jnp.asarray(self.bounds, jnp.int32)[self.bound_at]
        return table[0], table[1]


jax.tree_util.register_dataclass(
    PackedSegments, data_fields=[f.name for f in dataclasses.fields(PackedSegments)], meta_fields=[])
jax.tree_util.register_dataclass(
    VarlenRuns, data_fields=["cu_q", "cu_k", "kv_index", "covered_q", "ok", "covered_kv", "longest", "used_q", "used_k",
                             "bound_at"],
    # static: the kernels branch and compile on them
    meta_fields=["identity", "covers_block", "covers_queries", "max_q", "max_k", "bounds"])


@dataclasses.dataclass(frozen=True)
class LengthChoice:
    """The backward's ``max_seqlen`` bounds a kernel call is compiled for, ``bounds`` ((max_q,
    max_k) pairs, static, distinct), and ``at``, the device's pick among them (traced int32)."""

    bounds: tuple[tuple[int, int], ...]
    at: jax.Array


def length_choice(ladder, t: int, s: int, longest, least: int = 1) -> LengthChoice:
    """The smallest of ``ladder`` that bounds the ``longest`` run (traced), as (max_q, max_k) for a
    t x s block (each bound capped at the block's own lengths, equal pairs compiled once).
    ``least``: the caller's floor on ``longest`` (a row of at most m runs covering its t tokens
    has a run of at least t / m): bounds below it are never picked, so they are not compiled.

    Why a choice inside the kernel call and not one variant per bound: every variant of a
    ``lax.switch`` is its own code — the run lists, the packed keys, the scatter of dK / dV —
    and the bound changes only the kernel's grid; with the bound as a second switch around the
    FFI call alone, that code is compiled once per run-slot count, not once per (slots, bound)
    (the one call's backward: 7 x 11 variants became 7, each with one 11-way kernel switch).
    Each compiled bound still costs the host on every execution (XLA prepares every kernel call
    of every branch: ≈ 0.3–0.45 µs each on an H200, docs/gpu/host-gaps-2026-11-29-h200.md)."""
    if ladder[-1] < max(t, s):  # a run may be max(t, s) long: a smaller last bound would drop tiles silently
        raise ValueError(f"a length ladder must end at max(t, s) = {max(t, s)} or above, got {ladder}")
    if not 1 <= least <= max(t, s):  # no run is longer than the block: such a floor is a caller's mistake
        raise ValueError(f"the floor on the longest run must be in [1, max(t, s) = {max(t, s)}], got {least}")
    ladder = [bound for bound in ladder if bound >= least]  # never empty: ladder[-1] >= max(t, s) >= least
    capped = [(min(bound, t), min(bound, s)) for bound in ladder]
    bounds = tuple(dict.fromkeys(capped))  # distinct, in the ladder's order
    index = np.asarray([bounds.index(pair) for pair in capped], np.int32)
    return LengthChoice(bounds, jnp.asarray(index)[smallest_holding(ladder, longest)])


def index_length_ladder(n: int) -> tuple[int, ...]:
    """The backward's ``max_seqlen`` bounds for token-index blocks: n/8, n/2 and n, none below 256."""
    return tuple(sorted({max(min(n, 256), n * eighths // 8) for eighths in (1, 4, 8)}))


def _run_starts(ids):
    """[b, t] bool: where a run of equal ids starts in each row."""
    return jnp.concatenate([jnp.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)


def _one_run_per_id(ids, limit: int):
    """Per row: (every id is one run and there are at most ``limit`` runs, the number of runs).

    Up to :data:`PAIRWISE_RUNS` runs the check compares the ids at the first ``limit`` run starts
    pairwise ([limit, limit] a row, one fusion) rather than sorting the row: on a GPU a sort is
    cub's radix sort, several kernels and, on an H200, 0.06-0.13 ms of idle device after each —
    three a step on one GPU's whole 32k sequence (2026-11-29). A row with more runs than ``limit``
    is refused (the caller has no slot count for it); past ``PAIRWISE_RUNS`` (a test's thousands of
    slots) the row is sorted."""
    first = _run_starts(ids)
    runs = jnp.sum(first, axis=1)
    if limit > PAIRWISE_RUNS:
        ordered = jnp.sort(ids, axis=1)
        return (runs == jnp.sum(_run_starts(ordered), axis=1)) & (runs <= limit), runs  # runs == distinct ids
    starts = jax.vmap(lambda f: jnp.nonzero(f, size=limit, fill_value=0)[0])(first)
    run_ids = jnp.take_along_axis(ids, starts, axis=1)  # [b, limit]
    real = jnp.arange(limit)[None, :] < runs[:, None]
    pair = real[:, :, None] & real[:, None, :] & ~jnp.eye(limit, dtype=bool)[None]
    repeated = jnp.any(pair & (run_ids[:, :, None] == run_ids[:, None, :]), axis=(1, 2))
    return ~repeated & (runs <= limit), runs


PAIRWISE_RUNS = 256  # the most runs _one_run_per_id compares pairwise (VARLEN_MAX_RUNS: 64k pairs a row)


def expressible(q_ids, kv_ids, causal: bool, limit: int | None = None):
    """(ok, most runs in a row): ``ok`` when every id is one run of each row's queries and keys
    (stricter than needed on the keys: a split document no query reads also refuses), the queries
    have at most ``limit`` runs a row (default: the block's length; a caller passes its largest run
    slot count — a block with more has no form here) and the keys at most ``max(limit,
    PAIRWISE_RUNS)`` (the slots count query runs: the keys may hold more, checked without a sort up
    to 256), and, for a causal block, the keys are the queries' own tokens. ``most`` counts every
    query run, past ``limit`` too."""
    t, s = q_ids.shape[1], kv_ids.shape[1]
    q_ok, q_runs = _one_run_per_id(q_ids, min(limit or t, t))
    kv_ok, _ = _one_run_per_id(kv_ids, min(max(limit or s, PAIRWISE_RUNS), s))
    ok = jnp.all(q_ok) & jnp.all(kv_ok)
    if causal:
        ok = ok & jnp.all(q_ids == kv_ids) if q_ids.shape == kv_ids.shape else jnp.zeros((), bool)
    return ok, jnp.max(q_runs)


def _longest_run(ids):
    """The longest run of equal ids in any row of ``ids`` [b, t] (traced int)."""
    b, t = ids.shape
    run = jnp.cumsum(_run_starts(ids), axis=1) - 1 + jnp.arange(b)[:, None] * t  # a global run index per token
    return jnp.max(jnp.zeros((b * t,), jnp.int32).at[run.reshape(-1)].add(1))


def length_ladder(n: int) -> tuple[int, ...]:
    """Static run-length bounds a kernel is compiled for (``max_seqlen``): the powers of two from
    256 up to n, 3n/8, 3n/4 and n (n itself when below 256). FA3's varlen backward launches its
    grid for ``max_seqlen`` whatever the runs' real lengths, for every run slot, so a tighter
    static bound saves idle tiles — measured on an H100 (2026-11-26) on the whole 128k short mix
    (163 documents, the longest 7,668): 25.0 ms with the bound 16,384 (the former ladder's
    smallest, n/8), 19.5 with the exact bound, over 256 slots. A causal block takes the finer
    :func:`causal_length_ladder`."""
    floor = min(n, 256)
    powers = {floor << k for k in range(n.bit_length()) if floor << k <= n}
    return tuple(sorted(powers | {max(floor, 3 * n // 8), max(floor, 3 * n // 4), n}))


def causal_length_ladder(n: int) -> tuple[int, ...]:
    """The backward's bounds for a causal (diagonal) block — the whole sequence on one device
    (one GPU, Ulysses) is one: 256·2^k times 1, 5/4, 3/2 and 7/4 up to n, and n (n itself when
    below 256), a bound at most 25 % above the longest run from 256 up. On an H200 (2026-11-29)
    the whole 32k short mix (35 documents, the longest 4,988) took 6.83 ms fwd+bwd on
    :func:`length_ladder`'s 8,192, 6.42 on this one's 5,120. Only the FFI call is compiled once
    per bound (:func:`length_choice`); the FULL blocks of a ring (every other block, each with
    its boundary and slot variants) keep the coarser ladder: this one there took a ring of 4's
    program from 288 to 692 kernel calls and its CPU compile 15 to 17 s (16k tokens, short mix)."""
    floor = min(n, 256)
    steps = {(floor << k) * quarters // 4 for k in range(n.bit_length()) for quarters in (4, 5, 6, 7)}
    return tuple(sorted({bound for bound in steps if bound <= n} | {n}))


# The names of the dispatchers' variants (kernels/branches.py): the portable fallback, the boundary
# form (:func:`boundary_runs`) and the runs form at m slots (its length bound chosen inside: length_choice).
PORTABLE = "portable"
BOUNDARY = "boundary"
RUNS = "runs"


def runs_variant(m: int) -> tuple:
    return (RUNS, m)


def runs_choice(ok, most, sizes, boundary_ok=False, prefix: tuple = ()) -> branches.Choice:
    """Which of :func:`fused_branches`' variants (named under ``prefix``) a block takes: the
    boundary form when ``boundary_ok``, else, when ``ok`` (expressible), the runs form with the
    smallest of ``sizes`` holding ``most`` runs a row; nothing (the caller's fallback) when no
    size holds them."""
    runs = branches.Grid((*prefix, RUNS), ((sizes, searchsorted(jnp.asarray(sizes), most)),))
    return branches.First([(boundary_ok, (*prefix, BOUNDARY)), (ok, runs)])


def fused_branches(segments, causal: bool, kernel, slots=None, form=None, *, boundary: bool = False,
                   lengths: bool = False, valid=None, ladder=None, prefix: tuple = ()):
    """(variants, choice) of :func:`dispatch` without its portable branch: ``variants`` (named
    ``(*prefix, BOUNDARY)`` and ``(*prefix, *runs_variant(m))``, argument-free callables) and
    ``choice`` (:func:`runs_choice`), which selects none of them when the block is not
    expressible — the caller's fallback then. ``ladder``: with ``lengths``, the length bounds
    the runs form's kernel chooses among (:func:`length_choice`; default :func:`causal_length_ladder` for a
    causal block, :func:`length_ladder` for any other)."""
    form = varlen_offsets if form is None else form
    slots = RUN_SLOTS if slots is None else slots
    q_ids, kv_ids = segments
    t, s = q_ids.shape[1], kv_ids.shape[1]
    sizes = sorted({min(m, t) for m in slots})
    ok, most = expressible(q_ids, kv_ids, causal, limit=sizes[-1])
    if valid is not None:
        ok = ok & valid
    with_lengths = lambda runs, m: runs
    if lengths:
        bounds = (ladder or (causal_length_ladder if causal else length_ladder))(max(t, s))
        # a form that knows its longest run (``runs.longest``: a causal block's, from its offsets)
        # bounds its own kernel; the ids' longest run (a scatter-add of every token into its run)
        # serves the others, and XLA drops it where no variant reads it
        ids_choice = length_choice(bounds, t, s, jnp.maximum(_longest_run(q_ids), _longest_run(kv_ids)))
        # runs that cover the block (a causal block's own) put at most m runs on each row's t
        # tokens, so the longest has at least ceil(t / m) keys: no smaller bound is compiled
        with_lengths = lambda runs, m: runs.bounded_by(
            ids_choice if runs.longest is None else
            length_choice(bounds, t, s, runs.longest, least=-(-t // m) if runs.covers_block else 1))

    variants, boundary_ok = {}, False
    if boundary and not causal:  # tried first: no gather of keys, no scatter of dK / dV
        edge = boundary_runs(q_ids, kv_ids)
        boundary_ok = edge.ok & (True if valid is None else valid)
        variants[(*prefix, BOUNDARY)] = lambda: kernel(edge)
    for m in sizes:
        variants[(*prefix, *runs_variant(m))] = lambda m=m: kernel(with_lengths(form(q_ids, kv_ids, causal, m), m))
    return variants, runs_choice(ok, most, sizes, boundary_ok, prefix)


def switch_with_fallback(variants: dict, choice: branches.Choice, portable):
    """One ``lax.switch`` over ``variants`` and ``portable`` (named PORTABLE, taken when
    ``choice`` selects nothing). Every branch returns each output in the widest dtype any fused
    variant gives it: the inputs' dtype when every variant keeps it (a causal diagonal block's
    runs cover the block: its gradients are the kernel's own), float32 when one accumulates
    (scattered dK / dV); the portable kernel's float32 results are cast to it. One variant of each
    form is traced for its dtypes (:func:`_form`: the sizes of a form's variants never change them;
    tracing all of them cost 1.3-1.5 s a block at 8k tokens on 2 cores)."""
    forms = {}
    for name, variant in variants.items():
        forms.setdefault(_form(name), variant)
    shapes = [jax.eval_shape(variant) for variant in forms.values()]
    like = jax.tree.map(lambda *xs: jnp.result_type(*(x.dtype for x in xs)), *shapes)
    cast = lambda fn: lambda: jax.tree.map(lambda x, dtype: x.astype(dtype), fn(), like)
    return branches.select({**{name: cast(fn) for name, fn in variants.items()}, PORTABLE: cast(portable)},
                           with_fallback(choice)).switch()


def _form(name: tuple) -> tuple:
    """A variant's name without its trailing static sizes (run slots, length bound): the variants
    of one form — ``(*prefix, RUNS)``, ``(PLAN,)`` or ``(*prefix, BOUNDARY)`` — run the same code."""
    while name and (name[-1] is None or isinstance(name[-1], int)):
        name = name[:-1]
    return name


def with_fallback(choice: branches.Choice) -> branches.Choice:
    """``choice``, else the portable kernel."""
    return branches.First([(True, choice)], otherwise=PORTABLE)


def dispatch(segments, causal: bool, kernel, portable, slots=None, form=None, *, boundary: bool = False,
             lengths: bool = False, valid=None):
    """``kernel(runs)`` with ``runs = form(q_ids, kv_ids, causal, m)`` for the smallest m of ``slots``
    that holds the block's runs, or ``portable()`` when none does or the block is not expressible
    — one ``lax.switch``, decided on the device (``form``: :func:`varlen_offsets` by default).
    ``boundary`` (FlashAttention's form, FULL blocks): first try :func:`boundary_runs` — keys that
    all precede the queries, one document at most shared — three runs a row, no gather.
    ``lengths``: also pick the smallest of :func:`length_ladder` that bounds the longest run,
    given to the kernel as ``runs.bounds`` / ``runs.bound_at`` (the backward's grid:
    :func:`length_choice`).
    ``valid`` (traced bool, or None): the caller's own condition for the runs to be exact (the
    token-index forms: :func:`index_segments`); False sends the block to ``portable()``."""
    variants, choice = fused_branches(segments, causal, kernel, slots, form, boundary=boundary, lengths=lengths,
                                      valid=valid)
    return switch_with_fallback(variants, choice, portable)


def _isin_rows(x, table):
    """Per row, whether each of ``x`` [b, n] occurs in ``table`` [b, m] (sort + search, not n·m)."""
    def row(a, c):
        c = jnp.sort(c)
        at = jnp.clip(searchsorted(c, a), 0, c.shape[0] - 1)
        return c[at] == a
    return jax.vmap(row)(x, table)


def boundary_runs(q_ids, kv_ids):
    """A FULL block whose keys all precede its queries in original order (every off-diagonal
    block of a causal call on the contiguous or zigzag layout) shares at most one document: the
    keys' last run and the queries' first. Then each row is three runs over the block's own
    memory — (0 queries, the keys before the shared run), (the shared queries, the shared keys),
    (the other queries, 0 keys) — and no key is gathered. Returns the :class:`VarlenRuns`
    (``identity``: True) with ``ok``: every row has that shape (no other id of the queries
    among the keys, none of the other keys among the queries)."""
    b, t = q_ids.shape
    s = kv_ids.shape[1]

    def run_length(x):  # the leading run's length per row
        same = x == x[:, :1]
        return jnp.where(same.all(1), x.shape[1], jnp.argmin(same, axis=1))

    shared = q_ids[:, 0] == kv_ids[:, -1]
    n_q = jnp.where(shared, run_length(q_ids), 0)
    n_k = jnp.where(shared, run_length(kv_ids[:, ::-1]), 0)
    q_after = jnp.arange(t)[None, :] >= n_q[:, None]
    k_before = jnp.arange(s)[None, :] < (s - n_k)[:, None]
    ok = jnp.all(~(q_after & _isin_rows(q_ids, kv_ids))) & jnp.all(~(k_before & _isin_rows(kv_ids, q_ids)))
    q_len = jnp.stack([jnp.zeros_like(n_q), n_q, t - n_q], 1)  # [b, 3]
    k_len = jnp.stack([s - n_k, n_k, jnp.zeros_like(n_k)], 1)
    cu = lambda n: jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n.reshape(-1)).astype(jnp.int32)])
    return VarlenRuns(cu_q=cu(q_len), cu_k=cu(k_len), kv_index=jnp.arange(b * s, dtype=jnp.int32), covered_q=~q_after,
                      ok=ok, covered_kv=~k_before, identity=True)


def row_runs(q_ids, kv_ids, m: int):
    """One batch row: (q_start, q_len, kv_start, kv_len, included, ok) for up to m query runs.
    ``included``: a valid run whose document has keys here; ``ok``: the row is expressible."""
    t, s = q_ids.shape[0], kv_ids.shape[0]
    first = jnp.concatenate([jnp.ones((1,), bool), q_ids[1:] != q_ids[:-1]])
    n_runs = first.sum()
    q_start = jnp.nonzero(first, size=m, fill_value=t)[0]
    q_end = jnp.concatenate([q_start[1:], jnp.full((1,), t, q_start.dtype)])
    q_end = jnp.where(jnp.arange(m) == n_runs - 1, t, q_end)
    valid = jnp.arange(m) < n_runs
    q_len = jnp.where(valid, q_end - q_start, 0)
    doc = q_ids[jnp.minimum(q_start, t - 1)]
    q_count = (q_ids[None, :] == doc[:, None]).sum(1)
    in_kv = kv_ids[None, :] == doc[:, None]  # [m, s]
    kv_len = in_kv.sum(1)
    kv_start = jnp.argmax(in_kv, axis=1)
    kv_last = s - 1 - jnp.argmax(in_kv[:, ::-1], axis=1)
    one_run = (q_count == q_len) & ((kv_len == 0) | (kv_last - kv_start + 1 == kv_len))
    ok = (n_runs <= m) & jnp.all(one_run | ~valid)
    included = valid & (kv_len > 0)
    return q_start, q_len, kv_start, kv_len, included, ok


def packed_segments(q_ids, kv_ids, causal: bool, m: int = MAX_RUNS) -> PackedSegments:
    """The block's segments in cuDNN's packed form, traced, with at most m runs a row."""
    b, t = q_ids.shape
    m = min(m, t)
    q_start, q_len, kv_start, kv_len, included, ok = jax.vmap(lambda a, c: row_runs(a, c, m))(q_ids, kv_ids)
    ok = jnp.all(ok)
    if causal:
        ok = ok & jnp.all(q_ids == kv_ids) if q_ids.shape == kv_ids.shape else jnp.zeros((), bool)
    pad = lambda x: jnp.where(included, x, -1).astype(jnp.int32)
    minus = jnp.full((b, 1), -1, jnp.int32)
    slot = jnp.where(included, jnp.cumsum(included.reshape(-1)).reshape(b, m) - 1, -1).astype(jnp.int32)
    q_run = jnp.cumsum(_run_starts(q_ids), axis=1) - 1  # [b, t]
    run_included = jnp.take_along_axis(included, jnp.minimum(q_run, m - 1), axis=1) & (q_run < m)
    docs = jnp.take_along_axis(q_ids, jnp.minimum(q_start, t - 1), axis=1)  # [b, m]
    covered_kv = jnp.any((kv_ids[:, None, :] == docs[:, :, None]) & included[:, :, None], axis=1)
    return PackedSegments(q_seqlen=pad(q_len), kv_seqlen=pad(kv_len), q_offsets=jnp.concatenate([pad(q_start), minus], 1),
                          kv_offsets=jnp.concatenate([pad(kv_start), minus], 1), slot=slot, q_run=q_run,
                          q_start=q_start, covered_q=run_included, covered_kv=covered_kv, ok=ok)


def varlen_offsets(q_ids, kv_ids, causal: bool, m: int = MAX_RUNS) -> VarlenRuns:
    """The block as FlashAttention varlen sees it: b·m sequences (each row's m run slots, unused
    ones zero-length) over the packed queries [b·t] and the packed keys: :class:`VarlenRuns` with
    ``cu_q``, ``cu_k`` int32 [b·m + 1], ``kv_index`` int32 [b·s], ``identity`` (a causal diagonal
    block: the packed keys are the block's keys, no gather), ``covered_q``, ``covered_kv`` and
    ``ok`` as :func:`packed_segments`. A causal block takes :func:`causal_offsets`."""
    if causal:
        return causal_offsets(q_ids, kv_ids, m)
    b, t = q_ids.shape
    s = kv_ids.shape[1]
    seg = packed_segments(q_ids, kv_ids, causal, m)
    m = seg.q_start.shape[1]
    rows = jnp.arange(b)[:, None]
    starts = jnp.where(seg.q_start < t, rows * t + seg.q_start, rows * t + t)  # unused slots: the row's end
    cu_q = jnp.concatenate([starts.reshape(-1), jnp.full((1,), b * t, starts.dtype)]).astype(jnp.int32)
    kv_len = jnp.where(seg.kv_seqlen > 0, seg.kv_seqlen, 0).reshape(-1)
    cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(kv_len).astype(jnp.int32)])
    kv_start = (rows * s + jnp.maximum(seg.kv_offsets[:, :-1], 0)).reshape(-1)
    p = jnp.arange(b * s)
    run = jnp.clip(searchsorted(cu_k, p, side="right") - 1, 0, b * m - 1)
    kv_index = jnp.where(p < cu_k[-1], kv_start[run] + p - cu_k[run], b * s).astype(jnp.int32)
    return VarlenRuns(cu_q=cu_q, cu_k=cu_k, kv_index=kv_index, covered_q=seg.covered_q, ok=seg.ok,
                      covered_kv=seg.covered_kv, identity=causal, covers_block=causal)


def causal_offsets(q_ids, kv_ids, m: int = MAX_RUNS) -> VarlenRuns:
    """:func:`varlen_offsets` of a causal (diagonal) block: its runs are its own tokens, so the
    offsets are the run starts, the same for queries and keys (``identity``, ``covers_block``:
    nothing gathered, nothing blanked) — without :func:`packed_segments`' per-run searches over
    the keys ([m, s] a row), which on one GPU's whole sequence were a dozen small kernels between
    the dispatch's switch and the kernel, the device idle while the host launched them.
    ``ok``: :func:`expressible` (each id one run, the keys the queries' own) with at most m runs;
    ``longest``: the longest run (the backward's bound, :func:`fused_branches`)."""
    b, t = q_ids.shape
    m = min(m, t)
    ok, _ = expressible(q_ids, kv_ids, True, limit=m)  # ok: at most m runs a row too
    starts = jax.vmap(lambda f: jnp.nonzero(f, size=m, fill_value=t)[0])(_run_starts(q_ids))  # unused: the row's end
    cu = jnp.concatenate([(jnp.arange(b)[:, None] * t + starts).reshape(-1), jnp.full((1,), b * t)]).astype(jnp.int32)
    every = jnp.ones((b, t), bool)
    # the runs' lengths are the offsets' differences (unused slots and row ends: 0)
    return VarlenRuns(cu_q=cu, cu_k=cu, kv_index=jnp.arange(b * t, dtype=jnp.int32), covered_q=every, ok=ok,
                      covered_kv=every, longest=jnp.max(jnp.diff(cu)), identity=True, covers_block=True)


# ---- blocks masked by token index (``token_index`` calls) ----------------------------------------

def _bisect_right(sorted_ids, sorted_index, ids, index):
    """Per (id, index) of ``ids``, ``index`` (any shape), how many entries of the lexicographically
    sorted pairs (``sorted_ids``, ``sorted_index``) [n] are <= it — a vectorized binary search of
    ceil(log2(n + 1)) static steps."""
    n = sorted_ids.shape[0]
    lo, hi = jnp.zeros(ids.shape, jnp.int32), jnp.full(ids.shape, n, jnp.int32)
    for _ in range(n.bit_length()):
        mid = (lo + hi) // 2
        at = jnp.minimum(mid, n - 1)
        below = (sorted_ids[at] < ids) | ((sorted_ids[at] == ids) & (sorted_index[at] <= index))
        active = lo < hi
        lo, hi = jnp.where(active & below, mid + 1, lo), jnp.where(active & ~below, mid, hi)
    return lo


def _row_index_segments(q_ids, kv_ids, q_index, kv_index):
    t = q_ids.shape[0]
    # ids as their rank among the row's ids (< t + s): 3·rank + 2 cannot overflow where 3·id could
    ranked = jnp.sort(jnp.concatenate([q_ids, kv_ids]))
    q_ids, kv_ids = (searchsorted(ranked, x, side="left").astype(jnp.int32) for x in (q_ids, kv_ids))
    order = jnp.lexsort((kv_index, kv_ids))
    k_ids, k_index = kv_ids[order], kv_index[order]
    count = lambda ids, index: _bisect_right(k_ids, k_index, ids, index) - searchsorted(k_ids, ids, side="left")
    seen = count(q_ids, q_index)  # keys of each query's document with index <= its own
    q_order = jnp.argsort(q_ids, stable=True)
    sorted_q = q_ids[q_order]
    document = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), bool), sorted_q[1:] != sorted_q[:-1]]))
    most = jax.ops.segment_max(seen[q_order], document, num_segments=t)
    never = jnp.iinfo(jnp.int32).max  # no count reaches it
    least = jax.ops.segment_min(jnp.where(seen[q_order] > 0, seen[q_order], never), document, num_segments=t)
    real = jnp.arange(t) <= document[-1]
    ok = jnp.all(~real | (most == 0) | (most == least))
    at = jnp.minimum(searchsorted(sorted_q, kv_ids, side="left"), t - 1)
    prefix = jnp.where(sorted_q[at] == kv_ids, most[document[at]], 0)  # the keys its document's queries see
    visible = count(kv_ids, kv_index) <= prefix
    return jnp.where(seen > 0, 3 * q_ids, 3 * q_ids + 1), jnp.where(visible, 3 * kv_ids, 3 * kv_ids + 2), ok


def index_segments(q_ids, kv_ids, q_index, kv_index):
    """A block masked by token index (same document and key index <= query index: a ``token_index``
    call's FULL block with the window ``(UNBOUNDED, 0)``) as a document mask on new ids, when one
    exists: ``(q_ids', kv_ids', ok)``. Each query sees a set of keys of its document nested by its
    index; when every query of a document that sees any key sees the same number of them, the
    visible pairs are exactly ``q_ids' == kv_ids'`` with q' = 3·doc for those queries, 3·doc + 1
    for the others (they see nothing), k' = 3·doc for the keys they see, 3·doc + 2 for the rest —
    doc the id's rank among the row's ids, so 3·doc + r never collides across documents nor
    overflows (as ``seqplan.documents.index_runs`` on the host). ``ok`` (traced bool) says whether that holds in every row;
    then :func:`dispatch` runs the block FULL on the new ids (``valid=ok``). On the per-document
    zigzag every block off the diagonal holds, and so does the contiguous layout's. Traced, static
    shapes: two sorts and binary searches per row, no [t, s] comparison."""
    q_new, kv_new, ok = jax.vmap(_row_index_segments)(q_ids, kv_ids, q_index, kv_index)
    return q_new, kv_new, jnp.all(ok)


def increasing_in_documents(ids, index):
    """Whether the token indices increase along every run of equal ids (traced bool): a diagonal
    block (queries = keys) whose documents are runs is then, by token index, exactly the document
    mask with the block's own causal mask."""
    same = ids[:, 1:] == ids[:, :-1]
    return jnp.all(~same | (index[:, 1:] > index[:, :-1]))


def index_dispatch(segments, positions, kernel, portable, *, lengths: bool = False):
    """:func:`dispatch` for a block masked by token index (``positions = (q_index [b, t],
    kv_index [b, s])``, ``segments`` the ids or None: one document per row): a diagonal block
    (equal indices and ids) runs as the causal document block when its indices increase within
    each document (:func:`increasing_in_documents`), any other as the FULL document block on
    :func:`index_segments`' ids — one ``lax.switch`` over both forms' branches and one
    ``portable()`` fallback, taken when the block's form does not hold. ``kernel(causal, runs)``."""
    q_index, kv_index = positions
    q_ids, kv_ids = segments if segments is not None else (jnp.zeros(q_index.shape, jnp.int32),
                                                          jnp.zeros(kv_index.shape, jnp.int32))
    q_new, kv_new, ok = index_segments(q_ids, kv_ids, q_index, kv_index)
    compiled = dict(slots=INDEX_RUN_SLOTS, lengths=lengths, ladder=index_length_ladder)
    variants, full = fused_branches((q_new, kv_new), False, lambda runs: kernel(False, runs), boundary=True,
                                    valid=ok, prefix=(FULL,), **compiled)
    diagonal, causal = False, None
    if q_index.shape == kv_index.shape:  # a diagonal block is possible: its causal forms, compiled first
        causal_variants, causal = fused_branches(
            (q_ids, kv_ids), True, lambda runs: kernel(True, runs), valid=increasing_in_documents(q_ids, q_index),
            prefix=(CAUSAL,), **compiled)
        variants = {**causal_variants, **variants}
        diagonal = jnp.all(q_index == kv_index) & jnp.all(q_ids == kv_ids)
    return switch_with_fallback(variants, index_choice(diagonal, causal, full), portable)


# index_dispatch's two forms, the prefixes of their variants' names
CAUSAL, FULL = "causal", "full"


def index_choice(diagonal, causal: branches.Choice | None, full: branches.Choice) -> branches.Choice:
    """A diagonal block takes the causal forms' choice, any other the FULL forms' — a block whose
    form selects nothing takes the portable kernel (not the other form: its mask differs)."""
    return branches.First([(diagonal, causal), (jnp.logical_not(diagonal), full)])


# ---- a device's queries against every key in one call (all-gather-KV: seqplan.documents.prefix_runs) ----

# Static run slots (all rows together) the one call is compiled for, over at most
# seqplan.documents.PREFIX_KEY_FACTOR times the sequence's keys; a plan beyond them goes to the
# caller's fallback. The balance mixes' per-document hybrid at 128k over 8 devices needs at most 41 runs.
# Finer than the per-block ladders: a device makes one or two such calls (not R² blocks), so more
# variants cost seconds of compile, while FA3's backward launches its grid for every slot — the
# short mix's shared-prefix part (7–11 runs) sat on 32 slots and its local part (34–43) on 64:
# 1.8–5.9× the real runs' grid (128k, 4 devices; docs/gpu/documents-2026-11-27-h200x4.md).
PREFIX_SLOTS = (8, 16, 32, 48, 64, 128, 256)


def _row_prefix(q_ids, kv_ids, q_index, kv_index):
    ranked = jnp.sort(jnp.concatenate([q_ids, kv_ids]))
    q_doc, kv_doc = (searchsorted(ranked, x, side="left").astype(jnp.int32) for x in (q_ids, kv_ids))
    order = jnp.lexsort((kv_index, kv_doc))
    k_doc, k_index = kv_doc[order], kv_index[order]
    upper = _bisect_right(k_doc, k_index, q_doc, q_index)  # the query's document's keys up to its index end here
    first = searchsorted(k_doc, q_doc, side="left").astype(jnp.int32)
    start = jnp.concatenate([jnp.ones((1,), bool), (q_doc[1:] != q_doc[:-1]) | (upper[1:] != upper[:-1] + 1)])
    return order.astype(jnp.int32), upper, first, start


def prefix_runs(q_ids, kv_ids, q_index, kv_index, m: int, cap: int, rows=None) -> VarlenRuns:
    """``seqplan.documents.prefix_runs`` traced, with static shapes: queries [b, t] (ids and token
    indices) against keys [b, s] as at most ``m`` causal runs over at most ``cap`` gathered keys.
    Returns :class:`VarlenRuns` — a pytree, so a forward can keep it for its backward —
    (``cu_q``, ``cu_k`` int32 [m + 1]; ``kv_index`` int32 [cap] into the packed keys [b·s], b·s —
    out of range: a zero key, a dropped gradient — past the last run; ``covered_q`` [b, t] True)
    with ``ok`` (traced: the runs fit, every query sees a key, no index is negative) and
    ``longest`` (traced: the longest run's keys, for the backward's bound). ``rows``: the rows'
    sort and searches (``jax.vmap(_row_prefix)``) when a caller builds several plans from them."""
    b, t = q_index.shape
    s = kv_index.shape[1]
    rows = jax.vmap(_row_prefix)(q_ids, kv_ids, q_index, kv_index) if rows is None else rows
    order, upper, first, start = rows
    flat_start, upper, first = start.reshape(-1), upper.reshape(-1), first.reshape(-1)
    n = jnp.sum(flat_start)
    starts = jnp.nonzero(flat_start, size=m, fill_value=b * t)[0].astype(jnp.int32)
    ends = jnp.concatenate([starts[1:], jnp.full((1,), b * t, jnp.int32)])
    real = jnp.arange(m) < n
    head, last = jnp.minimum(starts, b * t - 1), jnp.maximum(ends - 1, 0)
    k_len = jnp.where(real, upper[last] - first[head], 0)
    row, k_start = head // t, first[head]
    cu_q = jnp.concatenate([starts, jnp.full((1,), b * t, jnp.int32)])
    cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(k_len).astype(jnp.int32)])
    p = jnp.arange(cap)
    run = jnp.clip(searchsorted(cu_k, p, side="right") - 1, 0, m - 1)
    at = jnp.clip(k_start[run] + p - cu_k[run], 0, s - 1)
    kv_packed = row[run] * s + order[row[run], at]
    kv_index_out = jnp.where(p < cu_k[-1], kv_packed, b * s).astype(jnp.int32)
    nonnegative = (jnp.min(q_index) >= 0) & (jnp.min(kv_index) >= 0)
    ok = (n <= m) & (cu_k[-1] <= cap) & jnp.all(upper > first) & nonnegative
    # identity False: the keys are gathered, never the block's own
    return VarlenRuns(cu_q=cu_q, cu_k=cu_k, kv_index=kv_index_out, covered_q=jnp.ones((b, t), bool), ok=ok,
                      longest=jnp.max(k_len), identity=False, covers_queries=True)


def prefix_plans(q_ids, kv_ids, q_index, kv_index) -> list[VarlenRuns]:
    """:func:`prefix_runs` for each of ``PREFIX_SLOTS`` (at least b slots: FA3's varlen forward
    writes every query's lse into an [nseq, h, t] buffer) over ``PREFIX_KEY_FACTOR`` times the
    keys; ``q_ids`` / ``kv_ids`` None: one document per row. Computed once per call: the forward
    keeps them for its backward.

    Only the largest is built: a plan of m slots that fits (``ok``) is the largest's first m runs
    — the same offsets, ``kv_index`` and ``longest`` (:func:`trimmed_plan`) — and one that does not
    is never run (``prefix_choice`` takes the first that fits), so the key search and gather over
    the whole key capacity run once, not once per slot count."""
    b, t = q_index.shape
    s = kv_index.shape[1]
    zeros = lambda x: jnp.zeros(x.shape, jnp.int32)
    q_ids, kv_ids = (zeros(q_index), zeros(kv_index)) if q_ids is None else (q_ids, kv_ids)
    sizes = sorted({min(max(m, b), b * t) for m in PREFIX_SLOTS})
    rows = jax.vmap(_row_prefix)(q_ids, kv_ids, q_index, kv_index)  # one sort for every slot count's plan
    largest = prefix_runs(q_ids, kv_ids, q_index, kv_index, sizes[-1], PREFIX_KEY_FACTOR * b * s, rows)
    run_count = jnp.sum(rows[3])  # _row_prefix's run starts, every row
    return [trimmed_plan(largest, m, run_count) for m in sizes[:-1]] + [largest]


def trimmed_plan(largest: VarlenRuns, m: int, run_count) -> VarlenRuns:
    """:func:`prefix_runs` with ``m`` slots from the same call with more, given ``run_count``
    (traced): identical to it when it fits (``ok``; the offsets past the last run are all the end,
    the keys' index is the same runs'), and never ok when it does not — too many runs for m
    slots, or (as for the largest) too many keys for the capacity."""
    end = largest.cu_q[-1:]  # b·t: every slot past the last run starts (and ends) there
    return dataclasses.replace(largest, cu_q=jnp.concatenate([largest.cu_q[:m], end]), cu_k=largest.cu_k[: m + 1],
                               ok=largest.ok & (run_count <= m))


def _own_key_starts(ids, p: int):
    """(where each of :func:`own_key_runs`' sequences starts over the row's keys [b, t] bool, and
    where the run holding position p starts [b])."""
    first, at = _run_starts(ids), jnp.arange(ids.shape[1])
    head = jnp.max(jnp.where(first & (at <= p)[None, :], at[None, :], 0), axis=1)
    return (at[None, :] == 0) | (at[None, :] == head[:, None]) | (first & (at > p)[None, :]), head


def own_key_runs(ids, index, p: int, m: int, starts=None) -> VarlenRuns:
    """A shared-prefix call's local part — a shard's queries [p, t) against its own keys [0, t),
    ``ids`` / ``index`` [b, t] the shard's — over the shard's own memory: no ranking sort, no
    gathered keys. Where each id is one run of the row whose token indices increase along it,
    a query sees exactly its run's keys up to itself: FA3's causal varlen (bottom-right) on
    (queries from p, keys from the run's start). Each row is its sequences over its keys in order:
    (0 queries, the keys before the run holding position p), that run from p, then every later
    run — at most ``m`` sequences in all (unused: the end). ``ok``: the row is runs of one id each
    (at most ``PAIRWISE_RUNS``, compared without a sort) with increasing indices, the sequences
    fit, no index negative; ``longest``: the longest run's keys (the backward's bound). Queries
    packed [b·(t − p)], keys [b·t] (``identity``): a key before that run is read by no query here
    (``covered_kv`` False: its dK / dV zeroed after the call). Where ``ok`` fails the caller runs
    the portable kernel (``allgather._part_forward``). ``starts``: :func:`_own_key_starts` of these
    ids, when the caller has them (:func:`own_key_plans`)."""
    b, t = index.shape
    ids = jnp.zeros((b, t), jnp.int32) if ids is None else ids
    starts, head = _own_key_starts(ids, p) if starts is None else starts
    at = jnp.arange(t)
    n = jnp.sum(starts)
    flat = jnp.nonzero(starts.reshape(-1), size=m, fill_value=b * t)[0].astype(jnp.int32)
    row, key_at = flat // t, flat % t
    q_starts = jnp.where(flat < b * t, row * (t - p) + jnp.maximum(key_at - p, 0), b * (t - p))
    cu_q = jnp.concatenate([q_starts, jnp.full((1,), b * (t - p), jnp.int32)]).astype(jnp.int32)
    cu_k = jnp.concatenate([flat, jnp.full((1,), b * t, jnp.int32)])
    k_len, q_len = jnp.diff(cu_k), jnp.diff(cu_q)
    one_run, _ = _one_run_per_id(ids, min(PAIRWISE_RUNS, t))
    ok = (n <= m) & jnp.all(one_run) & increasing_in_documents(ids, index) & (jnp.min(index) >= 0)
    return VarlenRuns(cu_q=cu_q, cu_k=cu_k, kv_index=jnp.arange(b * t, dtype=jnp.int32),
                      covered_q=jnp.ones((b, t - p), bool), ok=ok, covered_kv=at[None, :] >= head[:, None],
                      longest=jnp.max(jnp.where(q_len > 0, k_len, 0)), identity=True, covers_queries=True)


def own_key_plans(ids, index, p: int) -> list[VarlenRuns]:
    """:func:`own_key_runs` for each of ``PREFIX_SLOTS`` (at least two sequences a row: the keys
    before p's run and that run), the fewest that fit picked on the device (:func:`prefix_dispatch`).
    As :func:`prefix_plans`, only the largest is built and the others trimmed from it
    (:func:`trimmed_plan`: its sequences are flat over the rows, the unused ones at the end)."""
    b, t = index.shape
    ids = jnp.zeros((b, t), jnp.int32) if ids is None else ids
    sizes = sorted({min(max(m, 2 * b), b * t) for m in PREFIX_SLOTS})
    starts = _own_key_starts(ids, p)  # one search for every slot count's plan
    largest = own_key_runs(ids, index, p, sizes[-1], starts)
    return [trimmed_plan(largest, m, jnp.sum(starts[0])) for m in sizes[:-1]] + [largest]


def prefix_length_ladder(n: int) -> tuple[int, ...]:
    """The one call's backward ``max_seqlen`` bounds: n/32 to n in steps of 1.5× and 4/3× (n/32,
    3n/64, n/16, 3n/32 … 3n/4, n), none below 256 — finer than :func:`length_ladder`, where a
    device of short documents sits (the short mix at 128k: its longest run 7.7k of 24.8k keys took
    the bound n/2 when the steps were powers of two; FA3's backward launches its grid for the
    bound)."""
    return tuple(sorted({max(min(n, 256), n * k // 64) for k in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}))


def prefix_dispatch(plans: list[VarlenRuns], kernel, fallback, *, keys: int, lengths: bool = False):
    """``kernel(runs)`` on the plan of :func:`prefix_plans` (over ``keys`` keys a row) with the fewest slots that holds the
    device's runs (and, ``lengths``, the smallest of :func:`prefix_length_ladder` bounding the
    longest run: the backward's ``max_seqlen``, whose grid FA3 launches whatever the runs' lengths,
    chosen around the kernel call alone: :func:`length_choice`), or ``fallback()`` when none does —
    one ``lax.switch`` decided on the device."""
    t, s = plans[0].covered_q.shape[1], keys
    # every plan holds the same runs: gathered keys (prefix_runs) or the block's own (own_key_runs)
    choice = length_choice(prefix_length_ladder(s), t, s, plans[-1].longest) if lengths else None
    with_lengths = lambda runs: runs if choice is None else runs.bounded_by(choice)
    slot_counts = [plan.cu_q.shape[0] - 1 for plan in plans]
    variants = {plan_variant(m): lambda runs=runs: kernel(with_lengths(runs)) for m, runs in zip(slot_counts, plans)}
    return switch_with_fallback(variants, prefix_choice(slot_counts, [plan.ok for plan in plans]), fallback)


PLAN = "plan"


def plan_variant(slots: int) -> tuple:
    """The name of :func:`prefix_dispatch`'s variant for the plan of ``slots`` runs."""
    return (PLAN, slots)


def prefix_choice(slot_counts, fits) -> branches.Choice:
    """The first plan (fewest slots) that ``fits``; nothing (the fallback) when none fits."""
    return branches.First([(fit, plan_variant(m)) for m, fit in zip(slot_counts, fits)])
