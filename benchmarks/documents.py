"""Packed-document problems for the one-GPU replay driver: the balance probe's mixes
(``parity.probes.balance.MIXES``) beside ``parity.core.documents``' patterns, and the per-document
zigzag (``--layout document-zigzag``: ``seqplan.layouts.document_layout`` with explicit
``token_index``), with its own verification — the parity case matrix has no per-row layouts.

Fitting a mix to the per-document zigzag at a fixed length: the mix is drawn at ``seq`` tokens,
every document padded to a multiple of 2R (``seqplan.layouts.pad_documents``), the documents
that no longer fit dropped from the end, and the rest of the row one filler document — so the
problem keeps its length, its padding tokens count as work (they are computed), and the ids stay
runs of increasing ids (what ``Problem.visible_keys`` counts).
"""

from __future__ import annotations

import numpy as np

from seqplan.layouts import DOCUMENT_HYBRID, DOCUMENT_LAYOUTS, DOCUMENT_ZIGZAG  # noqa: F401  (re-exported)


def mix_names() -> tuple[str, ...]:
    from parity.probes.balance import BENCHMARK_MIXES

    return tuple(m.name for m in BENCHMARK_MIXES)


def mix_ids(name: str, batch: int, seq: int) -> np.ndarray:
    """[batch, seq] int32: the balance probe's mix ``name`` (or the driver's extra ones,
    ``BENCHMARK_MIXES``) at ``seq`` tokens in every row."""
    from parity.probes.balance import BENCHMARK_MIXES

    mix = {m.name: m for m in BENCHMARK_MIXES}[name]
    return np.broadcast_to(mix.segment_ids(seq).astype(np.int32), (batch, seq)).copy()


def fit_documents(ids: np.ndarray, ring: int, multiple: int = 1) -> np.ndarray:
    """``ids`` [b, seq] (original order) made acceptable to ``document_layout`` at the same
    length: padded per document, cut at the last document boundary that fits, one filler document
    to the end (module docstring). ``seq`` must be a multiple of ``lcm(2R, multiple)``."""
    from seqplan.layouts import document_runs, pad_documents

    b, seq = ids.shape
    unit = int(np.lcm(2 * ring, multiple))
    if seq % unit:
        raise ValueError(f"seq={seq} must be a multiple of lcm(2R, {multiple}) = {unit} for the per-document zigzag")
    padded, _ = pad_documents(ids, ring)
    out = np.empty((b, seq), np.int32)
    for row in range(b):
        starts, lengths = document_runs(padded[row])
        ends = starts + lengths
        keep = int(ends[ends <= seq].max()) if (ends <= seq).any() else 0
        keep -= keep % unit  # the filler must be a multiple of 2R as well
        out[row, :keep] = padded[row, :keep]
        out[row, keep:] = int(padded[row, :keep].max()) + 1 if keep else 0
    return out


def layout_keywords(ids: np.ndarray, ring: int, layout: str = DOCUMENT_ZIGZAG) -> dict:
    """The replay's NumPy keywords of a per-row layout (``seqplan.layouts.row_layout``: the
    per-document zigzag or hybrid) for fitted ``ids``: ``segment_ids`` and ``token_index`` in layout
    order, ``perm`` [b, seq] to lay data out (not a keyword)."""
    from seqplan.layouts import row_layout

    layout = row_layout(layout, ids, ring)
    return {"segment_ids": np.take_along_axis(ids, layout.perm, 1).astype(np.int32),
            "token_index": layout.token_index, "perm": layout.perm}


def verify_document_path(framework: str, problem, ring: int, ulysses: int, outer: int, kv_exchange: str,
                         backend: str, devices: str = "gpu", seq: int = 2048, seed: int = 0,
                         layout: str = DOCUMENT_ZIGZAG) -> tuple[bool, str]:
    """(passed, detail): the replay of a per-row ``layout`` with explicit token indices, in the
    problem's dtype and backend at ``seq`` tokens (8 heads, kv heads in the problem's ratio, the
    problem's documents fitted), against the float64 oracle under the numerics policy (the
    low-precision control: the framework's dense attention in the same dtype)."""
    from dataclasses import replace

    from parity.core.cases import Case
    from parity.core.compare import compare
    from parity.core.inputs import flash_ideal, make_inputs, oracle
    from parity.runners.base import Unavailable, load_runner

    heads = 8
    case = Case(ring=ring, ulysses=ulysses, ring_outer=outer, kv_exchange=kv_exchange, seq=seq, heads=heads,
                kv_heads=max(1, heads * problem.kv_heads // problem.heads), head_dim=problem.head_dim,
                layout="contiguous", causal=problem.causal, dtype=problem.dtype)
    raw = mix_ids(problem.documents, 1, seq) if problem.documents in mix_names() else problem.__class__(
        seq=seq, documents=problem.documents).segment_ids()
    x = replace(make_inputs(case, seed), segment_ids=fit_documents(raw, ring, 2 * ring * ulysses))
    ref = oracle(case, x)
    low = case.dtype != "float32"
    ideal = flash_ideal(case, x) if low else None
    got = run_document_replay(framework, case, x, backend, devices, layout)
    control = None
    if low:
        base = load_runner(framework)
        if isinstance(base, Unavailable):
            return False, base.reason
        control = type(base)(block_backend=backend).replay(devices).run_control(case, x)
    checks = compare(case, got, ref, control, ideal)
    failed = [str(c) for c in checks if not c.ok]
    return (not failed, "; ".join(failed) if failed else f"{len(checks)} tensors within the policy "
            f"({layout}, {seq} tokens, {case.dtype})")


def run_document_replay(framework: str, case, x, backend: str, devices: str = "gpu",
                        layout: str = DOCUMENT_ZIGZAG) -> dict:
    """o, lse, dq, dk, dv in original order of the replay of ``case``'s strategy over the per-row
    ``layout`` of ``x.segment_ids`` (fitted), with explicit token indices."""
    kw_np = layout_keywords(x.segment_ids, case.ring, layout)
    perm = kw_np.pop("perm")
    inverse = np.argsort(perm, axis=1)

    def lay(a, axis=1):
        index = perm[:, None, :] if axis == 2 else perm[:, :, None, None]
        return np.take_along_axis(a, index, axis)

    def back(a, axis=1):
        index = inverse[:, None, :] if axis == 2 else inverse[:, :, None, None]
        return np.take_along_axis(a, index, axis)

    arrays = [lay(a) for a in (x.q, x.k, x.v, x.do)] + [lay(x.dlse, 2)]
    if framework == "jax":
        import jax.numpy as jnp

        from jax_impl import replay
        cast = [jnp.asarray(np.asarray(a, np.float32).astype(jnp.dtype(case.dtype))) for a in arrays[:4]]
        dlse = jnp.asarray(arrays[4], jnp.float32)
        to = jnp.asarray
    else:
        import torch

        from torch_impl import replay
        device = f"cuda:{torch.cuda.current_device()}" if devices == "gpu" and torch.cuda.is_available() else "cpu"
        cast = [torch.tensor(np.asarray(a, np.float32), device=device).to(getattr(torch, case.dtype))
                for a in arrays[:4]]
        dlse = torch.tensor(np.asarray(arrays[4], np.float32), device=device)
        to = lambda a: torch.tensor(np.ascontiguousarray(a), device=device)
    strategy = replay.Strategy(ring=case.ring, ulysses=case.ulysses, outer=case.ring_outer,
                               kv_exchange=case.kv_exchange)
    kw = dict(strategy=strategy, causal=case.causal, layout="contiguous", block_backend=backend,
              segment_ids=to(kw_np["segment_ids"]), token_index=to(kw_np["token_index"]))
    q, k, v, do = cast
    ids, index = kw.pop("segment_ids"), kw.pop("token_index")

    def both(q, k, v, do, dlse, ids, index):
        o, lse = replay.replay_attention(q, k, v, segment_ids=ids, token_index=index, **kw)
        return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, dlse, segment_ids=ids, token_index=index,
                                                       **kw))

    if framework == "jax":  # one compiled program, ids and indices its arguments
        import jax  # (eagerly, every lax.switch of fused forms compiles alone)

        both = jax.jit(both)
    o, lse, dq, dk, dv = both(q, k, v, do, dlse, ids, index)
    out = {n: np.asarray(t.float().cpu() if framework == "torch" else t).astype(np.float64)
           for n, t in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))}
    return {n: back(t, 2) if n == "lse" else back(t) for n, t in out.items()}
