"""DistCommunicator over real gloo processes: bit-identical to the simulation, honest
byte counts, collectives, and failures (silent peer, corrupted or mis-sized payload)
that name the peer instead of hanging."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from gossip.comm import (
    DistCommunicator,
    PeerError,
    PeerPayloadError,
    PeerTimeoutError,
    SimulatedCommunicator,
    init_from_env,
)
from tests._comm_topo import build
from tests._dist import run_world
from tests.conftest import CorruptPayload, decode_f32, payloads, strict_decode

multiprocess = pytest.mark.multiprocess


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# ------------------------------------------------------------------------- worlds
D = 37  # floats per payload: 148 bytes


def _exchange_world(names: list[str]) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for name in names:
        comm = DistCommunicator(build(name, n), timeout=30)
        P1, P2 = payloads(n, D, 1), payloads(n, D, 2)
        rec1 = comm.neighbor_exchange(P1[rank : rank + 1])
        handle = comm.neighbor_exchange_async(P2[rank : rank + 1])
        rec2 = handle.wait()
        out[name] = {
            "sums": [rec1.weighted_sum(decode_f32), rec2.weighted_sum(decode_f32)],
            "senders": rec1.senders.tolist(),
            "payloads": [rec1.payloads.clone(), rec2.payloads.clone()],
            "neighbors": comm.neighbors,
            "ledger": comm.ledger.as_dict(detail=True),
        }
    comm = DistCommunicator(build("ring", n), timeout=30)
    X = torch.arange(6, dtype=torch.float32).reshape(1, 2, 3) * (rank + 1) + 0.25
    out["collectives"] = {
        "sum": comm.all_reduce(X),
        "mean": comm.all_reduce_async(X, op="mean").wait(),
        "gather": comm.all_gather(X),
        "bcast": comm.broadcast_async(X, src=n - 1).wait(),
        "unrecorded": comm.all_reduce(X, record=False),
        "u8": comm.all_reduce(torch.full((1, 3), 200, dtype=torch.uint8), record=False),
        "X": X,
        "ledger": comm.ledger.as_dict(detail=True),
    }
    return out


def _silent_peer_world(timeout: float) -> dict:
    """Ring of 4: rank 2 exchanges once, then goes silent; its neighbours 1 and 3 time out.

    (On gloo a rank whose wait timed out closes all its connections, so ranks that
    still talk to 1 or 3 afterwards would see PeerConnectionError naming them;
    rank 0 finishes its exchange before that.)
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = DistCommunicator(build("ring", n), timeout=timeout)
    P = torch.full((1, 64), rank, dtype=torch.uint8)
    comm.neighbor_exchange(P)  # sizes agreed with every neighbour
    if rank == 2:
        time.sleep(timeout + 1.5)  # alive but silent
        return {}
    out: dict = {}
    t0 = time.monotonic()
    try:
        comm.neighbor_exchange(P)
        out["exchange"] = ("ok", (), time.monotonic() - t0)
    except PeerTimeoutError as exc:
        out["exchange"] = (type(exc).__name__, exc.peers, time.monotonic() - t0, str(exc))
        try:
            comm.all_reduce(torch.ones(1, 1))
        except RuntimeError as again:
            out["after"] = str(again)
    return out


def _silent_collective_world(timeout: float) -> tuple:
    """World of 2: rank 1 never joins the all-reduce."""
    comm = DistCommunicator(timeout=timeout)
    if dist.get_rank() == 1:
        time.sleep(timeout + 1.5)
        return ()
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1, 3))
        return ("ok",)
    except PeerTimeoutError as exc:
        return (type(exc).__name__, exc.peers, time.monotonic() - t0, str(exc))


def _crashing_peer_world() -> dict:
    """Ring of 4: rank 2 exits after one exchange; its neighbours are told who vanished."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = DistCommunicator(build("ring", n), timeout=20)
    P = torch.full((1, 16), rank, dtype=torch.uint8)
    comm.neighbor_exchange(P)
    dist.barrier()
    if rank == 2:
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.neighbor_exchange(P)
        return {"error": None}
    except PeerError as exc:
        return {"error": type(exc).__name__, "peers": exc.peers, "took": time.monotonic() - t0}


def _bad_payload_world() -> dict:
    """Ring of 3: rank 1 sends a corrupted payload, then rank 2 a payload 4 bytes too long."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = DistCommunicator(build("ring", n), timeout=10)
    out: dict = {}
    P = torch.zeros(1, 32, dtype=torch.uint8)
    if rank == 1:
        P[0, 0] = 0xFF
    try:
        comm.neighbor_exchange(P).weighted_sum(strict_decode)
        out["corrupt"] = ("ok",)
    except PeerPayloadError as exc:
        out["corrupt"] = (exc.peers, str(exc), type(exc.__cause__).__name__)
    size = 48 + (4 if rank == 2 else 0)
    try:
        comm.neighbor_exchange(torch.zeros(1, size, dtype=torch.uint8))
        out["size"] = ("ok",)
    except PeerPayloadError as exc:
        out["size"] = (exc.peers, str(exc))
    # the mismatch was caught before any payload moved: the group still works
    out["still_works"] = float(comm.all_reduce(torch.ones(1, 1))[0, 0])
    return out


# ------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def world4() -> list[dict]:
    """One world of 4 ranks for the exchange and collective checks (start-up is the cost)."""
    return run_world(4, _exchange_world, ["ring", "complete", "star"], timeout=60)


@multiprocess
@pytest.mark.parametrize("name", ["ring", "complete", "star"])
def test_exchange_is_bit_identical_to_the_simulation_and_bytes_are_honest(
    world4: list[dict], name: str
) -> None:
    n, nbytes = 4, D * 4
    topo = build(name, n)
    sim = SimulatedCommunicator(topo)
    refs = [sim.neighbor_exchange(payloads(n, D, s)).weighted_sum(decode_f32) for s in (1, 2)]
    for r, res in enumerate(world4):
        got = res[name]
        ids = topo.neighbors(r)[0].tolist()
        assert got["senders"] == ids and list(got["neighbors"]) == ids
        for k, s in enumerate((1, 2)):
            # what arrived is exactly what the neighbours sent
            assert torch.equal(got["payloads"][k], payloads(n, D, s)[ids])
            assert torch.equal(_bits(got["sums"][k][0]), _bits(refs[k][r])), (name, r, k)
        led = got["ledger"]
        assert led["time"]["communicate"] > 0 and led["time"]["compute"] == 0
        deg = len(ids)
        assert led["ops"]["exchange"] == {"calls": 2, "sent": 2 * nbytes * deg, "received": 2 * nbytes * deg}
        assert led["ops"]["control"]["sent"] == 16 * deg  # one size check for the one size
        # the simulation charges the same size check: the ledgers agree node by node
        assert led["per_node"] == {"node": [r], "sent": [sim.ledger.sent_by(r)],
                                   "received": [sim.ledger.received_by(r)]}
        assert _pairs(led) == {k: v for k, v in sim.ledger.traffic().items() if r in k}


def _pairs(led: dict) -> dict:
    p = led["per_peer"]
    return dict(zip(zip(p["src"], p["dst"]), p["bytes"]))


@multiprocess
def test_collectives_match_the_simulation_and_are_charged_alike(world4: list[dict]) -> None:
    n = 4
    X = torch.cat([res["collectives"]["X"] for res in world4])
    sim = SimulatedCommunicator(build("ring", n))
    # the same recorded calls as the world function, in the same order
    ref_sum, ref_mean = sim.all_reduce(X), sim.all_reduce(X, op="mean")
    ref_gather, ref_bcast = sim.all_gather(X), sim.broadcast(X, src=n - 1)
    sim.all_reduce(X, record=False)
    totals = {op: 0 for op in ("all_reduce", "all_gather", "broadcast")}
    for r, res in enumerate(world4):
        c = res["collectives"]
        torch.testing.assert_close(c["sum"], ref_sum[r : r + 1])  # ring order: equal to rounding
        torch.testing.assert_close(c["mean"], ref_mean[r : r + 1])
        torch.testing.assert_close(c["unrecorded"], ref_sum[r : r + 1])
        u8 = sim.all_reduce(torch.full((n, 3), 200, dtype=torch.uint8), record=False)
        assert torch.equal(c["u8"], u8[r : r + 1])  # integers wrap alike
        assert torch.equal(c["gather"], ref_gather) and torch.equal(c["bcast"], ref_bcast[r : r + 1])
        led = c["ledger"]
        assert _pairs(led) == {k: v for k, v in sim.ledger.traffic().items() if r in k}
        for op in totals:
            totals[op] += led["ops"][op]["sent"]
            assert led["ops"][op]["calls"] == sim.ledger.calls[op]
    assert totals == {op: sim.ledger.as_dict()["ops"][op]["sent"] for op in totals}


@multiprocess
def test_a_silent_peer_makes_its_neighbours_time_out_naming_it() -> None:
    timeout = 1.0
    t0 = time.monotonic()
    res = run_world(4, _silent_peer_world, timeout, timeout=30)
    assert time.monotonic() - t0 < 15
    for r in (1, 3):
        kind, peers, took, msg = res[r]["exchange"]
        assert kind == "PeerTimeoutError" and peers == (2,)
        assert timeout * 0.9 <= took < timeout + 2.0
        assert f"rank {r} got no answer from rank 2 within 1 s (waited for ranks [" in msg
        assert "unusable after an earlier failure" in res[r]["after"]
    assert res[0]["exchange"][0] == "ok"  # rank 0's neighbours (1, 3) answered


@multiprocess
def test_a_collective_with_a_silent_peer_times_out() -> None:
    timeout = 1.0
    kind, peers, took, msg = run_world(2, _silent_collective_world, timeout, timeout=30)[0]
    assert kind == "PeerTimeoutError" and peers == (1,)
    assert timeout * 0.9 <= took < timeout + 2.0
    assert msg.startswith("all_reduce: rank 0 got no answer from rank 1 within 1 s")


@multiprocess
def test_a_bad_payload_is_reported_naming_the_sender_and_sizes_are_checked() -> None:
    res = run_world(3, _bad_payload_world, timeout=30)
    for r in (0, 2):
        peers, msg, cause = res[r]["corrupt"]
        assert peers == (1,) and cause == CorruptPayload.__name__
        assert f"bad payload from rank 1 (received by rank {r}): checksum mismatch" in msg
    assert res[1]["corrupt"] == ("ok",)
    for r in (0, 1):
        peers, msg = res[r]["size"]
        assert peers == (2,) and f"rank {r}: it sends 48 bytes per payload but rank 2 sends 52 bytes" in msg
    assert res[2]["size"][0] == (0, 1)
    assert all(res[r]["still_works"] == 3.0 for r in range(3))


@multiprocess
def test_a_crashed_peer_is_named_without_waiting_for_the_timeout() -> None:
    res = run_world(4, _crashing_peer_world, timeout=40, return_exceptions=True)
    assert "rank 2 died without reporting" in str(res[2])
    assert res[0] == {"error": None}  # rank 0's neighbours are 1 and 3
    for r in (1, 3):
        # gloo notices the closed connection; either way the error names rank 2 quickly
        assert res[r]["error"] in ("PeerConnectionError", "PeerTimeoutError") and res[r]["peers"] == (2,)
        assert res[r]["took"] < 15


def _torus_world() -> list[torch.Tensor]:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = DistCommunicator(build("torus", n), timeout=30)
    P = payloads(n, D, 3)
    return [comm.neighbor_exchange(P[rank : rank + 1]).weighted_sum(decode_f32)]


@multiprocess
def test_torus_3x3_is_bit_identical_to_the_simulation() -> None:
    res = run_world(9, _torus_world, timeout=60)
    ref = SimulatedCommunicator(build("torus", 9)).neighbor_exchange(payloads(9, D, 3)).weighted_sum(decode_f32)
    for r in range(9):
        assert torch.equal(_bits(res[r][0][0]), _bits(ref[r]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_from_env_reads_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; launch with torchrun"):
        init_from_env()
    with pytest.raises(ValueError, match=r"`backend` must be 'auto', 'gloo' or 'nccl', got 'mpi'"):
        init_from_env("mpi")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    try:
        device = init_from_env("gloo", timeout=30)
        assert device == torch.device("cpu") and dist.get_backend() == "gloo"
        comm = DistCommunicator(timeout=5)
        assert comm.nodes.tolist() == [0] and comm.world_size == 1
        assert torch.equal(comm.all_reduce(torch.ones(1, 2), op="mean"), torch.ones(1, 2))
        with pytest.raises(ValueError, match="has no topology"):
            comm.neighbor_exchange(torch.zeros(1, 4, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"topology has n = 4 nodes but the process group has 1 ranks"):
            DistCommunicator(build("ring", 4))
        with pytest.raises(ValueError, match=r"`timeout` must be a positive number of seconds, got 0"):
            DistCommunicator(timeout=0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dist_communicator_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"no process group; call gossip.comm.init_from_env\(\)"):
        DistCommunicator()


def _nccl_world() -> list[torch.Tensor]:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    comm = DistCommunicator(build("complete", n), timeout=60)
    P = payloads(n, D, 4).cuda()
    s = comm.neighbor_exchange(P[rank : rank + 1]).weighted_sum(decode_f32).cpu()
    return [s, comm.all_reduce(torch.ones(1, 3, device="cuda")).cpu()]


@multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank, 2 or more")
def test_nccl_exchange_is_bit_identical_to_the_simulation() -> None:
    n = min(torch.cuda.device_count(), 4)
    res = run_world(n, _nccl_world, backend="nccl", timeout=120)
    ref = SimulatedCommunicator(build("complete", n)).neighbor_exchange(payloads(n, D, 4)).weighted_sum(decode_f32)
    for r in range(n):
        assert torch.equal(_bits(res[r][0][0]), _bits(ref[r]))
        assert torch.equal(res[r][1], torch.full((1, 3), float(n)))


def _late_peer_world(delay: float) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = DistCommunicator(build("ring", n), timeout=30)
    P = payloads(n, D, 1)
    comm.neighbor_exchange(P[rank : rank + 1])  # the size check and first connections
    comm.all_reduce(torch.ones(1, 1))  # both ranks start the timed exchange together
    comm.ledger.reset()
    if rank == 1:
        time.sleep(delay)
    comm.neighbor_exchange(P[rank : rank + 1])
    return comm.ledger.times


@multiprocess
def test_waiting_for_a_late_peer_is_charged_to_wait() -> None:
    delay = 1.0
    t0, t1, t2 = run_world(3, _late_peer_world, delay, timeout=30)
    for t in (t0, t2):  # rank 1's neighbours wait for its payload ...
        assert t["wait"] >= 0.8 * delay
        assert t["communicate"] < 0.5 * delay and t["compress"] == 0.0  # ... and nothing else gets it
    assert t1["wait"] < 0.5 * delay  # rank 1's neighbours were there already
