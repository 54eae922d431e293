"""Tier 1 — jax_impl and torch_impl mirror each other file for file and name for name (they may not
import each other), and keep no copies: what is framework-free lives once, in seqplan/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_file_is_kept_twice():
    """Nothing framework-free is copied between the mirrors: no .py file under jax_impl/ has a
    byte-identical twin under torch_impl/ (shared code lives in seqplan/, imported by both)."""
    twins = [str(p.relative_to(ROOT / "jax_impl")) for p in (ROOT / "jax_impl").rglob("*.py")
             if (ROOT / "torch_impl" / p.relative_to(ROOT / "jax_impl")).is_file()
             and p.read_bytes() == (ROOT / "torch_impl" / p.relative_to(ROOT / "jax_impl")).read_bytes()]
    assert not twins, twins


def test_mirrors_have_the_same_files_and_public_names():
    jax_files = {p.name for p in (ROOT / "jax_impl").glob("*.py")}
    # hf.py: Hugging Face transformers (5.x) has torch models only, so only torch_impl registers
    # itself as their attention implementation.
    torch_files = {p.name for p in (ROOT / "torch_impl").glob("*.py")} - {"hf.py"}
    assert jax_files == torch_files

    def public(path):
        tree = ast.parse(path.read_text())
        return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}

    for name in sorted(jax_files - {"__init__.py"}):
        jax_names, torch_names = public(ROOT / "jax_impl" / name), public(ROOT / "torch_impl" / name)
        # Framework-shaped pairs: JAX's ring_shift and diagonal_shift (ppermutes XLA schedules) are
        # torch's RingShift and RingShift.diagonal (start/wait around the compute, reused
        # buffers); partition_specs (JAX shardings) and global_shape (torch's local shards) each
        # describe placement in their framework's terms. check_ranks_agree exists for torch's
        # per-rank local shards only (JAX's global arrays have one shape by construction);
        # merge_partials_into is the in-place merge (XLA reuses buffers by itself). Walking the
        # schedule: JAX's walk (scans, traced steps) and visit_block (the per-device lax.cond) are
        # torch's KVWalk / DKVTrail (start/wait, reused buffers, concrete visits) and add_grads
        # (in-place accumulation; JAX's grad_block returns the sums). walk_forward is the ring's
        # and the double ring's one forward in both; torch's walk_backward is their one backward
        # too (JAX's double ring sends its backward's K/V as raw bits, so each JAX variant keeps
        # its own backward).
        jax_only = {"partition_specs", "ring_shift", "diagonal_shift", "walk", "visit_block"}
        torch_only = {"global_shape", "RingShift", "check_ranks_agree", "merge_partials_into", "KVWalk", "DKVTrail",
                      "add_grads", "walk_backward"}
        # Packed documents: both gather the ids once (gather_segment_ids) and decide per block with
        # schedule.document_flags. JAX decides inside the traced program — under_masks (one
        # lax.switch: skip / static mask / + documents / + window), local_forward / local_backward (the own
        # block's switch), shard_ids / visit_masks (slices of the gathered [b, R·t] and the
        # traced shard pair); torch decides in Python — block_work (the DocumentWork of a concrete
        # block) and attend_block (a block's (o, lse), or None when skipped).
        jax_only |= {"under_masks", "local_forward", "local_backward", "shard_ids", "visit_masks"}
        torch_only |= {"block_work", "attend_block"}
        # Windows (and documents) per visit: JAX builds a visit's mask keywords inside the traced
        # program (visit_masks: a dict; under_masks: one lax.switch over skip / mask variants);
        # torch carries them as Python objects, per call (ShardMasks, kept on the autograd
        # context) and per visit (VisitMasks), and decides per block in Python. Both share
        # add_sinks and sinks_grad (ring_positions is seqplan's); varying_like types JAX's replicated sinks like q
        # for shard_map's check_vma (torch has no such types).
        jax_only |= {"varying_like"}
        torch_only |= {"ShardMasks", "VisitMasks"}
        # alone_dtype: the dtype JAX's own block is cast to inside each lax.switch variant (a
        # device's only block goes straight to the caller's dtype; XLA keeps a float32 copy at a
        # switch boundary otherwise); torch's block calls are eager and return the kernel's dtype.
        jax_only |= {"alone_dtype"}
        # local_attention is JAX's per-device entry point (inside the caller's shard_map): torch's
        # sequence_parallel_attention already takes each rank's local shards.
        jax_only |= {"local_attention"}
        # crop_block: torch crops a token-index block to the documents both sides hold (host ids,
        # eager shapes; BlockGrads carries the cropped block to add_grads); JAX's shapes are
        # static, so its blocks stay whole.
        torch_only |= {"crop_block", "BlockGrads"}
        # portable_config: all-gather-KV's one call in JAX decides on the device and falls back,
        # inside one lax.switch, to the blocks on the portable kernel; torch decides on the host
        # and walks the blocks with the configured kernel.
        jax_only |= {"portable_config"}
        assert jax_names - jax_only == torch_names - torch_only, name
