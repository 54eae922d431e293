"""Tier 1 — jax_impl and torch_impl mirror each other file for file and name for name (they may not
import each other), and keep no copies: what is framework-free lives once, in seqplan/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A function or class body of fewer statements (nested ones counted) may be written in both: a
# one-line adapter that binds a framework's piece to seqplan's logic (``make_config``,
# ``AttentionConfig.backend``, ``get_backend``) reads the same in both and is no copy of logic.
MIN_STATEMENTS = 3

# Bodies still written in both implementations, outside what has moved to seqplan so far (issue 50):
# (jax_impl definition, torch_impl definition) -> why it is still there. Each entry is a debt; the
# test fails on an entry whose pair is no longer a copy, so the list can only shrink.
KNOWN_COPIES: dict[tuple[str, str], str] = {}


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _bodies(source: str, file: str) -> dict[str, list[str]]:
    """Normalised body (AST dump, docstrings dropped: comments and positions are not in the AST)
    -> the ``file:Qualified.name`` of every function and class of ``source`` with that body and
    at least ``MIN_STATEMENTS`` statements."""
    found: dict[str, list[str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                statements = sum(isinstance(s, ast.stmt) for top in child.body for s in ast.walk(top))
                if statements >= MIN_STATEMENTS:
                    found.setdefault(ast.dump(ast.Module(body=child.body, type_ignores=[])), []).append(f"{file}:{name}")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(_without_docstrings(ast.parse(source)), "")
    return found


def _package_bodies(package: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for body, names in _bodies(path.read_text(), str(path.relative_to(ROOT / package))).items():
            found.setdefault(body, []).extend(names)
    return found


def _copies(jax_bodies: dict[str, list[str]], torch_bodies: dict[str, list[str]]) -> set[tuple[str, str]]:
    """(jax_impl definition, torch_impl definition) of every body written in both."""
    return {(j, t) for body in jax_bodies.keys() & torch_bodies.keys() for j in jax_bodies[body]
            for t in torch_bodies[body]}


def test_the_copy_detector_sees_through_docstrings_comments_and_names():
    """The detector itself: a body copied under another name, with another docstring and comments,
    is found; a body that differs in one identifier, or is shorter than MIN_STATEMENTS, is not."""
    jax_source = '''
def resolve(name, table):
    """JAX's words."""
    if name not in table:  # unknown
        raise ValueError(name)
    return table[name]

class Registry:
    def check(self, name):
        if name not in self.table:
            raise ValueError(name)
        return self.table[name]

def short(x):
    return x + 1
'''
    torch_source = '''
def pick(name, table):
    """torch's words, another name."""
    if name not in table:
        raise ValueError(name)
    return table[name]

def check(self, name):
    if name not in self.backends:
        raise ValueError(name)
    return self.backends[name]

def short(x):
    return x + 1
'''
    assert _copies(_bodies(jax_source, "a.py"), _bodies(torch_source, "b.py")) == {("a.py:resolve", "b.py:pick")}


def test_no_function_or_class_body_is_written_twice():
    """Nothing framework-free is copied between the mirrors: no function or class body (of at
    least MIN_STATEMENTS statements) under jax_impl/ is also under torch_impl/, byte for byte
    after dropping docstrings and comments, beyond the commented KNOWN_COPIES."""
    copies = _copies(_package_bodies("jax_impl"), _package_bodies("torch_impl"))
    assert not copies - KNOWN_COPIES.keys(), sorted(copies - KNOWN_COPIES.keys())
    assert not KNOWN_COPIES.keys() - copies, f"no longer copies, drop from KNOWN_COPIES: {sorted(KNOWN_COPIES.keys() - copies)}"


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
        # its own backward). A window's halo (the rows a trimmed hop carries): JAX's shift_halo
        # (traced slices and pads around the ppermute) is inside torch's KVWalk / DKVTrail (the rows
        # sent, then copied into place after the wait).
        jax_only = {"partition_specs", "ring_shift", "diagonal_shift", "walk", "visit_block", "shift_halo"}
        torch_only = {"global_shape", "RingShift", "check_ranks_agree", "merge_partials_into", "KVWalk", "DKVTrail",
                      "add_grads", "walk_backward"}
        # Packed documents: both gather the ids once (gather_segment_ids) and decide per block with
        # schedule.document_flags. JAX decides inside the traced program — under_masks (one
        # lax.switch: skip / static mask / + documents / + window), local_forward / local_backward (the own
        # block's switch), shard_of / visit_masks (slices of the gathered [b, R·t] and the
        # traced shard pair); torch decides in Python — block_work (the DocumentWork of a concrete
        # block) and attend_block (a block's (o, lse), or None when skipped).
        jax_only |= {"under_masks", "local_forward", "local_backward", "shard_of", "visit_masks"}
        torch_only |= {"block_work", "attend_block"}
        # The batch's ids on the host (host_ids, HostIds, HostShards, declared_host_ids): torch plans
        # its blocks on the host from a copy of the gathered ids, which waits for the GPU; JAX plans
        # them on the device inside the traced program and makes no such copy. host_to_device (comm.py):
        # torch's upload of host plans and ids without a sync; XLA places JAX's arguments itself.
        torch_only |= {"host_ids", "HostIds", "HostShards", "declared_host_ids", "host_to_device"}
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
        # alone_grad_dtypes / GradDtypes: the same for the own block's dq and dK / dV.
        jax_only |= {"alone_dtype", "alone_grad_dtypes", "GradDtypes"}
        # local_attention is JAX's per-device entry point (inside the caller's shard_map): torch's
        # sequence_parallel_attention already takes each rank's local shards.
        jax_only |= {"local_attention"}
        # crop_block is in both (a windowed block cropped to its band, seqplan.bands.crop_to_band);
        # torch's also crops a token-index block to the documents both sides hold (host ids, eager
        # shapes; BlockGrads carries the cropped block to add_grads), which JAX's static shapes cannot.
        torch_only |= {"BlockGrads"}
        # all-gather-KV's one call in JAX decides on the device and falls back, inside one
        # lax.switch, to the portable kernel over every gathered key (gathered_masks,
        # portable_forward / portable_backward); torch decides on the host and walks the blocks
        # with the configured kernel.
        jax_only |= {"gathered_masks", "portable_forward", "portable_backward"}
        # Ulysses in head groups: torch issues each group's all-to-alls asynchronously and waits where
        # they are read (PendingAllToAll over InFlight; start_seq_to_heads / start_heads_to_seq), its
        # ulysses walks the groups in _in_head_groups; JAX writes the groups as separate all-to-alls
        # (_split_heads, _through_heads) and XLA's scheduler places them.
        torch_only |= {"InFlight", "PendingAllToAll", "start_seq_to_heads", "start_heads_to_seq"}
        # masked / mask_choice: the names of under_masks' lax.switch variants and which one a block
        # takes (kernels/branches.py turns them into the switch's index); torch decides in Python.
        jax_only |= {"masked", "mask_choice"}
        # One walk per framework, shared by ring, double ring, all-gather KV and the replay. JAX's
        # walk is traced and calls a visit per step: forward_visit / backward_visit build those
        # callbacks, resident_kv slices a resident shard (all-gather, replay) for them, and
        # DKVAccumulation (TRAVELLING, per_shard_accumulation) says how a traced backward's dK / dV
        # state is kept. torch's walk is an eager loop over (visit, kv) pairs: attend_visits /
        # grad_visits consume any such iterator (KVWalk, all-gather's gathered shards, the replay's
        # resident ones) and ShardGrads is the in-place per-shard twin of DKVTrail.
        jax_only |= {"forward_visit", "backward_visit", "resident_kv", "DKVAccumulation", "TRAVELLING",
                     "per_shard_accumulation"}
        torch_only |= {"attend_visits", "grad_visits", "ShardGrads"}
        # Deterministic mode: both hold it while a call's kernels run (deterministic_kernels: torch
        # its strict switch, JAX a flag while the backward is traced); torch's kernels read torch's
        # switch, JAX's FA3 calls read kernels_deterministic. XLA reads its own flag only at
        # start-up, which check_deterministic_ready asks for in both.
        jax_only |= {"kernels_deterministic"}
        assert jax_names - jax_only == torch_names - torch_only, name
