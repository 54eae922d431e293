"""Overlap probes: the same ring program with its communication or its compute taken out.

    compute-only: every K/V (and dK/dV) hop is replaced by a local copy of the buffer rolled by
                  one token (JAX) / copied into the receive buffer (torch): the same kernels on
                  different data each step, so XLA cannot merge identical steps, and no bytes move.
                  The hops are replaced through each framework's communication hook
                  (``comm.Comm`` installed with ``comm.using``), which every ring, all-gather and
                  double-ring transfer goes through;
    comm-only:    the block kernels are replaced by a "probe" backend that returns zeros that
                  depend on one element of K and V (so no hop is dead code): the same hops, no
                  attention math.

If the ring overlaps its transfers with compute, full ≈ max(compute-only, comm-only); with no
overlap, full ≈ their sum. The rows carry ``extra["variant"]``; only ring meshes are probed.
"""

from __future__ import annotations

import contextlib

VARIANTS = ("compute-only", "comm-only")


def probe_rows(impl_rows, variant_context, problem, spec, layout: str, backend: str, iters: int, warmup: int) -> list:
    """A ring mesh's forward+backward in each variant: ``impl_rows`` of one benchmark side, run
    inside that side's ``variant_context`` (``jax_variant`` or ``torch_variant``)."""
    rows = []
    for variant in VARIANTS:
        with variant_context(variant) as probe_backend:
            rows += impl_rows(problem, spec, layout, probe_backend or backend, iters, warmup, fwd_modes=(False,),
                              variant=variant)
    return rows


@contextlib.contextmanager
def jax_variant(variant: str):
    """jax_impl for one variant; yields the block backend name to use (None: unchanged)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.block import BlockBackend, register_backend
    from jax_impl.comm import Comm, using

    if variant == "compute-only":
        class LocalRoll(Comm):
            """Every hop a local roll by one token: no bytes move."""

            def shift(self, tree, hop, axes):
                return jax.tree.map(lambda x: jnp.roll(x, 1, axis=1), tree)

        with using(LocalRoll()):
            yield None
        return

    def touch(q, k, v):  # [b, 1, 1, 1] f32, zero, but reading K and V
        return (k[:, :1, :1, :1].astype(jnp.float32) + v[:, :1, :1, :1].astype(jnp.float32)) * 0.0

    def fwd(q, k, v, mask, scale):
        b, t, h, _ = q.shape
        return jnp.zeros(q.shape, jnp.float32) + touch(q, k, v), jnp.zeros((b, h, t), jnp.float32)

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None):
        z = touch(q, k, v)
        return (jnp.zeros(q.shape, jnp.float32) + z, jnp.zeros(k.shape, jnp.float32) + z,
                jnp.zeros(v.shape, jnp.float32) + z)

    register_backend(BlockBackend("probe", fwd, bwd))
    yield "probe"


class _LocalCopy:
    """A torch transfer (``start``/``wait``) that copies into the receive buffer: no bytes move."""

    def start(self, tensors, into) -> None:
        for src, dst in zip(tensors, into):
            dst.copy_(src)

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def torch_variant(variant: str):
    """torch_impl for one variant; yields the block backend name to use (None: unchanged)."""
    import torch

    from torch_impl.block import BlockBackend, register_backend
    from torch_impl.comm import Comm, using

    if variant == "compute-only":
        class LocalCopy(Comm):
            """Every hop a local copy into the receive buffer."""

            def shift(self, hop, groups):
                return _LocalCopy()

        with using(LocalCopy()):
            yield None
        return

    def touch(k, v):
        return (k[:, :1, :1, :1].float() + v[:, :1, :1, :1].float()) * 0.0

    def fwd(q, k, v, mask, scale):
        b, t, h, _ = q.shape
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device) + touch(k, v),
                torch.zeros((b, h, t), dtype=torch.float32, device=q.device))

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None):
        z = touch(k, v)
        return tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) + z for x in (q, k, v))

    register_backend(BlockBackend("probe", fwd, bwd))
    yield "probe"
