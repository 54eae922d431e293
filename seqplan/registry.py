"""The block-backend registry, written once: backends by name, what each can run (its mask, dtype
and soft-capping; whether it is available in this process), a name checked against determinism,
``"auto"`` resolved through a routing table (``seqplan.routing``), and all-gather-KV's one-call
eligibility. Each implementation's ``block.py`` builds one :class:`BackendRegistry` from its
framework's pieces — its routing table, its dtype and device-kind names, its refusal message, how
it wraps kernels to route or soft-cap them — and its ``kernels/`` register the kernel adapters,
the only framework-specific part. Backends are any objects with ``name``, ``supports(mask,
dtype, softcap=False)`` and ``available()`` (each ``block.BlockBackend``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .config import AttentionConfig
from .routing import Route, as_block_mask, first_route, reachable
from .schedule import BlockMask

Backend = TypeVar("Backend")


@dataclass(frozen=True)
class BackendRegistry(Generic[Backend]):
    """One framework's block backends and its ``"auto"`` routing.

    routes:               the routing table (``block.AUTO_ROUTES``): first matching row that can run wins.
    nondeterministic:     names refused when ``deterministic=True`` (measured non-deterministic).
    refusal:              name -> the message refusing a non-deterministic backend (says how to
                          get a deterministic one in that framework).
    warn_only:            () -> whether that refusal only warns (torch's ``warn_only`` mode) instead of raising.
    dtype_name:           a dtype (or its name) -> its name ("bfloat16", ...), as the routes spell it.
    process_device_kinds: () -> the device kinds this process has ("cpu", "cuda", ...).
    routing:              (deterministic, softcap) -> the ``"auto"`` backend that resolves each block call.
    capped:               (backend, softcap) -> ``backend`` soft-capping every block.
    backends:             name -> backend, filled by the kernel modules (:meth:`register`).
    """

    routes: tuple[Route, ...]
    nondeterministic: frozenset[str]
    refusal: Callable[[str], str]
    warn_only: Callable[[], bool]
    dtype_name: Callable[[Any], str]
    process_device_kinds: Callable[[], set[str]]
    routing: Callable[[bool, float | None], Backend]
    capped: Callable[[Backend, float], Backend]
    backends: dict[str, Backend] = field(default_factory=dict)

    def register(self, backend: Backend) -> None:
        """Make ``backend`` selectable by name (tests use this to count kernel calls)."""
        if backend.name == "auto":
            raise ValueError("'auto' is the routing backend's name; register a concrete backend under another name")
        self.backends[backend.name] = backend

    def check_named(self, name: str, deterministic: bool) -> None:
        """ValueError for an unknown name; a non-deterministic backend under ``deterministic``
        refused (RuntimeError) or, in warn-only mode, warned about at the caller of ``block``'s function."""
        if name not in self.backends:
            raise ValueError(f"unknown block backend {name!r}; registered: {sorted(self.backends)} and 'auto'")
        if name in self.nondeterministic and deterministic:
            if not self.warn_only():
                raise RuntimeError(self.refusal(name))
            # this frame, get / resolve, block.get_backend / resolve_backend, then their caller
            warnings.warn(self.refusal(name), stacklevel=4)

    def resolve(self, name: str, *, device_kind: str, dtype, mask, deterministic: bool = False,
                softcap: bool = False) -> str:
        """The concrete backend that runs a block of ``dtype`` under ``mask`` (a BlockMask, MaskKind
        or its value) on ``device_kind`` when ``name`` is asked for: ``name`` itself (checked), or for
        ``"auto"`` the backend of the first matching row of ``routes`` that is available and supports
        the mask in that dtype. ``softcap``: the block is soft-capped — a named backend that does
        not apply soft-capping to it runs it on ``"reference"`` instead (``capped``), and "auto"
        takes only rows whose backend does."""
        if name != "auto":
            self.check_named(name, deterministic)
            if softcap and not self.caps(self.backends[name], mask, dtype):
                return "reference"
            return name
        return first_route(self.routes, device_kind=device_kind, dtype=self.dtype_name(dtype),
                           mask=as_block_mask(mask), deterministic=bool(deterministic), can_run=self.can_run,
                           softcap=bool(softcap))

    def caps(self, backend: Backend, mask, dtype) -> bool:
        """Whether ``backend``'s kernels soft-cap a block of ``dtype`` under ``mask``."""
        return bool(backend.supports(as_block_mask(mask), self.dtype_name(dtype), softcap=True))

    def can_run(self, name: str, mask: BlockMask, dtype: str, softcap: bool = False) -> bool:
        """Whether backend ``name`` is registered, available and computes ``mask`` in ``dtype``
        (soft-capped when ``softcap``): a routing row's test."""
        backend = self.backends.get(name)
        if backend is None or not backend.available():
            return False
        return backend.supports(mask, dtype, softcap=True) if softcap else backend.supports(mask, dtype)

    def reachable_here(self, deterministic: bool) -> list[str]:
        """Backends "auto" may route to in this process (rows of its device kinds, available)."""
        return reachable(self.routes, device_kinds=self.process_device_kinds(), deterministic=deterministic,
                         usable=lambda name: name in self.backends and self.backends[name].available())

    def get(self, name: str = "auto", *, deterministic: bool = False, softcap: float | None = None) -> Backend:
        """The backend called ``name``: ``"auto"`` is ``routing`` — or, when every row this process
        can reach names one backend (a CPU-only process: ``reference``), that backend itself; a
        name is checked (:meth:`check_named`). ``softcap`` (a float, or None): the kernels
        soft-cap every block — "auto" routes each block to a backend that applies it, a named
        backend runs on its own kernels only the blocks it can cap (``capped``)."""
        if name == "auto":
            names = self.reachable_here(bool(deterministic))
            if len(names) > 1:
                return self.routing(bool(deterministic), softcap)
            backend = self.backends[names[0]]
        else:
            self.check_named(name, deterministic)
            backend = self.backends[name]
        return backend if softcap is None else self.capped(backend, softcap)


def one_call_backend(config: AttentionConfig, documents: bool, *, device_kind: str, dtype,
                     resolve_backend: Callable[..., str]) -> str | None:
    """The backend an all-gather-KV call's document blocks resolve to, when the call could run as
    one varlen call per device — decided on static facts: causal by token indices
    (``config.token_index``: the window ``(UNBOUNDED, 0)``) or by the layout's positions with
    packed documents (``documents``) and no window (``schedule.one_call_mask``), not soft-capped;
    the block mask resolved by ``resolve_backend`` (a registry's :meth:`BackendRegistry.resolve`)
    on ``device_kind`` and ``dtype``. None: not such a call. The framework decides whether that
    backend has a one-call kernel (:func:`prefix_eligible`)."""
    mask = config.one_call_mask(documents)
    if config.softcap is not None or mask is None:
        return None
    return resolve_backend(config.block_backend, device_kind=device_kind, dtype=dtype, mask=mask,
                           deterministic=config.deterministic)


def prefix_eligible(config: AttentionConfig, documents: bool, *, device_kind: str, dtype,
                    resolve_backend: Callable[..., str], one_call_backends: Collection[str]) -> bool:
    """Whether an all-gather-KV call may run as one varlen call per device: its document blocks
    resolve (:func:`one_call_backend`) to one of the framework's varlen backends that have a
    one-call kernel, ``one_call_backends``."""
    name = one_call_backend(config, documents, device_kind=device_kind, dtype=dtype, resolve_backend=resolve_backend)
    return name is not None and name in one_call_backends
