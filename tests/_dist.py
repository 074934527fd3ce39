"""Run a function on a real multi-process torch.distributed world, for tests.

    from tests._dist import run_world

    def _ranks_sum(offset):                    # top-level, so it can be pickled
        x = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(x)
        return int(x)

    assert run_world(4, _ranks_sum, 1) == [10, 10, 10, 10]

Each call starts ``world_size`` fresh processes, creates a process group in each
(gloo by default) over a ``FileStore`` in a temporary directory of its own, runs
``fn(*args, **kwargs)`` on every rank and returns the results by rank. If a rank
raises, :class:`WorldError` carries every rank's exception and traceback (or pass
``return_exceptions=True`` to get the exceptions in the list instead). A world that
has not finished after ``timeout`` seconds is killed and :class:`WorldTimeoutError`
says which ranks never reported, so a hang fails the test instead of CI.

Processes are started with the ``forkserver`` method by default: a server process
imports torch once and forks each rank from it (about 0.2 s per world), instead of
``spawn`` starting and importing torch in every rank (several seconds per rank on a
small machine). Both give clean processes with no inherited threads or process
groups; ``start_method="spawn"`` is there for platforms without forkserver.

Inside ``fn``: ``torch.distributed`` is initialised (``dist.get_rank()``,
``dist.get_world_size()``), ``torch.get_num_threads() == threads``, the environment
holds ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` plus ``env``. Results travel back
pickled by value (tensors included). Results are collected before the process
group is torn down, so a rank stuck in teardown after a deliberate failure does not
lose them; such ranks are killed after a short grace period.
"""

from __future__ import annotations

import os
import pickle
import queue as _queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_world", "WorldError", "WorldTimeoutError", "RankFailure"]

_PRELOAD = ["torch", "torch.distributed", "numpy"]
_GRACE_S = 3.0  # after every rank reported, how long teardown may take before a kill


class RankFailure:
    """What one rank raised: the exception (or its text if it did not pickle) and traceback."""

    def __init__(self, rank: int, exception: BaseException | None, kind: str, message: str, tb: str):
        self.rank, self.exception, self.kind, self.message, self.traceback = (
            rank, exception, kind, message, tb,
        )

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {self.kind}: {self.message})"


class WorldError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> :class:`RankFailure`."""

    def __init__(self, message: str, failures: Mapping[int, RankFailure], results: list[Any]):
        super().__init__(message)
        self.failures = dict(failures)
        self.results = results


class WorldTimeoutError(WorldError, TimeoutError):
    """The world did not finish within the hard timeout; ``missing`` ranks never reported."""

    def __init__(self, message: str, failures: Mapping[int, RankFailure], results: list[Any],
                 missing: list[int]):
        super().__init__(message, failures, results)
        self.missing = missing


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    pg_timeout_s: float,
    threads: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        __import__("torch.distributed.nn.functional")  # before the group: see gossip.comm.distributed._preload_before_init
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # gloo connects the mesh per process; without this a rank that fails fast
        # could tear its connections down while another is still connecting
        dist.barrier()
        result = fn(*args, **kwargs)
        try:
            out.put((rank, True, pickle.dumps(result)))
        except Exception as exc:  # the result did not pickle: report that
            raise TypeError(f"run_world: rank {rank}'s result does not pickle: {exc}") from exc
    except BaseException as exc:  # report everything, including SystemExit
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        out.put((rank, False, (blob, type(exc).__name__, str(exc), tb)))
    finally:
        # Queue.put hands the report to a feeder thread; flush it before teardown, so
        # a rank that crashes while destroying its process group (seen with gloo work
        # whose last reference dies on gloo's own thread) has still reported
        out.close()
        out.join_thread()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    start_method: str = "forkserver",
    return_exceptions: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return results by rank.

    Args:
        world_size: number of processes (ranks).
        fn: a module-level function (it is pickled by reference).
        timeout: hard limit in seconds for the whole world, start-up included; also
            the process group's timeout.
        backend: torch.distributed backend (``"gloo"``; ``"nccl"`` needs a GPU per rank).
        threads: ``torch.set_num_threads`` in every rank (keep small on shared CPUs).
        env: extra environment variables for the ranks.
        start_method: ``"forkserver"`` (fast, default) or ``"spawn"``.
        return_exceptions: put a failed rank's exception in the list instead of
            raising :class:`WorldError`.

    Raises:
        WorldError: a rank raised (``failures`` has every rank's exception and
            traceback) or died without reporting (e.g. a C++ abort).
        WorldTimeoutError: the world did not finish within ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"run_world: `world_size` must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"run_world: `timeout` must be > 0 seconds, got {timeout}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD + [fn.__module__])  # no effect once started
    tmp = tempfile.mkdtemp(prefix="gossip_world_")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, os.path.join(tmp, "store"), backend, float(timeout), threads,
                  dict(env or {}), fn, args, kwargs, out),
            daemon=True,
            name=f"run_world-rank{r}",
        )
        for r in range(world_size)
    ]
    results: list[Any] = [None] * world_size
    failures: dict[int, RankFailure] = {}
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(reported) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=0.05)
            except _queue.Empty:
                # a rank that died without reporting (signal, os._exit) will never report
                dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                if dead:
                    time.sleep(0.2)  # its report may still be in flight
                    _drain(out, reported, results, failures)
                    for r in dead:
                        if r not in reported:
                            code = procs[r].exitcode
                            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                            failures[r] = RankFailure(r, None, "ProcessDied",
                                                      f"rank {r} died without reporting ({why})", "")
                            reported.add(r)
                continue
            _store(rank, ok, payload, reported, results, failures)
        missing = sorted(set(range(world_size)) - reported)
    finally:
        # teardown may wait on ranks that failed on purpose; a hung world gets none
        grace = time.monotonic() + (_GRACE_S if len(reported) == world_size else 0.0)
        for p in procs:
            if p.pid is not None:
                p.join(timeout=max(grace - time.monotonic(), 0.0))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if missing:
        lines = [f"run_world: {fn.__name__} on {world_size} ranks did not finish within "
                 f"{timeout:g} s; ranks {missing} never reported"]
        lines += [f"rank {r}: {f.kind}: {f.message}" for r, f in sorted(failures.items())]
        raise WorldTimeoutError("\n".join(lines), failures, results, missing)
    if failures and not return_exceptions:
        lines = [f"run_world: {fn.__name__} failed on ranks {sorted(failures)}"]
        for r, f in sorted(failures.items()):
            lines.append(f"--- rank {r}: {f.kind}: {f.message}\n{f.traceback}")
        raise WorldError("\n".join(lines), failures, results)
    if failures:
        for r, f in failures.items():
            results[r] = f.exception if f.exception is not None else RuntimeError(
                f"{f.kind}: {f.message}")
    return results


def _store(rank: int, ok: bool, payload: Any, reported: set[int], results: list[Any],
           failures: dict[int, RankFailure]) -> None:
    reported.add(rank)
    if ok:
        results[rank] = pickle.loads(payload)
        return
    blob, kind, message, tb = payload
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    failures[rank] = RankFailure(rank, exc, kind, message, tb)


def _drain(out: Any, reported: set[int], results: list[Any],
           failures: dict[int, RankFailure]) -> None:
    while True:
        try:
            rank, ok, payload = out.get_nowait()
        except _queue.Empty:
            return
        _store(rank, ok, payload, reported, results, failures)
