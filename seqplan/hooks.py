"""An installed-hook stack, framework-free: each implementation's ``comm.using`` / ``current_comm``
(the transfer hook a probe installs around attention calls) is one :class:`HookStack` of its own
``Comm`` type."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

Hook = TypeVar("Hook")


class HookStack(Generic[Hook]):
    """The hooks installed by nested ``with stack.using(hook):`` blocks over a default one."""

    def __init__(self, kind: type, default: Hook):
        self._kind, self._installed = kind, [default]

    def current(self) -> Hook:
        """The hook the next call picks up: the innermost installed one, else the default."""
        return self._installed[-1]

    @contextlib.contextmanager
    def using(self, hook: Hook) -> Iterator[Hook]:
        """Install ``hook`` for the calls made inside the block (a TypeError unless it is one of ``kind``)."""
        if not isinstance(hook, self._kind):
            raise TypeError(f"using() takes a {self._kind.__name__}, got {type(hook).__name__}")
        self._installed.append(hook)
        try:
            yield hook
        finally:
            self._installed.pop()
