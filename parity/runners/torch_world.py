"""A reusable world of torch.distributed worker processes (gloo on CPU, NCCL on GPUs).

Starting processes and process groups is the slow part of a torch distributed test, so a
``World`` starts ``size`` workers once and then runs any number of tasks on them: ``run(fn,
*args)`` sends the same call to every rank and returns the per-rank results in rank order. ``fn``
must be importable by name (module-level). ``make_mesh`` gives a worker its DeviceMesh, built
once per process and axes. Collectives are bounded by ``timeout_s``, so a rank
that fails cannot leave the others blocked forever: they time out and the world reports it.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import dataclass


@dataclass
class TaskError(RuntimeError):
    rank: int
    trace: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed:\n{self.trace}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, backend: str, timeout_s: float, tasks, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 — report every failure to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# What the fork server imports once, before it forks any rank (see :func:`_context`).
PRELOAD = ["torch", "torch.distributed", __name__]


def _context():
    """The start method of the ranks: a fork server that imported torch once, so a rank starts in
    milliseconds instead of re-importing torch (≈ 1 s a rank under ``spawn``: measured 14.8 s → 1.4 s
    for worlds of 1, 2, 4 and 8 ranks on 2 cores). It forks from a clean server process, never from
    the caller (which may hold JAX's threads), and imports no CUDA: NCCL ranks initialise their device
    after the fork. Where there is no fork server (Windows), ``spawn``. A rank sees the environment
    of the server's start (the first world of the process), as it would a cached world's."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class World:
    """``size`` ranks of one process group (:func:`_context`); use as a context manager or ``close()``."""

    def __init__(self, size: int, backend: str = "gloo", timeout_s: float = 120.0):
        ctx = _context()
        self.size, self.timeout_s = size, timeout_s
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        self._pending = self._stopped = False
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, size, port, backend, timeout_s, self._tasks[r], self._results),
                                   daemon=True) for r in range(size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args) -> list:
        """Run ``fn(*args)`` on every rank; per-rank results in rank order, or raise TaskError."""
        self.submit(fn, *args)
        return self.collect()

    def submit(self, fn, *args) -> None:
        """Start ``fn(*args)`` on every rank and return at once (the parent can work meanwhile:
        the parity run compiles the JAX side while the torch ranks compute); ``collect`` answers.
        One task at a time: submit, then collect, before the next submit."""
        if self._pending:
            raise RuntimeError("collect() the previous task before submitting another")
        self._pending = True
        for q in self._tasks:
            q.put((fn.__module__, fn.__qualname__, args))

    def collect(self) -> list:
        """The submitted task's per-rank results in rank order, or raise TaskError."""
        if not self._pending:
            raise RuntimeError("nothing submitted")
        self._pending = False
        out: dict[int, object] = {}
        errors: list[TaskError] = []
        for _ in range(self.size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout_s + 60)
            except Exception as err:  # queue.Empty: a rank died or hung past the collective timeout
                self.close()
                raise RuntimeError(f"world of {self.size}: no answer within {self.timeout_s + 60:.0f} s") from err
            if ok:
                out[rank] = value
            else:
                errors.append(TaskError(rank, value))
        if errors:  # the other ranks may be stuck in a collective: this world is spent
            self.close()
            for key, world in list(_WORLDS.items()):
                if world is self:
                    del _WORLDS[key]
            raise min(errors, key=lambda e: e.rank)
        return [out[r] for r in range(self.size)]

    def stop(self) -> None:
        """Ask every live rank to exit after its current task (returns at once; once per world)."""
        if self._stopped:
            return
        self._stopped = True
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)

    def close(self) -> None:
        self.stop()
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_WORLDS: dict[tuple[int, str], World] = {}


def get_world(size: int, backend: str = "gloo", timeout_s: float = 120.0) -> World:
    """A cached world of ``size`` ranks (started on first use, shared by every later caller)."""
    key = (size, backend)
    if key not in _WORLDS:
        _WORLDS[key] = World(size, backend, timeout_s)
    return _WORLDS[key]


def close_world(size: int, backend: str = "gloo") -> None:
    """Close the cached world of ``size`` ranks, if any (its workers exit and free their devices)."""
    world = _WORLDS.pop((size, backend), None)
    if world is not None:
        world.close()


def close_worlds() -> None:
    """Close every cached world (their workers exit)."""
    worlds = list(_WORLDS.values())
    _WORLDS.clear()
    for world in worlds:  # every rank of every world told first: they wind down side by side
        world.stop()
    for world in worlds:
        world.close()


_MESHES: dict = {}  # per worker process: (device_type, axes) -> DeviceMesh


def make_mesh(device_type: str, axes: tuple[tuple[str, int], ...]):
    """The ``DeviceMesh`` of ``axes`` ((name, size) pairs, canonical order) on this worker's
    process group, built once per process: every task of a world reuses it."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, tuple(axes))
    if key not in _MESHES:
        names, sizes = zip(*axes)
        _MESHES[key] = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    return _MESHES[key]
