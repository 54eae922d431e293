"""The one-GPU replay driver's packed-document inputs: the balance mixes by name, the fit of a mix
to the per-document zigzag at a fixed length, and (``--full``) a CPU smoke run of
``--layout document-zigzag`` whose rows carry ``time_balance``."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import Problem
from benchmarks.documents import fit_documents, mix_ids, mix_names
from helpers import FULL
from seqplan.layouts import document_layout, document_runs


def test_mixes_are_accepted_by_name():
    assert set(mix_names()) == {"short", "heavy-tail", "few-long", "quarter-capped"}
    ids = Problem(seq=4096, documents="few-long").segment_ids()
    np.testing.assert_array_equal(ids, mix_ids("few-long", 1, 4096))


@pytest.mark.parametrize("name", ["short", "heavy-tail", "few-long", "quarter-capped"])
def test_fitted_mix_keeps_its_length_and_fits_the_layout(name):
    ring, seq = 8, 16384
    raw = mix_ids(name, 1, seq)
    fitted = fit_documents(raw, ring, 2 * ring)
    assert fitted.shape == raw.shape
    _, lengths = document_runs(fitted[0])
    assert np.all(lengths % (2 * ring) == 0)
    assert np.all(np.diff(fitted[0]) >= 0)  # runs of increasing ids (Problem.visible_keys counts them)
    document_layout(fitted, ring)  # accepted
    assert Problem(seq=seq, documents=name, fit_ring=ring, fit_multiple=2 * ring).segment_ids().shape == (1, seq)


@pytest.mark.skipif(not FULL, reason="a CPU smoke run of the driver (seconds): --full")
@pytest.mark.slow
def test_smoke_run_reports_time_balance():
    from benchmarks import bench_replay

    rows = bench_replay.main(["--smoke", "--documents", "short", "--layout", "document-zigzag", "--strategies",
                              "zigzag-r2", "--frameworks", "torch", "--replay-devices", "all", "--no-kernels"])
    assert rows and all(r.verified for r in rows)
    balances = {r.extra["time_balance"] for r in rows}
    assert len(balances) == 1 and next(iter(balances)) >= 1.0
    assert rows[0].extra["time_balance_devices"] == [0, 1]
