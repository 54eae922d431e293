"""The ``"auto"`` block backend's routing rules as data: a :class:`Route` row matches a block by
device kind, dtype, mask kind and determinism, and the first row whose backend can run the block
(its mask, its dtype, and soft-capping when the call has a ``softcap``) wins. Each
implementation's ``block.py`` holds its own table (``AUTO_ROUTES``: its framework's
kernels and their measurements) and registry; the row type and the walk over a table are here,
written once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .schedule import BlockMask, MaskKind

LOW_PRECISION = ("bfloat16", "float16")
ALL_MASKS = tuple(MaskKind)


@dataclass(frozen=True)
class Route:
    """One row of a routing table: a block whose inputs match every field (``None``: any) runs on
    ``backend``. ``reason``: the measurement or rule behind the row."""

    backend: str
    reason: str
    device_kinds: tuple[str, ...] | None = None  # "cpu", "cuda", ... (each block.py's device_kind_of)
    dtypes: tuple[str, ...] | None = None
    masks: tuple[MaskKind, ...] | None = None
    deterministic: bool | None = None

    def matches(self, device_kind: str, dtype: str, mask: MaskKind, deterministic: bool) -> bool:
        return ((self.device_kinds is None or device_kind in self.device_kinds)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.masks is None or mask in self.masks)
                and (self.deterministic is None or deterministic == self.deterministic))


def as_block_mask(mask) -> BlockMask:
    """A BlockMask from a BlockMask, a MaskKind or its value ("full", "causal", "strict")."""
    return mask if isinstance(mask, BlockMask) else BlockMask(MaskKind(mask))


def first_route(routes: Iterable[Route], *, device_kind: str, dtype: str, mask: BlockMask, deterministic: bool,
                can_run: Callable[[str, BlockMask, str, bool], bool], softcap: bool = False) -> str:
    """The backend of the first row matching the block whose backend ``can_run(name, mask, dtype,
    softcap)`` (registered, available, supports that mask in that dtype — soft-capped when
    ``softcap``: a backend's ``supports(mask, dtype, softcap=True)``); ValueError naming the block
    if none."""
    for route in routes:
        if route.matches(device_kind, dtype, mask.kind, deterministic) and can_run(route.backend, mask, dtype,
                                                                                   softcap):
            return route.backend
    capped = " soft-capped" if softcap else ""
    raise ValueError(f"no block backend for{capped} {device_kind} {dtype} {mask} blocks (deterministic={deterministic})")


def reachable(routes: Iterable[Route], *, device_kinds: set[str], deterministic: bool,
              usable: Callable[[str], bool]) -> list[str]:
    """The backends a table may route to in a process with these device kinds (rows of those
    kinds and of this determinism whose backend is ``usable``: registered and available), in
    table order, each once."""
    names = [r.backend for r in routes
             if (r.device_kinds is None or device_kinds & set(r.device_kinds))
             and (r.deterministic is None or r.deterministic == deterministic) and usable(r.backend)]
    return list(dict.fromkeys(names))
