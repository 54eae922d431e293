"""seqplan — the sequence-parallel plan, framework-free: what every device of a ring / Ulysses /
USP / double-ring mesh computes and in which order, written once and imported by both
implementations (``jax_impl``, ``torch_impl``) and by ``parity.core``.

- ``axes``        the mesh axis names that pick the algorithm
- ``layouts``     the token permutations (contiguous, zigzag, stripe) and every shard's original positions
- ``schedule``    block masks, step plans, the visiting order (``Schedule``, ``device_visits``), the
                  per-block document and window decisions
- ``validation``  shape / option checks, run before any collective; the algorithm a mesh picks
- ``config``      ``AttentionConfig`` (each implementation subclasses it with its Comm and kernels), the
                  static fields' checks, the scale default, the ``check_ranks`` environment default
- ``routing``     the ``"auto"`` backend's row type and the walk over a routing table
- ``registry``    the block-backend registry (names, capabilities, determinism, "auto" resolved) each
                  ``block.py`` instantiates, and all-gather-KV's one-call eligibility (``prefix_eligible``)
- ``strategy``    the mesh a one-device replay stands for
- ``chunks``      how the portable kernels walk a block's keys (bounded scores)
- ``documents``   a block's document runs for varlen kernels (cumulative offsets over the block's own
                  queries and keys), and ``HostPair`` (a block's ids or token indices with their host copy)
- ``chooser``     the measured layout / K/V exchange choice for a batch of packed documents
                  (``choose_layout``), with the padding it needs
- ``bands``       a windowed block as a band of its grid: the crop and window sizes the fused
                  kernels' own sliding windows take

Pure Python and NumPy: importing it loads neither jax nor torch (tests/unit/test_layering.py).
"""

from .axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from .layouts import LAYOUTS, layout_permutation, ring_positions, seq_multiple
from .schedule import BlockMask, MaskKind, Schedule, device_visits
from .strategy import Strategy

__all__ = ["DATA", "LAYOUTS", "RING", "RING_INNER", "RING_OUTER", "ULYSSES", "BlockMask", "MaskKind", "Schedule",
           "Strategy", "device_visits", "layout_permutation", "ring_positions", "seq_multiple"]
