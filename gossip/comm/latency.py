"""Network latency emulated inside the communicator, for kernels without ``netem``.

``tc``'s ``tbf`` shapes bandwidth on any Linux, but delaying packets needs the
``netem`` qdisc, which some kernels lack. :class:`LatencyCommunicator` wraps any
communicator and adds, to every operation, the time its messages would spend in
flight on a network whose one-way latency is ``latency_s``:

==================  ===================  ==============================================
operation           rounds (added waits)  why
==================  ===================  ==============================================
neighbor_exchange   1                    the sends to all neighbours go out in parallel
all_reduce          2 (n - 1)            ring all-reduce: n - 1 reduce-scatter steps,
                                         then n - 1 all-gather steps, each waiting for
                                         the previous one's message
all_gather          n - 1                ring all-gather
broadcast           ceil(log2 n)         binomial tree: the holders double each round
sharded_exchange    2 (n - 1)            push then pull, each counted as an all-gather
==================  ===================  ==============================================

with ``n`` the world size; a world of one sends nothing and waits nothing. The
bandwidth part (bytes over the link rate) is left to the wrapped communicator and the
network it runs on, so a shaped link plus this wrapper gives, per round,
``latency + bytes / rate``: the usual alpha-beta cost model.

When the wait happens: the latency clock starts when the operation is posted. When
its handle is waited on, the wrapped operation completes first and then the wrapper
sleeps for whatever part of ``rounds * latency_s`` has not already passed between
posting and waiting. A blocking call therefore costs exactly ``rounds * latency_s``
more than the wrapped one; an asynchronous one that is overlapped with computation
hides up to that much of it, as a real in-flight message would. The sleep is charged
to the ledger's ``communicate`` phase. Operations with ``record=False`` (metrics,
evaluation) wait too: the network does not know what a message is for.

Everything else (``ledger``, ``nodes``, ``world_size``, ``topology``, ``rank``,
``neighbors``, ...) is the wrapped communicator's own.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .base import Communicator, Handle

__all__ = ["LatencyCommunicator", "latency_rounds"]


def latency_rounds(op: str, n: int) -> int:
    """Sequential message rounds of operation ``op`` among ``n`` nodes (see the module doc)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"latency_rounds: `n` must be a positive integer, got {n!r}")
    if n == 1:
        return 0
    if op == "neighbor_exchange":
        return 1
    if op == "all_reduce":
        return 2 * (n - 1)
    if op == "all_gather":
        return n - 1
    if op == "broadcast":
        return math.ceil(math.log2(n))
    if op == "sharded_exchange":  # the push and the pull, each as an all-gather's rounds
        return 2 * (n - 1)
    raise ValueError(
        "latency_rounds: `op` must be one of 'neighbor_exchange', 'all_reduce', "
        f"'all_gather', 'broadcast', 'sharded_exchange', got {op!r}"
    )


class _LatencyHandle(Handle):
    """Completes the wrapped handle, then sleeps out what is left of the latency."""

    __slots__ = ("_inner", "_comm", "_ready_at", "_done", "_result")

    def __init__(self, inner: Handle, comm: LatencyCommunicator, delay_s: float) -> None:
        self._inner = inner
        self._comm = comm
        self._ready_at = time.perf_counter() + delay_s
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        if not self._done:
            # the latency that passed between posting and now (overlap) is not paid again
            owed = self._ready_at - time.perf_counter()
            result = self._inner.wait()
            if owed > 0:
                with self._comm.ledger.phase("communicate"):
                    self._comm._sleep(owed)
            self._result, self._done = result, True
        return self._result

    def advance(self) -> None:
        self._inner.advance()

    def is_completed(self) -> bool:
        return self._done or (
            self._inner.is_completed() and time.perf_counter() >= self._ready_at
        )


class LatencyCommunicator(Communicator):
    """Wraps ``inner`` and adds ``latency_s`` per message round (see the module doc).

    Args:
        inner: any communicator (``DistCommunicator``, ``SimulatedCommunicator``, another
            wrapper).
        latency_s: one-way network latency in seconds, finite and >= 0; 0 makes the
            wrapper a pass-through.

    Use: ``comm = LatencyCommunicator(DistCommunicator(topo), latency_s=0.020)``.
    The wait per operation is ``latency_rounds(op, world_size) * latency_s``.
    """

    def __init__(self, inner: Communicator, latency_s: float) -> None:
        for attr in ("neighbor_exchange_async", "all_reduce_async", "all_gather_async",
                     "broadcast_async", "ledger", "nodes", "world_size"):
            if not hasattr(inner, attr):
                raise TypeError(
                    f"LatencyCommunicator: `inner` must be a communicator (it has no "
                    f"`{attr}`), got {type(inner).__name__}"
                )
        if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)):
            raise ValueError(
                f"LatencyCommunicator: `latency_s` must be a number of seconds >= 0, got {latency_s!r}"
            )
        lat = float(latency_s)
        if not math.isfinite(lat) or lat < 0:
            raise ValueError(
                f"LatencyCommunicator: `latency_s` must be a finite number of seconds >= 0, got {latency_s!r}"
            )
        self.inner = inner
        self.latency_s = lat

    # the wrapped communicator's state, read through (never copied: it may change)
    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.inner.world_size

    @property
    def nodes(self) -> torch.Tensor:  # type: ignore[override]
        return self.inner.nodes

    @property
    def topology(self) -> Any:  # type: ignore[override]
        return getattr(self.inner, "topology", None)

    @property
    def ledger(self) -> Any:  # type: ignore[override]
        return self.inner.ledger

    def __getattr__(self, name: str) -> Any:
        # only called for names not found on the wrapper: rank, neighbors, timeout, ...
        if name == "inner":  # not set yet (during unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def delay_s(self, op: str) -> float:
        """Seconds added to one ``op`` (``neighbor_exchange``, ``all_reduce``, ...)."""
        return latency_rounds(op, int(self.world_size)) * self.latency_s

    def _wrap(self, handle: Handle, op: str) -> Handle:
        delay = self.delay_s(op)
        return handle if delay <= 0 else _LatencyHandle(handle, self, delay)

    @staticmethod
    def _sleep(seconds: float) -> None:
        # time.sleep may wake a little early on some platforms; finish the interval
        end = time.perf_counter() + seconds
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(left)

    # ---------------------------------------------------------------- asynchronous
    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        kw = {} if step is None else {"step": step}  # static graphs: the inner call as before
        return self._wrap(self.inner.neighbor_exchange_async(P, record=record, **kw), "neighbor_exchange")

    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        return self._wrap(self.inner.all_reduce_async(X, op, record=record), "all_reduce")

    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        return self._wrap(self.inner.all_gather_async(X, record=record), "all_gather")

    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        return self._wrap(self.inner.broadcast_async(X, src, record=record), "broadcast")

    def sharded_exchange_async(self, P, in_nbytes, out_nbytes, server, *, record: bool = True) -> Handle:
        return self._wrap(self.inner.sharded_exchange_async(P, in_nbytes, out_nbytes, server, record=record),
                          "sharded_exchange")

    def __repr__(self) -> str:
        return f"LatencyCommunicator({self.inner!r}, latency_s={self.latency_s:g})"
