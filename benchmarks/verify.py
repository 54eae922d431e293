"""Benchmarks time only verified work: each row's exact path — framework, strategy (mesh), layout,
block backend, and so the mask kinds its schedule produces — is first run on a *reduced* problem
(same heads ratio, head_dim, dtype, causality; ``REDUCED_SEQ`` tokens) through the parity
pipeline (``parity.runners.pipeline.check_case``: float64 truth, dense same-dtype control, the
numerics policy). A row whose path fails is reported as failing: its throughput is removed and the
reason goes into its note. Rows of other projects' code (torch_cp, yunchang, fa3_jax, ceilings)
are not ringbridge's path and carry ``verified = None``.

A verdict is computed once per distinct path and reused by every row (sequence length and
fwd/fwd+bwd do not change the path).
"""

from __future__ import annotations

from .common import MeshSpec, Problem, Row

REDUCED_SEQ = 2048  # divisible by 2·R·U for every mesh of up to 8 devices (zigzag's constraint)
OURS = {"jax_impl": "jax", "jax_impl_mc": "jax", "torch_impl": "torch",
        "jax_impl_replay": "jax", "torch_impl_replay": "torch"}


def reduced_case(shape, layout: str, problem: Problem):
    """The parity ``Case`` of a row's path: the mesh ``shape`` (a ``parity.core.mesh.MeshShape``),
    at ``REDUCED_SEQ`` tokens with 8 query heads (kv heads in the problem's ratio, at least 1), the
    problem's document pattern and its window scaled to the reduced length."""
    from parity.core.cases import Case

    heads = 8
    kv_heads = max(1, heads * problem.kv_heads // problem.heads)
    masks = {}
    if getattr(problem, "documents", "none") != "none":
        from .documents import mix_names

        # a balance mix (long documents) has no reduced form: the harness's "mix" pattern stands in
        masks["documents"] = "mix" if problem.documents in mix_names() else problem.documents
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
        row.note = f"NOT VERIFIED, not a throughput: {detail}; {row.note}".strip("; ")
    return row


def verify_rows(rows: list[dict], devices: str = "gpu") -> list[dict]:
    """The driver's pass over saved rows (dicts): each ringbridge mesh row's path is verified
    (once per path) and the row marked; other rows get ``verified = None``."""
    from parity.runners.torch_world import close_worlds

    verdicts: dict[tuple, tuple[bool, str]] = {}
    out = []
    try:
        for data in rows:
            row = Row(**{k: v for k, v in data.items() if k in Row.__dataclass_fields__})
            framework = OURS.get(row.framework)
            mesh = row.extra.get("mesh")
            if framework is None or not mesh or row.framework.endswith("_replay") or row.extra.get("variant"):
                out.append(data | {"verified": data.get("verified")})
                continue
            window = row.extra.get("window")
            problem = Problem(seq=row.seq_len, heads=row.extra.get("heads", 32), kv_heads=row.extra.get("kv_heads", 32),
                              documents=row.extra.get("documents", "none"),
                              window=None if window is None else tuple(window))
            backend = row.extra.get("block_backend", "auto")
            key = (framework, mesh, row.layout, backend, problem.kv_heads * 8 // problem.heads, problem.documents,
                   problem.window and tuple(max(1, round(w * REDUCED_SEQ / problem.seq)) if w else 0
                                            for w in problem.window))
            if key not in verdicts:
                try:
                    case = reduced_case(MeshSpec(mesh).shape, row.layout, problem)
                    verdicts[key] = verify_path(framework, case, backend, devices)
                except Exception as err:  # noqa: BLE001 — a path that cannot be checked is not verified
                    verdicts[key] = (False, f"verification raised {type(err).__name__}: {err}")
                print(f"verify {key}: {verdicts[key]}", flush=True)
            out.append(mark(row, verdicts[key]).to_dict())
    finally:
        close_worlds()
    return out
