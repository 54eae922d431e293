"""The local block kernel's interface, the registry of backends, and ``"auto"``: the routing table.
The registry's logic (names, capabilities, determinism, resolving "auto") is ``seqplan.registry``,
written once; this module gives it the framework's pieces and the kernel wrappers.

    block_fwd(q, k, v, mask, scale, segments=None, positions=None, softcap=None)                   -> (o, lse)
    block_bwd(do, q, k, v, o, lse, mask, scale, dlse, segments=None, positions=None, softcap=None) -> (dq, dk, dv)

q, do, o: [b, t, h, d]; k, v: [b, s, hk, d]; lse, dlse: [b, h, t] float32; o and the gradients
float32, or the inputs' dtype where a fused kernel computed them there (never widened by an
adapter: the loops cast where they merge or accumulate, in float32, and a device's only block
goes straight to the caller's dtype). ``mask`` is a :class:`schedule.BlockMask` (full / causal / strict, each optionally with
documents and a window); ``segments = (q_ids [b, t], kv_ids [b, s])`` is given exactly when
``mask.documents``, ``positions = (q_pos [t], kv_pos [s])`` (int32 original positions) exactly
when ``mask.window`` is set (the loops pass each as a keyword, and only then: kernels written
before them need not take it). ``softcap`` (a float: every scaled logit x becomes softcap ·
tanh(x / softcap) before the softmax, Gemma 2's logit soft-capping) is given, by keyword, only
when the call has one, and only to a backend whose ``supports(mask, dtype, softcap=True)`` says
its kernels apply it (:func:`capped_backend`, :func:`routing_backend`): a kernel that does not
know the keyword fails loudly instead of computing uncapped attention. ``block_bwd`` takes the
*global* ``o`` and ``lse`` (after every block was merged), which is what makes per-block gradients
sum to the true gradient.

**Backends** live in ``kernels/``, one module per kernel family, each registering itself here
(``jax_impl/kernels/__init__.py`` imports them; none imports an optional package at module
level): ``reference`` (portable einsum, float32, any device), ``cudnn`` (XLA's cuDNN fused
attention), ``fa3`` (FlashAttention-3 through flash_attn3_jax, Hopper). Only ``reference``
implements soft-capping (flash_attn3_jax 0.2.3's wheel has no softcap kernels; XLA's cuDNN
attention takes none). ``kernels/`` is the one
folder where jax_impl and torch_impl differ by nature — each binds its own framework's kernels —
while the algorithm files mirror each other.

**"auto"** is a routing backend: every block call resolves (device kind of the inputs, dtype,
block mask, deterministic) to a concrete backend through :data:`AUTO_ROUTES` — the first row that
matches and whose backend is registered and available — so one attention call may run its causal
diagonal and its full off-diagonal blocks on different kernels. :func:`resolve_backend` gives the
same answer as a name, for reports and benchmark rows. Inside ``jit`` the inputs have no device,
so a traced call resolves for the default device (``jax.devices()[0]``: the platform ``jit``
compiles for unless told otherwise); to force a kernel, name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from seqplan.registry import BackendRegistry
from seqplan.routing import ALL_MASKS, LOW_PRECISION, Route
from seqplan.schedule import BlockMask as BlockMask  # re-exported: callers build block.BlockMask (parity's sweep)
from seqplan.schedule import MaskKind

F32 = jnp.float32


@dataclass(frozen=True)
class BlockBackend:
    """A pair of block kernels with the signatures in the module docstring."""

    name: str
    fwd: Callable
    bwd: Callable
    # False when the kernels' outputs carry no shard_map "varying axes" type (flash_attn3_jax's
    # primitives): the API then runs shard_map with check_vma=False.
    typed_for_shard_map: bool = True
    # supports(mask, dtype name, softcap=False) -> whether the kernels compute that block mask in
    # that dtype (soft-capped, when softcap is True: their fwd / bwd then take softcap=). By
    # default every mask and dtype, never soft-capping: a backend opts in.
    supports: Callable[..., bool] = lambda mask, dtype, softcap=False: not softcap
    # available() -> whether the kernels can run in this process (an optional package of the
    # verified version is installed): "auto" routes only to available backends.
    available: Callable[[], bool] = lambda: True
    # True when the kernels run a windowed block faster given its parts' static position offset
    # (BlockMask.offset): the loops then compile one variant per distinct offset of a block.
    window_offsets: bool = False
    # one_run_documents(q, mask) -> True when the kernels run the document mask ``mask`` on these
    # queries as varlen runs, so one document covering the block is one run at the plain kernel's
    # speed: a device's own block then compiles no plain variant beside its document one (one
    # run-time switch fewer a pass: loop.under_masks, docs/decisions.md).
    one_run_documents: Callable[..., bool] = lambda q, mask: False


# Run-to-run determinism, measured on H200 (``python -m parity determinism``, 2026-11-22): the
# fused backwards accumulate dq with atomics, so dq differs between identical runs for cudnn and
# fa3; with XLA_FLAGS=--xla_gpu_deterministic_ops=true XLA makes cudnn deterministic. FA3's
# backward has a deterministic mode of its own, which fa3 and fa3_varlen ask for while a call that
# wants determinism is traced (``config.deterministic_kernels``): bitwise reproducible, 1.10-1.12x its
# default step (H200, 2026-11-29: docs/gpu/determinism-fa3-2026-11-29-h200.md). "reference" and
# every forward were bitwise reproducible. None is refused.
NONDETERMINISTIC_WHEN_REQUESTED: frozenset[str] = frozenset()


# ---- "auto": the routing table --------------------------------------------------------------------

# First match wins; a row whose backend is not available (fa3 not installed at its verified
# version) is passed over. Speeds: docs/gpu/kernel-table-2026-11-23-h100.md (H100, bf16, 32k
# tokens, 32 heads, d 128, fwd+bwd TFLOP/s), each pair verified there against a float64 truth.
AUTO_ROUTES: tuple[Route, ...] = (
    Route("reference", "float32 is held to 1e-5 relative: only the portable kernel computes in float32",
          dtypes=("float32",)),
    Route("reference", "no fused kernel on the CPU", device_kinds=("cpu",)),
    Route("fa3", "fastest verified in bf16: 632 / 600 / 598 TFLOP/s full / causal / strict vs cuDNN "
          "573 / 556 / 541 (needs flash_attn3_jax 0.2.3; fp16 not yet verified on a GPU); windowed blocks whose "
          "parts are position runs (BlockMask.offset) on FA3's own window, cropped to the band; deterministic "
          "mode on FA3's deterministic backward: 56.4 ms at 32k causal against cuDNN's 74.4 (H200, 2026-11-29)",
          device_kinds=("cuda",), dtypes=("bfloat16",), masks=ALL_MASKS),
    Route("cudnn", "verified bf16 and fp16 (fp16 resolves here, not to fa3, until fa3's fp16 is verified)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION),
    Route("fa3_varlen", "document blocks (full, causal diagonal; one run per document, at most runs.VARLEN_MAX_RUNS per "
          "row, else the portable kernel by lax.cond) and token-index causal blocks (runs.index_dispatch) on FA3 "
          "varlen: docs/gpu/masked-2026-11-24-h100.md; deterministic mode on FA3's deterministic backward, "
          "1.10-1.12x its default step (docs/gpu/determinism-fa3-2026-11-29-h200.md; needs flash_attn3_jax 0.2.3)",
          device_kinds=("cuda",), dtypes=LOW_PRECISION, masks=(MaskKind.FULL, MaskKind.CAUSAL)),
    Route("reference", "any other platform, and every block no fused kernel takes: the portable kernel"),
)


def _kind(device) -> str:
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in getattr(device.client, "platform_version", "").lower() else "cuda"


def device_kind_of(x) -> str:
    """The kind of device ``x`` lives on: "cpu", "cuda", "rocm", "tpu", ... A traced value has no
    device: the default device's kind (see the module docstring)."""
    concrete = not isinstance(x, jax.core.Tracer) and hasattr(x, "devices")
    return _kind(next(iter(x.devices())) if concrete else jax.devices()[0])


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else jnp.dtype(dtype).name


def _refusal(name: str) -> str:
    return (f"block backend {name!r} is not deterministic (its backward's dq differs between identical "
            "runs) and deterministic=True (by default: XLA_FLAGS has "
            "--xla_gpu_deterministic_ops=true): use 'auto', 'fa3', 'fa3_varlen', 'cudnn' or 'reference'")


def _process_device_kinds() -> set[str]:
    return {"cpu", _kind(jax.devices()[0])}


def _softcap_keyword(softcap: float | None) -> dict:
    """The kernels' ``softcap=`` keyword: given only when the call soft-caps (module docstring)."""
    return {} if softcap is None else {"softcap": softcap}


def routing_backend(deterministic: bool = False, softcap: float | None = None) -> BlockBackend:
    """The ``"auto"`` backend: each call resolved by :func:`resolve_backend` from its inputs (and,
    with ``softcap``, only to backends that soft-cap, given ``softcap=``).
    ``typed_for_shard_map`` is False when any backend it may route to in this process is."""
    capped = _softcap_keyword(softcap)

    def pick(q, mask) -> BlockBackend:
        return _BACKENDS[resolve_backend("auto", device_kind=device_kind_of(q), dtype=q.dtype, mask=mask,
                                         deterministic=deterministic, softcap=softcap is not None)]

    def fwd(q, k, v, mask, scale, **mask_arrays):  # segments= / positions=, as the mask needs
        return pick(q, mask).fwd(q, k, v, mask, scale, **mask_arrays, **capped)

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, **mask_arrays):
        return pick(q, mask).bwd(do, q, k, v, o, lse, mask, scale, dlse, **mask_arrays, **capped)

    names = _REGISTRY.reachable_here(deterministic)
    typed = all(_BACKENDS[n].typed_for_shard_map for n in names)
    # capped blocks all run on the portable kernel: no variant per window offset to compile
    def one_run_documents(q, mask) -> bool:  # capped blocks: as capped_backend, never
        return softcap is None and pick(q, mask).one_run_documents(q, mask)

    return BlockBackend("auto", fwd, bwd, typed_for_shard_map=typed,
                        window_offsets=softcap is None and any(_BACKENDS[n].window_offsets for n in names),
                        one_run_documents=one_run_documents)


def capped_backend(backend: BlockBackend, softcap: float) -> BlockBackend:
    """``backend`` with every block soft-capped at ``softcap``: a block runs on ``backend``'s
    kernels, given ``softcap=``, where its ``supports(mask, dtype, softcap=True)`` says they
    apply it, and on the portable kernel (``"reference"``) otherwise — as the fused adapters run
    the masks they cannot compute — never uncapped. (A fused backend named explicitly with a
    softcap therefore runs every block on the portable kernel: none applies soft-capping.)"""
    def pick(q, mask) -> BlockBackend:
        return backend if _REGISTRY.caps(backend, mask, q.dtype) else _BACKENDS["reference"]

    def fwd(q, k, v, mask, scale, **mask_arrays):
        return pick(q, mask).fwd(q, k, v, mask, scale, softcap=softcap, **mask_arrays)

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, **mask_arrays):
        return pick(q, mask).bwd(do, q, k, v, o, lse, mask, scale, dlse, softcap=softcap, **mask_arrays)

    return BlockBackend(backend.name, fwd, bwd, typed_for_shard_map=backend.typed_for_shard_map,
                        supports=backend.supports, available=backend.available)


_REGISTRY: BackendRegistry[BlockBackend] = BackendRegistry(
    AUTO_ROUTES, NONDETERMINISTIC_WHEN_REQUESTED, refusal=_refusal, warn_only=lambda: False, dtype_name=_dtype_name,
    process_device_kinds=_process_device_kinds, routing=routing_backend, capped=capped_backend)
_BACKENDS: dict[str, BlockBackend] = _REGISTRY.backends  # the kernels/ modules fill it (register_backend)


def register_backend(backend: BlockBackend) -> None:
    """Make ``backend`` selectable by name (tests use this to count kernel calls)."""
    _REGISTRY.register(backend)


def resolve_backend(name: str, *, device_kind: str, dtype, mask, deterministic: bool = False,
                    softcap: bool = False) -> str:
    """The concrete backend that runs a block of ``dtype`` under ``mask`` (a BlockMask, MaskKind
    or its value) on ``device_kind`` when ``name`` is asked for: ``name`` itself (checked), or for
    ``"auto"`` the backend of the first matching row of :data:`AUTO_ROUTES` that is available.
    ``softcap``: the block is soft-capped — a named backend that does not apply soft-capping to
    it runs it on ``"reference"`` instead (:func:`capped_backend`), and "auto" takes only rows
    whose backend does (``seqplan.registry.BackendRegistry.resolve``)."""
    return _REGISTRY.resolve(name, device_kind=device_kind, dtype=dtype, mask=mask, deterministic=deterministic,
                             softcap=softcap)


def get_backend(name: str = "auto", *, deterministic: bool = False, softcap: float | None = None) -> BlockBackend:
    """The backend called ``name``. ``"auto"`` is :func:`routing_backend` — or, when every row this
    process can reach names one backend (a CPU-only process: ``reference``), that backend itself.
    ``deterministic=True`` (the API's ``deterministic`` argument, which defaults to whether
    XLA_FLAGS has ``--xla_gpu_deterministic_ops=true``) refuses a backend measured
    non-deterministic in that mode (none today: FA3's kernels take their deterministic backward,
    ``config.deterministic_kernels``), and "auto" avoids it. XLA reads its flags when the backend
    starts, so this cannot make XLA's own ops deterministic.
    ``softcap`` (a float, or None): the kernels soft-cap every block — "auto" routes each block
    to a backend that applies it, a named backend runs on its own kernels only the blocks it can
    cap (:func:`capped_backend`)."""
    return _REGISTRY.get(name, deterministic=deterministic, softcap=softcap)
