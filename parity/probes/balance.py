"""``python -m parity balance``: the computed work per device of causal ring attention over packed
documents, from the schedule alone (no kernel runs; NumPy only, the schedule and layouts of
jax_impl imported when it runs — they are pure Python / NumPy).

For a document mix at realistic length (64k-128k tokens), ring size R and static layout, every
device walks ``schedule.device_visits(ring_schedule(layout, causal=True, R), device)``; each
visit's block meets the device's query part and the visiting shard's key part (global ids in
layout order) and ``schedule.document_work`` decides from their id ranges — SKIP, PLAIN or
DOCUMENTS — as the implementations do at run time (the device's own shard is never skipped).
Three counts of the work a device computes:

    (a) block area of the computed (not skipped) blocks, a causal or strict block counting half
        (what a block kernel without tile skipping computes);
    (b) tiles of ``tile`` x ``tile`` (default 128 x 128) inside computed blocks that hold at least
        one visible pair (what a kernel that skips empty tiles computes);
    (c) visible (query, key) pairs (the mask area: the least any kernel can compute);
    (d) the per-document run area: per computed block and document, its queries x its keys that
        its latest query can see, halved on a device's own block (causal per document) — what a
        varlen kernel that runs every document of a block as one full or causal problem computes.

The per-document zigzag ("document-zigzag", ``seqplan.layouts.document_layout``) is no static
layout: the ids are padded first (``seqplan.layouts.pad_documents``: every document to a multiple
of 2R, the row to a multiple of R x tile; ``padding`` counts the added tokens, computed like real
ones), and every visit is one whole-shard block whose causal mask is by token index. Every shard
holds a piece of every document, so the run-time range tests skip nothing: (a) is R full blocks
per device; (b), (c) and (d) are what a kernel that skips what the indices mask computes.

Per (tokens, mix, R, layout): max / mean over devices of each, and the busiest device's (a) and
(b) relative to the UNPACKED causal zigzag's per-device work (one document, same tokens and R),
so "≤ 1" means packing costs the step nothing over plain causal training.

Communication is not changed by documents: K/V hops are the same; the ids add one all-gather of
int32 [b, t] per call (``ids_gather_bytes``, as the accounting model counts them), kept for the
backward.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..core.documents import lengths_to_ids, long_tailed_lengths

# the last two: seqplan.layouts.document_layout and hybrid_layout (per-row layouts)
LAYOUTS = ("contiguous", "zigzag", "stripe", "document-zigzag", "document-hybrid")
TILE = 128


@dataclass(frozen=True)
class Mix:
    """A fixed-seed long-tailed document-length mix: lognormal(log ``median``, ``sigma``) lengths
    (tokens), plus ``long`` documents of these fractions of the sequence, at random places."""

    name: str
    median: float
    sigma: float
    long: tuple[float, ...] = ()
    seed: int = 0
    cap: float | None = None  # the longest document, as a fraction of the tokens (None: no cap)

    def segment_ids(self, tokens: int) -> np.ndarray:
        """[tokens] int32 ids in original order, the same for every call."""
        rng = np.random.default_rng(self.seed)
        forced = tuple(max(1, int(f * tokens)) for f in self.long)
        cap = None if self.cap is None else max(1, int(self.cap * tokens))
        return lengths_to_ids(long_tailed_lengths(rng, tokens, median=self.median, sigma=self.sigma, forced=forced,
                                                  cap=cap))


MIXES = (
    Mix("short", median=600, sigma=1.0, seed=1),  # many short documents (chat / web text)
    Mix("heavy-tail", median=1500, sigma=1.8, seed=2),  # a wide spread, some documents of 10k+
    Mix("few-long", median=400, sigma=1.2, long=(0.25, 0.125, 0.0625), seed=3),  # short ones around 3 long ones
)
# Not a balance-probe mix (the probe's tables keep MIXES): the benchmark driver's stand-in for
# MagiAttention's published 8×H100 varlen setting (issue 51) — documents capped at a quarter of
# the tokens, drawn long-tailed; their own draws come from a chat dataset's lengths, not shipped here.
QUARTER_CAPPED = Mix("quarter-capped", median=1024, sigma=1.5, seed=51, cap=0.25)
BENCHMARK_MIXES = MIXES + (QUARTER_CAPPED,)
TOKENS = (65536, 131072)
RINGS = (2, 4, 8)


@dataclass(frozen=True)
class Balance:
    """One (tokens, mix, ring, layout): per-device counts and what the table reports."""

    tokens: int
    mix: str
    ring: int
    layout: str
    documents: int
    area: list[float]  # (a) per device, in tokens² (query x key entries computed)
    tiles: list[int]  # (b) per device
    pairs: list[int]  # (c) per device
    blocks: dict[str, int]  # computed blocks of each DocumentWork, all devices (SKIP: not computed)
    area_vs_zigzag: float  # max (a) / the unpacked causal zigzag's per-device (a)
    tiles_vs_zigzag: float  # max (b) / the unpacked causal zigzag's per-device (b)
    runs: list[float] = ()  # (d) per device: the per-document run area (module docstring)
    padding: int = 0  # tokens the layout adds (document-zigzag: seqplan.layouts.pad_documents)
    runs_vs_zigzag: float = 0.0  # max (d) / the unpacked causal zigzag's per-device (d)

    @property
    def run_imbalance(self) -> float:
        return imbalance(self.runs)

    @property
    def area_imbalance(self) -> float:
        return imbalance(self.area)

    @property
    def tile_imbalance(self) -> float:
        return imbalance(self.tiles)

    @property
    def pair_imbalance(self) -> float:
        return imbalance(self.pairs)

    def to_dict(self) -> dict:
        return asdict(self) | {"area_max_over_mean": self.area_imbalance, "tiles_max_over_mean": self.tile_imbalance,
                               "pairs_max_over_mean": self.pair_imbalance, "runs_max_over_mean": self.run_imbalance}


def imbalance(work) -> float:
    """max / mean over devices (the busiest device sets the step time)."""
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean())


def ids_gather_bytes(batch: int, tokens: int, ring: int, ulysses: int = 1) -> float:
    """Bytes per device of the ids' all-gathers per call (contract's all-gather bytes: (n-1)/n of
    the output): over Ulysses to [b, t/R], then over the ring to [b, t], int32."""
    return 4 * batch * (tokens / ring * (ulysses - 1) / ulysses + tokens * (ring - 1) / ring)


def visible_pairs(ids: np.ndarray) -> np.ndarray:
    """[t] per query (original order): causal keys in its document = its rank among the tokens of
    its id, counted from 1 (any id pattern, contiguous or not)."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    starts = np.repeat(first, np.diff(np.r_[first, len(ids)]))
    rank = np.empty(len(ids), dtype=np.int64)
    rank[order] = np.arange(len(ids)) - starts + 1
    return rank


def visible_tiles(ids: np.ndarray, perm: np.ndarray, tile: int) -> np.ndarray:
    """[t/tile, t/tile] bool over layout-order tiles: does tile (a, c) hold a visible causal pair?

    Exact for any ids: tile (a, c) does iff some document has a query in a and a key in c whose
    original position is at most the query's, i.e. the smallest position of the document's keys
    in c is at most the largest of its queries in a. Per (tile, document) entry its largest and
    smallest position, then every pair of entries of one document (sum over documents of
    (tiles it touches)² candidates: 1M for one document of 128k tokens in 128-token tiles)."""
    tokens = len(ids)
    layout_ids, positions = ids[perm], perm
    _, doc = np.unique(layout_ids, return_inverse=True)
    n_docs = int(doc.max()) + 1
    key = (np.arange(tokens) // tile) * n_docs + doc
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    entry_tile, entry_doc = np.divmod(sorted_key[starts], n_docs)
    latest = np.maximum.reduceat(positions[order], starts)
    earliest = np.minimum.reduceat(positions[order], starts)
    by_doc = np.argsort(entry_doc, kind="stable")  # entries grouped by document
    entry_tile, entry_doc, latest, earliest = (a[by_doc] for a in (entry_tile, entry_doc, latest, earliest))
    per_doc = np.bincount(entry_doc, minlength=n_docs)
    doc_start = np.cumsum(per_doc) - per_doc
    partners = per_doc[entry_doc]  # every entry (as the query tile) meets every entry of its document
    q_entry = np.repeat(np.arange(len(entry_doc)), partners)
    offset = np.arange(len(q_entry)) - np.repeat(np.cumsum(partners) - partners, partners)
    k_entry = doc_start[entry_doc[q_entry]] + offset
    hit = earliest[k_entry] <= latest[q_entry]
    grid = np.zeros((tokens // tile, tokens // tile), dtype=bool)
    grid[entry_tile[q_entry[hit]], entry_tile[k_entry[hit]]] = True
    return grid


def device_counts(ids: np.ndarray, layout: str, ring: int, tile: int = TILE) -> dict:
    """(a) area, (b) tiles and (c) pairs per device and the computed blocks by DocumentWork, for
    causal ring attention over one sequence of ``ids`` (original order) — module docstring."""
    from seqplan.layouts import layout_permutation
    from seqplan.schedule import DocumentWork, MaskKind, device_visits, document_work, ring_schedule

    if layout in ("document-zigzag", "document-hybrid"):
        return document_counts(ids, ring, tile, layout)
    tokens = len(ids)
    shard = tokens // ring
    if tokens % (2 * ring) or (shard // 2) % tile:
        raise ValueError(f"tokens={tokens} must split into 2·R={2 * ring} parts of a multiple of tile={tile}")
    perm = layout_permutation(tokens, layout, ring)
    layout_ids = ids[perm]
    grid = visible_tiles(ids, perm, tile)
    pairs = visible_pairs(ids)[perm].reshape(ring, shard).sum(axis=1)
    schedule = ring_schedule(layout, True, ring)
    area, tiles, runs = np.zeros(ring), np.zeros(ring, dtype=np.int64), np.zeros(ring)
    blocks = dict.fromkeys((w.name for w in DocumentWork), 0)
    for device in range(ring):
        for visit in device_visits(schedule, device):
            block = visit.block
            if block is None:  # fully masked by the layout: never computed
                continue
            q_lo, q_hi = block.q_part.bounds(shard)
            k_lo, k_hi = block.kv_part.bounds(shard)
            q = layout_ids[device * shard + q_lo:device * shard + q_hi]
            kv = layout_ids[visit.source * shard + k_lo:visit.source * shard + k_hi]
            work = document_work(*(np.array([f(x)]) for x, f in ((q, np.min), (q, np.max), (kv, np.min), (kv, np.max))))
            if visit.step.local and work is DocumentWork.SKIP:  # the own shard is never skipped (cannot happen)
                work = DocumentWork.DOCUMENTS
            blocks[work.name] += 1
            if work is DocumentWork.SKIP:
                continue
            area[device] += (q_hi - q_lo) * (k_hi - k_lo) * (1.0 if block.mask.kind is MaskKind.FULL else 0.5)
            rows = slice((device * shard + q_lo) // tile, (device * shard + q_hi) // tile)
            cols = slice((visit.source * shard + k_lo) // tile, (visit.source * shard + k_hi) // tile)
            tiles[device] += int(grid[rows, cols].sum())
            q_at = slice(device * shard + q_lo, device * shard + q_hi)
            k_at = slice(visit.source * shard + k_lo, visit.source * shard + k_hi)
            runs[device] += _run_area(layout_ids[q_at], perm[q_at], layout_ids[k_at], perm[k_at], visit.step.local)
    return {"area": area, "tiles": tiles, "pairs": pairs, "runs": runs, "blocks": blocks,
            "visible_tiles": int(grid.sum()), "padding": 0}


def _run_area(q_ids, q_index, kv_ids, kv_index, own: bool) -> float:
    """(d) of one block: per document, its queries x its keys at or before its latest query."""
    docs, inverse = np.unique(np.r_[q_ids, kv_ids], return_inverse=True)
    q_doc, kv_doc = inverse[:len(q_ids)], inverse[len(q_ids):]
    latest = np.full(len(docs), -1, np.int64)
    np.maximum.at(latest, q_doc, q_index)
    n_q = np.bincount(q_doc, minlength=len(docs))
    n_k = np.bincount(kv_doc[kv_index <= latest[kv_doc]], minlength=len(docs))
    return float((n_q * n_k).sum()) * (0.5 if own else 1.0)


def _index_run_area(q_ids, q_index, kv_ids, kv_index) -> float:
    """(d) of one block masked by token index: the area of the runs the varlen kernels are given
    (``seqplan.documents.index_runs``: n_q·n_k a full run, n·(n+1)/2 a causal one)."""
    from seqplan.documents import index_runs

    planned = index_runs(q_ids[None], kv_ids[None], q_index[None], kv_index[None])
    if planned is None:  # not expressible as runs: what the portable kernel's runs would be
        return _run_area(q_ids, q_index, kv_ids, kv_index, False)
    runs, causal = planned
    n_q, n_k = np.diff(runs.cu_q).astype(np.float64), np.diff(runs.cu_k).astype(np.float64)
    return float((np.minimum(n_q, n_k) * (n_q + 1) / 2).sum() if causal else (n_q * n_k).sum())  # causal runs: square


def document_counts(ids: np.ndarray, ring: int, tile: int = TILE, layout: str = "document-zigzag",
                    split_at: int | None = None) -> dict:
    """:func:`device_counts` for a per-row layout (module docstring): ``ids`` unpadded; ``split_at``:
    the hybrid's threshold (None: its default)."""
    from seqplan.layouts import document_layout, hybrid_layout, pad_documents

    padded = pad_documents(ids[None], ring, multiple=ring * tile)[0][0]
    perm = (document_layout(padded[None], ring) if layout == "document-zigzag"
            else hybrid_layout(padded[None], ring, split_at)).perm[0]
    tokens, shard = len(padded), len(padded) // ring
    layout_ids = padded[perm]
    grid = visible_tiles(padded, perm, tile)
    pairs = visible_pairs(padded)[perm].reshape(ring, shard).sum(axis=1)
    tiles = grid.reshape(ring, shard // tile, -1).sum(axis=(1, 2))
    runs = np.zeros(ring)
    for device in range(ring):
        q = slice(device * shard, (device + 1) * shard)
        for source in range(ring):
            k = slice(source * shard, (source + 1) * shard)
            runs[device] += _index_run_area(layout_ids[q], perm[q], layout_ids[k], perm[k])
    return {"area": np.full(ring, float(ring * shard * shard)), "tiles": tiles, "pairs": pairs, "runs": runs,
            "blocks": {"SKIP": 0, "PLAIN": 0, "DOCUMENTS": ring * ring}, "visible_tiles": int(grid.sum()),
            "padding": tokens - len(ids)}


def balance_table(mixes=MIXES, tokens=TOKENS, rings=RINGS, layouts=LAYOUTS, tile: int = TILE) -> list[Balance]:
    """Every (tokens, mix, ring, layout), with the unpacked causal zigzag as the yardstick."""
    rows = []
    for n in tokens:
        for ring in rings:
            unpacked = device_counts(np.zeros(n, dtype=np.int32), "zigzag", ring, tile)
            zz_area, zz_tiles, zz_runs = unpacked["area"].max(), unpacked["tiles"].max(), unpacked["runs"].max()
            for mix in mixes:
                ids = mix.segment_ids(n)
                for layout in layouts:
                    c = device_counts(ids, layout, ring, tile)
                    rows.append(Balance(n, mix.name, ring, layout, int(len(np.unique(ids))), c["area"].tolist(),
                                        c["tiles"].tolist(), c["pairs"].tolist(), c["blocks"],
                                        float(c["area"].max() / zz_area), float(c["tiles"].max() / zz_tiles),
                                        c["runs"].tolist(), c["padding"], float(c["runs"].max() / zz_runs)))
    return rows


def print_balance(rows: list[Balance], seconds: float, tile: int = TILE) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"computed work per device, causal ring over packed documents (from the schedule; max/mean "
                        f"over devices; 'vs zz' = busiest device / unpacked causal zigzag's; tiles {tile}x{tile})")
    for column in ("tokens", "mix", "docs", "R", "layout", "(a) area max/mean", "(a) vs zz", "(b) tiles max/mean",
                   "(b) vs zz", "(c) pairs max/mean", "(d) runs max/mean", "(d) vs zz", "pad", "blocks skip/plain/docs"):
        table.add_column(column, justify="left" if column in ("mix", "layout") else "right")
    for r in rows:
        blocks = "/".join(str(r.blocks[k]) for k in ("SKIP", "PLAIN", "DOCUMENTS"))
        table.add_row(f"{r.tokens // 1024}k", r.mix, str(r.documents), str(r.ring), r.layout,
                      f"{r.area_imbalance:.2f}", f"{r.area_vs_zigzag:.2f}", f"{r.tile_imbalance:.2f}",
                      f"{r.tiles_vs_zigzag:.2f}", f"{r.pair_imbalance:.2f}", f"{r.run_imbalance:.2f}",
                      f"{r.runs_vs_zigzag:.2f}", str(r.padding), blocks)
    console = Console(width=200)
    console.print(table)
    console.print(f"{len(rows)} configurations in {seconds:.1f} s. Bytes: K/V hops are unchanged by documents; the ids "
                  "add one all-gather of int32 [b, t] per call.", highlight=False, markup=False)


def run_balance(tokens=TOKENS, rings=RINGS, tile: int = TILE, json_path: str | None = None) -> int:
    """The CLI command: the table, and the rows as JSON when asked."""
    start = time.time()
    rows = balance_table(tokens=tokens, rings=rings, tile=tile)
    print_balance(rows, time.time() - start, tile)
    if json_path:
        payload = {"tile": tile, "mixes": [asdict(m) for m in MIXES], "rows": [r.to_dict() for r in rows]}
        Path(json_path).write_text(json.dumps(payload, indent=1))
        print(f"rows written to {json_path}")
    return 0


__all__ = ["MIXES", "BENCHMARK_MIXES", "QUARTER_CAPPED", "TOKENS", "RINGS", "LAYOUTS", "TILE", "Mix", "Balance",
           "imbalance", "ids_gather_bytes", "visible_pairs", "visible_tiles", "device_counts", "balance_table",
           "print_balance", "run_balance"]
