"""What every benchmark row shares: the problem, its FLOPs, the timing loop's statistics and the
row format (one JSON object per measured configuration)."""

from __future__ import annotations

import statistics
import traceback
from dataclasses import asdict, dataclass, field
from functools import cached_property

from parity.core.mesh import MeshShape


@dataclass(frozen=True)
class Problem:
    """One attention problem: global sizes, as in the issue's tables (bf16, causal, batch 1)."""

    seq: int = 131072  # global tokens
    batch: int = 1
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    causal: bool = True
    dtype: str = "bfloat16"
    documents: str = "none"  # packed documents: a parity.core.documents pattern drawn at seed 0 ("mix")
    # or a parity.probes.balance.BENCHMARK_MIXES name ("short", "heavy-tail", "few-long", "quarter-capped")
    window: tuple[int, int] | None = None  # sliding window (left, right) on original positions
    fit_ring: int = 0  # > 0: the ids fitted to the per-document zigzag of this R (benchmarks.documents)
    fit_multiple: int = 1  # ... at a length multiple of this (2·R·U)

    def segment_ids(self):
        """[batch, seq] int32 ids in original order (``None`` without documents): the pattern of
        ``parity.core.documents`` drawn from seed 0, or the balance probe's mix of that name, so
        every run times the same mix; fitted to the per-document zigzag with ``fit_ring``."""
        if self.documents == "none":
            return None
        import numpy as np

        from .documents import fit_documents, mix_ids, mix_names

        if self.documents in mix_names():
            ids = mix_ids(self.documents, self.batch, self.seq)
        else:
            from parity.core.documents import draw_segment_ids

            ids = draw_segment_ids(self.documents, self.batch, self.seq, np.random.default_rng(0))
        return fit_documents(ids, self.fit_ring, self.fit_multiple) if self.fit_ring else ids

    def visible_keys(self):
        """[batch, seq] int64: how many keys each query (by original position) sees under the
        causal / full mask, the documents (runs of one id) and the window — exact, NumPy, O(s)."""
        import numpy as np

        i = np.arange(self.seq)
        left, right = self.window if self.window is not None else (self.seq, self.seq)
        right = 0 if self.causal else right
        ids = self.segment_ids()
        counts = []
        for row in ids if ids is not None else [np.zeros(self.seq, np.int64)] * self.batch:
            starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])  # each id run (a document)
            if len(starts) != len(np.unique(row)):
                raise ValueError("visible_pairs counts documents as runs of one id: the pattern reuses ids")
            ends = np.r_[starts[1:], self.seq]
            run = np.repeat(np.arange(len(starts)), ends - starts)
            lo = np.maximum(starts[run], i - left)
            hi = np.minimum(ends[run] - 1, i + right)
            counts.append(np.maximum(hi - lo + 1, 0))
        return np.stack(counts).astype(np.int64)

    def visible_pairs(self) -> float:
        """(query, key) pairs the mask lets through, summed over the batch: s²/2 causal, s² not,
        counted exactly (:meth:`visible_keys`) with documents and windows."""
        if self.documents == "none" and self.window is None:
            return self.batch * self.seq**2 / (2 if self.causal else 1)
        return int(self.visible_keys().sum())

    def own_flops(self, positions, heads_share: float, fwd_only: bool) -> float:
        """The FLOPs of one device's own visible pairs: the pairs whose query is at original
        ``positions`` (its ring shard), for its share of the heads (1/U under Ulysses)."""
        fwd = 4 * self.heads * heads_share * self.head_dim * float(self.visible_keys()[:, positions].sum())
        return fwd if fwd_only else 3.5 * fwd

    def flops(self, fwd_only: bool) -> float:
        """4·d·h·(visible pairs) forward — 4·b·h·s²·d/2 when causal, the FlashAttention papers'
        convention, and counted on the mask area with documents or windows; ×3.5 for forward +
        backward (the backward is 2.5× the forward: five matmuls to two)."""
        fwd = 4 * self.heads * self.head_dim * self.visible_pairs()
        return fwd if fwd_only else 3.5 * fwd

    def floor_terms(self, devices: int, fwd_only: bool) -> list[tuple[str, int]]:
        """The memory floor per device, term by term (bytes), for this device's share of the
        sequence (t = seq / devices tokens, every head): what the numerics policy makes resident —
        q, k, v, o in the dtype and the float32 lse; one arriving K/V pair (the ring's next
        shard); and for forward + backward dq, dk, dv, do in the dtype plus the float32 dK/dV
        accumulator and its travelling copy (dK/dV accumulate in float32 and travel with K/V)."""
        t = self.seq // devices
        e = 2 if self.dtype in ("bfloat16", "float16") else 4
        q = self.batch * t * self.heads * self.head_dim * e
        kv = self.batch * t * self.kv_heads * self.head_dim * e
        kv32 = self.batch * t * self.kv_heads * self.head_dim * 4
        terms = [("q, o", 2 * q), ("k, v", 2 * kv), ("lse (float32)", self.batch * self.heads * t * 4),
                 ("arriving K/V pair", 2 * kv)]
        if not fwd_only:
            terms += [("dq, do", 2 * q), ("dk, dv", 2 * kv), ("float32 dK/dV accumulator", 2 * kv32),
                      ("its travelling copy", 2 * kv32)]
        return terms

    def min_bytes_per_device(self, devices: int, fwd_only: bool) -> int:
        """The floor of :meth:`floor_terms`, summed (issue 28's definition; results files before
        2026-11-23 evening used the same without the float32 dK/dV accumulator and its copy)."""
        return sum(b for _, b in self.floor_terms(devices, fwd_only))

    def floor_arithmetic(self, devices: int, fwd_only: bool) -> str:
        """The floor's terms and sum, one line each, in MiB."""
        terms = self.floor_terms(devices, fwd_only)
        lines = [f"  {name:28s} {b / 2**20:10.1f} MiB" for name, b in terms]
        return "\n".join([f"memory floor per device ({devices} devices, {'fwd' if fwd_only else 'fwd+bwd'}, "
                          f"{self.seq // devices} tokens each):", *lines,
                          f"  {'floor':28s} {sum(b for _, b in terms) / 2**20:10.1f} MiB"])


@dataclass
class Row:
    """One measured configuration (the JSON row; ``explore.benchmark_rows`` reads these)."""

    framework: str  # jax_impl, torch_impl, torch_cp, yunchang, fa3_jax, or a *_ceiling
    strategy: str  # MeshSpec.strategy (ring, ulysses, usp, double_ring, allgather, ...), or single
    layout: str
    seq_len: int
    devices: int
    ulysses: int
    ring: int
    fwd_only: bool
    ms_per_iter: float | None = None
    ms_spread: float | None = None  # max - min over the timed iterations
    peak_mb_per_device: float | None = None
    tflops_per_gpu: float | None = None
    efficiency: float | None = None  # tflops_per_gpu / the same-run single-GPU ceiling of its framework
    memory_vs_floor: float | None = None
    note: str = ""  # the error, when a configuration failed
    extra: dict = field(default_factory=dict)
    # True: the row's exact path passed the parity check on a reduced problem before it was timed
    # (benchmarks/verify.py); False: it failed (no throughput reported); None: not ringbridge's code.
    verified: bool | None = None

    @property
    def iters_per_s(self) -> float | None:
        return None if not self.ms_per_iter else 1e3 / self.ms_per_iter

    def to_dict(self) -> dict:
        return asdict(self) | {"iters_per_s": self.iters_per_s}


def summarize(times_ms: list[float]) -> tuple[float, float]:
    """(median, max - min) of per-iteration times."""
    return statistics.median(times_ms), max(times_ms) - min(times_ms)


def record_queued(row: Row, measure) -> None:
    """``row.extra["queued_ms"] = measure()``; a failure is the row's ``queued_error``, never the
    row's loss (its waited times stand)."""
    try:
        row.extra["queued_ms"] = round(measure(), 4)
    except Exception as err:  # noqa: BLE001 — the second timing is an addition to a measured row
        row.extra["queued_error"] = f"{type(err).__name__}: {err}"[:200]


def finish(row: Row, problem: Problem, times_ms: list[float], peak_bytes: float | None) -> Row:
    row.ms_per_iter, row.ms_spread = summarize(times_ms)
    if row.extra.get("variant") != "comm-only":  # the comm-only probe does no attention math
        row.tflops_per_gpu = problem.flops(row.fwd_only) / (row.ms_per_iter * 1e-3) / row.devices / 1e12
    if peak_bytes is not None:
        row.peak_mb_per_device = peak_bytes / 2**20
        row.memory_vs_floor = peak_bytes / problem.min_bytes_per_device(row.devices, row.fwd_only)
    return row


@dataclass(frozen=True)
class MeshSpec:
    """A sequence-parallel configuration by its ``parity.core.mesh`` name, the same names the
    parity cases start with: ``ring-r4``, ``ulysses-u4``, ``usp-r2xu2`` (ring × ulysses),
    ``double_ring-ro2xri2`` (outer × inner), ``double_ring_usp-ro2xri2xu2``, ``ring-agkv-r4`` /
    ``usp-agkv-r2xu2`` (all-gather KV), ``ring-r1`` (one device)."""

    name: str

    def __post_init__(self):
        self.shape  # noqa: B018 — parse now: a bad name fails before any GPU work

    @cached_property
    def shape(self) -> MeshShape:
        return MeshShape.from_name(self.name)

    @property
    def axes(self) -> dict[str, int]:
        return self.shape.axes

    @property
    def kv_exchange(self) -> str:
        return self.shape.kv_exchange

    @property
    def strategy(self) -> str:
        """The row's strategy label: the algorithm the mesh selects (``parity.core.mesh.algorithm``),
        ``allgather`` / ``allgather_usp`` for all-gather KV."""
        if self.kv_exchange == "allgather":
            return "allgather" if self.shape.algorithm == "ring" else f"allgather_{self.shape.algorithm}"
        return self.shape.algorithm

    @property
    def devices(self) -> int:
        return self.shape.devices

    @property
    def ring(self) -> int:
        return self.shape.ring

    @property
    def ulysses(self) -> int:
        return self.shape.ulysses


def problem_masks(args, documents: str | None = None) -> dict:
    """The ``Problem`` keywords of the mask flags: one of ``--documents``' names (``documents``;
    default its first) and ``--window``."""
    first = documents_names(args.documents)[0]
    return {"documents": documents or first, "window": None if args.window is None else (args.window, 0)}


def documents_names(value: str) -> list[str]:
    """``--documents``: "none", or comma-separated patterns / mixes, each its own problem."""
    names = [name for name in value.split(",") if name]
    if not names or ("none" in names and len(names) > 1):
        raise SystemExit(f"--documents takes 'none' or a comma-separated list of patterns / mixes, got {value!r}")
    return names


def window_anchored(args) -> bool:
    """Whether a run times its frameworks' window anchors (``*_window_anchor`` rows, at
    ``--ceiling-seq``): a sliding window without documents — a masked run skips the unmasked
    ceilings, and documents get the varlen anchors on their ids — with a ceiling length, and not a
    JAX multi-controller run (which times no single-GPU rows)."""
    return (args.window is not None and args.documents == "none" and bool(args.ceiling_seq)
            and not getattr(args, "multi_controller", False))


def mask_extra(problem: Problem) -> dict:
    """What a row records of its problem's masks (``verify.mark_rows`` rebuilds the problem from it)."""
    return {"documents": problem.documents, "window": problem.window, "fit_ring": problem.fit_ring,
            "fit_multiple": problem.fit_multiple}


def head_groups_extra(spec) -> dict:
    """``{"head_groups": G}`` for a Ulysses mesh's row: the API's ``head_groups`` default on a Ulysses
    axis (``RINGBRIDGE_HEAD_GROUPS``, read by the row's calls and by the check before it alike);
    ``{}`` for meshes without one, which ignore it."""
    from seqplan.config import default_head_groups

    return {"head_groups": default_head_groups(None, spec.ulysses)} if spec.ulysses > 1 else {}


STATIC_LAYOUTS = ("contiguous", "zigzag", "stripe")
# The per-document hybrid with all-gather KV's shared prefix (seqplan.shared: the call passes the
# shared_tokens seqplan.chooser gives) — a driver layout name, on all-gather-KV meshes only.
SHARED_HYBRID = "document-hybrid-shared"


def check_layouts(layouts: str, documents: str) -> list[str]:
    """``--layout``'s names, refused before any GPU work when unknown, or per-row without documents."""
    from seqplan.layouts import DOCUMENT_LAYOUTS

    names = [name for name in layouts.split(",") if name]
    known = STATIC_LAYOUTS + DOCUMENT_LAYOUTS + (SHARED_HYBRID,)
    for name in names:
        if name not in known:
            raise SystemExit(f"--layout takes {', '.join(known)}; got {name!r}")
        if is_row_layout(name) and documents == "none":
            raise SystemExit(f"--layout {name} lays out packed documents: it needs --documents")
    if not names:
        raise SystemExit("--layout names no layout")
    return names


def mesh_layouts(spec: MeshSpec, layouts: str) -> list[str]:
    """The layouts ``spec`` runs under ``--layout`` (a sequence not split over a ring has one)."""
    names = [name for name in layouts.split(",") if name and (name != SHARED_HYBRID or spec.kv_exchange == "allgather")]
    return names if spec.ring > 1 else ["contiguous"]


def weak_paths(args, devices: int, framework: str = "jax") -> list[tuple[MeshSpec, str, str, Problem]]:
    """``--weak``'s rows: per tokens-per-GPU value, a ring over 1, 2, 4, 8 of the ``devices`` at
    that many tokens per device — (spec, layout, backend, problem), the first of ``--layout``
    (contiguous on one device) and of ``framework``'s backends (``--jax-backends`` /
    ``--torch-backends``). The JAX side times them on one process; the torch side under one
    torchrun world per ring size (``benchmarks.run``); ``benchmarks.verify`` checks the same paths."""
    backend = getattr(args, f"{framework}_backends", "auto").split(",")[0]
    out = []
    for per_gpu in (int(t) for t in (getattr(args, "weak", "") or "").split(",") if t):
        for n in (n for n in (1, 2, 4, 8) if n <= devices):
            problem = Problem(seq=per_gpu * n, heads=args.heads, kv_heads=args.kv_heads, **problem_masks(args))
            out.append((MeshSpec(f"ring-r{n}"), args.layout.split(",")[0] if n > 1 else "contiguous", backend, problem))
    return out


def weak_worlds(args, devices: int) -> list[int]:
    """The ring sizes ``--weak`` times (1, 2, 4, 8 up to ``devices``): one torchrun world each."""
    return sorted({spec.devices for spec, *_ in weak_paths(args, devices)})


def mesh_rows(specs, backends: str, layouts: str) -> list[tuple[MeshSpec, str, str]]:
    """(spec, backend, layout) of every mesh row, the static layouts first: a per-row layout's
    programs compile longest, so a run cut short keeps every static row."""
    rows = [(spec, backend, layout) for spec in specs for backend in filter(None, backends.split(","))
            for layout in mesh_layouts(spec, layouts)]
    return sorted(rows, key=lambda row: is_row_layout(row[2]))


def is_row_layout(layout: str) -> bool:
    """A per-row layout (``seqplan.layouts.row_layout``: per-document zigzag or hybrid, the hybrid
    with its shared prefix)?"""
    from seqplan.layouts import DOCUMENT_LAYOUTS

    return layout in DOCUMENT_LAYOUTS + (SHARED_HYBRID,)


def row_layout_name(layout: str) -> str:
    """The ``seqplan.layouts.row_layout`` a per-row driver layout lays rows out with."""
    from seqplan.layouts import DOCUMENT_HYBRID

    return DOCUMENT_HYBRID if layout == SHARED_HYBRID else layout


def row_problem(problem: Problem, spec: MeshSpec, layout: str) -> Problem:
    """The problem a row of ``layout`` on ``spec`` times: a per-row layout's ids fitted to the
    mesh's ring (every document a multiple of 2R tokens, the length a multiple of 2R·U:
    ``benchmarks.documents.fit_documents``); a static layout's unchanged."""
    from dataclasses import replace

    if not is_row_layout(layout):
        return problem
    return replace(problem, fit_ring=spec.ring, fit_multiple=2 * spec.ring * spec.ulysses)


@dataclass(frozen=True)
class LaidOut:
    """A row's global arrays in layout order, what the public API takes: the static layout name
    the call passes (a per-row layout passes "contiguous", which then only fixes divisibility),
    the segment ids [b, seq] int32 (None without documents), the token indices [b, seq]
    int32 (None for a static layout: the name implies them) and all-gather KV's shared prefix
    (``SHARED_HYBRID``: ``seqplan.shared``; else None)."""

    api_layout: str
    segment_ids: object = None
    token_index: object = None
    shared_tokens: int | None = None

    @property
    def shared(self) -> dict:
        """The API keyword of the shared prefix, {} without one."""
        return {} if self.shared_tokens is None else {"shared_tokens": self.shared_tokens}


def lay_out(problem: Problem, spec: MeshSpec, layout: str) -> LaidOut:
    """``problem``'s ids (fitted for a per-row layout: :func:`row_problem`) in ``layout``'s order
    over ``spec``, with the token indices a per-row layout passes."""
    import numpy as np

    ids = row_problem(problem, spec, layout).segment_ids()
    if is_row_layout(layout):
        from seqplan.shared import shared_tokens_for

        from .documents import layout_keywords

        laid = layout_keywords(ids, spec.ring, row_layout_name(layout))
        shared = shared_tokens_for(laid["segment_ids"], spec.ring) if layout == SHARED_HYBRID else None
        return LaidOut("contiguous", laid["segment_ids"].astype(np.int32), laid["token_index"].astype(np.int32), shared)
    if ids is None:
        return LaidOut(layout)
    from seqplan.layouts import layout_permutation

    return LaidOut(layout, ids[:, layout_permutation(problem.seq, layout, spec.ring, spec.ulysses)].astype(np.int32))


DEFAULT_MESHES = ("ring-r4", "ulysses-u4", "usp-r2xu2", "double_ring-ro2xri2", "ring-agkv-r4")


def shared_arguments(description: str):
    """The flags both benchmark sides take (the driver passes one flag set to both)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--ceiling-seq", type=int, default=32768,
                    help="single-GPU ceiling tokens (0: skip); with --documents the varlen anchors run instead, at each "
                         "--seqs length on the rows' own ids (0: skip them too)")
    ap.add_argument("--meshes", default=",".join(DEFAULT_MESHES), help="parity.core mesh names, comma-separated")
    ap.add_argument("--layout", default="zigzag",
                    help="ring layouts, comma-separated: contiguous, zigzag, stripe, or the per-row layouts of packed "
                         "documents document-zigzag, document-hybrid (ids fitted to the ring, explicit token indices); "
                         "each ring mesh runs once per layout; Ulysses-only meshes run contiguous once; weak scaling "
                         "uses the first")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--documents", default="none",
                    help="packed documents, comma-separated, each its own problem: a parity.core.documents pattern "
                         "drawn at seed 0 (e.g. mix) or a parity.probes.balance.BENCHMARK_MIXES name (short, "
                         "heavy-tail, few-long, quarter-capped); TFLOP/s count the mask area; the single-GPU "
                         "ceilings are then each framework's fused varlen kernel on the same ids (the *_varlen_anchor "
                         "rows)")
    ap.add_argument("--passes", choices=("both", "fwd+bwd", "fwd"), default="both",
                    help="time the forward, forward+backward, or both (default)")
    ap.add_argument("--window", type=int, default=None, help="sliding window left extent (right 0)")
    ap.add_argument("--weak", default="", help="weak scaling: tokens per GPU (comma-separated); a ring over 1, 2, 4, "
                    "8 GPUs (as many as there are), each side (torch: a torchrun world per ring size)")
    ap.add_argument("--overlap", action="store_true",
                    help="also time ring meshes with compute only / communication only (benchmarks/overlap.py)")
    return ap


def fwd_modes(passes: str) -> tuple[bool, ...]:
    """``--passes`` as the rows' ``fwd_only`` values."""
    return {"both": (True, False), "fwd+bwd": (False,), "fwd": (True,)}[passes]


def anchor_problems(problem: Problem, specs, layouts: str) -> list[Problem]:
    """The distinct problems the rows of ``specs`` × ``layouts`` time (:func:`row_problem`): each
    gets its framework's varlen anchor on the same ids (raw for static layouts, fitted per ring)."""
    out = []
    for spec in specs:
        for layout in mesh_layouts(spec, layouts):
            p = row_problem(problem, spec, layout)
            if p not in out:
                out.append(p)
    return out


def anchor_row(framework: str, problem: Problem, result: dict, fwd_only: bool = False) -> Row:
    """A one-GPU anchor row (``benchmarks.masked``'s anchor result) on ``problem``: fwd+bwd (or the
    forward alone, ``fwd_only``), TFLOP/s on the visible pairs. ``verified``: True when its
    4096-token check passed (the kernel, not ringbridge's path, checked the same way), False when it
    failed (no throughput), None when the anchor raised (the error is the note)."""
    row = Row(framework, "single", "-", problem.seq, 1, 1, 1, fwd_only,
              extra={"kernel": result.get("kernel"), **mask_extra(problem),
                     "verified_at_4096": result.get("verified_at_4096"), "candidates": result.get("candidates")})
    if "error" in result:
        row.note = result["error"]
        return row
    row.verified = bool(result.get("verified"))
    if not row.verified:
        row.note = f"anchor NOT VERIFIED at 4096 tokens: {result.get('verified_at_4096')}"
        return row
    row.ms_per_iter = result["fwd_ms" if fwd_only else "fwd_bwd_ms"]
    row.tflops_per_gpu = problem.flops(fwd_only) / (row.ms_per_iter * 1e-3) / 1e12
    if not fwd_only and result.get("fwd_bwd_queued_ms"):  # the anchors that time one (benchmarks.masked)
        row.extra["queued_ms"] = round(result["fwd_bwd_queued_ms"], 4)
    return row


def best_anchor(framework: str, problem: Problem, candidates: dict) -> Row:
    """The fastest verified of ``candidates`` (name -> a ``benchmarks.masked`` anchor of
    ``problem``, each checked at 4096 tokens by its function; one that raises kept as its error)
    as a ``framework`` row on ``problem`` (:func:`anchor_row`); ``extra.kernel`` names the one
    chosen, ``extra.candidates`` has them all."""
    results = {}
    for name, fn in candidates.items():
        try:
            results[name] = fn(problem)
        except Exception as err:  # noqa: BLE001 — one kernel failing must not lose the other
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    usable = [c for c in results.values() if c.get("verified") and c.get("fwd_bwd_ms")]
    best = min(usable, key=lambda c: c["fwd_bwd_ms"]) if usable else next(iter(results.values()))
    best = dict(best, candidates={n: {k: c.get(k) for k in ("kernel", "fwd_bwd_ms", "verified", "error")}
                                  for n, c in results.items()})
    row = anchor_row(framework, problem, best)
    print(f"{framework} {problem.documents} window {problem.window} fit {problem.fit_ring}: {row.tflops_per_gpu} "
          f"TFLOP/s ({best.get('kernel')}) {row.note}", flush=True)
    return row


def one_call_record(problem: Problem, spec: MeshSpec, laid: LaidOut, backend: str, replay, make_q, to_array) -> dict:
    """Whether every ring device of an all-gather-KV row runs the one varlen call, with its runs
    per device: the framework's ``replay.one_call_plan`` on the row's global ids (host side);
    ``make_q()`` a global query array of the row's shape, dtype and device (the plan reads no
    values; built only for such rows), ``to_array`` the framework's array constructor. {} for
    other rows; a shared-prefix row records its ``shared_tokens`` of the shard's tokens instead."""
    if spec.kv_exchange != "allgather" or laid.segment_ids is None:
        return {}
    if laid.shared_tokens is not None:  # two parts per device (seqplan.shared): no whole-sequence plan to show
        return {"shared_tokens": laid.shared_tokens, "shard_tokens": problem.seq // spec.ring}
    try:
        q = make_q()
        strategy = replay.Strategy(ring=spec.ring, ulysses=spec.ulysses, kv_exchange=spec.kv_exchange)
        index = None if laid.token_index is None else to_array(laid.token_index)
        plans = [replay.one_call_plan(device * spec.ulysses, q, strategy=strategy, causal=problem.causal,
                                      layout=laid.api_layout, block_backend=backend,
                                      segment_ids=to_array(laid.segment_ids), window=problem.window, token_index=index)
                 for device in range(spec.ring)]
    except Exception as err:  # noqa: BLE001 — the row keeps its timing; the record says why it is missing
        return {"one_call": None, "one_call_error": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"one_call": all(p is not None for p in plans),
            "runs": [None if p is None else len(p.cu_q) - 1 for p in plans]}
