"""One GPU: every block backend of both frameworks through the block interface the strategies call
— forward and the backward with the given lse — for every mask kind (full, causal, strict) against
the portable kernel and a float64 truth (``parity.probes.kernels``, the contract's (docs/contract.md) low-precision
policy), at 4096-token blocks. A backend not installed here is skipped with its reason."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from gpu_tasks import jax_on_gpu, needs_gpus

pytestmark = [needs_gpus(1)]

@pytest.mark.parametrize("backend", ["aten_flash", "aten_cudnn"])
@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
def test_gpu_block_kernel_matches_portable_kernel(backend, mask):
    """One process, one GPU: the CUDA SDPA adapters (GQA K/V passed through at their own head count,
    strict mask by row shift, LSE shape) agree with the portable kernel on the same bf16 inputs,
    forward and backward."""
    from seqplan.schedule import BlockMask as Mask
    from torch_impl.block import get_backend

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, hk, d = 1, 256, 8, 2, 128
    q, do = (torch.randn(b, t, h, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, t, hk, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    m = Mask(mask)
    ref, fast = get_backend("reference"), get_backend(backend)
    o_r, lse_r = ref.fwd(q, k, v, m, d**-0.5)
    o_f, lse_f = fast.fwd(q, k, v, m, d**-0.5)
    assert o_f.shape == o_r.shape and lse_f.shape == lse_r.shape == (b, h, t)
    torch.testing.assert_close(o_f.float(), o_r, atol=2e-2, rtol=2e-2)  # o comes back in bf16
    torch.testing.assert_close(lse_f, lse_r, atol=2e-3, rtol=1e-3)
    o = o_r.bfloat16()
    for g_f, g_r in zip(fast.bwd(do, q, k, v, o, lse_r, m, d**-0.5), ref.bwd(do, q, k, v, o, lse_r, m, d**-0.5)):
        torch.testing.assert_close(g_f.float(), g_r, atol=5e-2, rtol=5e-2)  # MHA grads come back in bf16


def _jax_block_matches_portable(backend: str, mask: str, t: int) -> None:
    """jax_impl's ``backend`` block kernels (the backward with the *given* o and lse) against the
    portable kernel on the same bf16 inputs, GQA 8 / 2, d 128: o, lse and every gradient."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from jax_impl.block import get_backend
    from seqplan.schedule import BlockMask as Mask

    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    rng = np.random.default_rng(0)
    b, h, hk, d = 1, 8, 2, 128
    q, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, hk, d)), jnp.bfloat16) for _ in range(2))
    m, scale = Mask(mask), d**-0.5
    ref, fast = get_backend("reference"), get_backend(backend)
    o_r, lse_r = ref.fwd(q, k, v, m, scale)
    o_f, lse_f = jax.jit(lambda q, k, v: fast.fwd(q, k, v, m, scale))(q, k, v)
    assert o_f.shape == o_r.shape and lse_f.shape == lse_r.shape == (b, h, t)
    np.testing.assert_allclose(np.asarray(o_f, np.float32), np.asarray(o_r, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse_f), np.asarray(lse_r), atol=2e-3, rtol=1e-3)
    o = o_r.astype(jnp.bfloat16)
    fast_grads = jax.jit(lambda *a: fast.bwd(*a, m, scale))(do, q, k, v, o, lse_r)
    for g_f, g_r in zip(fast_grads, ref.bwd(do, q, k, v, o, lse_r, m, scale)):
        np.testing.assert_allclose(np.asarray(g_f, np.float32), np.asarray(g_r, np.float32), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
def test_gpu_jax_cudnn_block_kernel_matches_portable_kernel(mask):
    """One GPU: jax_impl's cuDNN block kernels (the backward bound to cuDNN's primitive with the
    *given* o and lse) agree with the portable kernel on the same bf16 inputs."""
    _jax_block_matches_portable("cudnn", mask, 256)


VERIFIED = [("jax", b) for b in ("reference", "cudnn", "fa3")] + [("torch", b) for b in ("reference", "aten_flash",
                                                                                          "aten_cudnn", "fa4")]


def _skip_without_fa4(backend: str) -> None:
    from torch_impl.kernels import fa4

    if backend == "fa4" and not fa4.available():
        pytest.skip("fa4 needs flash-attn-4 (flash_attn.cute) on a compute capability 9.0+ GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["full", "causal", "strict"])
@pytest.mark.parametrize("framework,backend", VERIFIED, ids=lambda x: x)
def test_block_backend_matches_float64_truth_at_4096_tokens(framework, backend, mask, dtype, seed):
    """MHA/GQA/MQA at d 128 and GQA at d 64, 4096 × 4096 (and for full masks the zigzag ring's 2048 × 4096 and
    4096 × 2048) through ``fwd`` then ``bwd``: every tensor within the policy of the truth."""
    if framework == "jax" and not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    _skip_without_fa4(backend)
    from parity.probes import kernels

    # MHA / GQA / MQA at d 128, and GQA at d 64: every head layout and both head dims, without the
    # full product (each new shape costs a compilation).
    cases = [c for c in kernels.cases(4096, {framework: (backend,)}, [dtype], [64, 128])
             if c.mask == mask and (c.head_dim == 128 or (c.heads, c.kv_heads) == (8, 2))]
    results = kernels.verify(cases, seed, print)
    skipped = [r.status for r in results if r.status.startswith("skipped")]
    if backend == "fa3" and skipped and all("flash_attn3_jax" in s for s in skipped):
        pytest.skip(skipped[0])
    bad = [(r.case.tq, r.case.tk, r.status, {n: (t.max_abs, t.tolerance) for n, t in r.tensors.items() if not t.ok})
           for r in results if r.status != "pass"]
    assert not bad, bad


# ---- "flex": torch FlexAttention with every block mask inside the kernel (compiled) -----------------

def _flex_case(mask, seed: int, t: int = 4096, s: int | None = None, heads: int = 8, kv_heads: int = 2, d: int = 128):
    """bf16 q, k, v, do [1, ., ., d] (CUDA), an lse cotangent, and the block's ids / positions:
    queries are the last t tokens of one original sequence of t + s tokens, keys its first s (a
    causal / strict block: the queries' own tokens); documents are runs of 1-1500 tokens of
    consecutive ids, so blocks hold whole, cut and absent documents (rows with no key)."""
    s = t if s is None else s
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(1, t, heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, s, kv_heads, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    dlse = torch.randn(1, heads, t, device="cuda", generator=gen)
    n = t + s
    lengths = torch.randint(1, 1500, (n,), device="cuda", generator=gen)
    ids = torch.repeat_interleave(torch.arange(n, device="cuda"), lengths)[:n][None].int()
    pos = torch.arange(n, device="cuda", dtype=torch.int32)
    queries = slice(n - t, n)
    keys = slice(0, s) if mask.kind.value == "full" else queries
    extra = {}
    if mask.documents:
        extra["segments"] = (ids[:, queries], ids[:, keys])
    if mask.window is not None:
        extra["positions"] = (pos[queries], pos[keys])
    return q, k, v, do, dlse, extra


def _flex_visible(mask, t: int, s: int, extra: dict):
    """[1, t, s] bool: the pairs ``mask`` admits (schedule.BlockMask.visible, vectorised)."""
    i, j = torch.arange(t, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    vis = {"full": torch.ones(t, s, dtype=torch.bool, device="cuda"), "causal": j <= i, "strict": j < i}[mask.kind.value]
    vis = vis[None]
    if mask.documents:
        q_ids, kv_ids = extra["segments"]
        vis = vis & (q_ids[:, :, None] == kv_ids[:, None, :])
    if mask.window is not None:
        (q_pos, kv_pos), (left, right) = extra["positions"], mask.window
        vis = vis & ((kv_pos[None, :] >= q_pos[:, None] - left) & (kv_pos[None, :] <= q_pos[:, None] + right))[None]
    return vis


def _flex_dense(q, k, v, visible, scale, do, dlse, dtype):
    """Attention under ``visible`` in ``dtype`` (float64: truth; bf16: the policy's control) and
    its gradients for (do, dlse); rows with no visible key: o = 0, lse = -inf, no gradient."""
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = (torch.einsum("bthd,bshd->bhts", q, kk) * scale).to(dtype)
    vis = visible[:, None]
    has_key = vis.any(-1)
    wide = scores.to(torch.float64 if dtype == torch.float64 else torch.float32)
    wide = wide.masked_fill(~vis, float("-inf")).masked_fill(~has_key[..., None], 0.0)
    lse = torch.logsumexp(wide, dim=-1)
    p = (torch.exp(wide - lse[..., None]) * vis).to(dtype)
    o = torch.einsum("bhts,bshd->bthd", p, vv)
    torch.autograd.backward((o, lse.masked_fill(~has_key, 0.0)), (do.to(dtype), dlse.to(lse.dtype) * has_key))
    return {n: x.detach() for n, x in zip(("o", "lse", "dq", "dk", "dv"),
                                           (o, lse.masked_fill(~has_key, float("-inf")), q.grad, k.grad, v.grad))}


def _flex_check(got: dict, truth: dict, control: dict, label: str) -> None:
    """Every tensor within the low-precision policy of the truth (-inf lse rows: the same rows)."""
    from parity.core.numerics import check_tensor

    bad = []
    for name, g in got.items():
        g, w, c = g.double(), truth[name], control[name].double()
        if name == "lse":
            empty = torch.isinf(w)
            assert torch.equal(torch.isinf(g) & (g < 0), empty), f"{label} lse: -inf rows differ"
            g, w, c = (x.masked_fill(empty, 0.0) for x in (g, w, c))
        check = check_tensor(name, g.cpu().numpy(), w.cpu().numpy(), "bfloat16", c.cpu().numpy())
        print(label, check)
        if not check.ok:
            bad.append(str(check))
    assert not bad, f"{label}: {bad}"


FLEX_MASKS = [("full", False, None, 4096), ("causal", False, None, None), ("strict", False, None, None),
              ("causal", True, None, None), ("full", True, None, 2048), ("strict", True, None, None),
              ("causal", True, (1000, 0), None), ("full", False, (3000, 500), 4096)]


def _flex_route(route: str, monkeypatch):
    """Pin the flex backward route on CUDA ("operator" skipped where this torch's dynamo cannot
    trace torch's flex backward operator alone: torch 2.11 cannot, 2.13 can)."""
    from torch_impl.block import get_backend
    from torch_impl.kernels import flex

    if not get_backend("flex").available():
        pytest.skip("torch has no FlexAttention backward operator or no Triton")
    if route == "operator" and not flex.operator_backward_compiles():
        pytest.skip(f"torch {torch.__version__}'s dynamo cannot trace the flex backward operator alone")
    monkeypatch.setitem(flex.BACKWARD_ROUTES, "cuda", route)
    return get_backend("flex")


@pytest.mark.parametrize("route", ["operator", "recompute"])
@pytest.mark.parametrize("kind,documents,window,s", FLEX_MASKS,
                         ids=[f"{k}{'-documents' if d else ''}{'-window' if w else ''}-{s or 4096}" for k, d, w, s in
                              FLEX_MASKS])
def test_gpu_flex_block_matches_float64_truth_and_portable_kernel(kind, documents, window, s, route, monkeypatch,
                                                                  seed):
    """One GPU, bf16, 4096 queries, GQA 8/2, d 128, the compiled FlexAttention kernels (block
    mask from tile summaries; each backward route of torch_impl/kernels/flex.py): o, lse (fwd)
    and dq, dk, dv (bwd with the block's own o / lse and an lse cotangent) within the
    low-precision policy of a float64 truth, and close to the portable kernel."""
    from seqplan.schedule import BlockMask
    from torch_impl.block import get_backend

    mask = BlockMask(kind, documents=documents, window=window)
    flex = _flex_route(route, monkeypatch)
    q, k, v, do, dlse, extra = _flex_case(mask, seed, s=s)
    scale = q.shape[-1] ** -0.5
    o, lse = flex.fwd(q, k, v, mask, scale, **extra)
    grads = flex.bwd(do, q, k, v, o, lse, mask, scale, dlse, **extra)
    got = dict(zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads)))
    visible = _flex_visible(mask, q.shape[1], k.shape[1], extra)
    if documents:
        assert (~visible.any(-1)).any() or kind != "full", "the documents must leave rows without a key"
    truth = _flex_dense(q, k, v, visible, scale, do, dlse, torch.float64)
    control = _flex_dense(q, k, v, visible, scale, do, dlse, torch.bfloat16)
    _flex_check(got, truth, control, str(mask))
    ref = get_backend("reference")  # the portable kernel on the same bf16 inputs: relative L2 within bf16 rounding
    o_r, lse_r = ref.fwd(q, k, v, mask, scale, **extra)
    fin = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin], lse_r[fin], atol=2e-3, rtol=1e-3)
    for name, g_f, g_r in zip(("o", "dq", "dk", "dv"), (o, *grads),
                              (o_r, *ref.bwd(do, q, k, v, o, lse, mask, scale, dlse, **extra))):
        rel = (torch.linalg.vector_norm(g_f.float() - g_r) / torch.linalg.vector_norm(g_r)).item()
        assert rel <= 2e-2, f"{mask} {name}: relative L2 {rel:.2e} from the portable kernel"


@pytest.mark.parametrize("route", ["operator", "recompute"])
def test_gpu_flex_backward_with_merged_global_o_lse(route, monkeypatch, seed):
    """One GPU, bf16: a query shard's own block (causal) and an earlier shard's (full), both with
    documents and a window, merged with merge_partials into the global (o, lse); each block's
    backward given that global o / lse sums (dq) and concatenates (dk, dv) to gradients within
    the policy of the float64 gradients of attention over both shards, by each backward route."""
    from seqplan.schedule import BlockMask
    from torch_impl import merge_partials

    flex = _flex_route(route, monkeypatch)
    t = 4096
    full = BlockMask("full", documents=True, window=(3000, 0))
    q, k_a, v_a, do, dlse, extra = _flex_case(full, seed, t=t, s=t)  # queries: tokens t..2t-1; keys A: 0..t-1
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    k_b, v_b = (torch.randn(k_a.shape, device="cuda", generator=gen).bfloat16() for _ in range(2))  # keys B: own tokens
    k, v = torch.cat([k_a, k_b], dim=1), torch.cat([v_a, v_b], dim=1)
    (q_ids, a_ids), (q_pos, a_pos) = extra["segments"], extra["positions"]
    blocks = [(full, slice(0, t)), (BlockMask("causal", documents=True, window=(3000, 0)), slice(t, 2 * t))]
    kw = [{"segments": (q_ids, a_ids), "positions": (q_pos, a_pos)},
          {"segments": (q_ids, q_ids), "positions": (q_pos, q_pos)}]
    scale = q.shape[-1] ** -0.5
    parts = [flex.fwd(q, k[:, keys], v[:, keys], m, scale, **e) for (m, keys), e in zip(blocks, kw)]
    o, lse = merge_partials(*parts[1], *parts[0])
    dq = torch.zeros(q.shape, device="cuda")
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")
    for (m, keys), e in zip(blocks, kw):
        g = flex.bwd(do, q, k[:, keys], v[:, keys], o, lse, m, scale, dlse, **e)
        dq += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    visible = torch.cat([_flex_visible(m, t, t, e) for (m, _), e in zip(blocks, kw)], dim=-1)
    truth = _flex_dense(q, k, v, visible, scale, do, dlse, torch.float64)
    control = _flex_dense(q, k, v, visible, scale, do, dlse, torch.bfloat16)
    _flex_check({"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, truth, control, "merged")


@pytest.mark.parametrize("backend", ["aten_varlen", "fa4"])
def test_gpu_torch_varlen_document_blocks_match_the_portable_kernel(backend):
    """aten_varlen / fa4 on document blocks (a causal diagonal with length-1 documents, a full block
    whose edge cuts a document, a full block where half the query documents have no key): o,
    lse, dq, dk, dv against the portable kernel in float32, empty rows exactly o = 0 and
    lse = -inf, and the varlen path (not the fallback) taken — benchmarks.masked's checks."""
    _skip_without_fa4(backend)
    from benchmarks.masked import block_checks

    rows = block_checks("cuda", backend=backend)
    assert rows and all(r["verified"] for r in rows), rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_fa4_soft_capped_document_blocks_match_the_portable_kernel(dtype, seed):
    """fa4 with soft-capping (Gemma 2's 50 / 30 scaled to these logits: 2.0) on a causal diagonal
    of packed documents and on a full block with absent documents, forward and backward from the
    portable kernel's global o and lse: within the low-precision bound of the portable kernel in
    float32 (the capped slope in both passes)."""
    _skip_without_fa4("fa4")
    import numpy as np

    from seqplan.schedule import BlockMask, MaskKind
    from torch_impl.block import get_backend

    t, heads, kv_heads, d = 4096, 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cut = np.sort(np.random.default_rng(seed).choice(np.arange(1, 2 * t), 12, replace=False))
    ids = torch.from_numpy(np.repeat(np.arange(13, dtype=np.int32), np.diff(np.r_[0, cut, 2 * t]))[None]).cuda()
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(getattr(torch, dtype))
    ref, fast = get_backend("reference", softcap=2.0), get_backend("fa4", softcap=2.0)
    for kind, seg in ((MaskKind.CAUSAL, (ids[:, :t], ids[:, :t])), (MaskKind.FULL, (ids[:, t:], ids[:, :t]))):
        q, do, k, v = rnd(1, t, heads, d), rnd(1, t, heads, d), rnd(1, t, kv_heads, d), rnd(1, t, kv_heads, d)
        mask, scale = BlockMask(kind, documents=True), d**-0.5
        o_r, lse_r = ref.fwd(q, k, v, mask, scale, segments=seg)
        o_f, lse_f = fast.fwd(q, k, v, mask, scale, segments=seg)
        g_r = ref.bwd(do, q, k, v, o_r.to(q.dtype), lse_r, mask, scale, segments=seg)
        g_f = fast.bwd(do, q, k, v, o_r.to(q.dtype), lse_r, mask, scale, segments=seg)
        seen = lse_r.isfinite()
        assert torch.equal(seen, lse_f.isfinite())
        assert float((lse_f - lse_r)[seen].abs().max()) <= 1e-2
        for name, x, y in (("o", o_f, o_r), *zip(("dq", "dk", "dv"), g_f, g_r)):
            err = float((x.float() - y.float()).abs().max() / y.float().abs().max())
            assert err <= 2e-2, f"{kind.value} {name}: {err:.2e}"


@pytest.mark.parametrize("backend", ["fa3_varlen", "cudnn_varlen"])
def test_gpu_jax_varlen_document_blocks_match_the_portable_kernel(backend):
    """The JAX document backends on the same blocks (fa3_varlen needs flash_attn3_jax 0.2.3)."""
    pytest.importorskip("jax")
    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    if backend == "fa3_varlen":
        from jax_impl.kernels.fa3 import VERIFIED_VERSION, verified

        if not verified():
            pytest.skip(f"fa3_varlen needs flash_attn3_jax {VERIFIED_VERSION}")
    from benchmarks.masked import jax_block_checks

    rows = jax_block_checks(backend=backend)
    assert rows and all(r["verified"] for r in rows), rows


def test_gpu_jax_own_document_block_matches_the_portable_kernel():
    """The whole sequence on a one-device mesh, ``auto``: a device's own block, whose document variant
    alone is compiled where the backend runs one document as one varlen run (``fa3_varlen``,
    ``BlockBackend.one_run_documents``, 2026-11-29: the plain kernel took a one-document block
    before) — one document covering it and the short mix, against the portable kernel in float32
    (``benchmarks.one_gpu_documents.check_ids``, 4096 tokens, 8 / 2 heads of 128)."""
    pytest.importorskip("jax")
    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    from jax_impl.kernels.fa3 import VERIFIED_VERSION, verified

    if not verified():
        pytest.skip(f"fa3_varlen needs flash_attn3_jax {VERIFIED_VERSION}")
    import numpy as np

    from benchmarks.common import Problem
    from benchmarks.one_gpu_documents import check_ids

    for label, ids in (("one document", np.zeros((1, 4096), np.int32)),
                       ("short", Problem(seq=4096, documents="short").segment_ids())):
        row = check_ids(label, ids, "auto")
        assert row["passed"], row


@pytest.mark.parametrize("backend", ["aten_window", "fa4"])
def test_gpu_torch_window_blocks_match_the_portable_kernel(backend):
    """aten_window (FA2's window) and fa4 (FA4's) on windowed blocks (a causal diagonal, an
    off-diagonal band, a corner-only band whose crop leaves most rows empty, a two-sided window,
    and non-contiguous positions that must take the portable path) against the portable kernel in
    float32 — benchmarks.masked's checks."""
    from benchmarks.masked import window_checks

    _skip_without_fa4(backend)
    rows = window_checks(backend=backend)
    assert rows and all(r["verified"] for r in rows), rows
    assert [r["fused_path"] for r in rows] == [True, True, True, True, False]


@pytest.mark.parametrize("backend,case", [("fa4", "causal"), ("fa4", "documents-short"), ("fa4", "window-4096"),
                                          ("aten_flash", "causal"), ("aten_varlen", "documents-short"),
                                          ("aten_window", "window-4096")])
def test_gpu_torch_deterministic_mode_is_reproducible_and_correct(backend, case):
    """Under torch's deterministic switch (what a ``deterministic=True`` call holds while its kernels
    run), each backend "auto" routes there — FA4 in FA4's deterministic mode, FA2's dense, varlen and
    window kernels in torch's — computes the same as the portable kernel in float32 at 4096 tokens
    and repeats o, dq, dk, dv bit for bit at 8192 (32 / 8 heads); what deterministic mode costs is
    ``benchmarks.determinism_cost``'s."""
    _skip_without_fa4(backend)
    from benchmarks import determinism_cost as cost

    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"  # conftest: before cuBLAS's first handle
    chosen = next(c for c in cost.CASES if c.name == case)
    checked = cost.check(chosen, backend, "deterministic", 4096)
    assert checked["passed"], checked["errors"]
    repeated = cost.repeats_and_time(chosen, backend, "deterministic", 8192, repeats=3, iters=1, warmup=0)
    assert all(repeated["bitwise_same"].values()), repeated["bitwise_same"]


JAX_DETERMINISTIC_STEPS = r'''
import json
import jax.numpy as jnp
import numpy as np
from benchmarks.common import Problem
from benchmarks.one_gpu_documents import PASS, _inputs, _mesh_call
from jax_impl.block import resolve_backend
from seqplan.schedule import BlockMask, MaskKind

out = {}
for mix in (None, "short"):
    ids = None if mix is None else jnp.asarray(Problem(seq=8192, heads=8, kv_heads=2, documents=mix).segment_ids())
    low = _inputs(8192, 8, 2, 128, jnp.bfloat16, seed=1)
    step = _mesh_call("auto")[0]
    text = step.lower(*low, ids).as_text()  # what the kernels were asked for, as compiled
    runs = [[np.asarray(x.astype(jnp.float32)) for x in step(*low, ids)] for _ in range(3)]
    want = _mesh_call("reference")[0](*(x.astype(jnp.float32) for x in low), ids)
    errors = [float(np.abs(g - np.asarray(w)).max() / np.abs(np.asarray(w)).max()) for g, w in zip(runs[0], want)]
    out[str(mix)] = {"kernel": resolve_backend("auto", device_kind="cuda", dtype="bfloat16", deterministic=True,
                                               mask=BlockMask(MaskKind.CAUSAL, documents=mix is not None)),
                     "asked": {"deterministic": text.count("deterministic = true"),
                               "default": text.count("deterministic = false")},
                     "errors": errors, "passed": all(e <= PASS for e in errors),
                     "same": [all(np.array_equal(r[i], runs[0][i]) for r in runs[1:]) for i in range(4)]}
print("ROWS", json.dumps(out))
'''


def test_gpu_jax_deterministic_mode_runs_fa3_reproducibly():
    """JAX's deterministic mode (XLA started with ``--xla_gpu_deterministic_ops=true``: ``deterministic``
    defaults to True) routes causal blocks to ``fa3`` and document blocks to ``fa3_varlen``, both on
    FA3's deterministic backward (``config.deterministic_kernels``): the whole sequence on a
    one-device mesh at 8192 tokens (8 / 2 heads of 128), without and with the short mix's documents,
    within the contract's tolerance of the portable kernel in float32 and o, dq, dk, dv bit for bit
    the same over three steps. A fresh process: XLA reads the flag when it starts."""
    pytest.importorskip("jax")
    if not jax_on_gpu():
        pytest.skip("JAX has no GPU here (run with JAX_PLATFORMS=cuda)")
    from jax_impl.kernels.fa3 import VERIFIED_VERSION, verified

    if not verified():
        pytest.skip(f"fa3 needs flash_attn3_jax {VERIFIED_VERSION}")
    import json
    import subprocess
    import sys

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
    done = subprocess.run([sys.executable, "-c", JAX_DETERMINISTIC_STEPS], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "XLA_FLAGS": flags})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.split("ROWS", 1)[1])
    assert {m: r["kernel"] for m, r in rows.items()} == {"None": "fa3", "short": "fa3_varlen"}, rows
    # every FA3 backward call in the compiled step asks for the deterministic mode (bitwise repeats
    # alone could pass by luck at this size)
    assert all(r["asked"]["deterministic"] > 0 and r["asked"]["default"] == 0 for r in rows.values()), rows
    assert all(r["passed"] and all(r["same"]) for r in rows.values()), rows
