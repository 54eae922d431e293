"""ringbridge's torch implementation: the jax_impl algorithms, step for step, in torch.distributed."""

from seqplan.axes import DATA, RING, RING_INNER, RING_OUTER, ULYSSES
from seqplan.layouts import LAYOUTS, layout_permutation
from seqplan.schedule import BlockMask, Schedule, device_visits

from . import kernels  # noqa: F401  (registers the built-in block backends)
from .allgather import allgather_attention
from .api import sequence_parallel_attention
from .block import BlockBackend, get_backend, register_backend, resolve_backend
from .comm import Comm
from .config import AttentionConfig
from .dense import dense_attention
from .double_ring import double_ring_attention
from .loop import host_ids
from .merge import merge_partials
from .ring import ring_attention
from .ulysses import ulysses_attention
from .usp import usp_attention

__all__ = [
    "DATA", "LAYOUTS", "RING", "RING_INNER", "RING_OUTER", "ULYSSES", "AttentionConfig", "BlockBackend", "BlockMask",
    "Comm", "Schedule", "allgather_attention", "dense_attention", "device_visits", "double_ring_attention",
    "get_backend", "host_ids", "layout_permutation", "merge_partials", "register_backend", "resolve_backend",
    "ring_attention", "sequence_parallel_attention", "ulysses_attention", "usp_attention",
]
