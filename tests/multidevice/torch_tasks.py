"""Functions the torch tests run on every rank of a gloo world (importable by name)."""

from __future__ import annotations

_COLLECTIVES = ("batch_isend_irecv", "all_to_all_single", "all_gather_single", "all_gather_into_tensor",
                "reduce_scatter_single", "reduce_scatter_tensor")


def _error_before_any_collective(call, errors=(ValueError, TypeError, AssertionError)) -> tuple[str | None, str]:
    """Run ``call()`` with every attention collective booby-trapped (the rank check's all-reduce is
    left alone): (error type, message) of what it raised, (None, "no error") otherwise."""
    import torch.distributed as dist

    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def tripwire(*a, **k):
        raise AssertionError("a collective was reached: validation must come first")

    try:
        for n in saved:
            setattr(dist, n, tripwire)
        call()
    except errors as err:
        return type(err).__name__, str(err)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return None, "no error"


def bad_input_task(q_shape, k_shape, v_shape, dtypes, mesh_axes, kwargs):
    """Call sequence_parallel_attention with collectives booby-trapped; return (error type, message)."""
    import torch

    import torch_impl
    from parity.runners.torch_runner import make_mesh

    mesh = make_mesh("cpu", tuple(mesh_axes))

    def call():
        q, k, v = (torch.ones(s, dtype=getattr(torch, d)) for s, d in zip((q_shape, k_shape, v_shape), dtypes))
        torch_impl.sequence_parallel_attention(q, k, v, mesh, **kwargs)

    return _error_before_any_collective(call, (ValueError, TypeError, NotImplementedError, AssertionError))


def rank_task_with_local_causal_mask(case, x, device_type, block_backend):
    """parity.runners.torch_runner.rank_task with a planted bug: the ring masks causally by *local* layout
    positions (every layout planned as if it were contiguous) instead of original positions."""
    import seqplan.schedule as schedule
    from parity.runners.torch_runner import rank_task

    real = schedule.step_plan
    schedule.step_plan = lambda layout, causal: real("contiguous", causal)
    try:
        return rank_task(case, x, device_type, block_backend)
    finally:
        schedule.step_plan = real


def rank_task_keeping_one_ranks_sinks_grad(case, x, device_type, block_backend):
    """parity.runners.torch_runner.rank_task with a planted harness bug: only rank 0's sinks.grad
    comes back (the other ranks' contributions are dropped), as if sinks.grad held the full
    gradient on every rank."""
    import numpy as np
    import torch.distributed as dist

    from parity.runners.torch_runner import rank_task

    out = rank_task(case, x, device_type, block_backend)
    if dist.get_rank() != 0:
        out["dsinks"] = np.zeros_like(out["dsinks"])
    return out


def rank0_fails_before_a_collective() -> None:
    """Rank 0 raises; every other rank enters an all-reduce that rank 0 never joins."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank 0 refuses its input")
    dist.all_reduce(torch.ones(4))


def mismatched_inputs_task(mesh_axes, rank_overrides: dict, check_ranks: bool, device_type: str = "cpu"):
    """Every rank calls sequence_parallel_attention on ring-shaped local shards, except that the
    ranks named in ``rank_overrides`` (rank -> dict of q_seq / kv_seq / dtype / causal) pass something else.
    Returns (error type, message), or (None, "no error")."""
    import os

    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh
    from seqplan.config import CHECK_RANKS_ENV

    mine = {"q_seq": 8, "kv_seq": 8, "dtype": "float32", "causal": True} | rank_overrides.get(dist.get_rank(), {})
    dtype, device = getattr(torch, mine["dtype"]), device_type if device_type == "cpu" else torch.cuda.current_device()
    q = torch.randn(1, mine["q_seq"], 4, 8, device=device).to(dtype).requires_grad_()
    k, v = (torch.randn(1, mine["kv_seq"], 4, 8, device=device).to(dtype).requires_grad_() for _ in range(2))
    saved = os.environ.get(CHECK_RANKS_ENV)
    os.environ[CHECK_RANKS_ENV] = "1" if check_ranks else "0"
    try:
        o = torch_impl.sequence_parallel_attention(q, k, v, make_mesh(device_type, tuple(mesh_axes)), causal=mine["causal"],
                                                   layout="contiguous")
        o.sum().backward()
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)
    finally:
        os.environ.pop(CHECK_RANKS_ENV) if saved is None else os.environ.__setitem__(CHECK_RANKS_ENV, saved)
    return None, "no error"


def recorded_transfers_task() -> dict:
    """Every rank runs the double ring (2 x 2), the ring (4) and all-gather KV (4), forward and
    backward, with a recording ``torch_impl.comm.Comm`` installed around the forward only (the
    backward must use the one in its config). Returns {strategy: transfers asked for}."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import torch_impl
    from torch_impl.comm import Comm, using

    seen: list = []

    class Recording(Comm):
        def shift(self, hop, groups):
            seen.append(hop.value)
            return super().shift(hop, groups)

        def gather(self, x, group, async_op=False):
            seen.append("gather")
            return super().gather(x, group, async_op=async_op)

        def scatter(self, x_all, group, async_op=False):
            seen.append("scatter")
            return super().scatter(x_all, group, async_op=async_op)

    out = {}
    meshes = {"double_ring": (((2, 2), ("ring_outer", "ring_inner")), "ring"),
              "ring": (((4,), ("ring",)), "ring"), "allgather": (((4,), ("ring",)), "allgather")}
    gen = torch.Generator().manual_seed(0)
    for name, ((sizes, dims), exchange) in meshes.items():
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
        q, k, v = (torch.randn(1, 4, 2, 8, generator=gen).requires_grad_() for _ in range(3))
        seen.clear()
        with using(Recording()):
            o = torch_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="zigzag",
                                                       kv_exchange=exchange)
        forward = list(seen)
        o.sum().backward()
        out[name] = {"forward": forward, "backward": seen[len(forward):]}
    return out


def _sequence_block(coords: dict, sizes: dict) -> int:
    """The layout-order sequence block r·U + u this rank holds (r = o·I + i on a double ring)."""
    ring = coords.get("ring", coords.get("ring_outer", 0) * sizes.get("ring_inner", 1) + coords.get("ring_inner", 0))
    return ring * sizes.get("ulysses", 1) + coords.get("ulysses", 0)


def documents_task(mesh_axes, x: dict, kwargs: dict, count: bool = False, emulate_varlen: bool = False,
                   host: dict | None = None) -> dict:
    """Packed documents (and windows, sinks) on every rank: ``x`` holds the GLOBAL layout-order
    tensors (q, k, v, do [b, T, ., d], dlse [b, h, T], segment_ids [b, T] or None, optionally
    sinks [h] and token_index [b, T]); each rank takes its local shard (batch block of "data",
    sequence block r·U + u), runs sequence_parallel_attention with its local ids (and token
    indices) and the full sinks (return_lse=True;
    ``kwargs`` may hold a window) and the backward with (do, dlse). Returns its coordinates and
    shards (with sinks, its ``sinks.grad`` as "dsinks"), and with ``count`` the block-kernel
    calls it made, each as (pass, document mask?, query rows, key columns, window mask?),
    through a counting backend over the reference kernels. ``emulate_varlen``: q, k, v, do in
    bfloat16 on ``aten_varlen`` with FlashAttention-2's varlen ops emulated (tests/varlen_ops.py);
    "calls" then lists the ops' calls as (op, packed query rows). ``host``: NumPy "segment_ids"
    (and "token_index") [b, T] of this rank's data block, the call then run inside
    ``torch_impl.host_ids`` with the device-to-host copy of the gathered ids made to fail."""
    import contextlib

    import torch

    import torch_impl
    from parity.runners.torch_runner import make_mesh
    from torch_impl.block import BlockBackend, get_backend, register_backend

    mesh = make_mesh("cpu", tuple(mesh_axes))
    sizes = dict(mesh_axes)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    block, data = _sequence_block(coords, sizes), coords.get("data", 0)
    blocks = sizes.get("ring", sizes.get("ring_outer", 1) * sizes.get("ring_inner", 1)) * sizes.get("ulysses", 1)
    b, t = x["q"].shape[0] // sizes.get("data", 1), x["q"].shape[1] // blocks

    def local(a, seq_dim=1, grad=False):
        a = a[data * b:(data + 1) * b].narrow(seq_dim, block * t, t).contiguous()
        return a.clone().requires_grad_(grad)

    calls: list = []
    if count:
        reference = get_backend("reference")

        def fwd(q, k, v, mask, scale, segments=None, positions=None):
            calls.append(("fwd", mask.documents, q.shape[1], k.shape[1], mask.window is not None))
            return reference.fwd(q, k, v, mask, scale, segments, positions)

        def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None):
            calls.append(("bwd", mask.documents, q.shape[1], k.shape[1], mask.window is not None))
            return reference.bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)

        register_backend(BlockBackend("counting", fwd, bwd))
        kwargs = kwargs | {"block_backend": "counting"}
    if emulate_varlen:
        import varlen_ops
        from torch_impl.kernels import varlen

        real_ops = (varlen.flash_forward, varlen.flash_backward)
        varlen_ops.emulate(varlen)
        for name in ("flash_forward", "flash_backward"):
            op = getattr(varlen, name)
            setattr(varlen, name, lambda *a, _op=op, _n=name, **k: calls.append((_n, a[0].shape[0])) or _op(*a, **k))
        x = {n: a.bfloat16() if n in ("q", "k", "v", "do") else a for n, a in x.items()}
        kwargs = kwargs | {"block_backend": "aten_varlen"}
    q, k, v = (local(x[n], grad=True) for n in ("q", "k", "v"))
    ids = None if x.get("segment_ids") is None else local(x["segment_ids"])
    sinks = None if x.get("sinks") is None else x["sinks"].clone().requires_grad_()
    token_index = None if x.get("token_index") is None else local(x["token_index"])
    real_copies, block_of_host = _host_copies_of_loop(), contextlib.nullcontext()
    if host is not None:
        from torch_impl import loop

        def no_copy(*_):
            raise AssertionError("the gathered ids were copied to the host inside a host_ids block")

        loop._host_copies = no_copy  # the worker's module: put back below
        block_of_host = torch_impl.host_ids(host["segment_ids"][data * b:(data + 1) * b],
                                            None if host.get("token_index") is None
                                            else host["token_index"][data * b:(data + 1) * b])
    try:
        with block_of_host:
            o, lse = torch_impl.sequence_parallel_attention(q, k, v, mesh, return_lse=True, segment_ids=ids,
                                                            sinks=sinks, token_index=token_index, **kwargs)
        if emulate_varlen:  # the varlen backward takes no lse cotangent
            torch.autograd.backward(o, local(x["do"]))
        else:
            torch.autograd.backward((o, lse), (local(x["do"]), local(x["dlse"], seq_dim=2)))
    finally:
        if emulate_varlen:  # the worker serves later tasks: the real ops back, whatever happened
            varlen.flash_forward, varlen.flash_backward = real_ops
        _restore_host_copies(real_copies)
    out = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        out["dsinks"] = sinks.grad
    return {"coords": coords, "block": block, "data": data, "calls": calls,
            **{n: a.detach() for n, a in out.items()}}


def _host_copies_of_loop():
    from torch_impl import loop

    return loop._host_copies


def _restore_host_copies(real) -> None:
    from torch_impl import loop

    loop._host_copies = real


def bad_segment_ids_task(mesh_axes, q_shape, ids_shape, ids_dtype: str, ids_device: str, check_ranks: bool = False,
                         no_ids_on: tuple = ()):
    """sequence_parallel_attention on valid float32 q = k = v of ``q_shape`` with segment_ids of
    ``ids_shape`` / ``ids_dtype`` on ``ids_device`` (e.g. "meta") — none on the ranks in
    ``no_ids_on`` — every attention collective booby-trapped (the rank check's all-reduce is
    left alone). Returns (error type, message)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh

    mesh = make_mesh("cpu", tuple(mesh_axes))

    def call():
        q = torch.ones(q_shape)
        ids = torch.zeros(ids_shape, dtype=getattr(torch, ids_dtype), device=ids_device)
        ids = None if dist.get_rank() in no_ids_on else ids
        torch_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, segment_ids=ids, check_ranks=check_ranks)

    return _error_before_any_collective(call)


def bad_token_index_task(mesh_axes, q_shape, index_shape, index_dtype: str, index_value: int = 0,
                         check_ranks: bool = False, no_index_on: tuple = ()):
    """sequence_parallel_attention on valid float32 q = k = v of ``q_shape`` (causal) with
    token_index of ``index_shape`` / ``index_dtype``, every value ``index_value`` — none on the
    ranks in ``no_index_on`` — every attention collective booby-trapped (the rank check's
    all-reduce is left alone). Returns (error type, message)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh

    mesh = make_mesh("cpu", tuple(mesh_axes))

    def call():
        q = torch.ones(q_shape)
        index = torch.full(index_shape, index_value, dtype=getattr(torch, index_dtype))
        index = None if dist.get_rank() in no_index_on else index
        torch_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, token_index=index, check_ranks=check_ranks)

    return _error_before_any_collective(call)


def bad_window_or_sinks_task(mesh_axes, window, sinks_shape, sinks_dtype: str, sinks_device: str,
                             check_ranks: bool = False, per_rank: dict | None = None):
    """sequence_parallel_attention on valid float32 q = k = v [1, 8, 4, 8] (causal) with ``window``
    and sinks of ``sinks_shape`` (None: no sinks) / ``sinks_dtype`` on ``sinks_device``; ranks in
    ``per_rank`` (rank -> {"window": ..., "sinks_shape": ...}) pass their own instead; every
    attention collective booby-trapped (the rank check's all-reduce is left alone). Returns
    (error type, message)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh

    mesh = make_mesh("cpu", tuple(mesh_axes))
    mine = {"window": window, "sinks_shape": sinks_shape} | (per_rank or {}).get(dist.get_rank(), {})

    def call():
        q = torch.ones(1, 8, 4, 8)
        sinks = None
        if mine["sinks_shape"] is not None:
            sinks = torch.zeros(mine["sinks_shape"], dtype=getattr(torch, sinks_dtype), device=sinks_device)
        torch_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, window=mine["window"], sinks=sinks,
                                               check_ranks=check_ranks)

    return _error_before_any_collective(call)


def layer_task(mesh_axes, weights: dict, config: dict, x: dict) -> dict:
    """The attention layer (``torch_impl.layers.SequenceParallelAttention``) with ``weights``
    (numpy, nn.Linear orientation) on this rank's shard of the GLOBAL layout-order ``x`` (x [b, T,
    D], positions, segment_ids, optional token_index [b, T], dy [b, T, D]): returns the local
    output and the gradients of Σ y·dy with respect to the weights (this rank's share) and x."""
    import numpy as np
    import torch

    from parity.runners.torch_runner import make_mesh
    from seqplan.config import AttentionLayerConfig
    from torch_impl.layers import SequenceParallelAttention

    mesh = make_mesh("cpu", tuple(mesh_axes))
    ring = dict(mesh_axes)["ring"]
    rank = mesh.get_coordinate()[0]
    layer = SequenceParallelAttention(AttentionLayerConfig(**config), mesh)
    with torch.no_grad():
        for name, w in weights.items():
            getattr(layer, name).weight.copy_(torch.from_numpy(w))
    t = x["x"].shape[1] // ring

    def local(name):
        a = x[name]
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a[:, rank * t:(rank + 1) * t]))

    xs = local("x").requires_grad_(True)
    y = layer(xs, local("positions"), local("segment_ids"), token_index=local("token_index"))
    (y * local("dy")).sum().backward()
    grads = {name: getattr(layer, name).weight.grad.numpy() for name in weights}
    return {"rank": rank, "y": y.detach().numpy(), "dx": xs.grad.numpy(), "grads": grads}


def float32_rows_task(cases: list, seq: int = 64) -> list:
    """Each case ``(layout, causal, window, sinks, ids, kv_float32)`` of ring attention over the
    whole world, run twice on one backend that returns the inputs' dtype as the GPU kernels do
    (the portable kernels' output cast): with the loops' ``Float32Rows`` and with a subclass that
    widens the whole shard at once (the accumulators before 2026-11-28). Returns, per case, the
    outputs and gradients that differ in any bit (sign of zero included) and the row spans the
    partial accumulators widened (none would mean the partial path never ran)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from torch_impl import loop, merge
    from torch_impl.block import BlockBackend, get_backend, register_backend

    ref = get_backend("reference")

    def fwd(q, k, v, mask, scale, **kw):
        o, lse = ref.fwd(q, k, v, mask, scale, **kw)
        return o.to(q.dtype), lse

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, **kw):
        return tuple(g.to(q.dtype) for g in ref.bwd(do, q, k, v, o, lse, mask, scale, dlse, **kw))

    register_backend(BlockBackend("input_dtype_reference", fwd, bwd, supports=lambda mask, dtype, softcap=False: True))
    spans: list = []

    class Partial(merge.Float32Rows):
        def result(self, dtype):
            spans.append(tuple(self._spans))
            return super().result(dtype)

    class Whole(merge.Float32Rows):
        def __init__(self, base):
            super().__init__(base)
            self.full()

    rank, world = dist.get_rank(), dist.get_world_size()
    t = seq // world
    out = []
    for layout, causal, window, use_sinks, use_ids, kv_float32 in cases:
        gen = torch.Generator().manual_seed(0)
        q, do = (torch.randn(2, seq, 4, 8, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, seq, 2, 8, generator=gen) for _ in range(2))
        dlse, sinks = torch.randn(2, 4, seq, generator=gen), torch.randn(4, generator=gen)
        ids = (torch.arange(seq) // 7)[None].expand(2, seq)
        mine = slice(rank * t, (rank + 1) * t)
        runs = []
        for accumulator in (Partial, Whole):
            loop.Float32Rows = accumulator  # the name the loops construct their accumulators by
            try:
                ql = q[:, mine].bfloat16().requires_grad_()
                kl, vl = (x[:, mine].to(torch.float32 if kv_float32 else torch.bfloat16).requires_grad_() for x in (k, v))
                s = sinks.clone().requires_grad_() if use_sinks else None
                o, lse = torch_impl.ring_attention(
                    ql, kl, vl, dist.group.WORLD, causal=causal, layout=layout, window=window, sinks=s,
                    segment_ids=ids[:, mine].contiguous() if use_ids else None, block_backend="input_dtype_reference")
                torch.autograd.backward((o, lse), (do[:, mine].bfloat16(), dlse[:, :, mine]))
            finally:
                loop.Float32Rows = merge.Float32Rows
            runs.append({"o": o, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                         **({"dsinks": s.grad} if use_sinks else {})})
        same = lambda a, b: torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))
        error = {}
        if layout == "contiguous":  # layout order is the original order: this rank's rows of a float64 truth
            truth = _dense_float64(q, k, v, do, dlse, causal, window, sinks if use_sinks else None,
                                   ids if use_ids else None)
            for name, want in truth.items():
                got = runs[0][name].detach().double()
                want = want[:, :, mine] if name == "lse" else want[:, mine]
                error[name] = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        out.append({"differ": [n for n in runs[0] if not same(runs[0][n].detach(), runs[1][n].detach())],
                    "partial_spans": [s for s in spans if s and s != ((0, t),)], "error": error})
        spans.clear()
    return out


def _dense_float64(q, k, v, do, dlse, causal, window, sinks, ids) -> dict:
    """Dense attention in float64 on bf16-rounded inputs (original order; GQA, a window (left,
    right), sinks, segment ids): o, lse and the gradients of q, k, v of sum(do·o) + sum(dlse·lse)."""
    import torch

    x = {n: a.bfloat16().double().requires_grad_() for n, a in (("q", q), ("k", k), ("v", v))}
    s_ = None if sinks is None else sinks.double().requires_grad_()
    g = q.shape[2] // k.shape[2]
    ke, ve = (x[n].repeat_interleave(g, dim=2) for n in ("k", "v"))
    scores = torch.einsum("bthd,bshd->bhts", x["q"], ke) * q.shape[-1] ** -0.5
    i, j = torch.arange(q.shape[1])[:, None], torch.arange(q.shape[1])[None, :]
    visible = torch.ones_like(i == j)
    if causal:
        visible = visible & (j <= i)
    if window is not None:
        visible = visible & (j >= i - window[0]) & (j <= i + window[1])
    visible = visible[None, None] & (True if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = scores if s_ is None else torch.cat([scores, s_[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    lse = torch.logsumexp(logits, -1)
    o = torch.einsum("bhts,bshd->bthd", torch.exp(scores - lse[..., None]), ve)
    torch.autograd.backward((o, lse), (do.bfloat16().double(), dlse.double()))
    return {"o": o.detach(), "lse": lse.detach(), "dq": x["q"].grad, "dk": x["k"].grad, "dv": x["v"].grad}


def head_groups_order_task(mesh_axes, x: dict, kwargs: dict) -> list[str]:
    """The order in which one rank issues its all-to-alls and runs its block kernels through a
    forward and backward of ``sequence_parallel_attention`` (``x``: the global layout-order q, k,
    v, do, dlse; ``kwargs``: e.g. head_groups): a list of "a2a" / "a2a-sync" (async_op or not),
    "fwd" / "bwd" (a block kernel call) and "backward" (where the backward starts)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh
    from torch_impl.block import BlockBackend, get_backend, register_backend

    mesh = make_mesh("cpu", tuple(mesh_axes))
    sizes = dict(mesh_axes)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    block = _sequence_block(coords, sizes)
    t = x["q"].shape[1] // (sizes.get("ring", 1) * sizes.get("ulysses", 1))
    events: list[str] = []
    reference, real = get_backend("reference"), dist.all_to_all_single

    def fwd(q, k, v, mask, scale, segments=None, positions=None):
        events.append("fwd")
        return reference.fwd(q, k, v, mask, scale, segments, positions)

    def bwd(do, q, k, v, o, lse, mask, scale, dlse=None, segments=None, positions=None):
        events.append("bwd")
        return reference.bwd(do, q, k, v, o, lse, mask, scale, dlse, segments, positions)

    def all_to_all_single(*args, async_op=False, **kw):
        events.append("a2a" if async_op else "a2a-sync")
        return real(*args, async_op=async_op, **kw)

    register_backend(BlockBackend("ordering", fwd, bwd))
    dist.all_to_all_single = all_to_all_single
    try:
        q, k, v = (x[n].narrow(1, block * t, t).clone().requires_grad_() for n in ("q", "k", "v"))
        o, lse = torch_impl.sequence_parallel_attention(q, k, v, mesh, return_lse=True, block_backend="ordering",
                                                        **kwargs)
        events.append("backward")
        torch.autograd.backward((o, lse), (x["do"].narrow(1, block * t, t), x["dlse"].narrow(2, block * t, t)))
    finally:
        dist.all_to_all_single = real
    return events


def shared_prefix_order_task(mesh_axes, x: dict, kwargs: dict) -> list:
    """:func:`documents_task` on all-gather KV with ``shared_tokens`` (in ``kwargs``), recording in
    order each all-gather the call issues (its local shape) and each time the shared prefix's
    plan is made (``seqplan.shared.split_runs``, no plan remembered beforehand). Returns the events."""
    import torch_impl.allgather as allgather
    from seqplan.documents import forget_plans
    from torch_impl.comm import Comm, using

    events: list = []

    class Recording(Comm):
        def gather(self, x, group, async_op: bool = False):
            events.append(("gather", tuple(x.shape)))
            return super().gather(x, group, async_op=async_op)

    real = allgather.split_runs

    def planned(*args, **flags):
        events.append(("plan",))
        return real(*args, **flags)

    forget_plans()
    allgather.split_runs = planned
    try:
        with using(Recording()):
            documents_task(mesh_axes, x, kwargs)
    finally:
        allgather.split_runs = real  # the worker serves later tasks
    return events
