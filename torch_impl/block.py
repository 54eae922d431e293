"""The local block kernel's interface, the registry of backends, and ``"auto"``: the routing table.
The registry's logic (names, capabilities, determinism, resolving "auto") is ``seqplan.registry``,
written once; this module gives it the framework's pieces and the kernel wrappers.

    block_fwd(q, k, v, mask, scale, segments=None, positions=None, softcap=None)                   -> (o, lse)
    block_bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None, softcap=None)
                                                                                     -> (dq, dk, dv)

(o and the gradients in float32 or the input dtype.) q, do, o: [b, t, h, d]; k, v: [b, s, hk, d];
lse, dlse: [b, h, t] float32. ``mask`` is a :class:`schedule.BlockMask` (full / causal / strict,
each optionally restricted to packed documents and to a window). ``segments = (q_ids [b, t],
kv_ids [b, s])`` (int32 segment ids of the block's queries and keys) is given if and only if
``mask.documents``, ``positions = (q_pos [t], kv_pos [s])`` (int32 original positions) if and
only if ``mask.window`` is set: the loops pass them by keyword, and only then, so a backend that
never receives such a mask may omit the parameter. ``softcap`` (a float: every scaled logit x
becomes softcap · tanh(x / softcap) before the softmax, Gemma 2's logit soft-capping) is given,
by keyword, only when the call has one, and only to a backend whose ``supports(mask, dtype,
softcap=True)`` says its kernels apply it (:func:`capped_backend`, :func:`routing_backend`): a
kernel that does not know the keyword fails loudly instead of computing uncapped attention.
``block_bwd`` takes the *global* ``o`` and ``lse``; kernels may return the input dtype, and every
caller accumulates into float32 rows (``merge.Float32Rows``; ``Tensor.add_`` promotes in place).
A kernel returns fresh tensors, never a view of its inputs or a cached tensor: the loops write the
accumulated rows back into a block's own outputs.

**Backends** live in ``kernels/``, one module per kernel family, each registering itself here
(``torch_impl/kernels/__init__.py`` imports them): ``reference`` (portable einsum, float32, any
device), ``aten_cpu``, ``aten_flash``, ``aten_cudnn`` (torch's SDPA ops). Soft-capping is applied
by ``reference`` and ``flex`` (a ``score_mod``) only: torch's aten attention ops take none.
``kernels/`` is the one
folder where torch_impl and jax_impl differ by nature — each binds its own framework's kernels —
while the algorithm files mirror each other.

**"auto"** is a routing backend: every block call resolves (device kind of the inputs, dtype,
block mask, deterministic) to a concrete backend through :data:`AUTO_ROUTES` — the first row that
matches and whose backend is registered, available and ``supports`` the block's mask and dtype
(so document-masked and windowed blocks go to the portable kernel until a fused kernel for them
is registered). :func:`resolve_backend` gives the same answer as a name, for reports and benchmark rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqplan.registry import BackendRegistry
from seqplan.routing import ALL_MASKS, LOW_PRECISION, Route
from seqplan.schedule import BlockMask as BlockMask  # re-exported: callers build block.BlockMask (parity's sweep)
from seqplan.schedule import MaskKind

F32 = torch.float32


@dataclass(frozen=True)
class BlockBackend:
    """A pair of block kernels with the signatures in the module docstring."""

    name: str
    fwd: Callable
    bwd: Callable
    # supports(mask, dtype name, softcap=False) -> whether the kernels compute that block mask in
    # that dtype (soft-capped, when softcap is True: their fwd / bwd then take softcap=). By
    # default every mask and dtype, never soft-capping: a backend opts in.
    supports: Callable[..., bool] = lambda mask, dtype, softcap=False: not softcap
    # available() -> whether the kernels can run in this process: "auto" routes only to available backends.
    available: Callable[[], bool] = lambda: True


# Run-to-run determinism, measured on H200 (``python -m parity determinism``, 2026-11-22): the
# fused backwards accumulate dq with atomics, so dq differs between identical runs for
# aten_flash and aten_cudnn; torch.use_deterministic_algorithms(True) makes aten_flash
# deterministic (torch picks FlashAttention's deterministic backward) but not aten_cudnn.
# "reference" and every forward were bitwise reproducible. One H200, 2026-11-29
# (``python -m benchmarks.determinism_cost``, 32k tokens, 32 / 8 heads, 5 runs): under torch's
# strict switch fa4 (FA4's own deterministic backward), aten_flash, aten_varlen and aten_window
# are bitwise identical (fa4 1.06-1.26x its default step, FA2's kernels 1.47-1.96x); outside it
# their dq (fa4 with GQA documents: dK / dV) differ. Under warn-only FA2's kernels stay atomic;
# fa4, which reads the switch itself, stays deterministic.
NONDETERMINISTIC_WHEN_REQUESTED = frozenset({"aten_cudnn"})


# ---- "auto": the routing table --------------------------------------------------------------------

# First match wins; a row whose backend is not available is passed over. Speeds:
# docs/gpu/kernel-table-2026-11-23-h100.md (H100, bf16, 32k tokens, 32 heads, d 128, fwd+bwd
# TFLOP/s), each pair verified there against a float64 truth.
AUTO_ROUTES: tuple[Route, ...] = (
    Route("reference", "float32 is held to 1e-5 relative: only the portable kernel computes in float32",
          dtypes=("float32",)),
    Route("reference", "the CPU default (aten_cpu is not measured against it)", device_kinds=("cpu",)),
    Route("fa4", "every block FA4 takes, where installed: plain blocks on its dense kernel (one GPU, 32k, 32 / 8 "
          "heads, fwd+bwd: 619 vs cuDNN's 547 TFLOP/s, 4x H200, same run), windowed blocks on its own sliding window "
          "(529.7 at window (4096, 0) vs FA2's window 286, same run), document blocks, token-index causal blocks and "
          "soft-capped blocks (1.08-1.81x aten_varlen on the 4-GPU table): docs/decisions.md; the GPU tier and "
          "every mesh row verify it first. In deterministic mode too (FA4's deterministic backward, bitwise "
          "reproducible: 52.6 ms causal at 32k against aten_flash's 94.5, one H200, docs/decisions.md)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, masks=(MaskKind.FULL, MaskKind.CAUSAL)),
    Route("aten_flash", "torch's deterministic mode makes aten_flash's backward deterministic; aten_cudnn's stays not",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, deterministic=True),
    Route("aten_cudnn", "fastest verified: 577 / 561 / 531 TFLOP/s full / causal / strict vs aten_flash 325 / 325 / "
          "323 (bf16; fp16 verified for d 64 MHA only so far)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, masks=ALL_MASKS, deterministic=False),
    Route("aten_varlen", "document blocks (full, causal diagonal; ids one run per document) and token-index causal "
          "blocks (seqplan.documents.index_runs) on FA2 varlen: "
          "docs/gpu/masked-2026-11-24-h100.md; in deterministic mode too (FA2's deterministic backward under torch's "
          "switch: bitwise reproducible, 1.5-2.0x its default step, one H200)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, masks=(MaskKind.FULL, MaskKind.CAUSAL)),
    Route("aten_window", "windowed blocks (full, causal) whose positions are two contiguous ranges, on FA2's "
          "sliding window: docs/gpu/masked-2026-11-24-h100.md; in deterministic mode too (bitwise reproducible under "
          "torch's switch, 1.47x its default step, one H200)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, masks=(MaskKind.FULL, MaskKind.CAUSAL)),
    Route("reference", "any other platform, and every block no fused kernel takes: the portable kernel"),
)


def device_kind_of(x) -> str:
    """The kind of device tensor ``x`` lives on: "cpu", "cuda", ..."""
    return x.device.type


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _refusal(name: str) -> str:
    why = "its backward's dq differs between identical runs"
    return (f"block backend {name!r} is not deterministic ({why}) and deterministic=True (by default: "
            "torch.use_deterministic_algorithms(True) is set): use 'aten_flash' (deterministic in that mode) or "
            "'reference'")


def _process_device_kinds() -> set[str]:
    return {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())


def _extras(segments, positions, softcap) -> dict:
    """The kernel keywords a block carries: ids only for document blocks, positions only for
    windowed ones, ``softcap`` only when the call soft-caps."""
    given = {"segments": segments, "positions": positions, "softcap": softcap}
    return {name: x for name, x in given.items() if x is not None}


def routing_backend(deterministic: bool = False, softcap: float | None = None) -> BlockBackend:
    """The ``"auto"`` backend: each call resolved by :func:`resolve_backend` from its inputs (and,
    with ``softcap``, only to backends that soft-cap, given ``softcap=``)."""
    def pick(q, mask) -> BlockBackend:
        return _BACKENDS[resolve_backend("auto", device_kind=device_kind_of(q), dtype=q.dtype, mask=mask,
                                         deterministic=deterministic, softcap=softcap is not None)]

    def fwd(q, k, v, mask, scale, segments=None, positions=None):
        return pick(q, mask).fwd(q, k, v, mask, scale, **_extras(segments, positions, softcap))

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None):
        return pick(q, mask).bwd(do, q, k, v, o, lse, mask, scale, dlse, **_extras(segments, positions, softcap))

    return BlockBackend("auto", fwd, bwd)


def capped_backend(backend: BlockBackend, softcap: float) -> BlockBackend:
    """``backend`` with every block soft-capped at ``softcap``: a block runs on ``backend``'s
    kernels, given ``softcap=``, where its ``supports(mask, dtype, softcap=True)`` says they
    apply it, and on the portable kernel (``"reference"``) otherwise — as the aten adapters run
    the masks they cannot compute — never uncapped. (An aten backend named explicitly with a
    softcap therefore runs every block on the portable kernel: none applies soft-capping.)"""
    def pick(q, mask) -> BlockBackend:
        return backend if _REGISTRY.caps(backend, mask, q.dtype) else _BACKENDS["reference"]

    def fwd(q, k, v, mask, scale, segments=None, positions=None):
        return pick(q, mask).fwd(q, k, v, mask, scale, **_extras(segments, positions, softcap))

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None):
        return pick(q, mask).bwd(do, q, k, v, o, lse, mask, scale, dlse, **_extras(segments, positions, softcap))

    return BlockBackend(backend.name, fwd, bwd, supports=backend.supports, available=backend.available)


_REGISTRY: BackendRegistry[BlockBackend] = BackendRegistry(
    AUTO_ROUTES, NONDETERMINISTIC_WHEN_REQUESTED, refusal=_refusal,
    warn_only=lambda: torch.is_deterministic_algorithms_warn_only_enabled(), dtype_name=_dtype_name,
    process_device_kinds=_process_device_kinds, routing=routing_backend, capped=capped_backend)
_BACKENDS: dict[str, BlockBackend] = _REGISTRY.backends  # the kernels/ modules fill it (register_backend)


def register_backend(backend: BlockBackend) -> None:
    """Make ``backend`` selectable by name (tests use this to count kernel calls)."""
    _REGISTRY.register(backend)


def resolve_backend(name: str, *, device_kind: str, dtype, mask, deterministic: bool = False,
                    softcap: bool = False) -> str:
    """The concrete backend that runs a block of ``dtype`` under ``mask`` (a BlockMask, MaskKind
    or its value) on ``device_kind`` when ``name`` is asked for: ``name`` itself (checked), or for
    ``"auto"`` the backend of the first matching row of :data:`AUTO_ROUTES` that is available and
    supports the mask in that dtype. ``softcap``: the block is soft-capped — a named backend that
    does not apply soft-capping to it runs it on ``"reference"`` instead (:func:`capped_backend`),
    and "auto" takes only rows whose backend does (``seqplan.registry.BackendRegistry.resolve``)."""
    return _REGISTRY.resolve(name, device_kind=device_kind, dtype=dtype, mask=mask, deterministic=deterministic,
                             softcap=softcap)


def get_backend(name: str = "auto", *, deterministic: bool = False, softcap: float | None = None) -> BlockBackend:
    """The backend called ``name``. ``"auto"`` is :func:`routing_backend` — or, when every row this
    process can reach names one backend (a CPU-only process: ``reference``), that backend itself.
    ``deterministic=True`` (the API's ``deterministic`` argument, which defaults to
    ``torch.are_deterministic_algorithms_enabled()``) refuses a backend measured non-deterministic
    in that mode — or warns, under ``torch.use_deterministic_algorithms(True, warn_only=True)``, as
    torch's own ops do — and "auto" avoids it. ``softcap`` (a float, or None): the kernels
    soft-cap every block — "auto" routes each block to a backend that applies it, a named backend
    runs on its own kernels only the blocks it can cap (:func:`capped_backend`)."""
    return _REGISTRY.get(name, deterministic=deterministic, softcap=softcap)
