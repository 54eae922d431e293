"""The multi-GPU driver's packed-document plumbing, without GPUs: why these exist — a row timed on
ids that are not the ones its verification, its anchor or its layout assume would be a wrong
number, not an error. Per-row layouts lay ids out exactly as the replay does, unknown layouts are
refused before any work, a row is marked only by its own path's verdict, and a document row's
efficiency is taken against its framework's anchor on the same ids."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks.common import MeshSpec, Problem, check_layouts, lay_out, mesh_rows, row_problem
from benchmarks.run import add_efficiency
from benchmarks.verify import mark_rows, path_key, planned_paths, reduced_case

SEQ = 4096


def test_layouts_are_refused_before_any_work():
    with pytest.raises(SystemExit, match="--layout takes"):
        check_layouts("zigzag,document-zagzig", "short")
    with pytest.raises(SystemExit, match="needs --documents"):
        check_layouts("document-hybrid", "none")
    assert check_layouts("zigzag,document-hybrid", "short") == ["zigzag", "document-hybrid"]


@pytest.mark.parametrize("layout", ["document-zigzag", "document-hybrid"])
def test_a_row_layout_lays_out_the_fitted_ids_with_their_token_indices(layout):
    from seqplan.layouts import row_layout

    spec, problem = MeshSpec("usp-r2xu2"), Problem(seq=SEQ, heads=8, kv_heads=2, documents="heavy-tail")
    fitted = row_problem(problem, spec, layout)
    assert (fitted.fit_ring, fitted.fit_multiple) == (2, 8)
    laid = lay_out(problem, spec, layout)
    ids = fitted.segment_ids()
    perm = row_layout(layout, ids, spec.ring).perm
    assert laid.api_layout == "contiguous"
    np.testing.assert_array_equal(laid.token_index, perm)  # each token's original index, in layout order
    np.testing.assert_array_equal(laid.segment_ids, np.take_along_axis(ids, perm, 1))
    assert sorted(laid.token_index[0].tolist()) == list(range(SEQ))


def test_a_static_layout_keeps_the_raw_ids_and_passes_no_token_index():
    from seqplan.layouts import layout_permutation

    spec, problem = MeshSpec("ring-r4"), Problem(seq=SEQ, documents="short")
    laid = lay_out(problem, spec, "zigzag")
    assert row_problem(problem, spec, "zigzag") is problem and laid.token_index is None
    np.testing.assert_array_equal(laid.segment_ids, problem.segment_ids()[:, layout_permutation(SEQ, "zigzag", 4, 1)])


def test_static_rows_come_before_per_row_layouts_and_ulysses_runs_once():
    rows = mesh_rows([MeshSpec("ring-r4"), MeshSpec("ulysses-u4")], "auto", "document-hybrid,zigzag")
    assert [(s.name, layout) for s, _, layout in rows] == [
        ("ring-r4", "zigzag"), ("ulysses-u4", "contiguous"), ("ring-r4", "document-hybrid")]


def test_the_verified_case_of_a_row_layout_is_its_token_index_case():
    case = reduced_case(MeshSpec("ring-agkv-r4").shape, "document-hybrid", Problem(seq=SEQ, documents="few-long"))
    assert (case.token_index, case.row_layout, case.layout, case.documents) == (True, "document-hybrid", "contiguous",
                                                                                 "mix")


def _args(**kw):
    base = dict(documents="short,few-long", layout="zigzag,document-hybrid", meshes="ring-r4,ulysses-u4,ring-r2",
                seqs="131072", heads=32, kv_heads=8, window=None, only=None, gpus=4, jax_backends="auto",
                torch_backends="auto")
    return argparse.Namespace(**(base | kw))


def test_planned_paths_are_one_per_verdict_and_torch_only_on_its_world():
    paths = planned_paths(_args())
    keys = [path_key(*p) for p in paths]
    assert len(keys) == len(set(keys))  # the mixes share the reduced "mix" case: verified once
    torch_meshes = {p[1] for p in paths if p[0] == "torch"}
    assert torch_meshes == {"ring-r4", "ulysses-u4"}  # ring-r2 needs 2 ranks: torch runs it on no 4-GPU world
    assert {p[1] for p in paths if p[0] == "jax"} == {"ring-r4", "ulysses-u4", "ring-r2"}


def _row(framework="torch_impl", layout="document-hybrid", tflops=100.0, documents="short", fit=4):
    return {"framework": framework, "strategy": "ring", "layout": layout, "seq_len": 131072, "devices": 4,
            "ulysses": 1, "ring": 4, "fwd_only": False, "ms_per_iter": 10.0, "tflops_per_gpu": tflops,
            "verified": None, "note": "", "extra": {"mesh": "ring-r4", "block_backend": "auto", "heads": 32,
                                                     "kv_heads": 8, "documents": documents, "window": None,
                                                     "fit_ring": fit, "fit_multiple": 8}}


def test_rows_are_marked_by_their_own_path_only():
    row = _row()
    key = path_key("torch", "ring-r4", "document-hybrid", "auto", Problem(seq=131072, kv_heads=8, documents="short"))
    passed = mark_rows([row], {key: {"passed": True, "detail": "ok", "resolved": {"by-token-index": "aten_varlen"}}})
    assert passed[0]["verified"] is True and passed[0]["extra"]["resolved"] == {"by-token-index": "aten_varlen"}
    other = mark_rows([_row(layout="zigzag")], {key: {"passed": True, "detail": "ok"}})
    assert other[0]["verified"] is False and other[0]["tflops_per_gpu"] is None  # no verdict: no throughput


def test_document_efficiency_is_against_the_anchor_on_the_same_ids():
    rows = [_row(tflops=100.0), _row(layout="zigzag", tflops=50.0, fit=0),
            _row("torch_varlen_anchor", "-", 400.0, fit=4), _row("torch_varlen_anchor", "-", 250.0, fit=0),
            _row("jax_varlen_anchor", "-", 1000.0, fit=4)]
    out = add_efficiency(rows)
    assert out[0]["efficiency"] == pytest.approx(0.25)  # fitted ids: the fitted anchor, torch's own
    assert out[1]["efficiency"] == pytest.approx(0.20)  # raw ids: the raw anchor


def test_every_sequence_length_is_planned_when_a_window_changes_the_path():
    """A window's reduced reach depends on the length, so each --seqs length has its own verdict:
    a row at the second length must find one (it lost its throughput when only the first was planned)."""
    args = _args(seqs="32768,131072", documents="none", layout="zigzag", meshes="ring-r4", window=4096)
    keys = {path_key(*p) for p in planned_paths(args)}
    for seq in (32768, 131072):
        problem = Problem(seq=seq, kv_heads=8, window=(4096, 0))
        assert path_key("jax", "ring-r4", "zigzag", "auto", problem) in keys, seq


def test_weak_scaling_rings_are_planned_for_verification_as_both_sides_time_them():
    """``--weak``: each side times a ring over 1, 2 and 4 of the GPUs (``common.weak_paths``; torch
    in a torchrun world per ring size, ``weak_worlds``); each must have a verdict, or its rows lose
    their throughput (JAX's had none before 11-27), on the backend that side times."""
    from benchmarks.common import weak_paths, weak_worlds

    args = _args(documents="none", layout="zigzag", meshes="ring-r4", seqs="131072", weak="32768",
                 torch_backends="aten_cudnn")
    keys = {path_key(*p) for p in planned_paths(args)}
    for framework, backend in (("jax", "auto"), ("torch", "aten_cudnn")):
        timed = weak_paths(args, args.gpus, framework)
        assert [(spec.name, layout, b, problem.seq) for spec, layout, b, problem in timed] == [
            ("ring-r1", "contiguous", backend, 32768), ("ring-r2", "zigzag", backend, 65536),
            ("ring-r4", "zigzag", backend, 131072)]
        for spec, layout, b, problem in timed:
            assert path_key(framework, spec.name, layout, b, problem) in keys, (framework, spec.name)
    assert weak_worlds(args, 4) == [1, 2, 4] and weak_worlds(args, 2) == [1, 2]
    assert not weak_paths(_args(), 4) and not weak_worlds(_args(), 4)  # no --weak: no rings of its own


@pytest.mark.parametrize("groups,want", [("1", (8, 2)), ("2", (16, 4)), ("4", (32, 8))])
def test_reduced_case_keeps_the_head_groups_path(groups, want, monkeypatch):
    """A row timed under RINGBRIDGE_HEAD_GROUPS is checked on the same path: the reduced case's
    groups hold K/V heads in the same relation to U as the row's (32 / 8 heads, U = 2: G = 2 splits
    4 K/V heads a group, G = 4 splits 2), where 8 / 2 heads would replicate (G = 2) or be refused (G = 4)."""
    from seqplan.validation import check_head_groups

    monkeypatch.setenv("RINGBRIDGE_HEAD_GROUPS", groups)
    case = reduced_case(MeshSpec("usp-r2xu2").shape, "contiguous", Problem(seq=SEQ, heads=32, kv_heads=8,
                                                                           window=(4096, 0)))
    assert (case.heads, case.kv_heads) == want
    g = int(groups)
    assert check_head_groups(g, case.heads, case.kv_heads, 2) == g
    assert (case.kv_heads // g >= 2) == (8 // g >= 2)  # split vs replicated, as the row
