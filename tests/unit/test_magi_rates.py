"""The issue-51 comparison's arithmetic (benchmarks/magi.py) and its document mix — why here: the
8-GPU run it serves cannot be re-done cheaply, so the backward's rate (2.5 F over the difference
of two measured times) and the pairing of rows are checked on made-up rows before a GPU sees them."""

import numpy as np
import pytest

from benchmarks.magi import BACKWARD_FACTOR, PUBLISHED, pass_rates, table


def _row(fwd_only, ms, tflops, layout="zigzag", verified=True, framework="jax_impl"):
    return {"framework": framework, "strategy": "ring", "layout": layout, "seq_len": 65536, "fwd_only": fwd_only,
            "ms_per_iter": ms, "tflops_per_gpu": tflops, "verified": verified,
            "extra": {"mesh": "ring-r8", "block_backend": "auto", "documents": "quarter-capped"}}


def test_the_backward_rate_is_its_flops_over_the_extra_time():
    # forward: 10 ms at 100 TFLOP/s per GPU = 1000 TFLOP·ms; forward + backward 45 ms
    (rates,) = pass_rates([_row(True, 10.0, 100.0), _row(False, 45.0, 3.5 * 1000 / 45.0)])
    assert rates.forward == 100.0
    assert rates.backward == pytest.approx(BACKWARD_FACTOR * 1000 / 35.0)
    assert rates.both == pytest.approx(3.5 * 1000 / 45.0) and rates.verified is True


def test_rows_pair_only_with_their_own_configuration_and_unverified_shows():
    rows = [_row(True, 10.0, 100.0), _row(False, 40.0, 87.5, layout="document-hybrid", verified=False),
            _row(True, 8.0, 120.0, layout="document-hybrid", verified=False)]
    by_layout = {r.name.split()[2]: r for r in pass_rates(rows)}
    assert by_layout["zigzag"].backward is None and by_layout["zigzag"].both is None
    assert by_layout["document-hybrid"].verified is False
    assert "| NO |" in table(pass_rates(rows))


def test_published_figures_convert_to_the_drivers_fwd_bwd_convention():
    # MagiAttention 459 forward / 360 backward: 3.5 F over F/459 + 2.5 F/360 = 384 (the figure)
    assert "| MagiAttention (published, 8× H100) | 459 | 360 | 384 | — |" in table([])
    assert set(PUBLISHED) >= {"MagiAttention", "Ulysses (FA3)", "USP"}


def test_the_quarter_capped_mix_never_exceeds_a_quarter_of_the_tokens():
    from benchmarks.documents import mix_ids
    from seqplan.layouts import document_runs

    for tokens in (4096, 65536):
        ids = mix_ids("quarter-capped", 2, tokens)
        _, lengths = document_runs(ids[0])
        assert ids.shape == (2, tokens) and (ids[0] == ids[1]).all()
        assert lengths.max() <= tokens // 4 and lengths.sum() == tokens and len(lengths) > 4
        assert not np.array_equal(ids[0], mix_ids("short", 1, tokens)[0])
