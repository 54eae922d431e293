"""Tier 1 — seqplan's block-backend registry on its own, with stand-in backends and no framework:
the checks a name goes through, "auto" over a routing table, and the one-call eligibility (each
``block.py`` and ``allgather.py`` binds these to its kernels; tests/unit/test_block_routing.py
checks the bound tables)."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import pytest

from seqplan.config import AttentionConfig
from seqplan.registry import BackendRegistry, prefix_eligible
from seqplan.routing import Route
from seqplan.schedule import MaskKind


@dataclass(frozen=True)
class Stub:
    name: str
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    capped: bool = False

    def supports(self, mask, dtype, softcap=False) -> bool:
        return dtype in self.dtypes and (self.capped or not softcap)

    def available(self) -> bool:
        return True


def _registry(warn_only: bool = False) -> BackendRegistry[Any]:
    routes = (Route("fast", "bf16 on the device", device_kinds=("cuda",), dtypes=("bfloat16",),
                    masks=(MaskKind.FULL,)),
              Route("reference", "everything else"))
    registry = BackendRegistry(routes, frozenset({"fast"}), refusal=lambda name: f"{name} is not deterministic",
                               warn_only=lambda: warn_only, dtype_name=str, process_device_kinds=lambda: {"cpu"},
                               routing=lambda deterministic, softcap: Stub("auto"),
                               capped=lambda backend, softcap: Stub(backend.name + "+cap"))
    for backend in (Stub("reference", capped=True), Stub("fast", dtypes=("bfloat16",))):
        registry.register(backend)
    return registry


def test_a_name_is_checked_and_auto_resolves_the_first_row_that_can_run():
    registry = _registry()
    with pytest.raises(ValueError, match="'auto' is the routing backend's name"):
        registry.register(Stub("auto"))
    with pytest.raises(ValueError, match="unknown block backend 'nope'"):
        registry.resolve("nope", device_kind="cpu", dtype="float32", mask="full")
    with pytest.raises(RuntimeError, match="fast is not deterministic"):
        registry.get("fast", deterministic=True)
    auto = lambda **kw: registry.resolve("auto", device_kind="cuda", dtype="bfloat16", **kw)
    assert auto(mask="full") == "fast" and auto(mask="causal") == "reference"  # the row's masks
    assert auto(mask="full", softcap=True) == "reference"  # fast cannot cap
    assert registry.resolve("fast", device_kind="cuda", dtype="bfloat16", mask="full", softcap=True) == "reference"
    assert registry.get("auto").name == "reference"  # one backend reachable on a CPU-only process
    assert registry.get("fast", softcap=0.5).name == "fast+cap"


def test_warn_only_mode_warns_at_the_callers_caller_instead_of_refusing():
    registry = _registry(warn_only=True)

    def get_backend(name):  # each block.py's wrapper: the warning points at its caller
        return registry.get(name, deterministic=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line, backend = inspect.currentframe().f_lineno, get_backend("fast")
    assert backend.name == "fast" and [str(w.message) for w in caught] == ["fast is not deterministic"]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_the_one_call_needs_documents_or_token_indices_and_the_frameworks_varlen_backend():
    registry = _registry()
    registry.register(Stub("varlen"))
    eligible = lambda config, documents, backend="varlen": prefix_eligible(
        config, documents, device_kind="cuda", dtype="bfloat16", resolve_backend=registry.resolve,
        one_call_backends=(backend,))
    causal = AttentionConfig(True, "zigzag", 0.5, block_backend="varlen")
    assert eligible(causal, documents=True)
    assert not eligible(causal, documents=False)  # nothing to pack: the blocks
    assert not eligible(causal, documents=True, backend="other_varlen")
    assert not eligible(AttentionConfig(True, "zigzag", 0.5, block_backend="varlen", softcap=1.0), documents=True)
    assert not eligible(AttentionConfig(True, "zigzag", 0.5, block_backend="varlen", window=(4, 0)), documents=True)
    by_index = AttentionConfig.for_call(16, causal=True, layout="zigzag", scale=None, block_backend="varlen",
                                        deterministic=False, comm=None, token_index=True)
    assert by_index.mask_window is not None and not by_index.schedule_causal and eligible(by_index, documents=False)
