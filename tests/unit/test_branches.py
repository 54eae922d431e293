"""Branch selection as data (jax_impl/kernels/branches.py): for every place that builds a
``lax.switch`` from named variants — under_masks (loop.mask_choice), the run dispatchers
(runs.runs_choice, runs.index_choice, runs.prefix_choice) — every combination of the traced
conditions runs the branch whose NAME is what that combination should pick. Each branch returns
its own position in the names; the test compares the name there with the expected name, written
here as plain if / else, so a wrong index (an off-by-one, a swapped case) fails by name."""

from __future__ import annotations

from itertools import product

import jax
import jax.numpy as jnp
import pytest

from jax_impl import loop
from jax_impl.kernels import branches, runs


def _named(names):
    """Variants that return their own position in ``names`` (taking ``operands``)."""
    return {name: (lambda *operands, i=i: jnp.int32(i)) for i, name in enumerate(names)}


def _picker(variants, choice_of, operands=()):
    """conditions -> the name of the branch ``lax.switch`` runs, the conditions traced (one jit)."""
    names = tuple(variants)
    run = jax.jit(lambda *traced: branches.select(variants, choice_of(*traced)).switch(*operands))
    return lambda *conditions: names[int(run(*conditions))]


# ---- the builder itself ----------------------------------------------------------------------

def test_a_choice_that_may_select_nothing_is_refused():
    variants = _named(["a", ("g", 1), ("g", 2)])
    with pytest.raises(ValueError):
        branches.select(variants, branches.Grid(("g",), (((1, 2), jnp.int32(0)),)))
    with pytest.raises(ValueError):
        branches.select(variants, branches.First([(jnp.bool_(True), "a")]))
    with pytest.raises(KeyError):  # a name no variant has
        branches.select(variants, branches.First([(jnp.bool_(True), "b")], otherwise="a"))


def test_first_falls_through_a_grid_past_its_options():
    variants = _named(["fallback", ("g", 1), ("g", 2)])
    pick = _picker(variants, lambda c, p: branches.First([(c, branches.Grid(("g",), (((1, 2), p),)))],
                                                         otherwise="fallback"))
    for condition, at in product((False, True), range(3)):
        got = pick(jnp.bool_(condition), jnp.int32(at))
        assert got == (("g", (1, 2)[at]) if condition and at < 2 else "fallback"), (condition, at)


# ---- under_masks: skipped, or masked with / without documents and a window option -----------

WINDOW_OPTIONS = [(None,), ((0,),), (None, (None,)), ((0,), (64,), (-64,))]


@pytest.mark.parametrize("win_options", WINDOW_OPTIONS)
@pytest.mark.parametrize("doc_options", [(False,), (False, True)])
@pytest.mark.parametrize("skippable", [False, True])
def test_under_masks_picks_by_name(skippable, doc_options, win_options):
    names = ([loop.SKIP] if skippable else []) + [loop.masked(d, o) for d in doc_options for o in win_options]
    variants = _named(names)
    documents = True in doc_options

    def choice(keep, one_document, at):
        # without documents, under_masks passes one_document as the Python True it starts from
        return loop.mask_choice(skippable, keep, one_document if documents else True, doc_options, win_options, at)
    pick = _picker(variants, choice, operands=(jnp.zeros(()),))
    for keep, one_document, at in product((False, True), (False, True) if documents else (True,),
                                          range(len(win_options))):
        got = pick(jnp.bool_(keep), jnp.bool_(one_document), jnp.int32(at))
        if skippable and not keep:
            want = loop.SKIP
        else:
            want = loop.masked(documents and not one_document, win_options[at])
        assert got == want, (keep, one_document, at)


# ---- dispatch / fused_branches: boundary form, runs form (slots), portable -------------------

SIZES = (4, 16, 64)
LADDER = (256, 512, 1024)


def _runs_names(prefix, sizes, boundary):
    return ([(*prefix, runs.BOUNDARY)] if boundary else []) + [(*prefix, *runs.runs_variant(m)) for m in sizes]


def _want_runs(prefix, ok, most, boundary_ok):
    """What dispatch should run, as its docstring says it."""
    if boundary_ok:
        return (*prefix, runs.BOUNDARY)
    if not ok or most > SIZES[-1]:
        return None  # the portable kernel
    return (*prefix, *runs.runs_variant(min(m for m in SIZES if m >= most)))


@pytest.mark.parametrize("boundary", [False, True])
def test_dispatch_picks_by_name(boundary):
    variants = _named(_runs_names((), SIZES, boundary) + [runs.PORTABLE])
    pick = _picker(variants, lambda ok, edge, most: runs.with_fallback(
        runs.runs_choice(ok, most, SIZES, edge if boundary else False)))
    for ok, edge, most in product((False, True), (False, True) if boundary else (False,), (1, 4, 5, 16, 17, 64, 65)):
        got = pick(jnp.bool_(ok), jnp.bool_(edge), jnp.int32(most))
        want = _want_runs((), ok, most, edge) or runs.PORTABLE
        assert got == want, (ok, edge, most)


@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_branches_compiles_the_named_variants(causal, lengths):
    """The names fused_branches gives its variants are the ones the choice above picks from:
    the boundary form first (FULL blocks), then one per slot count — the length bound is not a
    variant (``length_choice``: chosen around the kernel call inside each)."""
    ids = jnp.zeros((1, 128), jnp.int32)
    variants, _ = runs.fused_branches((ids, ids), causal, lambda r: jnp.int32(0), boundary=True, lengths=lengths,
                                      prefix=("p",))
    sizes = sorted({min(m, 128) for m in runs.RUN_SLOTS})
    assert list(variants) == _runs_names(("p",), sizes, boundary=not causal)


def test_the_length_choice_picks_the_smallest_bound_holding_the_longest_run():
    """``length_choice``: the bound the backward's kernel gets is the smallest of the ladder at
    least the longest run, capped at the block's own lengths; bounds equal after the cap are
    compiled once (and picked by every ladder step that capped to them)."""
    choose = jax.jit(lambda longest: runs.length_choice(LADDER, 600, 1024, longest).at)
    bounds = runs.length_choice(LADDER, 600, 1024, jnp.int32(0)).bounds
    assert bounds == ((256, 256), (512, 512), (600, 1024))
    for longest in (1, 255, 256, 257, 512, 513, 600, 1000, 1024):
        want = min(b for b in LADDER if b >= longest)
        assert bounds[int(choose(jnp.int32(longest)))] == (min(want, 600), min(want, 1024)), longest
    capped = runs.length_choice(LADDER, 300, 300, jnp.int32(290))  # 512 and 1024 both cap to 300
    assert capped.bounds == ((256, 256), (300, 300)) and int(capped.at) == 1


# ---- index_dispatch: a diagonal block's causal forms, any other's FULL forms -----------------

@pytest.mark.parametrize("diagonal_possible", [False, True])
def test_index_dispatch_picks_by_name(diagonal_possible):
    names = (_runs_names((runs.CAUSAL,), SIZES, False) if diagonal_possible else []) + \
        _runs_names((runs.FULL,), SIZES, True) + [runs.PORTABLE]
    variants = _named(names)

    def choice(diagonal, causal_ok, full_ok, edge, most):
        full = runs.runs_choice(full_ok, most, SIZES, edge, prefix=(runs.FULL,))
        if not diagonal_possible:  # index_dispatch's blocks of unequal shapes: no causal forms
            return runs.with_fallback(runs.index_choice(False, None, full))
        causal = runs.runs_choice(causal_ok, most, SIZES, prefix=(runs.CAUSAL,))
        return runs.with_fallback(runs.index_choice(diagonal, causal, full))
    pick = _picker(variants, choice)
    for diagonal, causal_ok, full_ok, edge, most in product((False, True) if diagonal_possible else (False,),
                                                            (False, True), (False, True), (False, True), (4, 16, 65)):
        got = pick(jnp.bool_(diagonal), jnp.bool_(causal_ok), jnp.bool_(full_ok), jnp.bool_(edge), jnp.int32(most))
        if diagonal:  # the causal forms or the portable kernel, never the FULL forms (another mask)
            want = _want_runs((runs.CAUSAL,), causal_ok, most, False)
        else:
            want = _want_runs((runs.FULL,), full_ok, most, edge)
        assert got == (want or runs.PORTABLE), (diagonal, causal_ok, full_ok, edge, most)


# ---- prefix_dispatch: the plan with the fewest slots that fits -------------------------------

def test_prefix_dispatch_picks_by_name():
    slot_counts = (32, 64, 256)
    variants = _named([runs.plan_variant(m) for m in slot_counts] + [runs.PORTABLE])
    pick = _picker(variants, lambda fits: runs.with_fallback(runs.prefix_choice(slot_counts, list(fits))))
    for fits in product((False, True), repeat=len(slot_counts)):
        got = pick(jnp.asarray(fits))
        fitting = [m for m, fit in zip(slot_counts, fits) if fit]
        want = runs.plan_variant(fitting[0]) if fitting else runs.PORTABLE
        assert got == want, fits
