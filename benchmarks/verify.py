"""Benchmarks time only verified work: each row's exact path — framework, strategy (mesh), layout,
block backend, and so the mask kinds its schedule produces — is first run on a *reduced* problem
(same heads ratio, head_dim, dtype, causality; ``REDUCED_SEQ`` tokens) through the parity
pipeline (``parity.runners.pipeline.check_case``: float64 truth, dense same-dtype control, the
numerics policy). A row whose path fails is reported as failing: its throughput is removed and the
reason goes into its note. Rows of other projects' code (torch_cp, yunchang, fa3_jax, ceilings)
are not ringbridge's path and carry ``verified = None``.

A verdict is computed once per distinct path and reused by every row (sequence length and
fwd/fwd+bwd do not change the path). The multi-GPU driver verifies every planned path BEFORE it
times anything (``python -m benchmarks.verify``, its own process: the GPUs are free again for the
timing sides when it exits) and writes the verdicts to ``verdicts.json`` as they come; the rows
are marked from that file (:func:`mark_rows`), so a run cut short keeps verified rows.

    python -m benchmarks.verify --out verdicts.json [the driver's flags]
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .common import SHARED_HYBRID, MeshSpec, Problem, Row, is_row_layout, row_layout_name

REDUCED_SEQ = 2048  # divisible by 2·R·U for every mesh of up to 8 devices (zigzag's constraint)
OURS = {"jax_impl": "jax", "jax_impl_mc": "jax", "torch_impl": "torch",
        "jax_impl_replay": "jax", "torch_impl_replay": "torch"}


def _grouped_heads(ulysses: int, problem: Problem) -> tuple[int, int] | None:
    """With Ulysses head groups (``RINGBRIDGE_HEAD_GROUPS`` > 1 on a Ulysses mesh), the reduced
    head counts that take the row's path: G groups whose K/V heads relate to U as the row's do (a
    group with at least U K/V heads splits them, asynchronously; one with fewer replicates them) —
    8 query heads would give 4 groups no whole K/V head. None: no groups, or counts G does not
    divide (the call then refuses them, as the row's would)."""
    from seqplan.config import default_head_groups

    groups = default_head_groups(None, ulysses)
    if groups == 1 or problem.kv_heads % groups or problem.heads % problem.kv_heads:
        return None
    kv_heads = groups * min(problem.kv_heads // groups, ulysses)
    return kv_heads * (problem.heads // problem.kv_heads), kv_heads


def reduced_case(shape, layout: str, problem: Problem):
    """The parity ``Case`` of a row's path: the mesh ``shape`` (a ``parity.core.mesh.MeshShape``),
    at ``REDUCED_SEQ`` tokens with 8 query heads (kv heads in the problem's ratio, at least 1; with
    Ulysses head groups as many as the groups' path needs: :func:`_grouped_heads`), the
    problem's document pattern and its window scaled to the reduced length; a per-row ``layout``
    (document-zigzag, document-hybrid, document-hybrid-shared) as the token-index case of that row
    layout; the backward with o's cotangent alone, as the timed step."""
    from parity.core.cases import Case

    heads = 8
    kv_heads = max(1, heads * problem.kv_heads // problem.heads)
    heads, kv_heads = _grouped_heads(shape.ulysses, problem) or (heads, kv_heads)
    # o's cotangent alone, as the timed step (its backward on the fused varlen kernels takes no dlse)
    masks = {"lse_cotangent": False}
    shared = layout == SHARED_HYBRID
    if is_row_layout(layout):  # a per-row layout: explicit token indices, the static name only fixes divisibility
        masks.update(token_index=True, row_layout=row_layout_name(layout), shared_prefix=shared)
        layout = "contiguous"
    if getattr(problem, "documents", "none") != "none":
        from .documents import mix_names

        # a balance mix (long documents) has no reduced form: the harness's "mix" pattern stands in — or,
        # for the shared prefix, "short" (under "mix" the reduced hybrid shares every token: one part only)
        masks["documents"] = ("short" if shared else "mix") if problem.documents in mix_names() else problem.documents
    if getattr(problem, "window", None) is not None:  # the same reach in shards: the same skipped and truncated steps
        masks["window"] = tuple(max(1, round(w * REDUCED_SEQ / problem.seq)) if w else 0 for w in problem.window)
    return Case(ring=shape.ring, ulysses=shape.ulysses, ring_outer=shape.ring_outer, kv_exchange=shape.kv_exchange,
                seq=REDUCED_SEQ, heads=heads, kv_heads=kv_heads, head_dim=problem.head_dim, layout=layout,
                causal=problem.causal, dtype=problem.dtype, **masks)


def verify_path(framework: str, case, backend: str, devices: str = "gpu", replay: bool = False,
                seed: int = 0) -> tuple[bool, str]:
    """(passed, detail) of ``case`` through ``check_case`` with ``framework``'s runner of
    ``backend`` — the mesh run, or with ``replay`` the one-device replay."""
    from parity.core.inputs import make_inputs
    from parity.runners.base import Unavailable, load_runner
    from parity.runners.pipeline import check_case

    base = load_runner(framework)
    if isinstance(base, Unavailable):
        return False, base.reason
    runner = type(base)(block_backend=backend)
    if replay:
        runner = runner.replay(devices)
    x = make_inputs(case, seed)
    ref = None
    if devices == "gpu":
        from parity.runners.replay_runner import torch_device
        from parity.runners.torch_truth import case_truth

        ref = case_truth(case, x, torch_device(devices))
    side = check_case(case, runner, x=x, ref=ref, devices=devices)
    worst = max(side.errors, key=side.errors.get) if side.errors else ""
    detail = side.detail.strip() or (f"worst {worst} error {side.errors[worst]:.2e}" if worst else "")
    return side.status == "passed", f"{side.status} ({side.mode}): {detail}"[:300]


def mark(row: Row, verdict: tuple[bool, str] | None) -> Row:
    """Set the row's ``verified``; a failed verification removes its throughput."""
    if verdict is None:
        row.verified = None
        return row
    row.verified, detail = verdict
    if not row.verified:
        row.ms_per_iter = row.ms_spread = row.tflops_per_gpu = row.efficiency = None
        row.extra.pop("queued_ms", None)  # no time of a path that failed its check, queued or not
        row.note = f"NOT VERIFIED, not a throughput: {detail}; {row.note}".strip("; ")
    return row


def _row_problem(row: Row) -> Problem:
    window = row.extra.get("window")
    return Problem(seq=row.seq_len, heads=row.extra.get("heads", 32), kv_heads=row.extra.get("kv_heads", 32),
                   documents=row.extra.get("documents", "none"), window=None if window is None else tuple(window))


def path_key(framework: str, mesh: str, layout: str, backend: str, problem: Problem) -> str:
    """The verdict's key: what decides the path (not the sequence length, nor fwd / fwd+bwd)."""
    window = problem.window and tuple(max(1, round(w * REDUCED_SEQ / problem.seq)) if w else 0 for w in problem.window)
    documents = problem.documents if problem.documents == "none" else _reduced_documents(problem.documents)
    return "|".join(map(str, (framework, mesh, layout, backend, problem.kv_heads * 8 // problem.heads, documents,
                              window)))


def _reduced_documents(name: str) -> str:
    from .documents import mix_names

    return "mix" if name in mix_names() else name


@contextlib.contextmanager
def _split_backward_checked(framework: str):
    """With ``RINGBRIDGE_BACKWARD_GROUPS=2`` a JAX row's one-call backward splits its runs where that
    pays — which the reduced problem's short runs never do, so its check would pass on the one call
    alone: the check runs with "always" (the two calls wherever both hold runs) instead. Yields the
    note the verdict carries."""
    if framework != "jax" or os.environ.get("RINGBRIDGE_BACKWARD_GROUPS") != "2":
        yield ""
        return
    os.environ["RINGBRIDGE_BACKWARD_GROUPS"] = "always"
    try:
        yield " [one-call backward checked as two groups of runs: RINGBRIDGE_BACKWARD_GROUPS=always]"
    finally:
        os.environ["RINGBRIDGE_BACKWARD_GROUPS"] = "2"


def verify_one(framework: str, mesh: str, layout: str, backend: str, problem: Problem, devices: str) -> dict:
    """{"passed", "detail", "resolved"} of one path (``reduced_case`` through ``verify_path``)."""
    from parity.probes.backend_sweep import resolved_backends

    try:
        case = reduced_case(MeshSpec(mesh).shape, layout, problem)
        with _split_backward_checked(framework) as note:
            passed, detail = verify_path(framework, case, backend, devices)
        detail += note
    except Exception as err:  # noqa: BLE001 — a path that cannot be checked is not verified
        return {"passed": False, "detail": f"verification raised {type(err).__name__}: {str(err)[:300]}"}
    try:
        resolved = resolved_backends(framework, backend, case, devices)
    except Exception as err:  # noqa: BLE001 — the verdict stands; the record says why the kernels are missing
        resolved = {"error": f"{type(err).__name__}: {err}"}
    return {"passed": passed, "detail": detail, "resolved": resolved}


def mark_rows(rows: list[dict], verdicts: dict) -> list[dict]:
    """Each ringbridge mesh row marked from ``verdicts`` ({path_key: verify_one's record}); a row
    whose path has no verdict is not verified (no throughput); other rows keep ``verified``."""
    out = []
    for data in rows:
        row = Row(**{k: v for k, v in data.items() if k in Row.__dataclass_fields__})
        framework = OURS.get(row.framework)
        mesh = row.extra.get("mesh")
        if framework is None or not mesh or row.framework.endswith("_replay") or row.extra.get("variant"):
            out.append(data | {"verified": data.get("verified")})
            continue
        key = path_key(framework, mesh, row.layout, row.extra.get("block_backend", "auto"), _row_problem(row))
        verdict = verdicts.get(key)
        if verdict is not None and verdict.get("resolved"):
            row.extra["resolved"] = verdict["resolved"]
        out.append(mark(row, (False, f"no verdict for {key}") if verdict is None
                        else (verdict["passed"], verdict["detail"])).to_dict())
    return out


def planned_paths(args) -> list[tuple[str, str, str, str, Problem]]:
    """(framework, mesh, layout, backend, problem) of every mesh row the driver's flags time."""
    from .common import documents_names, mesh_layouts, problem_masks, weak_paths

    frameworks = [f for f in ("jax", "torch") if args.only in (None, f)]
    backends = {"jax": args.jax_backends.split(","), "torch": args.torch_backends.split(",")}
    out = []
    problems = [Problem(seq=int(seq), heads=args.heads, kv_heads=args.kv_heads, **problem_masks(args, documents))
                for seq in filter(None, args.seqs.split(",")) for documents in documents_names(args.documents)]
    for problem in problems:  # every length: a window's reduced reach depends on it (path_key)
        for framework in frameworks:
            for mesh in filter(None, args.meshes.split(",")):
                spec = MeshSpec(mesh)
                if framework == "torch" and spec.devices != args.gpus:
                    continue
                for backend in filter(None, backends[framework]):
                    for layout in mesh_layouts(spec, args.layout):
                        path = (framework, mesh, layout, backend, problem)
                        if all(path_key(*p) != path_key(*path) for p in out):
                            out.append(path)
    for framework in frameworks:  # --weak's rings over 1, 2, 4 … of the GPUs (both sides time them)
        for spec, layout, backend, problem in weak_paths(args, args.gpus, framework):
            path = (framework, spec.name, layout, backend, problem)
            if all(path_key(*p) != path_key(*path) for p in out):
                out.append(path)
    return out


def main(argv=None) -> None:
    from .common import check_layouts, shared_arguments

    ap = shared_arguments("verify every planned path of the driver's flags before timing")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--only", choices=("jax", "torch"), default=None)
    ap.add_argument("--jax-backends", default="auto")
    ap.add_argument("--torch-backends", default="auto")
    ap.add_argument("--devices", choices=("gpu", "cpu"), default="gpu")
    args, _ = ap.parse_known_args(argv)
    check_layouts(args.layout, args.documents)
    from parity.core.devices import configure_jax_devices

    configure_jax_devices(args.devices)
    from parity.runners.torch_world import close_worlds

    verdicts: dict[str, dict] = {}
    try:
        for path in planned_paths(args):
            verdicts[path_key(*path)] = verify_one(*path, args.devices)
            print(f"verify {path_key(*path)}: {verdicts[path_key(*path)]}", flush=True)
            Path(args.out).write_text(json.dumps(verdicts, indent=1))  # as they come
    finally:
        close_worlds()
    Path(args.out).write_text(json.dumps(verdicts, indent=1))


if __name__ == "__main__":
    main()
