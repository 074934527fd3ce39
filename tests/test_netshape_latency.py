"""LatencyCommunicator: how many latency waits each operation adds, and delegation.

A behaviour test of the wait count, not a speed benchmark: the stand-in inner
communicator answers at once, so the elapsed time is the added latency; the
tolerance allows for a loaded machine (late, never early).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from gossip.comm import Communicator, Handle, SimulatedCommunicator
from gossip.comm.latency import LatencyCommunicator, latency_rounds
from gossip.comm.ledger import Ledger

LAT = 0.02
SLACK = 0.08  # a busy 2-core machine may wake a sleeper this late


class _Done(Handle):
    """A handle whose result is already there."""

    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result

    def is_completed(self):
        return True


class StandIn(Communicator):
    """Answers every operation at once and counts the calls."""

    def __init__(self, n: int) -> None:
        self.world_size = n
        self.nodes = torch.tensor([0])
        self.topology = "ring-stand-in"
        self.ledger = Ledger([0], n)
        self.rank = 0
        self.calls: list[str] = []

    def neighbor_exchange_async(self, P, *, record=True):
        self.calls.append("exchange")
        return _Done(("received", P))

    def all_reduce_async(self, X, op="sum", *, record=True):
        self.calls.append(f"all_reduce:{op}")
        return _Done(X * self.world_size if op == "sum" else X)

    def all_gather_async(self, X, *, record=True):
        self.calls.append("all_gather")
        return _Done(X.repeat(self.world_size, *([1] * (X.dim() - 1))))

    def broadcast_async(self, X, src, *, record=True):
        self.calls.append(f"broadcast:{src}")
        return _Done(X)


def _timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("n", [2, 4, 5])
def test_waits_per_operation(n):
    inner = StandIn(n)
    comm = LatencyCommunicator(inner, LAT)
    X = torch.ones(1, 3)
    P = torch.zeros(1, 8, dtype=torch.uint8)
    expected = {
        "neighbor_exchange": 1,
        "all_reduce": 2 * (n - 1),
        "all_gather": n - 1,
        "broadcast": math.ceil(math.log2(n)),
    }
    calls = {
        "neighbor_exchange": lambda: comm.neighbor_exchange(P),
        "all_reduce": lambda: comm.all_reduce(X, op="mean"),
        "all_gather": lambda: comm.all_gather(X),
        "broadcast": lambda: comm.broadcast(X, 1),
    }
    for op, f in calls.items():
        _, dt = _timed(f)
        want = expected[op] * LAT
        assert latency_rounds(op, n) == expected[op]
        assert comm.delay_s(op) == pytest.approx(want)
        assert want - 1e-3 <= dt <= want + SLACK, (op, n, dt, want)
    # every call reached the wrapped communicator, unchanged
    assert inner.calls == ["exchange", "all_reduce:mean", "all_gather", "broadcast:1"]
    # the waits are charged to the communicate phase of the wrapped ledger
    total = sum(expected.values()) * LAT
    assert comm.ledger.times["communicate"] >= total - 4e-3


def test_results_pass_through():
    comm = LatencyCommunicator(StandIn(3), 0.0)
    X = torch.arange(3.0).reshape(1, 3)
    assert torch.equal(comm.all_reduce(X), 3 * X)
    assert comm.all_gather(X).shape == (3, 3)
    assert comm.neighbor_exchange(torch.zeros(1, 2, dtype=torch.uint8))[0] == "received"


def test_zero_latency_and_world_of_one_add_nothing():
    for comm in (LatencyCommunicator(StandIn(8), 0.0), LatencyCommunicator(StandIn(1), 1.0)):
        _, dt = _timed(lambda: comm.all_reduce(torch.ones(1, 2)))
        assert dt < 0.05


def test_overlap_hides_latency():
    comm = LatencyCommunicator(StandIn(4), LAT)  # all_reduce: 6 rounds = 0.12 s
    h = comm.all_reduce_async(torch.ones(1, 2))
    time.sleep(0.08)  # computation overlapped with the message in flight
    _, dt = _timed(h.wait)
    assert 0.04 - 0.01 <= dt <= 0.04 + SLACK, dt
    _, dt = _timed(h.wait)  # a completed handle does not wait again
    assert dt < 0.01
    h = comm.all_reduce_async(torch.ones(1, 2))
    time.sleep(0.15)  # longer than the latency: nothing left to pay
    assert h.is_completed()
    _, dt = _timed(h.wait)
    assert dt < 0.02


def test_delegates_state_to_the_inner_communicator():
    inner = StandIn(4)
    comm = LatencyCommunicator(inner, LAT)
    assert isinstance(comm, Communicator)
    assert comm.world_size == 4 and comm.ledger is inner.ledger and comm.nodes is inner.nodes
    assert comm.topology == "ring-stand-in" and comm.rank == 0  # rank: read through
    assert comm.inner is inner and comm.latency_s == LAT
    with pytest.raises(AttributeError):
        comm.no_such_attribute  # noqa: B018
    assert "latency_s=0.02" in repr(comm)


def test_wraps_the_simulation_with_the_same_numbers():
    sim = SimulatedCommunicator(world_size=4)
    comm = LatencyCommunicator(sim, 0.005)
    X = torch.randn(4, 5)
    assert torch.equal(comm.all_reduce(X, op="mean"), SimulatedCommunicator(world_size=4).all_reduce(X, op="mean"))
    assert comm.ledger.as_dict()["bytes"] == sim.ledger.as_dict()["bytes"]
    _, dt = _timed(lambda: comm.all_gather(X))
    assert dt >= 3 * 0.005 - 1e-3


@pytest.mark.parametrize("bad, match", [
    (-0.001, r"`latency_s` must be a finite number of seconds >= 0, got -0.001"),
    (float("nan"), r"`latency_s` must be a finite number of seconds >= 0, got nan"),
    (float("inf"), r"got inf"),
    ("20ms", r"`latency_s` must be a number of seconds >= 0, got '20ms'"),
    (True, r"got True"),
])
def test_rejects_bad_latency(bad, match):
    with pytest.raises(ValueError, match=match):
        LatencyCommunicator(StandIn(2), bad)


def test_rejects_a_non_communicator():
    with pytest.raises(TypeError, match=r"`inner` must be a communicator \(it has no `neighbor_exchange_async`\)"):
        LatencyCommunicator(object(), 0.01)


def test_rounds_validation():
    assert latency_rounds("all_reduce", 1) == 0
    assert latency_rounds("broadcast", 8) == 3 and latency_rounds("broadcast", 9) == 4
    with pytest.raises(ValueError, match=r"`op` must be one of .* got 'reduce'"):
        latency_rounds("reduce", 4)
    with pytest.raises(ValueError, match=r"`n` must be a positive integer, got 0"):
        latency_rounds("all_reduce", 0)
