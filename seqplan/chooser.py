"""Which layout and K/V exchange to use for a batch of packed documents — the choice the 4-GPU
measurements made (docs/decisions.md, "The layout chooser"), as one call:

    choice = choose_layout(segment_ids, ring=4, ulysses=1)       # [b, seq] ids, original order
    config = choice.layer_config(config)                          # the layer's layout and kv_exchange
    x_laid = choice.lay_out(x)                                    # any [b, seq, ...] array, padded
    layer(x_laid, choice.lay_out(positions), choice.segment_ids, token_index=choice.token_index)
    loss weight: choice.real (False on padding tokens: give them no weight)

The rule, from 2026-11-26 on 4× H200 (128k tokens, the three balance mixes, both frameworks):
causal attention over packed documents split over a ring (R > 1) runs fastest on all-gather KV
with the per-document hybrid layout — the best ring-family row in five of six (mix, framework)
cases, the sixth a tie with USP on the same layout, and faster than the static zigzag ring on
every mix in both frameworks (1.8–2.0× on the heavy-tail and few-long mixes). Everything else —
one document per row, no ids, non-causal attention (every block full: no work to balance), or no
ring (Ulysses alone) — keeps the static zigzag (contiguous without a ring) on the ring exchange.
A sliding window (``window=``) takes contiguous shards on the ring exchange, documents or not: the
ring's hops then carry only the rows the window reads (the halo), and on 4× H200 (128k, (4096, 0),
2026-11-28) the ring of 4 ran at 0.92–0.93 of the framework's one-GPU window kernel where USP 2×2,
whose all-to-all moves every token whatever the window, ran at 0.71–0.77; the hybrid and all-gather
KV take no window beyond causal (a call refuses them).
All-gather KV holds every K/V shard of the ring on each device for the backward: R·t·Hk·d·2 values
where the ring holds two shards; the choice says so in ``reason``.

The hybrid's all-gather moves only each shard's shared prefix (``shared_tokens``, on by default;
``shared_prefix=False`` gathers everything), in both frameworks: on 4× H200 at 128k (2026-11-27,
ring of 4) it runs 1.26 / 1.08 / 1.10× the whole gather in JAX and 1.19 / 1.02 / 1.00× in torch on
the short / heavy-tail / few-long mixes (torch's split step had been 0.4-6.7 % slower until its
backward reduce-scattered under the local part and two host syncs a call went; docs/decisions.md,
"All-gather KV's shared prefix"). At 512k tokens (heavy-tail, 4× H200) the choice runs at 0.90
(torch, whole gather) and 0.89 (JAX) of the one-GPU varlen kernel on the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .layouts import DOCUMENT_HYBRID, hybrid_layout, pad_documents
from .shared import shared_tokens_for
from .validation import check_window

ALLGATHER, RING_EXCHANGE = "allgather", "ring"


@dataclass(frozen=True)
class LayoutChoice:
    """A batch's layout, exchange and padding.

    layout:       the static name the call passes (``layout=``): "contiguous" under a per-row layout
                  (it then only fixes divisibility; ``token_index`` carries the positions).
    row_layout:   the per-row layout (``DOCUMENT_HYBRID``) or None (a static layout).
    kv_exchange:  "allgather" or "ring".
    source:       [b, seq'] the original token index of every token in layout order, -1 for padding
                  (apply :meth:`lay_out` to every per-token array).
    segment_ids:  [b, seq'] int32 ids in layout order (the padding keeps its document's id, or
                  the row's filler id).
    token_index:  [b, seq'] int32, the positions the masks compare (None for a static layout).
    padding:      seq' - seq, the tokens added (computed like real ones).
    reason:       why this choice, in words (with the memory it costs).
    shared_tokens: all-gather KV's shared prefix (``seqplan.shared``): the leading tokens of each
                  ring shard whose documents span shards, on the bucket ladder — only their K/V
                  travel; None on the ring exchange."""

    layout: str
    row_layout: str | None
    kv_exchange: str
    source: np.ndarray
    segment_ids: np.ndarray
    token_index: np.ndarray | None
    padding: int
    reason: str
    shared_tokens: int | None = None

    @property
    def real(self) -> np.ndarray:
        """[b, seq'] bool: True on real tokens, False on padding (no loss weight: then padding
        changes no real output or gradient — ``seqplan.layouts.pad_documents``)."""
        return self.source >= 0

    def lay_out(self, x, fill=0) -> np.ndarray:
        """``x`` [b, seq, ...] in original order -> [b, seq', ...] in layout order, padding ``fill``."""
        x = np.asarray(x)
        if x.shape[:2] != (self.source.shape[0], self.source.shape[1] - self.padding):
            raise ValueError(f"x must be [b, seq, ...] = {(self.source.shape[0], self.source.shape[1] - self.padding)} "
                             f"in its first two dimensions, got {x.shape}")
        index = np.maximum(self.source, 0).reshape(self.source.shape + (1,) * (x.ndim - 2))
        taken = np.take_along_axis(x, index, 1)
        return np.where(self.real.reshape(index.shape), taken, np.asarray(fill, x.dtype))

    def read_back(self, y) -> np.ndarray:
        """``y`` [b, seq', ...] in layout order -> [b, seq, ...] in original order (padding dropped)."""
        y = np.asarray(y)
        b, width = self.source.shape
        out = np.empty((b, width - self.padding, *y.shape[2:]), y.dtype)
        for row in range(b):
            keep = self.source[row] >= 0
            out[row, self.source[row, keep]] = y[row, keep]
        return out

    def layer_config(self, config):
        """``config`` (a ``seqplan.config.AttentionLayerConfig``) with this choice's layout, exchange and
        shared prefix (per batch: a JAX program compiles once per ``shared_tokens`` bucket)."""
        return replace(config, layout=self.layout, kv_exchange=self.kv_exchange, shared_tokens=self.shared_tokens)


def _check(segment_ids, ring: int, ulysses: int) -> np.ndarray:
    for name, value in (("ring", ring), ("ulysses", ulysses)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ids = np.asarray(segment_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"segment_ids must be an integer [b, seq] array in original order, got {ids.dtype} {ids.shape}")
    return ids


def choose_layout(segment_ids, *, ring: int, ulysses: int = 1, causal: bool = True,
                  shared_prefix: bool = True, window=None) -> LayoutChoice:
    """The layout and K/V exchange for ``segment_ids`` [b, seq] (original order) on a mesh of
    ``ring`` × ``ulysses`` devices (module docstring), with the padding the layout needs: the
    per-document hybrid pads every document (split or kept whole) to a multiple of 2R and the row to a
    multiple of 2R·U (``seqplan.layouts.pad_documents``); a static layout pads nothing (seq must
    then be a multiple of the layout's own unit, as for any call). ``shared_prefix``: the hybrid's
    all-gather moves only each shard's shared prefix (``shared_tokens``; module docstring) —
    False gathers every shard (``shared_tokens`` None). ``window``: a sliding window (the calls'
    ``window``: an int or (left, right)) — the contiguous layout on the ring exchange, documents
    or not (module docstring)."""
    ids = _check(segment_ids, ring, ulysses)
    window = check_window(window)
    b, seq = ids.shape
    documents = any(len(np.unique(row)) > 1 for row in ids)
    if ring > 1 and causal and documents and window is None:
        padded, source = pad_documents(ids, ring, 2 * ring * ulysses)
        layout = hybrid_layout(padded, ring)
        token_index = layout.token_index.astype(np.int32)
        laid = np.take_along_axis(padded, layout.perm, 1).astype(np.int32)
        shared = shared_tokens_for(laid, ring) if shared_prefix else None
        gathered = (f"each shard's first {shared} of {laid.shape[1] // ring} tokens (the documents it shares; "
                    "seqplan.shared)" if shared_prefix else "every shard")
        return LayoutChoice(
            "contiguous", DOCUMENT_HYBRID, ALLGATHER, np.take_along_axis(source, layout.perm, 1), laid, token_index,
            padded.shape[1] - seq,
            f"causal packed documents over a ring of {ring}: per-document hybrid + all-gather KV (fastest ring-family "
            f"choice measured, 2026-11-26) of {gathered}, which each device holds for the backward", shared)
    static = "zigzag" if ring > 1 and window is None else "contiguous"
    why = ("no ring: the sequence is split by heads only" if ring == 1 else
           f"sliding window {window}: contiguous shards on the ring exchange, where a hop carries only the rows "
           "the window reads (4x H200, 128k, 2026-11-28: ring R 4 at 0.92-0.93 of the window kernel, USP 2x2 at "
           "0.71-0.77 — its all-to-all moves every token; prefer a ring-only mesh); the per-document hybrid and "
           "all-gather KV take no window beyond causal" if window is not None else
           "non-causal: every block is full, nothing to balance" if not causal else
           "one document per row: the static zigzag balances causal work")
    if static != "contiguous":
        from .layouts import layout_permutation

        perm = np.broadcast_to(np.asarray(layout_permutation(seq, static, ring, ulysses)), (b, seq))
    else:
        perm = np.broadcast_to(np.arange(seq), (b, seq))
    return LayoutChoice(static, None, RING_EXCHANGE, np.ascontiguousarray(perm),
                        np.take_along_axis(ids, perm, 1).astype(np.int32), None, 0, why)
