"""Functions the torch tests run on every rank of a gloo world (importable by name)."""

from __future__ import annotations


def bad_input_task(q_shape, k_shape, v_shape, dtypes, mesh_axes, kwargs):
    """Call sequence_parallel_attention with collectives booby-trapped; return (error type, message)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from parity.runners.torch_runner import make_mesh

    mesh = make_mesh("cpu", tuple(mesh_axes))
    saved = {n: getattr(dist, n) for n in ("batch_isend_irecv", "all_to_all_single")}

    def tripwire(*a, **k):
        raise AssertionError("a collective was reached: validation must come first")

    try:
        for n in saved:
            setattr(dist, n, tripwire)
        q, k, v = (torch.ones(s, dtype=getattr(torch, d)) for s, d in zip((q_shape, k_shape, v_shape), dtypes))
        torch_impl.sequence_parallel_attention(q, k, v, mesh, **kwargs)
    except (ValueError, TypeError, NotImplementedError, AssertionError) as err:
        return type(err).__name__, str(err)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return None, "no error"


def rank_task_with_local_causal_mask(case, x, device_type, block_backend):
    """parity.runners.torch_runner.rank_task with a planted bug: the ring masks causally by *local* layout
    positions (every layout planned as if it were contiguous) instead of original positions."""
    import torch_impl.ring as ring
    from parity.runners.torch_runner import rank_task

    real = ring.step_plan
    ring.step_plan = lambda layout, causal: real("contiguous", causal)
    try:
        return rank_task(case, x, device_type, block_backend)
    finally:
        ring.step_plan = real


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
    from torch_impl.comm import CHECK_RANKS_ENV

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
