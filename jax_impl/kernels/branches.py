"""Branch selection as data: the ``lax.switch`` index of a set of named variants, from traced
conditions, with no index arithmetic at the call site.

A caller names its variants (``{name: callable}``, in the order they are compiled) and says which
one a block takes as a :data:`Choice`:

- a name: that variant;
- :class:`Grid`: the variant named ``(*prefix, option_1, option_2, ...)`` for the option at each
  axis' traced position (e.g. the smallest run-slot count holding the runs x the smallest length
  bound) — no variant when a position is past its options (the caller's "none holds");
- :class:`First`: the first ``(condition, choice)`` whose condition holds and whose choice names a
  variant, else ``otherwise`` (``None``: no variant, so an enclosing :class:`First` goes on).

:func:`select` turns both into the switch's index and branch list. Why: an off-by-one in a
hand-computed index (``doc * len(options) + win``, ``n + index``, a variant inserted at 0 and
every other index shifted) runs the wrong kernel without an error; names are checked when the
choice is built (an unknown name is a ``KeyError`` at trace time) and can be tested per
condition combination (``tests/unit/test_branches.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import product
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class Grid(NamedTuple):
    """The variant named ``(*prefix, *(options[position] for each axis))``; ``axes``: pairs of
    (static options, traced or int position). A position past its options selects nothing, unless
    ``in_range``: the caller's positions never pass their options (e.g. looked up from a table
    of them), so the grid always selects a variant."""

    prefix: tuple
    axes: tuple[tuple[Sequence[Any], Any], ...]
    in_range: bool = False


class First(NamedTuple):
    """The first ``(condition, choice)`` of ``cases`` (priority order; a condition is a traced
    or Python bool) that holds and selects a variant, else ``otherwise`` (``None``: nothing)."""

    cases: Sequence[tuple[Any, Choice]]
    otherwise: Choice | None = None


Choice = Hashable | Grid | First  # a variant's name, or how to find it


class Selection(NamedTuple):
    """``lax.switch(index, branches, ...)`` runs the variant named ``names[index]``."""

    index: Any  # int32 (traced) or a Python int when the choice is static
    names: tuple[Hashable, ...]
    branches: tuple[Callable, ...]

    def switch(self, *operands):
        """The selected branch on ``operands``: one ``lax.switch``, or a direct call when there
        is one branch (nothing to decide, nothing for XLA to keep apart)."""
        if len(self.branches) == 1:
            return self.branches[0](*operands)
        return lax.switch(self.index, self.branches, *operands)


_NONE = -1  # "no variant" inside the resolution; never an index of a Selection


def _static(x) -> bool:
    return isinstance(x, (bool, int, np.bool_, np.integer))


def _where(condition, chosen, otherwise):
    """``jnp.where`` that stays a Python int when the condition is static."""
    if _static(condition):
        return chosen if condition else otherwise
    return jnp.where(condition, chosen, otherwise)


def _resolve(choice: Choice | None, position: Mapping[Hashable, int]):
    """The index ``choice`` selects (traced or int), or ``_NONE``."""
    if choice is None:
        return _NONE
    if isinstance(choice, First):
        index = _resolve(choice.otherwise, position)
        for condition, case in reversed(choice.cases):  # the first case is applied last: it wins
            if _static(condition) and not condition:  # never taken (its variant need not exist)
                continue
            chosen = _resolve(case, position)
            if _static(chosen) and chosen == _NONE:
                continue
            if not _static(chosen):  # a case that may select nothing falls through to the later ones
                condition = jnp.asarray(condition) & (chosen != _NONE)
            index = _where(condition, chosen, index)
        return index
    if isinstance(choice, Grid):
        options = [tuple(opts) for opts, _ in choice.axes]
        # one entry per combination of positions, plus one past each axis' options: nothing
        table = np.full([len(opts) + 1 for opts in options], _NONE, np.int32)
        for at in product(*(range(len(opts)) for opts in options)):
            name = (*choice.prefix, *(opts[i] for opts, i in zip(options, at)))
            table[at] = position[name]
        at = tuple(pos for _, pos in choice.axes)
        last = [len(opts) - (1 if choice.in_range else 0) for opts in options]  # past the options: nothing
        if all(_static(pos) for pos in at):
            return int(table[tuple(min(int(pos), end) for pos, end in zip(at, last))])
        return jnp.asarray(table)[tuple(jnp.clip(jnp.asarray(pos), 0, end) for pos, end in zip(at, last))]
    return position[choice]


def _total(choice: Choice | None) -> bool:
    """Whether ``choice`` selects a variant whatever the conditions and positions."""
    if choice is None:
        return False
    if isinstance(choice, Grid):
        return choice.in_range
    if isinstance(choice, First):
        return _total(choice.otherwise)
    return True


def select(variants: Mapping[Hashable, Callable], choice: Choice) -> Selection:
    """The switch index and branch list for ``choice`` over ``variants`` (compiled in their
    order). ``choice`` must always select a variant: end it with a name (``First.otherwise``)."""
    if not _total(choice):  # lax.switch would clamp a "nothing" (-1) to the first branch, silently
        raise ValueError(f"{choice!r} may select no variant: end it with a name (First.otherwise)")
    names = tuple(variants)
    index = _resolve(choice, {name: i for i, name in enumerate(names)})
    if not _static(index):
        index = index.astype(jnp.int32)
    return Selection(index, names, tuple(variants[name] for name in names))


def selected_name(selection: Selection) -> Hashable:
    """The selected variant's name, for tests: ``selection.index`` evaluated (concrete inputs)."""
    return selection.names[int(jax.device_get(selection.index))]
