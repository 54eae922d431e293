"""Causal and window masks by explicit token indices in the portable block kernels of both
frameworks (per-row ``positions`` [b, t], [b, s] under ``token_index_window``), against the
float64 oracle, on a per-document zigzag shard pair; a wrong token index is caught."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import document_layout, pad_documents
from seqplan.schedule import UNBOUNDED, BlockMask, token_index_window


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _problem(seed, ring=2, window=None):
    """A padded, laid-out mix with a length-1 document, on a ring of ``ring``."""
    rng = np.random.default_rng(seed)
    ids = np.array([[0] * 9 + [1] + [2] * 14, [7] * 3 + [8] * 21])
    padded, _ = pad_documents(ids, ring)
    layout = document_layout(padded, ring)
    laid_ids = np.take_along_axis(padded, layout.perm, 1)
    b, seq = padded.shape
    q, k, v, do = (rng.standard_normal((b, seq, 4, 8)).astype(np.float32) for _ in range(4))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA
    return layout.token_index, laid_ids, q, k, v, do, seq // ring


def _oracle(index, ids, q, k, v, do, qs, ks, window):
    fwd = attention_forward(q[:, qs], k[:, ks], v[:, ks], causal=True, q_pos=index[:, qs], k_pos=index[:, ks],
                            segment_ids=ids[:, qs], kv_segment_ids=ids[:, ks], window=window)
    return fwd, attention_backward(fwd, q[:, qs], k[:, ks], v[:, ks], do[:, qs])


def test_token_index_window():
    assert token_index_window(None, True) == (UNBOUNDED, 0)
    assert token_index_window((5, 3), True) == (5, 0)
    assert token_index_window((5, 3), False) == (5, 3)
    assert token_index_window(None, False) is None


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("window", [None, (6, 0)])
@pytest.mark.parametrize("chunk", [5])  # the key-chunk scan; one chunk: the replay tests' small blocks
def test_portable_kernels_take_per_row_token_indices(framework, window, chunk):
    index, ids, q, k, v, do, shard = _problem(0)
    mask = BlockMask("full", documents=True, window=token_index_window(window, True))
    # each device's queries against every key (a [t, R·t] block: every row sees a key, as the oracle
    # needs), then device 1's own block (square)
    for qs, ks in ((slice(0, shard), slice(None)), (slice(shard, 2 * shard), slice(None)),
                   (slice(shard, 2 * shard), slice(shard, 2 * shard))):
        fwd, (dq_r, dk_r, dv_r) = _oracle(index, ids, q, k, v, do, qs, ks, window)
        arrays = [q[:, qs], k[:, ks], v[:, ks], ids[:, qs], ids[:, ks], index[:, qs], index[:, ks], do[:, qs]]
        if framework == "jax":
            import jax.numpy as xp

            from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
        else:
            import torch as xp

            from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd
        qa, ka, va, qi, ki, qp, kp, doa = (xp.asarray(a) for a in arrays)
        o, lse = reference_block_fwd(qa, ka, va, mask, 8**-0.5, segments=(qi, ki), positions=(qp, kp), chunk=chunk)
        assert _rel(o, fwd.o) < 1e-5 and _rel(lse, fwd.lse) < 1e-5
        dq, dk, dv = reference_block_bwd(doa, qa, ka, va, xp.asarray(fwd.o.astype(np.float32)),
                                         xp.asarray(fwd.lse.astype(np.float32)), mask, 8**-0.5,
                                         segments=(qi, ki), positions=(qp, kp), chunk=chunk)
        for got, ref in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
            assert _rel(np.asarray(got), ref) < 1e-5


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_wrong_token_index_is_caught(framework):
    """The static zigzag's indices in place of the per-document zigzag's: the answer differs."""
    from seqplan.layouts import static_token_index

    index, ids, q, k, v, do, shard = _problem(1)
    wrong = static_token_index(index.shape[1], "zigzag", 2, batch=index.shape[0])
    qs, ks = slice(shard, 2 * shard), slice(None)
    want = _oracle(index, ids, q, k, v, do, qs, ks, None)[0]
    mask = BlockMask("full", documents=True, window=token_index_window(None, True))
    if framework == "jax":
        import jax.numpy as xp

        from jax_impl.kernels.reference import reference_block_fwd
    else:
        import torch as xp

        from torch_impl.kernels.reference import reference_block_fwd
    o, _ = reference_block_fwd(xp.asarray(q[:, qs]), xp.asarray(k[:, ks]), xp.asarray(v[:, ks]), mask, 8**-0.5,
                               segments=(xp.asarray(ids[:, qs]), xp.asarray(ids[:, ks])),
                               positions=(xp.asarray(wrong[:, qs]), xp.asarray(wrong[:, ks])))
    assert _rel(o, want.o) > 1e-2


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_positions_of_the_wrong_shape_are_refused(framework):
    mask = BlockMask("full", window=(UNBOUNDED, 0))
    q = np.zeros((2, 4, 1, 2), np.float32)
    if framework == "jax":
        import jax.numpy as xp

        from jax_impl.kernels.reference import reference_block_fwd
    else:
        import torch as xp

        from torch_impl.kernels.reference import reference_block_fwd
    bad = (xp.asarray(np.zeros((3, 4), np.int32)), xp.asarray(np.zeros((3, 4), np.int32)))  # batch 3, not 2
    with pytest.raises(ValueError, match="positions"):
        reference_block_fwd(xp.asarray(q), xp.asarray(q), xp.asarray(q), mask, 1.0, positions=bad)


def test_torch_fused_adapters_route_per_row_positions_to_the_portable_kernel():
    """flex and aten_window never reshape or band per-row token indices: flex hands the block to
    the portable kernel (same answer), the window adapter calls it not expressible."""
    import torch

    from torch_impl.kernels.flex import flex_block_fwd
    from torch_impl.kernels.reference import reference_block_fwd
    from torch_impl.kernels.window import block_band

    index, ids, q, k, v, _, shard = _problem(4)
    mask = BlockMask("full", window=token_index_window(None, True))
    arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v, index)]
    positions = (arrays[3], arrays[3])
    got = flex_block_fwd(*arrays[:3], mask, 0.3, positions=positions)
    want = reference_block_fwd(*arrays[:3], mask, 0.3, positions=positions)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert block_band(mask, q.shape[1], k.shape[1], positions) == "portable"
